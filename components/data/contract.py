"""The trajectory data contract: Task, Step, Trajectory, their JSONL/Parquet forms, and the transition view.

One JSON object per line (JSONL), or the same columns in Parquet where the free-form objects `parameters` and
`info` are stored as JSON text (Parquet has no schemaless map). These readers trust their input: untrusted user
files go through `components.data.onboarding`, which validates every record first.
"""
from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SOURCES = ("expert", "random", "policy", "synthetic", "human")
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
# The versioned data directory (onboarding writes it): accepted trajectories, their distinct tasks, rejected records,
# and the ids the pipeline's own seed collection stored there (so the next collection can supersede exactly those)
TRAJECTORIES, TASKS, QUARANTINE, COLLECTED = "trajectories.jsonl", "tasks.jsonl", "quarantine.jsonl", "collected.txt"
# A policy's own real episodes on training tasks (source: policy), as the RL stages that played them write them
ON_POLICY = "on_policy.jsonl"


@dataclass(frozen=True)
class Task:
    task_id: str
    environment: str
    instruction: str
    parameters: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Task:
        return cls(record["task_id"], record["environment"], record["instruction"], record.get("parameters") or {})

    def to_dict(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "environment": self.environment, "instruction": self.instruction,
                "parameters": self.parameters}


@dataclass(frozen=True)
class Step:
    state: str
    action: str
    next_state: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Trajectory:
    trajectory_id: str
    task: Task
    steps: list[Step]
    success: bool
    return_: float  # `return` in the files; a Python keyword here
    source: str

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Trajectory:
        return cls(
            trajectory_id=record["trajectory_id"],
            task=Task.from_dict(record["task"]),
            steps=[
                Step(s["state"], s["action"], s["next_state"], float(s["reward"]), s["done"], s.get("info") or {})
                for s in record["steps"]
            ],
            success=record["success"],
            return_=float(record["return"]),
            source=record["source"],
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "trajectory_id": self.trajectory_id,
            "task": self.task.to_dict(),
            "steps": [
                {"state": s.state, "action": s.action, "next_state": s.next_state,
                 "reward": s.reward, "done": s.done, "info": s.info}
                for s in self.steps
            ],
            "success": self.success,
            "return": self.return_,
            "source": self.source,
        }


@dataclass(frozen=True, slots=True)
class TaskRef:
    """A task known by its id and environment only: what the replay buffer stores of a transition's task."""

    task_id: str
    environment: str


@dataclass(frozen=True, slots=True)
class Transition:
    """One step seen from the experience model: (task, history, state, action) -> (next_state, reward, done).

    The project's one transition type. `annotation.AnnotatedTransition` is a Transition plus its reasoning trace;
    `replay_buffer.Retrieved` wraps one with where the buffer got it and its similarity to a query. `task` is the
    full Task, except in a transition read back from the replay buffer, which stores the task's id and environment
    only (a `TaskRef`: no instruction to read there; look the Task up by id where one is needed).
    """

    trajectory_id: str
    step_index: int
    task: Task | TaskRef
    state: str
    action: str
    next_state: str
    reward: float
    done: bool
    source: str  # the trajectory's contract source (SOURCES)
    # Keyword-only: earlier (state, action) pairs, oldest first (() when not carried), and the step's info.
    history: tuple[tuple[str, str], ...] = field(default=(), kw_only=True)
    info: dict[str, Any] = field(default_factory=dict, kw_only=True)


def transitions(trajectory: Trajectory, history_length: int | None = None) -> Iterator[Transition]:
    """Every step of a trajectory as a Transition, carrying at most `history_length` earlier steps."""
    for index, step in enumerate(trajectory.steps):
        start = 0 if history_length is None else max(0, index - history_length)
        history = tuple((s.state, s.action) for s in trajectory.steps[start:index])
        yield Transition(trajectory.trajectory_id, index, trajectory.task, step.state, step.action, step.next_state,
                         step.reward, step.done, trajectory.source, history=history, info=step.info)


def is_outcome(reward: float, done: bool) -> bool:
    """A step that earns a reward or ends its episode: rare in seed data (2-3% of TextWorld steps), so training
    repeats them and fidelity samples take them first."""
    return reward != 0 or done


def rewarded_commands(transitions_: Iterable[Any]) -> set[tuple[str, str]]:
    """(environment, action) of every rewarded transition: what `is_lookalike` compares against."""
    return {(t.task.environment, t.action) for t in transitions_ if t.reward > 0}


def is_lookalike(t: Any, rewarded: set[tuple[str, str]]) -> bool:
    """An unrewarded, non-terminal step whose command earns a reward elsewhere (`rewarded`, same environment): `eat
    meal` with no meal prepared, which an experience model rewarding by command or by turn wins."""
    return not is_outcome(t.reward, t.done) and (t.task.environment, t.action) in rewarded


def is_refused(t: Any) -> bool:
    """Whether the environment refused the step's command (step info `valid_action` false, as the real adapters
    record it)."""
    return t.info.get("valid_action") is False


