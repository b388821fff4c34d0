"""Real-environment speed, both environments in one run: start, resets/s, steps/s (random and expert policies).

    .venv/bin/python benchmarks/env_speed.py [--episodes N] [--tasks K] [--params params.yaml]

Held-out tasks are made first (TextWorld games generated and cached), outside every timing. Environments run one
after the other, one instance at a time, so they do not compete for the CPU. Timings count only the environment
call (reset or step); the scripted policies cost microseconds.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from components.config import load_params  # noqa: E402
from components.envs.registry import REAL_ENVIRONMENTS, real_environment  # noqa: E402


def timed(call: Any, *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    value = call(*args)
    return value, time.perf_counter() - started


def play(env: Any, tasks: list, episodes: int, make_policy: Any, max_steps: int) -> dict:
    """Episodes cycling over the tasks; step time only (resets untimed here, they have their own row)."""
    steps, step_s, successes = 0, 0.0, 0
    for index in range(episodes):
        task = tasks[index % len(tasks)]
        observation, history = env.reset(task), []
        policy = make_policy(env, index)
        for _ in range(max_steps):
            action = policy(task, observation, history)
            result, seconds = timed(env.step, action)
            steps, step_s = steps + 1, step_s + seconds
            history.append((observation.state, action))
            observation = result.observation
            if result.done:
                successes += bool(result.info.get("success"))
                break
    return {"steps": steps, "steps_per_s": steps / step_s, "success": successes / episodes}


def measure(name: str, params: Any, episodes: int, task_count: int) -> dict[str, float]:
    kind = real_environment(name)
    print(f"[{name}] making {task_count} held-out tasks (not timed)", flush=True)
    tasks = kind.make_tasks(params.environments, "heldout", task_count, params.seed)
    max_steps = kind.max_steps(params.environments)
    env = kind.open(params.environments)
    try:
        print(f"[{name}] measuring", flush=True)
        _, first = timed(env.reset, tasks[0])  # engine/browser start plus the first reset
        reset_s = [timed(env.reset, tasks[index % len(tasks)])[1] for index in range(1, episodes + 1)]
        rand = play(env, tasks, episodes,
                    lambda e, i: kind.random(e, random.Random(f"{params.seed}:{i}")), max_steps)
        expert = play(env, tasks, episodes, lambda e, i: kind.expert(e), max_steps)
    finally:
        env.close()
    mean_reset = sum(reset_s) / len(reset_s)
    return {
        "start + first reset (s)": first,
        "start alone, approx. (s)": max(0.0, first - mean_reset),
        "resets / s (cycling tasks)": 1 / mean_reset,
        "random: steps / s": rand["steps_per_s"],
        "random: steps played": rand["steps"],
        "random: success": rand["success"],
        "expert: steps / s": expert["steps_per_s"],
        "expert: steps played": expert["steps"],
        "expert: success": expert["success"],
    }


def table(results: dict[str, dict[str, float]]) -> str:
    names = list(results)
    rows = list(next(iter(results.values())))
    first = max(map(len, ["metric", *rows]))
    widths = [max(len(name), 10) for name in names]
    lines = ["  ".join(["metric".ljust(first), *(n.rjust(w) for n, w in zip(names, widths))])]
    lines.append("  ".join(["-" * first, *("-" * w for w in widths)]))
    for row in rows:
        cells = [_fmt(results[n][row]).rjust(w) for n, w in zip(names, widths)]
        lines.append("  ".join([row.ljust(first), *cells]))
    return "\n".join(lines)


def _fmt(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=10, help="resets, and episodes per policy (default 10)")
    parser.add_argument("--tasks", type=int, default=4, help="held-out tasks to cycle over (default 4)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--environments", nargs="+", default=list(REAL_ENVIRONMENTS), choices=REAL_ENVIRONMENTS)
    args = parser.parse_args(argv)
    params = load_params(args.params)
    results = {name: measure(name, params, args.episodes, args.tasks) for name in args.environments}
    print(f"\n{args.episodes} resets and {args.episodes} episodes per policy over {args.tasks} held-out tasks:\n")
    print(table(results))


if __name__ == "__main__":
    main()
