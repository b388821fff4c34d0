"""Seed collection: real episodes on training tasks by expert, noisy-expert, skipping-expert and random policies.

The mix gives the seed set both successes and failures, which the experience model needs to learn rewards; the
skipping expert's failures look like wins up to the last turn, so rewards cannot be learned from length alone.
Deterministic: task lists, policies' random choices and trajectory ids all derive from params. Resumable: each
finished episode is appended to a progress file first, so a crash loses at most the episode in flight; the
progress is resumed only by the same collection (same params, same collection and environment code).

An episode an environment failure ended (a hung or dead engine or browser, `base.env_failure`) is not the policy's
and never becomes seed data: it is played again, the same episode (same seeded choices) in a restarted engine, up to
ENV_FAILURE_ATTEMPTS times in all, then left out. The run's failed plays are kept aside, each with its reason, in
`env_failures/<environment>.jsonl` beside the collected files, which onboarding (`<out_dir>/*.jsonl`) never reads.
"""
from __future__ import annotations

import contextlib
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from components.data.contract import Trajectory, append_records, read_journal, write_trajectories
from components.envs.base import check_not_all_failed, env_failure
from components.envs.episode import run_episode
from components.envs.registry import has_adapter, real_environment
from components.files import discard_unless_stamped, fingerprint

SOURCE_OF = {"expert": "expert", "noisy_expert": "policy", "skipping_expert": "policy", "random": "random"}
ENV_FAILURE_ATTEMPTS = 3  # plays of one episode that environment failures may end before it is left out
ENV_FAILURES_DIR = "env_failures"


@dataclass(frozen=True)
class Collection:
    trajectories: list[Trajectory]  # collected, in plan order (out_path)
    env_failures: list[Trajectory]  # every play an environment failure ended, retried or not (env_failures_path)
    left_out: list[str]  # ids of the planned episodes environment failures ended every time: not collected


def env_failures_path(out_path: Path) -> Path:
    """Where the plays environment failures ended are kept: a folder beside the collected files."""
    return out_path.parent / ENV_FAILURES_DIR / out_path.name


def collect_environment(params, environment: str, out_path: Path, progress_path: Path,
                        log: Callable[[str], None] = print) -> Collection:
    """Collect the configured episode mix on `environment`'s training tasks; write them to `out_path`, and the plays
    environment failures ended to `env_failures_path(out_path)` (none: no file)."""
    kind = real_environment(environment)
    settings = params.collect_seed
    tasks = kind.make_tasks(params.environments, "train", settings.train_tasks, params.seed)
    mix = settings.episodes.model_dump()
    if kind.skipping_expert is None and mix["skipping_expert"]:
        log(f"[collect_seed {environment}] no skipping expert for this environment: its episodes are left out")
        mix["skipping_expert"] = 0
    plan = [(task, policy, repeat) for task in tasks for policy, count in mix.items() for repeat in range(count)]
    done = _load_progress(progress_path, _fingerprint(params))
    failures: list[Trajectory] = []
    left_out: list[str] = []
    start, fresh = time.monotonic(), 0
    env = kind.open(params.environments)
    try:
        for number, (task, policy_name, repeat) in enumerate(plan, start=1):
            trajectory_id = f"{task.task_id}-{policy_name}-{repeat}"
            if trajectory_id in done:
                continue
            for attempt in range(1, ENV_FAILURE_ATTEMPTS + 1):
                # Seeded per episode, not per run or attempt: a resumed run, or a retry after an environment
                # failure, makes the same choices as an unbroken run.
                rng = random.Random(zlib.crc32(f"{params.seed}/{trajectory_id}".encode()))
                policy = {"expert": lambda: kind.expert(env),
                          "noisy_expert": lambda: kind.noisy_expert(env, settings.noisy_epsilon, rng),
                          "skipping_expert": lambda: kind.skipping_expert(env, rng),
                          "random": lambda: kind.random(env, rng)}[policy_name]()
                trajectory = run_episode(env, task, policy, max_steps=kind.max_steps(params.environments),
                                         trajectory_id=trajectory_id, source=SOURCE_OF[policy_name])
                if (why := env_failure(trajectory)) is None:
                    break
                failures.append(trajectory)
                log(f"[collect_seed {environment}] {trajectory_id}: environment failure ({why}); "
                    + ("playing it again" if attempt < ENV_FAILURE_ATTEMPTS else f"left out after {attempt}"))
            else:
                left_out.append(trajectory_id)
                continue
            append_records([trajectory.to_dict()], progress_path)
            done[trajectory_id] = trajectory
            fresh += 1
            eta = (time.monotonic() - start) / fresh * (len(plan) - number)
            wins = sum(t.success for t in done.values())
            log(f"[collect_seed {environment}] {number}/{len(plan)} episodes, {wins} successes, ETA {eta:.0f}s")
    finally:
        env.close()
    kept_aside = env_failures_path(out_path)
    if failures:
        write_trajectories(failures, kept_aside)
    else:  # an earlier collection's
        kept_aside.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            kept_aside.parent.rmdir()  # only when empty
    collected = [done[i] for i in (f"{task.task_id}-{policy}-{repeat}" for task, policy, repeat in plan) if i in done]
    check_not_all_failed(collected + failures, f"collect_seed {environment}")  # raises with the progress kept
    write_trajectories(collected, out_path)
    progress_path.unlink(missing_ok=True)  # none when nothing was planned
    progress_path.with_suffix(".fingerprint").unlink(missing_ok=True)
    return Collection(collected, failures, left_out)


def _fingerprint(params) -> str:
    sources = [Path(__file__), *sorted((Path(__file__).parents[1] / "envs").glob("*.py"))]
    return fingerprint([params.seed, params.environments.model_dump(), params.collect_seed.model_dump()], sources)


def _load_progress(path: Path, fingerprint: str) -> dict[str, Trajectory]:
    discard_unless_stamped(path, fingerprint, path.with_suffix(".fingerprint"))  # another collection's episodes
    return {t.trajectory_id: t for t in map(Trajectory.from_dict, read_journal(path))}


def collectable(environments: list[str]) -> tuple[list[str], list[str]]:
    """Split environment names into those with a real adapter and seed-only ones."""
    return [e for e in environments if has_adapter(e)], [e for e in environments if not has_adapter(e)]