def success_rewards(trajectories: Iterable[Trajectory]) -> dict[str, float]:
    """Per environment, the lowest final reward of a successful trajectory: what a simulated episode's final reward
    must reach to count as a win (TextWorld: 1; MiniWoB's time-discounted rewards: the slowest success seen)."""
    lowest: dict[str, float] = {}
    for trajectory in trajectories:
        if trajectory.success and trajectory.steps and trajectory.steps[-1].reward > 0:
            environment, reward = trajectory.task.environment, trajectory.steps[-1].reward
            lowest[environment] = min(reward, lowest.get(environment, reward))
    return lowest


def is_success(reward: float, done: bool, success_reward: float | None) -> bool:
    """A final step that wins: it ends the episode with at least `success_reward` (None: with any positive reward,
    for a domain whose seed holds no success to learn the winning reward from)."""
    return done and (reward >= success_reward if success_reward is not None else reward > 0)


# The real environments whose games the project generates from a seed (components/envs): the train split draws seeds
# below HELDOUT_GAME_SEEDS, the held-out evaluation split from it. A held-out game's transitions only measure:
# onboarding quarantines them and the replay buffer refuses them, so they never train or ground anything.
SEEDED_GAME_ENVIRONMENTS = ("textworld-cooking", "miniwob")
HELDOUT_GAME_SEEDS = range(1_000_000, 2_000_000)


def is_heldout_game(environment: str | None, parameters: Any) -> bool:
    """A task of the held-out evaluation split of a seeded real environment (its parameters' seed says so)."""
    seed = parameters.get("seed") if isinstance(parameters, dict) else None
    return (environment in SEEDED_GAME_ENVIRONMENTS and isinstance(seed, int) and not isinstance(seed, bool)
            and seed in HELDOUT_GAME_SEEDS)


def is_heldout_task(task_id: str, fraction: float) -> bool:
    """A stable split by task: the same task lands on the same side on every machine, run and data size."""
    return zlib.crc32(task_id.encode("utf-8")) % 10_000 < fraction * 10_000


def file_format(path: str | Path) -> str | None:
    """'jsonl', 'parquet', or None for a file this contract cannot hold."""
    return SUFFIXES.get(Path(path).suffix.lower())


def read_trajectories(path: str | Path) -> list[Trajectory]:
    return [Trajectory.from_dict(record) for record in read_records(path)]


def write_trajectories(trajectories: Iterable[Trajectory], path: str | Path) -> None:
    write_records((t.to_dict() for t in trajectories), path)


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Plain dicts from a JSONL or Parquet file (the dict form of the contract)."""
    path = Path(path)
    if file_format(path) == "parquet":
        for row in pq.read_table(path).to_pylist():
            yield _from_parquet_row(row)
        return
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)


def write_records(records: Iterable[dict[str, Any]], path: str | Path) -> None:
    """Write atomically (temp file, then rename) so a crash never leaves half a data file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    if file_format(path) == "parquet":
        table = pa.Table.from_pylist([_to_parquet_row(r) for r in records], schema=PARQUET_SCHEMA)
        pq.write_table(table, partial)
    else:
        with partial.open("w", encoding="utf-8") as out:
            for record in records:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
    partial.replace(path)


def append_records(records: Iterable[dict[str, Any]], path: str | Path) -> None:
    """Append records to a JSONL journal of finished work, flushed: a crash loses at most the line being written
    (`read_journal` drops it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
        out.flush()


def read_journal(path: str | Path) -> list[dict[str, Any]]:
    """The whole records of a JSONL journal (`append_records`), [] when there is none. A line a crash cut short,
    and whatever follows it, is dropped from the file too, so the next append starts on a clean line."""
    path = Path(path)
    if not path.is_file():
        return []
    records, kept = [], 0
    with path.open("rb") as lines:
        for line in lines:
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no line end")
                if line.strip():
                    records.append(json.loads(line))
            except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                break
            kept += len(line)
    if kept < path.stat().st_size:
        with path.open("r+b") as out:
            out.truncate(kept)
    return records


PARQUET_SCHEMA = pa.schema([
    ("trajectory_id", pa.string()),
    ("task", pa.struct([("task_id", pa.string()), ("environment", pa.string()), ("instruction", pa.string()),
                        ("parameters", pa.string())])),
    ("steps", pa.list_(pa.struct([("state", pa.string()), ("action", pa.string()), ("next_state", pa.string()),
                                  ("reward", pa.float64()), ("done", pa.bool_()), ("info", pa.string())]))),
    ("success", pa.bool_()),
    ("return", pa.float64()),
    ("source", pa.string()),
])


def _to_parquet_row(record: dict[str, Any]) -> dict[str, Any]:
    task = dict(record["task"], parameters=json.dumps(record["task"].get("parameters") or {}))
    steps = [dict(step, info=json.dumps(step.get("info") or {})) for step in record["steps"]]
    return dict(record, task=task, steps=steps)


def _from_parquet_row(row: dict[str, Any]) -> dict[str, Any]:
    """Undo the JSON-text encoding of `parameters` and `info`; leave anything unexpected for validation."""
    task = row.get("task")
    if isinstance(task, dict) and isinstance(task.get("parameters"), str):
        task["parameters"] = _json_or_raw(task["parameters"])
    for step in row.get("steps") or []:
        if isinstance(step, dict) and isinstance(step.get("info"), str):
            step["info"] = _json_or_raw(step["info"])
    return row


def _json_or_raw(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # validation reports it as "not an object" instead of this reader crashing
