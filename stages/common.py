"""What the stages share: their names, the error a stage stops with, the seed-sources table of their reports.

Every stage imports this module, so every stage reruns when it changes: keep it small.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from components.reports import markdown_table

if TYPE_CHECKING:
    from components.data.contract import Trajectory

# stage names (in dvc.yaml, as Prefect flows, as modules stages/<name>.py), in pipeline order
STAGES = ("collect_seed", "validate", "annotate", "index_buffer", "train_experience_model", "train_policy_sft",
          "evaluate_experience_model", "synthetic_rl", "sim_to_real", "evaluate_policies",
          "evaluate_baselines", "correction_rounds")
# what `torchrun`/`accelerate launch` may start on several processes (components/distributed.py): only the main
# process writes, the processes play their shares of RL iterations and of evaluations and train one model
# data-parallel
RANK_AWARE_STAGES = ("train_experience_model", "train_policy_sft", "evaluate_experience_model", "synthetic_rl",
                     "sim_to_real", "evaluate_policies", "evaluate_baselines", "correction_rounds")
# old name -> new name: `dreamgym stage/flow OLD` still runs the stage, with a notice, for one release
RENAMED = {"evaluate": "evaluate_baselines"}


class StageError(RuntimeError):
    """A stage cannot run on what it was given; the message says what to do."""


def by_source(trajectories: list[Trajectory]) -> dict[tuple[str, str], list[Trajectory]]:
    """Trajectories grouped by (environment, source), in that order."""
    groups: dict[tuple[str, str], list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        groups[(trajectory.task.environment, trajectory.source)].append(trajectory)
    return dict(sorted(groups.items()))


def source_table(groups: dict[tuple[str, str], list[Trajectory]]) -> str:
    """A markdown table of `by_source` groups: trajectories, mean steps and success rate of each."""
    rows = [[env, source, len(group), sum(len(t.steps) for t in group) / len(group),
             sum(t.success for t in group) / len(group)] for (env, source), group in groups.items()]
    return markdown_table(["environment", "source", "trajectories", "mean steps", "success rate"], rows)
