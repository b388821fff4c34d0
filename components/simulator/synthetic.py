"""The synthetic environment: the experience model (plus retrieved real transitions) plays the environment.

`SyntheticEnvironment` has the same `reset`/`step` interface as the real adapters and takes the same tasks (its
`name` is the real environment it imitates), so RL code cannot tell them apart. Each step asks the experience model
(through `predict`, which never raises on bad output: it retries, then falls back) for the next state, reward and
`done`, with the episode's recent history and the top-k most similar transitions of that environment from the
replay buffer in the prompt. A step the model could not predict (its fallback) ends the episode as an environment
failure (`base.ENV_FAILURE`; unless `end_on_fallback` is off), as a crashed browser ends a real one: the episode is
not the policy's outcome, so RL gives it no advantage, the buffer and the curriculum do not get it, and evaluation
counts it apart. Going on from a state the model could not move would ask it the same again.

Rollouts are cheap because many episodes step together: `step_batch(episodes, actions)` does one `retrieve_batch`
per environment and one `predict` call for all of them. `step` is the batch of one, on the episode `reset` started.

Finished episodes become contract trajectories (`record_trajectory`, source "synthetic") and go back into the
buffer as synthetic transitions (`add_to_buffer`).
"""
from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from components.data.contract import Step, Task, Trajectory, is_success, transitions
from components.envs.base import ENV_FAILURE, Environment, Observation, StepResult
from components.llm.backends import GenerationBackend
from components.simulator.experience_model import (
    ExperienceQuery,
    InferenceSettings,
    PredictionStats,
    PromptFormat,
    predict,
)
from components.simulator.replay_buffer import ReplayBuffer, Retrieved


@dataclass
class SyntheticEpisode:
    """One episode in progress: its task, current state and the steps taken so far."""

    task: Task
    state: str
    trajectory_id: str
    steps: list[Step] = field(default_factory=list)
    done: bool = False
    success: bool = False

    def history(self, max_history: int) -> tuple[tuple[str, str], ...]:
        """The last `max_history` (state, action) pairs, oldest first."""
        recent = self.steps[-max_history:] if max_history > 0 else []
        return tuple((s.state, s.action) for s in recent)


class SyntheticEnvironment(Environment):
    def __init__(
        self,
        name: str,
        backend: GenerationBackend,
        buffer: ReplayBuffer | None,
        fmt: PromptFormat,
        settings: InferenceSettings,
        *,
        stats: PredictionStats | None = None,
        success_reward: float | None = None,
        initial_states: Mapping[str, str] | None = None,
        end_on_fallback: bool = True,
    ) -> None:
        """`fmt` (params experience_model.prompt) also sets the history length and the number of retrieved
        examples; `settings` how the experience model is asked (`experience_model.predict`'s); `end_on_fallback`
        False keeps an episode going after a fallback, on the unchanged state (an agent loop that handles it)."""
        self.name = name  # type: ignore[misc]  # per instance: the real environment this one imitates
        self.backend, self.buffer, self.fmt, self.settings = backend, buffer, fmt, settings
        self.stats = stats if stats is not None else PredictionStats()
        self.success_reward = success_reward  # a final reward that wins (contract.success_rewards); None: any > 0
        self.initial_states = dict(initial_states or {})
        self.end_on_fallback = end_on_fallback
        self.episode: SyntheticEpisode | None = None

    # -- episodes --
    def initial_state(self, task: Task) -> str:
        """`task.parameters["initial_state"]`, else the task's entry in `initial_states` (seed first states)."""
        state = task.parameters.get("initial_state") or self.initial_states.get(task.task_id)
        if not isinstance(state, str) or not state:
            raise ValueError(f"task {task.task_id!r}: no initial state (set task.parameters['initial_state'] or "
                             "pass initial_states, e.g. the first states of its seed trajectories)")
        return state

    def new_episode(self, task: Task, trajectory_id: str | None = None) -> SyntheticEpisode:
        if task.environment != self.name:
            raise ValueError(f"task {task.task_id!r} is for {task.environment!r}, this environment imitates "
                             f"{self.name!r}")
        return SyntheticEpisode(task, self.initial_state(task), trajectory_id or f"synthetic-{uuid.uuid4().hex}")

    def reset(self, task: Task) -> Observation:
        self.episode = self.new_episode(task)
        return Observation(self.episode.state)

    def step(self, action: str) -> StepResult:
        if self.episode is None:
            raise RuntimeError("step before reset")
        return self.step_batch([self.episode], [action])[0]

    # -- batched stepping --
    def step_batch(self, episodes: Sequence[SyntheticEpisode], actions: Sequence[str]) -> list[StepResult]:
        """Step every episode with its action: one retrieval per environment, one `predict` call for all."""
        if len(episodes) != len(actions):
            raise ValueError(f"{len(episodes)} episodes but {len(actions)} actions")
        if any(episode.done for episode in episodes):
            raise RuntimeError("an episode is over: start a new one")
        examples = self._retrieve(episodes, actions)
        queries = [ExperienceQuery(ep.task, ep.state, action, ep.history(self.fmt.history_length), found)
                   for ep, action, found in zip(episodes, actions, examples, strict=True)]
        predictions = predict(self.backend, queries, self.fmt, self.settings, stats=self.stats)
        results = []
        for episode, action, prediction, found in zip(episodes, actions, predictions, examples, strict=True):
            failed = prediction.fallback and self.end_on_fallback
            info = {"synthetic": True, "fallback": prediction.fallback, "reasoning": prediction.reasoning,
                    "truncated": failed}
            if failed:
                info[ENV_FAILURE] = "the experience model fell back: no parsable reply, or a prompt over its context"
            done = prediction.done or failed
            episode.steps.append(Step(episode.state, action, prediction.next_state, prediction.reward, done,
                                      dict(info)))
            episode.state, episode.done = prediction.next_state, done
            if prediction.done:
                episode.success = info["success"] = is_success(prediction.reward, True, self.success_reward)
            retrieved = [f"{r.trajectory_id}/{r.step_index}" for r in found]  # shown in info, not stored in the step
            results.append(StepResult(Observation(prediction.next_state), prediction.reward, done,
                                      {**info, "retrieved": retrieved}))
        return results

    def _retrieve(self, episodes: Sequence[SyntheticEpisode], actions: Sequence[str]) -> list[list[Retrieved]]:
        if self.buffer is None or not self.fmt.use_retrieval:
            return [[] for _ in episodes]
        return self.buffer.retrieve_examples(
            [(e.task.environment, e.state, a, e.trajectory_id) for e, a in zip(episodes, actions, strict=True)],
            self.fmt.top_k)


