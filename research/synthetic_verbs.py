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
from research.action_format import family, typed, typing_families


def typed_episode(episode: Trajectory) -> bool:
    return typed([step.action for step in episode.steps])


def episode_lines(source: str) -> list[str]:
    """The JSONL lines of a path, or of REVISION:PATH in git where no such file exists."""
    if Path(source).is_file():
        return Path(source).read_text(encoding="utf-8").splitlines()
    revision, _, path = source.partition(":")
    shown = subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True, text=True)
    if not path or shown.returncode:
        raise SystemExit(f"{source}: no such file, nor REVISION:PATH in git ({shown.stderr.strip()})")
    return shown.stdout.splitlines()


def splits(episodes: list[Trajectory], typing: set[str]) -> Counter:
    """(split, measure) -> count: episodes, simulated wins and episodes ended on a fallback per split."""
    counts: Counter = Counter()
    for episode in episodes:
        split = (f"{'typing' if family(episode) in typing else 'other'} task, "
                 f"{'typed' if typed_episode(episode) else 'never typed'}")
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
    if not args.trajectories.is_file():
        raise SystemExit(f"{args.trajectories}: no seed trajectories (`dvc checkout data.dvc`, or --trajectories)")
    typing = typing_families(read_trajectories(args.trajectories))
    print(f"task kinds the seed wins only by typing: {', '.join(sorted(typing)) or 'none'}")
    pooled: Counter = Counter()
    untyped_wins = []
    for source in args.episodes:
        episodes = [Trajectory.from_dict(json.loads(line)["trajectory"]) for line in episode_lines(source) if line]
        counts = splits(episodes, typing)
        report(source, counts)
        pooled.update(counts)
        untyped_wins += [e for e in episodes if e.success and family(e) in typing and not typed_episode(e)]
    if len(args.episodes) > 1:
        report("pooled", pooled)
    for episode in untyped_wins:
        print(f"  won without typing: {episode.task.task_id} {[step.action for step in episode.steps]} "
              f"({episode.steps[-1].info.get('reasoning', '')[:160]!r})")


if __name__ == "__main__":
    main()
