"""The real environments the pipeline knows, behind one uniform set of functions configured from params.

An `environment` name with no adapter here is a seed-only domain: its data trains the experience model, but
stages that need the real application (collection, real evaluation, sim-to-real) skip it.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from components.data.contract import Task
from components.envs.base import Environment, Observation, Policy, Split


@dataclass(frozen=True)
class RealEnvironment:
    name: str
    open: Callable[[Any], Environment]  # (environments params) -> a fresh environment
    make_tasks: Callable[[Any, Split, int, int], list[Task]]  # (params, split, count, seed)
    expert: Callable[[Environment], Policy]
    noisy_expert: Callable[[Environment, float, random.Random], Policy]
    random: Callable[[Environment, random.Random], Policy]
    max_steps: Callable[[Any], int]
    # The expert with one step left out, where an environment has one (None: not collected there).
    skipping_expert: Callable[[Environment, random.Random], Policy] | None = None


def _mix(expert: Policy, explorer: Policy, epsilon: float, rng: random.Random) -> Policy:
    """The expert's action, replaced with probability epsilon by the explorer's."""
    def act(task: Task, observation: Observation, history) -> str:
        return explorer(task, observation, history) if rng.random() < epsilon else expert(task, observation, history)
    return act


def _textworld() -> RealEnvironment:
    from components.envs import textworld_cooking as tw

    return RealEnvironment(
        name=tw.ENVIRONMENT,
        open=lambda p: tw.TextWorldCooking(p.textworld.cache_dir, step_timeout=p.textworld.step_timeout_s,
                                           describe_room=p.textworld.describe_room),
        make_tasks=lambda p, split, count, seed: tw.make_tasks(
            split, count, seed=seed, cache_dir=p.textworld.cache_dir, workers=p.textworld.generation_workers,
            **p.textworld.difficulty.model_dump()),
        expert=tw.expert_policy,
        noisy_expert=tw.noisy_expert_policy,  # walkthrough-aware: resumes the walkthrough after a detour
        random=lambda env, rng: tw.random_policy(rng),
        max_steps=lambda p: p.textworld.max_steps,
        skipping_expert=tw.skipping_expert_policy,
    )


def _miniwob() -> RealEnvironment:
    from components.envs import miniwob as mw

    return RealEnvironment(
        name="miniwob",
        open=lambda p: mw.MiniWoB(step_timeout_s=p.miniwob.step_timeout_s,
                                  episode_time_limit_s=p.miniwob.episode_time_limit_s),
        make_tasks=lambda p, split, count, seed: mw.make_tasks(split, count, seed=seed, task_names=p.miniwob.tasks),
        expert=lambda env: mw.expert_policy(),
        # the scripted solvers read the current page, so they recover from a random detour by themselves
        noisy_expert=lambda env, epsilon, rng: _mix(mw.expert_policy(), mw.random_policy(rng), epsilon, rng),
        random=lambda env, rng: mw.random_policy(rng),
        max_steps=lambda p: p.miniwob.max_steps,
        # no skipping expert: a scripted solver plays a left-out action on the next turn, reading the page
    )


_FACTORIES = {"textworld-cooking": _textworld, "miniwob": _miniwob}
REAL_ENVIRONMENTS = tuple(_FACTORIES)


def has_adapter(name: str) -> bool:
    return name in _FACTORIES


def real_environment(name: str) -> RealEnvironment:
    """The adapter for `name` (imported on demand: TextWorld and Selenium are heavy)."""
    if name not in _FACTORIES:
        raise KeyError(f"no real-environment adapter for {name!r} (known: {', '.join(REAL_ENVIRONMENTS)}); "
                       "seed-only domains skip the real-environment stages")
    return _FACTORIES[name]()
