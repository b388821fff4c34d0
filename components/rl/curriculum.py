"""The curriculum task generator: harder variations of the tasks the current policy is unsure about.

DreamGym's task value is the reward variance over a task's rollouts under the current policy,
V_tau = (1/n) * sum_i (r_i - mean(r))^2: zero when the policy always succeeds or always fails (nothing to learn),
highest at 50/50. Each iteration:

1. `observe(tasks, rewards)` records the variance of each task's group of episodes (for PPO, optionally of each
   cluster of similar tasks, see `cluster_tasks`).
2. `propose(backend, iteration)` asks the experience-model backbone for variations of the `top_tasks` highest-variance
   tasks (same action types, changed constraints, goals or context). Replies are validated (parseable, non-empty,
   length-bounded, not a duplicate) and become new task records; rejected replies are counted by reason, never raised.
3. `tasks_for_iteration(...)` picks the next iteration's tasks: at most floor(lambda * tasks_per_iteration) generated
   ones, the rest from the base tasks exactly as `task_schedule` picks them.

A generated task keeps its parent's parameters (so the synthetic environment resets it to the parent's
`initial_state`) and adds `parent_task_id` and `generated_at_iteration`: with `write_tasks` these JSONL records are
the versioned output of the curriculum. With `enabled` off (the ablation) nothing is generated and the schedule is
`task_schedule`'s, episode for episode. The whole state is a JSON-able dict (`state_dict`), so a checkpoint stores
it and a resumed run makes the same choices.
"""
from __future__ import annotations

import json
import logging
import math
import random
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from components.data.contract import Task, file_format, read_records, write_records
from components.llm.backends import GenerationBackend, Message
from components.simulator.experience_model import clip
from components.simulator.replay_buffer import Encoder

log = logging.getLogger(__name__)

STATE_VERSION = 1
REJECTION_REASONS = ("unparseable", "empty", "too_long", "duplicate", "backend_error")
REJECTIONS_KEPT = 100  # the most recent rejected replies kept for the report (the counters keep them all)


@dataclass(frozen=True)
class CurriculumSettings:
    """params synthetic_rl.curriculum: no defaults here, every value comes from params."""

    enabled: bool  # off: the ablation, plain `task_schedule` over the base tasks
    top_tasks: int  # highest-variance tasks varied per iteration
    variations_per_task: int
    max_generated_share: float  # lambda: at most this share of an iteration's tasks are generated ones
    min_variance: float  # a task whose rewards never vary teaches nothing and is not varied
    max_new_tokens: int
    temperature: float  # sampling, so several variations of one task can differ
    max_instruction_chars: int  # a longer reply is a model running on, not a task
    max_state_chars: int  # the parent's initial state in the prompt (head and tail kept)
    clusters: int  # PPO: k in k-means over task embeddings

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_generated_share <= 1.0:
            raise ValueError(f"max_generated_share must be in [0, 1], got {self.max_generated_share}")


def task_schedule(tasks: list[Task], tasks_per_iteration: int, group_size: int, seed: int,
                  iteration: int) -> list[Task]:
    """The base tasks of one iteration, each repeated `group_size` times; a fixed function of (seed, iteration), so a
    resumed run plays the same tasks an uninterrupted one would."""
    rng = random.Random(f"{seed}-{iteration}")
    chosen = rng.sample(tasks, min(tasks_per_iteration, len(tasks)))
    return [task for task in chosen for _ in range(group_size)]


# ---- task records ---------------------------------------------------------------------------------------------


def read_tasks(path: str | Path) -> list[Task]:
    """Task records written by `Curriculum.write_tasks` (JSONL, one task per line)."""
    return [Task.from_dict(record) for record in read_records(path)]


# ---- prompt and parsing ---------------------------------------------------------------------------------------

SYSTEM = (
    "You write training tasks for an agent in a text environment. Given a task and the environment's initial state, "
    "write one new task that is harder than the given one: the agent must use the same kinds of actions, but change "
    "the constraints, the goal or the context. The new task must be possible from the same initial state. "
    "Reply with the new task only, in exactly this format:\n<instruction>the new task</instruction>"
)
INSTRUCTION_END = "</instruction>"  # generation can stop there
_INSTRUCTION = re.compile(r"<instruction>(.*?)</instruction>", re.DOTALL)


def variation_prompt(parent: Task, max_state_chars: int) -> list[Message]:
    state = parent.parameters.get("initial_state")
    state_text = clip(state, max_state_chars) if isinstance(state, str) and state else "(not given)"
    user = f"Environment: {parent.environment}\nTask: {parent.instruction}\nInitial state:\n{state_text}"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


