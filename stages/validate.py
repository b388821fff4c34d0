"""validate: the versioned seed set re-checked against the contract and summarised (metrics/validate.json)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from components.config import Params
from components.data.contract import QUARANTINE, TRAJECTORIES, Trajectory
from components.data.validation import Limits, read_raw_records, validate_records
from components.reports import write_stage_outputs
from stages.common import StageError, by_source, source_table


def run(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Re-check the versioned seed set against the contract and summarise it (metrics/validate.json)."""
    data_dir = Path(root) / params.data.dir
    path = data_dir / TRAJECTORIES
    if not path.exists():
        raise StageError(f"no seed data at {path}; onboard some first: dreamgym data onboard FILE.jsonl")
    checked = validate_records(read_raw_records(path), Limits.of(params.data))
    if checked.rejected:
        first = checked.rejected[0]
        raise StageError(f"{len(checked.rejected)} stored trajectories break the contract (edited by hand?); "
                         f"first: {first.record.where}: {first.reasons[0]}. Re-onboard the original files.")
    trajectories = [trajectory for _, trajectory in checked.accepted]
    quarantine = data_dir / QUARANTINE
    metrics = {
        "trajectories": len(trajectories),
        "steps": sum(len(t.steps) for t in trajectories),
        "tasks": len({t.task.task_id for t in trajectories}),
        "quarantined": len(quarantine.read_text(encoding="utf-8").splitlines()) if quarantine.exists() else 0,
        "success_rate": sum(t.success for t in trajectories) / len(trajectories),
        "trajectories_by_environment": dict(sorted(Counter(t.task.environment for t in trajectories).items())),
    }
    write_stage_outputs("validate", metrics, report(params, metrics, trajectories), root)
    return metrics


def report(params: Params, metrics: dict[str, Any], trajectories: list[Trajectory]) -> str:
    return (f"# Seed data validation\n\n{metrics['trajectories']} trajectories, {metrics['steps']} steps, "
            f"{metrics['tasks']} tasks in `{params.data.dir}/`, all within the contract "
            f"(rewards in {params.data.reward_range}, texts up to {params.data.max_text_length} characters). "
            f"{metrics['quarantined']} record(s) sit in quarantine.\n\n" + source_table(by_source(trajectories)))
