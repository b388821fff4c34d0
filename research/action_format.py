"""How well-formed a kept run's held-out play is: the games with an action that carries more than one command in its
own text (`type [3] "Q2" "type [3]" "type [3]"`, a policy whose output format broke down) and the games that ran out
of turns repeating at most two distinct actions (a policy stuck in a loop), and the share of its actions by verb (a
policy that stopped typing, say), with its games on the task kinds the seed wins only by typing (where the seed's
trajectories are at hand).

    python research/action_format.py RUN POLICY [RUN POLICY ...] [--results reports/results_study/cpu]
                                     [--trajectories data/trajectories.jsonl]

A run is its folder under the results folder (miniwob/real-ppo-seed1); a policy is an evaluate_policies label
(sft_warm_start, synthetic_grpo, synthetic_ppo, sim-to-real). Prints one line a run and policy.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
from collections import Counter
from pathlib import Path

from components.data.contract import Trajectory, read_trajectories
from components.results.study import KEPT_GAMES

COMMAND = re.compile(r"\b(click|type|select|press) \[")  # the web adapter's action verbs, each with an element


def verb(action: str) -> str:
    """An action's first command's verb (`other` where it has none: TextWorld's commands, a broken reply)."""
    return match[1] if (match := COMMAND.search(action)) else "other"


def kind_of(environment: str, task_id: str) -> str:
    """A task id without its environment and seed (`miniwob-enter-text-s42` is `enter-text`)."""
    return task_id.removeprefix(f"{environment}-").rsplit("-s", 1)[0]


def family(trajectory: Trajectory) -> str:
    """A task's kind (MiniWoB's `task` parameter, else `kind_of` its id), so variations count as their base."""
    task = trajectory.task
    return str(task.parameters.get("task") or kind_of(task.environment, task.task_id))


def typed(actions: list[str]) -> bool:
    return any(verb(action) == "type" for action in actions)


def typing_families(seed: list[Trajectory]) -> set[str]:
    """Task kinds whose every real won seed episode types: kinds that are not won without typing."""
    wins: dict[str, list[bool]] = {}
    for trajectory in seed:
        if trajectory.success:
            wins.setdefault(family(trajectory), []).append(typed([step.action for step in trajectory.steps]))
    return {kind for kind, typing in wins.items() if all(typing)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pairs", nargs="+", metavar="RUN POLICY")
    parser.add_argument("--results", type=Path, default=Path("reports/results_study/cpu"))
    parser.add_argument("--trajectories", type=Path, default=Path("data/trajectories.jsonl"))
    args = parser.parse_args()
    if len(args.pairs) % 2:
        parser.error("give a policy after each run")
    typing = typing_families(read_trajectories(args.trajectories)) if args.trajectories.is_file() else set()
    for run, policy in zip(args.pairs[::2], args.pairs[1::2]):
        path = args.results / run / KEPT_GAMES
        if not path.is_file():
            raise SystemExit(f"{path}: no kept games (is {run!r} a finished run's folder?)")
        with path.open(encoding="utf-8") as handle:
            games = [row for row in csv.DictReader(handle) if row["policy"] == policy and not row["env_failure"]]
        if not games:
            raise SystemExit(f"{run}: no games of policy {policy!r}")
        actions = [json.loads(game["actions"]) for game in games]
        stacked = sum(any(len(COMMAND.findall(action)) > 1 for action in played) for played in actions)
        turns = max(int(game["steps"]) for game in games)
        looping = sum(int(game["steps"]) == turns and len(set(played)) <= 2 for game, played in zip(games, actions))
        won = sum(game["won"] == "1" for game in games)
        verbs = Counter(verb(action) for played in actions for action in played)
        total = sum(verbs.values())
        mix = ", ".join(f"{verb} {count / total:.0%}" for verb, count in verbs.most_common())
        needs_typing = [(game, played) for game, played in zip(games, actions)
                        if kind_of(game["environment"], game["task_id"]) in typing]
        on_typing = (f"; on typing tasks {len(needs_typing)} games, typed in "
                     f"{sum(typed(played) for _, played in needs_typing)}, won "
                     f"{sum(game['won'] == '1' for game, _ in needs_typing)}") if needs_typing else ""
        print(f"{run} {policy}: {len(games)} games, won {won}; an action of several commands in {stacked}; "
              f"all {turns} turns on at most two distinct actions in {looping}; {total} actions: {mix}{on_typing}")


if __name__ == "__main__":
    main()