# Parameters that pick one game or page of a task family, not the family: a variation keeps the family's others.
INSTANCE_KEYS = ("seed", "initial_state", "parent_task_id", "generated_at_iteration")


def variation_pairs(tasks: Sequence[Task], per_task: int) -> list[tuple[Task, str]]:
    """Pairs of related seed tasks for teaching the writer its role: (a task, the instruction of another task of its
    family, i.e. the same environment and parameters but INSTANCE_KEYS, with another instruction), up to `per_task`
    per task, each task's taken in turn after it so that the pairs spread over the family. A family whose tasks all
    share one instruction (every TextWorld cooking game) gives none: there is nothing to learn from it."""
    families: dict[str, list[Task]] = defaultdict(list)
    for task in tasks:
        family = {k: v for k, v in task.parameters.items() if k not in INSTANCE_KEYS}
        families[json.dumps([task.environment, family], sort_keys=True, default=str)].append(task)
    pairs = []
    for members in families.values():
        instructions = list(dict.fromkeys(task.instruction for task in members))  # distinct, in order
        for task in members:
            others = [text for text in instructions if normalised(text) != normalised(task.instruction)]
            if others:
                start = instructions.index(task.instruction) % len(others)
                pairs += [(task, text) for text in (others[start:] + others[:start])[:per_task]]
    return pairs


def variation_examples(pairs: Sequence[tuple[Task, str]], max_state_chars: int) -> list[dict[str, Any]]:
    """`variation_pairs` as SFT prompt/completion examples: the curriculum's own prompt, the reply in its format."""
    return [{"prompt": variation_prompt(parent, max_state_chars),
             "completion": [{"role": "assistant", "content": f"<instruction>{text}{INSTRUCTION_END}"}]}
            for parent, text in pairs]


def parse_instruction(reply: str) -> str | None:
    """The text inside the first <instruction>...</instruction>, stripped; None if there is no such pair."""
    match = _INSTRUCTION.search(reply) if isinstance(reply, str) else None
    return match[1].strip() if match else None


def normalised(text: str) -> str:
    """Lower-case words only: two instructions that differ in case, spacing or punctuation are the same task."""
    return " ".join(re.findall(r"\w+", text.lower()))


def task_key(task: Task, instruction: str) -> str:
    """What makes a task new: its world (environment and parameters, which fix the game or the initial state) and
    its instruction. Every TextWorld game has the same instruction, so the instruction alone would count one
    variation written for two games as a duplicate."""
    world = {k: v for k, v in task.parameters.items() if k not in ("parent_task_id", "generated_at_iteration")}
    return json.dumps([task.environment, world, normalised(instruction)], sort_keys=True, default=str)


# ---- the curriculum -------------------------------------------------------------------------------------------


