"""evaluate_baselines (was `evaluate`): the scripted expert and random policies on held-out tasks of each real
environment, success with confidence intervals. The report is the evaluation's own (`baseline_report`)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from components import distributed
from components.config import Params
from components.reports import write_stage_outputs
from components.results.evaluation import evaluate_baselines

JOURNALS = ".cache/evaluate_baselines"  # the games played so far, per policy and environment: a rerun resumes them


def run(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Expert and random baselines on held-out tasks of each real environment (success with confidence intervals).
    Under a launcher the processes share the games and the main process writes."""
    metrics, report = evaluate_baselines(params, journals=Path(root) / JOURNALS)
    if not distributed.is_main_process():
        return {}
    write_stage_outputs("evaluate_baselines", metrics, report, root)
    shutil.rmtree(Path(root) / JOURNALS, ignore_errors=True)
    return metrics
