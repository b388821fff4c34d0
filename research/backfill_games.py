"""A kept study run's evaluate_policies_games.csv, rebuilt from its episodes, for runs made before evaluate_policies
wrote the games file (983015e): the results study then pairs its games like a new run's.

    git show <exp ref>:reports/evaluate_policies_episodes.jsonl | python research/backfill_games.py RUN_DIR

`dvc exp show` / `git for-each-ref refs/exps` name the experiment refs; the run's params.yaml in the ref
(`sim_to_real.start_from`, `synthetic_rl.algorithm`, ...) tells which variant it was.
"""
import json
import re
import sys
from pathlib import Path

from components.reports import write_csv

KEYS = {"sft-warm-start": "sft_warm_start", "synthetic-grpo": "synthetic_grpo", "synthetic-ppo": "synthetic_ppo",
        "sim-to-real": "sim-to-real"}  # evaluate_policy's name (label with dashes) -> the metrics key
rows = []
for line in sys.stdin:
    episode = json.loads(line)
    match = re.fullmatch(r"eval-(.+)-(\d{5})-(.+)", episode["trajectory_id"])
    if not match:
        continue  # the replay audit's episodes
    name, _, task_id = match.groups()
    assert task_id == episode["task"]["task_id"], episode["trajectory_id"]
    won = episode["success"]
    rows.append({"policy": KEYS[name], "environment": episode["task"]["environment"], "task_id": task_id,
                 "won": int(won), "steps": len(episode["steps"]),
                 "actions": json.dumps([step["action"] for step in episode["steps"]])})
write_csv(rows, Path(sys.argv[1]) / "evaluate_policies_games.csv")
print(sys.argv[1], len(rows), "games", sum(r["won"] for r in rows), "won")