class Curriculum:
    """Base tasks, the tasks generated from them (in creation order), the latest reward variances and counters.

    `clusters` (PPO): task id -> cluster id, from `cluster_tasks`. With it, `observe` computes the variance over all
    episodes of a cluster and gives it to each of the cluster's tasks; a generated task joins its parent's cluster
    and a task without a cluster is a group of its own.
    """

    def __init__(self, base_tasks: Sequence[Task], settings: CurriculumSettings,
                 clusters: Mapping[str, int] | None = None) -> None:
        self.settings = settings
        self.base_tasks = list(base_tasks)
        self.tasks_by_id = {task.task_id: task for task in self.base_tasks}
        if len(self.tasks_by_id) != len(self.base_tasks):
            raise ValueError("base tasks have duplicate task ids")
        self.clusters = dict(clusters) if clusters is not None else None
        self.generated: list[Task] = []
        self.variance: dict[str, float] = {}  # task id -> reward variance when it was last played
        self.cluster_variance: dict[int, float] = {}  # PPO: cluster -> variance when it was last played
        self.last_observed: list[str] = []  # task ids of the latest `observe`: the policy as it is now
        self.unplayable: set[str] = set()  # generated tasks whose every episode an environment failure ended
        self.counts: Counter[str] = Counter()
        self.rejections: list[dict[str, str]] = []

    # -- choosing an iteration's tasks --
    def tasks_for_iteration(self, iteration: int, tasks_per_iteration: int, group_size: int,
                            seed: int) -> list[Task]:
        """The iteration's tasks, each repeated `group_size` times in a row (the shape of `task_schedule`).

        At most floor(lambda * tasks_per_iteration) are generated tasks: first those never played (newest first),
        then played ones that still have reward variance (highest first). The rest are base tasks, chosen by
        `task_schedule` itself; with the curriculum off or nothing generated, that is the whole schedule.
        """
        picked = self.generated_picks(tasks_per_iteration) if self.settings.enabled else []
        base = task_schedule(self.base_tasks, tasks_per_iteration - len(picked), group_size, seed, iteration)
        return base + [task for task in picked for _ in range(group_size)]

    def generated_picks(self, tasks_per_iteration: int) -> list[Task]:
        # 1e-9: 0.29 * 100 is 28.999999999999996 in floating point, and the cap means 29
        cap = math.floor(self.settings.max_generated_share * tasks_per_iteration + 1e-9)
        order = {task.task_id: number for number, task in enumerate(self.generated)}
        unplayed = [t for t in self.generated if t.task_id not in self.variance and t.task_id not in self.unplayable]
        # newest iteration first; within one iteration, creation order (parents of highest variance first)
        unplayed.sort(key=lambda t: (-t.parameters["generated_at_iteration"], order[t.task_id]))
        informative = [t for t in self.generated
                       if t.task_id in self.variance and self.variance[t.task_id] >= self.settings.min_variance]
        informative.sort(key=lambda t: (-self.variance[t.task_id], t.task_id))
        return (unplayed + informative)[:cap]

    # -- task values --
    def observe(self, tasks: Sequence[Task], rewards: Sequence[float]) -> None:
        """Record the reward variance of each group of an iteration's episodes (`rewards[i]` is `tasks[i]`'s)."""
        if len(tasks) != len(rewards):
            raise ValueError(f"{len(tasks)} tasks but {len(rewards)} rewards")
        unknown = sorted({t.task_id for t in tasks} - self.tasks_by_id.keys())
        if unknown:
            raise ValueError(f"tasks unknown to the curriculum: {unknown[:5]}")
        groups: dict[Any, list[float]] = defaultdict(list)
        for task, reward in zip(tasks, rewards, strict=True):
            groups[self.group_of(task.task_id)].append(float(reward))
        variances = {group: statistics.pvariance(values) for group, values in groups.items()}
        self.last_observed = list(dict.fromkeys(t.task_id for t in tasks))
        for task_id in self.last_observed:
            self.variance[task_id] = variances[self.group_of(task_id)]
        self.cluster_variance.update({g[1]: v for g, v in variances.items() if g[0] == "cluster"})

    def observe_failures(self, tasks: Sequence[Task]) -> None:
        """Record generated tasks played whose every episode an environment failure ended (in the synthetic
        environment: the experience model could not go on): they have no variance, and are not picked again as
        never played, which would replay them every iteration."""
        generated = {task.task_id for task in self.generated}
        self.unplayable |= {t.task_id for t in tasks if t.task_id in generated and t.task_id not in self.variance}

    def group_of(self, task_id: str) -> tuple[str, Any]:
        if self.clusters is not None and task_id in self.clusters:
            return ("cluster", self.clusters[task_id])
        return ("task", task_id)

    def hardest_tasks(self) -> list[Task]:
        """Up to `top_tasks` of the latest iteration's tasks with variance >= min_variance, highest first.

        Only the latest iteration counts: an older variance measured a policy that no longer exists.
        """
        candidates = [i for i in self.last_observed if self.variance[i] >= self.settings.min_variance]
        candidates.sort(key=lambda i: (-self.variance[i], i))
        return [self.tasks_by_id[i] for i in candidates[: self.settings.top_tasks]]

    # -- generating tasks --
    def propose(self, backend: GenerationBackend, iteration: int) -> list[Task]:
        """Variations of `hardest_tasks()` from one batched `generate` call; returns the accepted new tasks."""
        parents = self.hardest_tasks() if self.settings.enabled else []
        parents = [p for p in parents for _ in range(self.settings.variations_per_task)]
        if not parents:
            return []
        prompts = [variation_prompt(p, self.settings.max_state_chars) for p in parents]
        self.counts["proposed"] += len(prompts)
        try:
            replies = backend.generate(prompts, max_new_tokens=self.settings.max_new_tokens,
                                       temperature=self.settings.temperature)
            if len(replies) != len(prompts):
                raise RuntimeError(f"{len(replies)} replies for {len(prompts)} prompts")
        except Exception as error:  # noqa: BLE001  (a failed proposal must not stop training)
            log.warning("curriculum: the backend failed, no new tasks this iteration: %s", error)
            for _ in prompts:
                self.reject("", "backend_error")
            return []

        seen = {task_key(t, t.instruction) for t in self.tasks_by_id.values()}
        accepted = []
        for parent, reply in zip(parents, replies, strict=True):
            instruction = parse_instruction(reply)
            reason = self.check(instruction, seen, parent)
            if reason is not None:
                self.reject(reply, reason)
                continue
            seen.add(task_key(parent, instruction))
            accepted.append(self.add_generated(parent, instruction, iteration))
        self.counts["accepted"] += len(accepted)
        log.info("curriculum: iteration %d, %d of %d variations accepted", iteration, len(accepted), len(prompts))
        return accepted

    def check(self, instruction: str | None, seen: set[str], parent: Task) -> str | None:
        """Why a parsed instruction for a variation of `parent` is rejected, or None if it is a valid new task.
        `seen`: the `task_key`s of the tasks so far."""
        if instruction is None:
            return "unparseable"
        if not normalised(instruction):
            return "empty"
        if len(instruction) > self.settings.max_instruction_chars:
            return "too_long"
        if task_key(parent, instruction) in seen:
            return "duplicate"
        return None

    def reject(self, reply: str, reason: str) -> None:
        self.counts[f"rejected_{reason}"] += 1
        self.rejections.append({"reason": reason, "reply": reply[:500]})
        del self.rejections[:-REJECTIONS_KEPT]

    def add_generated(self, parent: Task, instruction: str, iteration: int) -> Task:
        number = 0
        while f"{parent.task_id}~g{iteration}-{number}" in self.tasks_by_id:
            number += 1
        parameters = {**parent.parameters, "parent_task_id": parent.task_id, "generated_at_iteration": iteration}
        task = Task(f"{parent.task_id}~g{iteration}-{number}", parent.environment, instruction, parameters)
        self.generated.append(task)
        self.tasks_by_id[task.task_id] = task
        if self.clusters is not None and parent.task_id in self.clusters:
            self.clusters[task.task_id] = self.clusters[parent.task_id]  # same action types: a close neighbour
        return task

    # -- records, checkpoints and metrics --
    def write_tasks(self, path: str | Path) -> None:
        """The generated tasks as JSONL task records, in creation order (atomic write)."""
        if file_format(path) != "jsonl":
            raise ValueError(f"{path}: generated tasks are written as .jsonl")
        write_records((task.to_dict() for task in self.generated), path)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "generated": [task.to_dict() for task in self.generated],
            "variance": dict(self.variance),
            "cluster_variance": {str(c): v for c, v in self.cluster_variance.items()},  # JSON keys are strings
            "clusters": dict(self.clusters) if self.clusters is not None else None,
            "last_observed": list(self.last_observed),
            "unplayable": sorted(self.unplayable),
            "counts": dict(self.counts),
            "rejections": list(self.rejections),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict` (after a JSON round trip, too) onto a curriculum over the same base tasks."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"curriculum state version {state.get('version')!r}, expected {STATE_VERSION}")
        self.generated = [Task.from_dict(record) for record in state["generated"]]
        self.tasks_by_id = {task.task_id: task for task in [*self.base_tasks, *self.generated]}
        self.variance = dict(state["variance"])
        self.cluster_variance = {int(c): v for c, v in state["cluster_variance"].items()}
        self.clusters = dict(state["clusters"]) if state["clusters"] is not None else None
        self.last_observed = list(state["last_observed"])
        self.unplayable = set(state.get("unplayable", []))  # absent from checkpoints written before it existed
        self.counts = Counter(state["counts"])
        self.rejections = list(state["rejections"])

    def summary(self) -> dict[str, Any]:
        """Counts for the iteration log: fixed keys, so every row has the same columns."""
        latest = [self.variance[i] for i in self.last_observed]
        return {
            "curriculum_enabled": self.settings.enabled,
            "generated_tasks": len(self.generated),
            "proposed": self.counts["proposed"],
            "accepted": self.counts["accepted"],
            "rejected": sum(self.counts[f"rejected_{r}"] for r in REJECTION_REASONS),
            **{f"rejected_{r}": self.counts[f"rejected_{r}"] for r in REJECTION_REASONS},
            "reward_variance_mean": sum(latest) / len(latest) if latest else 0.0,
            "reward_variance_max": max(latest, default=0.0),
        }


# ---- PPO: groups of similar tasks -----------------------------------------------------------------------------


def cluster_tasks(tasks: Sequence[Task], encoder: Encoder, n_clusters: int, seed: int) -> dict[str, int]:
    """Task id -> cluster id, by k-means on instruction embeddings; k is capped at the number of distinct ones."""
    from sklearn.cluster import KMeans

    distinct = list({task.task_id: task for task in tasks}.values())
    if not distinct:
        return {}
    vectors = np.asarray(encoder.encode([task.instruction for task in distinct]), dtype=np.float64)
    k = max(1, min(n_clusters, len(np.unique(vectors, axis=0))))  # more clusters than points: empty clusters
    labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(vectors)
    return {task.task_id: int(label) for task, label in zip(distinct, labels, strict=True)}
