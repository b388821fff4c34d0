"""Stage outputs people and DVC read: metrics/<stage>.json (DVC metrics) and reports/<stage>.md."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from components import distributed

# evaluate_policies' outcome of each policy on each held-out game; the results study keeps it per run to pair methods
GAMES_FILE = "reports/evaluate_policies_games.csv"


def metrics_path(stage: str, root: str | Path = ".") -> Path:
    return Path(root) / "metrics" / f"{stage}.json"


def report_path(stage: str, root: str | Path = ".") -> Path:
    return Path(root) / "reports" / f"{stage}.md"


def write_stage_outputs(stage: str, metrics: dict[str, Any], report: str, root: str | Path = ".") -> list[Path]:
    """The stage's metrics and report, written by the main process of a multi-process run only."""
    paths = [metrics_path(stage, root), report_path(stage, root)]
    if not distributed.is_main_process():
        return paths
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


def line_plot(rows: list[dict[str, Any]], x: str, ys: list[str], path: str | Path, title: str) -> Path:
    """One small panel per series in `ys` against `x` (learning curves), saved as a PNG. Without rows (a skipped
    stage) the PNG says so: it is a declared output all the same."""
    series = [y for y in ys if any(row.get(y) is not None for row in rows)]
    plt = pyplot()
    if not series:
        figure = plt.figure(figsize=(4, 1.5))
        figure.text(0.5, 0.5, f"{title}: no iterations", ha="center", va="center", fontsize=10)
        return save_figure(figure, path)
    figure, axes = plt.subplots(1, len(series), figsize=(3.2 * len(series), 2.8), squeeze=False)
    for axis, y in zip(axes[0], series):
        points = [(row[x], row[y]) for row in rows if row.get(y) is not None]
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
        axis.set_title(y, fontsize=9)
        axis.set_xlabel(x, fontsize=8)
        axis.tick_params(labelsize=7)
    figure.suptitle(title, fontsize=10)
    return save_figure(figure, path)


def pyplot() -> Any:
    """matplotlib.pyplot drawing to files only (no display); imported on first use, it takes a second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure: Any, path: str | Path) -> Path:
    """Lay out, write as PNG (creating the folder) and close `figure`."""
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    pyplot().close(figure)
    return path


def write_csv(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Rows as CSV (DVC plots read it); columns are the union of the rows' keys, in first-seen order."""
    import csv

    columns = list(dict.fromkeys(key for row in rows for key in row))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path
