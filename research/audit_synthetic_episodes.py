"""Which of synthetic RL's wins are real, while it runs: its episodes so far, replayed action by action in the real
games (the replay audit evaluate_policies makes once the stage is done, on the episodes its checkpoints hold now).

    python research/audit_synthetic_episodes.py [models/policy/rl/checkpoints/episodes.jsonl] [--environment NAME]

Uses params.yaml and data/ of this checkout: each episode is replayed on its real training task. Prints the
outcome agreement (synthetic wins the game confirms: `both`) and, for each synthetic win, its actions and the real
game's last answer. Cost: the real game's steps only (TextWorld: seconds).
"""
import argparse
import json
from collections import Counter
from dataclasses import replace

from components.config import load_params
from components.data.contract import TRAJECTORIES, Trajectory, read_trajectories
from components.envs.registry import real_environment
from components.results.evaluation import outcome_agreement, replay_in_real

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("episodes", nargs="?", default="models/policy/rl/checkpoints/episodes.jsonl")
parser.add_argument("--environment", default="textworld-cooking")
args = parser.parse_args()

params = load_params("params.yaml")
rows = [json.loads(line) for line in open(args.episodes, encoding="utf-8")]
tasks = {t.task.task_id: t.task for t in read_trajectories(f"{params.data.dir}/{TRAJECTORIES}")}
# the real task each synthetic episode started from (a curriculum variation has none: it cannot be replayed)
episodes = [replace(e, task=tasks[e.task.task_id]) for e in (Trajectory.from_dict(r["trajectory"]) for r in rows)
            if e.task.environment == args.environment and e.task.task_id in tasks]
real = replay_in_real(real_environment(args.environment), params.environments, episodes, progress=None)
print("episodes by iteration:", dict(sorted(Counter(r["iteration"] for r in rows).items())))
print(json.dumps(outcome_agreement(episodes, real)))
for synthetic, replayed in zip(episodes, real, strict=True):
    if synthetic.success:
        answer = replayed.steps[-1].next_state.split("Observation:")[-1].strip().splitlines()[0]
        print(f"synthetic win, real {replayed.success}: {[s.action for s in synthetic.steps]} -> {answer!r}")
