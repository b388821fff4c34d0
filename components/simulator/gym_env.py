"""A simulator bundle (`bundle.export_bundle`) as a Gymnasium environment: any agent loop can train against it.

    import gymnasium
    env = gymnasium.make("components.simulator.gym_env:dreamgym/Simulator-v0", bundle="path/to/bundle")
    observation, info = env.reset(seed=0)          # a training task of the bundle, drawn with the seed
    observation, reward, terminated, truncated, info = env.step("open fridge")

Observations and actions are text. The task's instruction comes with the first state in `info["instruction"]` (and
`info["task_id"]`); `options={"task_id": ...}` picks a task. Reward and termination are the experience model's;
an episode is truncated at the bundle's turn limit (or `max_turns`), and, where the project's
`experience_model.inference.fallback_ends_episode` was on (or `end_on_fallback=True`), at a step the model could not
predict (its fallback: no parsable reply); otherwise such a step keeps the state and the episode goes on. `info`
carries the fallback flag (and `env_failure`, why it ended an episode), the model's reasoning and the retrieved
examples' ids.

The id is registered when this module is imported: the `module:id` form above imports it for `gymnasium.make` (after
`import components.simulator.gym_env`, "dreamgym/Simulator-v0" alone does).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import gymnasium
from gymnasium import spaces

from components.envs.base import ENV_FAILURE
from components.simulator.bundle import load_bundle

ENV_ID = "dreamgym/Simulator-v0"
MAX_TEXT = 100_000  # characters of an observation or action: a bound the spaces need, far above any state here


class AnyText(spaces.Text):
    """Text of any characters (Gymnasium's `Text` takes a fixed charset, alphanumeric by default): states and commands
    are free text. Samples draw from printable ASCII."""

    def __init__(self, max_length: int = MAX_TEXT, seed: int | None = None) -> None:
        import string

        super().__init__(max_length=max_length, min_length=0, charset=string.printable, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"AnyText({self.max_length})"


class SimulatorEnv(gymnasium.Env):
    """The bundle's synthetic environment for one of its environments (`environment`; default: its only one)."""

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, bundle: str | Path, environment: str | None = None, max_turns: int | None = None,
                 backend: str | None = None, cache_dir: str | Path | None = None, render_mode: str | None = None,
                 end_on_fallback: bool | None = None):
        self.bundle = load_bundle(bundle)
        self.simulator = self.bundle.environment(environment, backend=backend, cache_dir=cache_dir,
                                                 end_on_fallback=end_on_fallback)
        self.environment = self.simulator.name
        self.max_turns = max_turns or self.bundle.max_turns
        self.observation_space, self.action_space = AnyText(), AnyText()
        self.render_mode = render_mode
        self._rng = random.Random()
        self._last = ""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None:  # the task drawn and the experience model's sampled retries repeat
            self._rng.seed(seed)
            if reseed := getattr(self.simulator.backend, "reseed", None):
                reseed(seed)
        task = self.bundle.choose_task(self.environment, self._rng, (options or {}).get("task_id"))
        self._last = self.simulator.reset(task).state
        return self._last, {"task_id": task.task_id, "instruction": task.instruction}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        result = self.simulator.step(str(action))
        self._last = result.observation.state
        failed = ENV_FAILURE in result.info  # the model's fallback ended it: truncated, not terminated
        truncated = failed or self.bundle.truncated(self.simulator.episode, self.max_turns)
        info = {"fallback": result.info["fallback"], "reasoning": result.info.get("reasoning", ""),
                "retrieved": result.info.get("retrieved", []), "success": result.info.get("success", False),
                "env_failure": result.info.get(ENV_FAILURE)}  # why it ended without an outcome, else None
        return self._last, float(result.reward), result.done and not failed, truncated, info

    def render(self) -> str | None:
        return self._last if self.render_mode == "ansi" else None


if ENV_ID not in gymnasium.registry:
    gymnasium.register(ENV_ID, entry_point=SimulatorEnv)
