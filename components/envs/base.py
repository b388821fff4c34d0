"""The interface every environment shares, real or synthetic, so RL code cannot tell them apart.

Gymnasium-like, in text: `reset(task)` gives the first observation, `step(action)` gives the next one with a
reward and `done`. The observation is an abstract text state (a compact rendering, never raw HTML) plus the
valid actions where the engine knows them. An invalid action is a failed step, never an exception.

Environment failures (an engine or browser that hangs or dies) are not the policy's doing, and every real adapter
reports them the same way: a step where it happens ends the episode with `info[ENV_FAILURE]` saying why, and a reset
where it happens raises `EnvironmentFailure` (a task that cannot be played, such as a game seed that does not
generate, stays a ValueError). `run_episode` turns the latter into a one-step episode with the same marker
(`failed_reset`), so evaluation, collection and RL count such episodes apart (`env_failure`) instead of as losses.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from components.data.contract import Step, Task, Trajectory

Split = Literal["train", "heldout"]
ENV_FAILURE = "env_failure"  # info key of the step an environment failure ended: why


class EnvironmentFailure(RuntimeError):
    """A reset failed because the engine or browser did (hung, died, would not start), not because of the task."""


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


def failed_reset(why: str) -> Step:
    """The only step of an episode whose reset failed: no state was seen and no action played."""
    return Step("", "", f"The environment failed: {why}", 0.0, True, {ENV_FAILURE: why, "truncated": True})


def env_failure(trajectory: Trajectory) -> str | None:
    """Why an environment failure ended this episode, or None (a win, a loss or a truncation that counts)."""
    return trajectory.steps[-1].info.get(ENV_FAILURE) if trajectory.steps else None


class EveryEpisodeFailed(RuntimeError):
    """An environment failure ended every episode of a batch: the environment is broken, not flaky."""


def check_not_all_failed(trajectories: Sequence[Trajectory], what: str) -> None:
    """Raise EveryEpisodeFailed when an environment failure ended every one of (some) episodes: a broken environment
    (not installed, out of memory, an experience model that cannot answer), whose count of failures would otherwise
    pass for a result."""
    reasons = [env_failure(t) for t in trajectories]
    if reasons and all(reasons):
        raise EveryEpisodeFailed(f"{what}: an environment failure ended every episode ({len(reasons)}); the first: "
                           f"{reasons[0]}")
