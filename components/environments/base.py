"""The interface every environment shares, real or synthetic, so RL code cannot tell them apart.

Gymnasium-like, in text: `reset(task)` gives the first observation, `step(action)` gives the next one with a
reward and `done`. The observation is an abstract text state (a compact rendering, never raw HTML) plus the
valid actions where the engine knows them. An invalid action is a failed step, never an exception.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from components.contract import Task

Split = Literal["train", "heldout"]


@dataclass(frozen=True)
class Observation:
    state: str  # abstract text state
    valid_actions: tuple[str, ...] | None = None  # None where the engine cannot enumerate them


@dataclass(frozen=True)
class StepResult:
    observation: Observation
    reward: float
    done: bool  # terminated or truncated; info["truncated"] says which
    info: dict[str, Any] = field(default_factory=dict)  # info["success"] set on the final step


# A policy maps (task, current observation, earlier (state, action) pairs) to the next action text.
Policy = Callable[[Task, Observation, Sequence[tuple[str, str]]], str]


class Environment(ABC):
    name: ClassVar[str]  # the `environment` value of the tasks it runs

    @abstractmethod
    def reset(self, task: Task) -> Observation: ...

    @abstractmethod
    def step(self, action: str) -> StepResult: ...

    def close(self) -> None:
        """Release engines, browsers and child processes. Safe to call twice."""

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
