"""How often the trained experience model falls back, per task, on the seed's own steps of training tasks: which tasks
its replies fail on (a reply looping to the cap never reaches </done>), before a policy takes it anywhere new.

    python research/fallbacks_by_task.py [N] [--set KEY=VALUE]...   # the first N steps of each task (default 6)

Run in a project whose train_experience_model and index_buffer stages have run (the checkout's params.yaml, with the
overrides; e.g. --set 'experience_model.environments=[miniwob]'). Prints, per task: steps asked, fallbacks, next
states predicted exactly, rewards on the right side of 0 (of those not fallen back), and the end of the first failed
reply. Steps of held-out tasks are never asked: they only measure elsewhere.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from components.builders import experience_predictor, saved_buffer
from components.config import load_params
from components.data.contract import TRAJECTORIES, is_heldout_task, read_trajectories, transitions
from components.simulator.experience_model import PredictionStats
from dreamgym.cli import set_overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps", nargs="?", type=int, default=6, help="seed steps asked per task")
    parser.add_argument("--set", action="append", default=[], help="a params override, as dreamgym --set takes")
    args = parser.parse_args()
    root, params = Path("."), load_params("params.yaml", set_overrides(args.set))
    environments = set(params.experience_model.environments)
    picked = defaultdict(list)
    for trajectory in read_trajectories(root / params.data.dir / TRAJECTORIES):
        task = trajectory.task
        if task.environment not in environments or is_heldout_task(task.task_id, params.data.heldout_task_fraction):
            continue
        name = task.parameters.get("task", task.environment)
        picked[name] += list(transitions(trajectory))[: args.steps - len(picked[name])]
    stats = PredictionStats()
    predict = experience_predictor(params, root, saved_buffer(params, root), stats)  # the model, loaded once
    for name, steps in sorted(picked.items()):
        fallbacks, stats.failed_replies = stats.fallbacks, []  # it keeps the first few failed replies: each task's
        predictions = predict(steps)
        answered = [(p, s) for p, s in zip(predictions, steps, strict=True) if not p.fallback]
        print(json.dumps({"task": name, "steps": len(steps), "fallbacks": stats.fallbacks - fallbacks,
                          "same_next_state": sum(p.next_state.strip() == s.next_state.strip() for p, s in answered),
                          "reward_side_right": sum((p.reward > 0) == (s.reward > 0) for p, s in answered)}),
              flush=True)
        for reply in stats.failed_replies[:1]:
            print("  first failed reply ends:", json.dumps(reply[-300:]), flush=True)
    print(json.dumps({"steps": stats.requests, "fallbacks": stats.fallbacks}))


if __name__ == "__main__":
    main()
