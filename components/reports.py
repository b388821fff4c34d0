"""Stage outputs people and DVC read: metrics/<stage>.json (DVC metrics) and reports/<stage>.md."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def metrics_path(stage: str, root: str | Path = ".") -> Path:
    return Path(root) / "metrics" / f"{stage}.json"


def report_path(stage: str, root: str | Path = ".") -> Path:
    return Path(root) / "reports" / f"{stage}.md"


def write_stage_outputs(stage: str, metrics: dict[str, Any], report: str, root: str | Path = ".") -> list[Path]:
    paths = [metrics_path(stage, root), report_path(stage, root)]
    for path, text in zip(paths, (json.dumps(metrics, indent=2, sort_keys=True) + "\n", report)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return paths


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
