"""Which of synthetic RL's wins are real, while it runs: its episodes so far, replayed action by action in the real
games (the replay audit evaluate_policies makes once the stage is done, on the episodes its checkpoints hold now).

    python research/audit_synthetic_episodes.py [models/policy/rl/checkpoints/episodes.jsonl] [--environment NAME]

Uses params.yaml and data/ of this checkout: each episode is replayed on its real training task. Prints the
outcome agreement (synthetic wins the game confirms: `both`), for each synthetic win its actions and the real game's
last answer, and where each false win parts from the game: at the first command the game refused that the simulator
answered otherwise, or else at the first step whose reward or end differs. Cost: the real game's steps only (TextWorld:
seconds).
"""
import argparse
import json
from collections import Counter
from dataclasses import replace

from components.config import load_params
from components.data.contract import TRAJECTORIES, Trajectory, is_refused, read_trajectories
from components.envs.registry import real_environment
from components.envs.textworld_cooking import game_reply
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
        answer = game_reply(replayed.steps[-1].next_state)
        print(f"synthetic win, real {replayed.success}: {[s.action for s in synthetic.steps]} -> {answer!r}")


def parting(synthetic: Trajectory, replayed: Trajectory) -> str:
    """Where a synthetic win the game does not give first parts from the game's replay: a command the game refused
    that the simulator answered otherwise (it let the command through), else a step whose reward or end differs."""
    for index, (sim, game) in enumerate(zip(synthetic.steps, replayed.steps)):
        game_said, simulator_said = game_reply(game.next_state), game_reply(sim.next_state)
        if is_refused(game) and simulator_said != game_said:
            return f"refused at step {index + 1}: {game.action!r} (game: {game_said!r}; simulator: {simulator_said!r})"
        if (sim.reward, sim.done) != (game.reward, game.done):
            return f"outcome at step {index + 1}: {game.action!r} (simulator {sim.reward}/{sim.done}, game " \
                   f"{game.reward}/{game.done})"
    return f"the game ended first, after {len(replayed.steps)} of {len(synthetic.steps)} steps"


false_wins = [(s, r) for s, r in zip(episodes, real, strict=True) if s.success and not r.success]
kinds = Counter(parting(s, r).split(" at ")[0].split(",")[0] for s, r in false_wins)
print(f"false wins: {len(false_wins)}; where they part from the game: {dict(kinds)}")
for synthetic, replayed in false_wins:
    print("  ", parting(synthetic, replayed))