# -- write-back ---------------------------------------------------------------------------------------------------


def first_state_tasks(trajectories: Sequence[Trajectory]) -> list[Task]:
    """The distinct tasks of `trajectories` (first seen first), each with its first seed state as
    `parameters["initial_state"]`: what the synthetic environment resets to."""
    tasks: dict[str, Task] = {}
    for trajectory in trajectories:
        task = trajectory.task
        if trajectory.steps and task.task_id not in tasks:
            tasks[task.task_id] = replace(task, parameters={**task.parameters,
                                                            "initial_state": trajectory.steps[0].state})
    return list(tasks.values())


def record_trajectory(episode: SyntheticEpisode) -> Trajectory:
    """A synthetic episode as a contract trajectory, a success when its final step won."""
    return Trajectory(episode.trajectory_id, episode.task, list(episode.steps), episode.done and episode.success,
                      sum(s.reward for s in episode.steps), "synthetic")


def episodes_from_buffer(records: Sequence[Retrieved], tasks: Mapping[str, Task],
                         success_reward: float | None = None) -> tuple[list[Trajectory], int]:
    """The synthetic episodes stored in a replay buffer (its records of one source), rebuilt as trajectories of the
    real `tasks` they played (by task id), in order of trajectory id; also how many episodes played a task not in
    `tasks` (a curriculum variation: no real game to replay it in). A win is judged as the synthetic environment
    judged it (`success_reward`)."""
    by_episode: dict[str, list[Retrieved]] = defaultdict(list)
    for record in records:
        by_episode[record.trajectory_id].append(record)
    trajectories, unreplayable = [], 0
    for trajectory_id, stored in sorted(by_episode.items()):
        stored.sort(key=lambda record: record.step_index)
        task = tasks.get(stored[0].task_id)
        if task is None:
            unreplayable += 1
            continue
        steps = [Step(r.state, r.action, r.next_state, r.reward, r.done, {}) for r in stored]
        episode = SyntheticEpisode(task, stored[-1].next_state, trajectory_id, steps, done=stored[-1].done,
                                   success=is_success(stored[-1].reward, stored[-1].done, success_reward))
        trajectories.append(record_trajectory(episode))
    return trajectories, unreplayable


def add_to_buffer(buffer: ReplayBuffer, trajectories: Sequence[Trajectory]) -> int:
    """Append the trajectories' transitions to the buffer as synthetic experience; returns how many were new."""
    return buffer.add([t for trajectory in trajectories for t in transitions(trajectory)], source="synthetic")
