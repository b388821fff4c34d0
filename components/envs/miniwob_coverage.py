"""What the text interface covers of MiniWoB++: for every non-flight task, whether it resets, how many of its
interactive elements the state shows, and the success of the expert (tasks with a solver) or of a random policy.

Rows are appended to a JSONL file as each task finishes, so a cut run goes on where it stopped.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from components.data.contract import append_records, read_journal
from components.envs.base import env_failure
from components.envs.episode import run_episode
from components.envs.miniwob import HTML_DIR, SOLVERS, MiniWoB, expert_policy, make_tasks, random_policy
from components.reports import markdown_table


@dataclass
class TaskCoverage:
    task: str
    reset_error: str = ""  # empty: every reset worked
    shown: int = 0  # interactive elements the state showed, summed over the episodes' first pages
    interactive: int = 0
    missing: list[str] = field(default_factory=list)  # tags of those it did not, each once
    policy: str = ""  # expert | random
    episodes: int = 0
    wins: int = 0
    failures: list[str] = field(default_factory=list)  # environment failures and policy errors, one per episode


def task_names() -> list[str]:
    """Every MiniWoB task the env runs (the flight.* tasks live apart and are refused)."""
    return sorted(path.stem for path in (HTML_DIR / "miniwob").glob("*.html"))


def measure_task(env: MiniWoB, name: str, *, episodes: int, max_steps: int, seed: int) -> TaskCoverage:
    """One task's row: `episodes` held-out pages, each checked for coverage at reset and then played."""
    row = TaskCoverage(name, policy="expert" if name in SOLVERS else "random")
    try:
        tasks = make_tasks("heldout", episodes, seed=seed, task_names=[name], env=env)
    except Exception as error:  # a page that does not load is this row's finding, not the run's end
        row.reset_error = _short(error)
        return row
    rng = random.Random(f"coverage/{name}/{seed}")
    for task in tasks:
        row.episodes += 1
        try:
            env.reset(task)
            shown, missing = env.interactive_coverage()
            row.shown, row.interactive = row.shown + shown, row.interactive + shown + len(missing)
            row.missing = sorted({*row.missing, *missing})
            policy = expert_policy() if row.policy == "expert" else random_policy(rng)
            trajectory = run_episode(env, task, policy, max_steps=max_steps, trajectory_id=task.task_id,
                                     source=row.policy)
        except Exception as error:  # a solver meeting a page it was not written for, or a browser that gave up
            row.failures.append(_short(error))
            continue
        row.wins += trajectory.success
        if why := env_failure(trajectory):
            row.failures.append(_short(why))
    return row


def _short(problem: BaseException | str) -> str:
    """One line of at most 160 characters that a table cell can hold."""
    text = f"{type(problem).__name__}: {problem}" if isinstance(problem, BaseException) else problem
    return " ".join(text.split()).replace("|", "/")[:160]


def run_coverage(rows_file: Path, names: Sequence[str], *, episodes: int, max_steps: int, step_timeout_s: float,
                 episode_time_limit_s: float, seed: int = 0,
                 progress: Callable[[str], None] = print) -> list[TaskCoverage]:
    """Every task's row, measuring only those `rows_file` does not hold yet (each appended when done)."""
    done = {row.task: row for row in read_rows(rows_file)}
    todo = [name for name in names if name not in done]
    started = time.monotonic()
    with MiniWoB(step_timeout_s=step_timeout_s, episode_time_limit_s=episode_time_limit_s) as env:
        for index, name in enumerate(todo, 1):
            row = measure_task(env, name, episodes=episodes, max_steps=max_steps, seed=seed)
            append_records([asdict(row)], rows_file)
            done[name] = row
            elapsed = time.monotonic() - started
            progress(f"[coverage miniwob] {index}/{len(todo)} {name}: shown {row.shown}/{row.interactive}, "
                     f"{row.policy} {row.wins}/{row.episodes}, elapsed {elapsed:.0f} s, "
                     f"ETA {elapsed / index * (len(todo) - index):.0f} s")
    return [done[name] for name in names]


def read_rows(rows_file: Path) -> list[TaskCoverage]:
    return [TaskCoverage(**record) for record in read_journal(rows_file)]


def coverage_markdown(rows: Sequence[TaskCoverage], *, episodes: int, max_steps: int) -> str:
    """The table, with a summary line above it."""
    loaded = [row for row in rows if not row.reset_error]
    full = [row for row in loaded if row.shown == row.interactive]
    won = [row for row in loaded if row.wins]
    table = markdown_table(
        ["task", "reset", "interactive elements shown", "not shown", "policy", "success", "failures"],
        [[row.task, "fails: " + row.reset_error if row.reset_error else "ok",
          f"{row.shown}/{row.interactive}" if row.interactive else "none found", ", ".join(row.missing),
          row.policy, f"{row.wins}/{row.episodes}", "; ".join(sorted(set(row.failures)))[:120]]
         for row in rows])
    return (f"{len(rows)} tasks: {len(loaded)} reset, {len(full)} show every interactive element they have, "
            f"{len(won)} won at least once ({episodes} held-out episodes of at most {max_steps} steps per task; "
            "the expert where it has a solver, else a random policy). Interactive elements: form controls, links, "
            "canvases, elements with a click handler or under a pointer cursor, counted on each episode's first "
            "page.\n\n" + table)
