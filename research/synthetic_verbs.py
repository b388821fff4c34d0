"""Whether the experience model rewards the verbs a web task needs: synthetic RL's simulated episodes, split by
whether their task needs typing (its real seed wins all type) and whether the episode typed, with the share the
simulator called won. A simulator that scores an episode that never typed as often as one that typed, on a task
that cannot be won without typing, gives synthetic RL no reason to type.

    python research/synthetic_verbs.py EPISODES [EPISODES ...] [--trajectories data/trajectories.jsonl]

EPISODES is synthetic RL's `episodes.jsonl` (models/policy/rl/checkpoints/, or a parked row's copy), as a path or
as REVISION:PATH read from git (a landed row's parked copy lives on in history). Prints one line per split and
file, then the split pooled over the files, and the simulated wins on typing tasks that never typed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
from collections import Counter
from pathlib import Path

from components.data.contract import Trajectory, read_trajectories

TYPING = "type ["


def episode_lines(source: str) -> list[str]:
    """The JSONL lines of a path, or of REVISION:PATH in git where no such file exists."""
    if Path(source).is_file():
        return Path(source).read_text(encoding="utf-8").splitlines()
    revision, _, path = source.partition(":")
    shown = subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True, text=True)
    if not path or shown.returncode:
        raise SystemExit(f"{source}: no such file, nor REVISION:PATH in git ({shown.stderr.strip()})")
    return shown.stdout.splitlines()


def kind_of(environment: str, task_id: str) -> str:
    """A task id without its environment and seed (`miniwob-enter-text-s42` is `enter-text`)."""
    return task_id.removeprefix(f"{environment}-").rsplit("-s", 1)[0]


def family(trajectory: Trajectory) -> str:
    """A task's kind (MiniWoB's `task` parameter, else `kind_of` its id), so variations count as their base."""
    task = trajectory.task
    return str(task.parameters.get("task") or kind_of(task.environment, task.task_id))


def typed(trajectory: Trajectory) -> bool:
    return any(step.action.startswith(TYPING) for step in trajectory.steps)


def typing_families(seed: list[Trajectory]) -> set[str]:
    """Task kinds whose every real won seed episode types: kinds that are not won without typing."""
    wins: dict[str, list[bool]] = {}
    for trajectory in seed:
        if trajectory.success:
            wins.setdefault(family(trajectory), []).append(typed(trajectory))
    return {kind for kind, typing in wins.items() if all(typing)}


def splits(episodes: list[Trajectory], typing: set[str]) -> Counter:
    """(split, measure) -> count: episodes, simulated wins and episodes ended on a fallback per split."""
    counts: Counter = Counter()
    for episode in episodes:
        split = (f"{'typing' if family(episode) in typing else 'other'} task, "
                 f"{'typed' if typed(episode) else 'never typed'}")
        counts[split, "episodes"] += 1
        counts[split, "won"] += episode.success
        counts[split, "fell back"] += any(step.info.get("fallback") for step in episode.steps)
    return counts


def report(name: str, counts: Counter) -> None:
    for split in sorted({split for split, _ in counts}):
        n, won = counts[split, "episodes"], counts[split, "won"]
        print(f"{name}: {split}: {n} episodes, simulator won {won} ({won / n:.0%}), "
              f"{counts[split, 'fell back']} ended on a fallback")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("episodes", nargs="+")
    parser.add_argument("--trajectories", type=Path, default=Path("data/trajectories.jsonl"))
    args = parser.parse_args()
    typing = typing_families(read_trajectories(args.trajectories))
    print(f"task kinds the seed wins only by typing: {', '.join(sorted(typing)) or 'none'}")
    pooled: Counter = Counter()
    untyped_wins = []
    for source in args.episodes:
        episodes = [Trajectory.from_dict(json.loads(line)["trajectory"]) for line in episode_lines(source) if line]
        counts = splits(episodes, typing)
        report(source, counts)
        pooled.update(counts)
        untyped_wins += [e for e in episodes if e.success and family(e) in typing and not typed(e)]
    if len(args.episodes) > 1:
        report("pooled", pooled)
    for episode in untyped_wins:
        print(f"  won without typing: {episode.task.task_id} {[step.action for step in episode.steps]} "
              f"({episode.steps[-1].info.get('reasoning', '')[:160]!r})")


if __name__ == "__main__":
    main()
