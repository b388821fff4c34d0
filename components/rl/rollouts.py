"""Multi-turn rollouts: many episodes at once, the policy's turns batched, the environment's too.

An episode is one token sequence: `prompt_ids` (system, task and first state, assistant header), then
`completion_ids`, which alternate the policy's action tokens (`env_mask` 1, with their sampling log-probabilities)
and the environment's reply, i.e. the end of the assistant turn and the next state as a user turn (`env_mask` 0).
GRPO and PPO train on exactly these tokens, the loss on the policy's tokens only.

Each turn: every unfinished episode gets its next action, either from one batched `generate` over its whole sequence
(left-padded; `batched`, what pays on a GPU) or one episode at a time through its own `ConversationBackend`, which
carries the episode's key/value cache from turn to turn and encodes only the new environment turn (what pays on a
CPU); then the environment steps all of them in one batch (`EpisodeBatch.step`: the synthetic environment
asks the experience model once per turn for the whole batch). An episode ends when the environment says done, at
`max_turns`, or when its sequence would pass `max_tokens`.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from components.data.contract import Step, Task, Trajectory
from components.envs.base import (
    ENV_FAILURE,
    Environment,
    EnvironmentFailure,
    Observation,
    StepResult,
    failed_reset,
)
from components.llm.backends import ConversationBackend, random_stream, sampling_settings, stream_seed
from components.rl.policy import SYSTEM, PolicyFormat, parse_action, state_message
from components.simulator.synthetic import SyntheticEnvironment, record_trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass
class Episode:
    task: Task
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)  # 1: the policy's token, 0: the environment's
    logprobs: list[float] = field(default_factory=list)  # sampling log-probability per completion token (env: 0)
    action_starts: list[int] = field(default_factory=list)  # where each action begins in completion_ids
    actions: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # one per turn
    done: bool = False  # the environment ended it (success or failure)
    truncated: bool = False  # the turn or token limit ended it
    success: bool = False
    env_failure: str | None = None  # why, when an environment failure ended it: its outcome is not the policy's
    trajectory: Trajectory | None = None  # the contract record, set when the episode ends

    @property
    def finished(self) -> bool:
        return self.done or self.truncated

    @property
    def return_(self) -> float:
        return sum(self.rewards)


class EpisodeBatch(Protocol):
    """Environments for a batch of episodes, stepped together."""

    def start(self, tasks: Sequence[Task]) -> list[Observation]: ...

    def step(self, indices: Sequence[int], actions: Sequence[str]) -> list[StepResult]: ...

    def trajectory(self, index: int) -> Trajectory: ...

    def close(self) -> None: ...


class SyntheticBatch:
    """Episodes in synthetic environments (one per imitated environment name): one `step_batch`, i.e. one
    experience-model call, per environment per turn."""

    def __init__(self, *envs: SyntheticEnvironment) -> None:
        self.envs = {env.name: env for env in envs}
        self.episodes: list = []

    def start(self, tasks: Sequence[Task]) -> list[Observation]:
        unknown = sorted({t.environment for t in tasks} - set(self.envs))
        if unknown:
            raise ValueError(f"no synthetic environment for {unknown} (have {sorted(self.envs)})")
        self.episodes = [self.envs[task.environment].new_episode(task) for task in tasks]
        return [Observation(episode.state) for episode in self.episodes]

    def step(self, indices: Sequence[int], actions: Sequence[str]) -> list[StepResult]:
        results: dict[int, StepResult] = {}
        for name, env in self.envs.items():
            mine = [(i, a) for i, a in zip(indices, actions, strict=True) if self.episodes[i].task.environment == name]
            if mine:
                stepped = env.step_batch([self.episodes[i] for i, _ in mine], [a for _, a in mine])
                results.update({i: r for (i, _), r in zip(mine, stepped, strict=True)})
        return [results[i] for i in indices]

    def trajectory(self, index: int) -> Trajectory:
        return record_trajectory(self.episodes[index])

    def close(self) -> None:
        self.episodes = []


class RemoteSyntheticBatch:
    """Episodes in synthetic environments served by simulator servers (components/simulator/server.py's protocol,
    {environment name: base URL}), one WebSocket session per episode. A turn sends every episode's step before it
    reads any reply, so the server steps them together, with other clients' steps (one experience-model call)."""

    def __init__(self, urls: dict[str, str], timeout_s: float = 3600.0) -> None:
        self.urls, self.timeout_s = urls, timeout_s
        self.connections: list = []

    def start(self, tasks: Sequence[Task]) -> list[Observation]:
        from websockets.sync.client import connect

        unknown = sorted({t.environment for t in tasks} - set(self.urls))
        if unknown:
            raise ValueError(f"no simulator server for {unknown} (have {sorted(self.urls)})")
        self.close()
        for task in tasks:  # one by one: close() then closes every one opened before a failure
            self.connections.append(connect(self.urls[task.environment].replace("http", "ws", 1) + "/ws",
                                            max_size=2 ** 26, open_timeout=60, proxy=None))
        for connection, task in zip(self.connections, tasks, strict=True):
            connection.send(json.dumps({"type": "reset", "data": {"task": task.to_dict()}}))
        return [Observation(self._receive(c, "observation")["observation"]["text"]) for c in self.connections]

    def step(self, indices: Sequence[int], actions: Sequence[str]) -> list[StepResult]:
        for i, action in zip(indices, actions, strict=True):
            self.connections[i].send(json.dumps({"type": "step", "data": {"message": action}}))
        results = []
        for i in indices:
            reply = self._receive(self.connections[i], "observation")
            observation = reply["observation"]
            info = {key: observation[key] for key in ("fallback", "reasoning", "truncated", "retrieved")}
            if observation.get("success") is not None:
                info["success"] = observation["success"]
            if observation.get("env_failure"):
                info[ENV_FAILURE] = observation["env_failure"]
            results.append(StepResult(Observation(observation["text"]), reply["reward"], reply["done"],
                                      {"synthetic": True, **info}))
        return results

    def trajectory(self, index: int) -> Trajectory:
        self.connections[index].send(json.dumps({"type": "state"}))
        return Trajectory.from_dict(self._receive(self.connections[index], "state")["trajectory"])

    def close(self) -> None:
        for connection in self.connections:
            connection.close()
        self.connections = []

    def _receive(self, connection, kind: str) -> dict:
        message = json.loads(connection.recv(timeout=self.timeout_s))
        if message.get("type") != kind:
            raise RuntimeError(f"simulator server {connection.remote_address}: {message.get('data')}")
        return message["data"]


class RealBatch:
    """Episodes in real environments: one engine per episode, opened by `open_environment(task)` (a batched policy
    needs every episode's next state before its next turn), stepped one after another. Counts every transition.
    An episode whose reset an environment failure ended starts with a state saying so, and its first step ends it
    as `run_episode` records such an episode (`failed_reset`), without touching the environment."""

    def __init__(self, open_environment: Callable[[Task], Environment], source: str = "policy") -> None:
        self.open_environment, self.source = open_environment, source
        self.envs: list[Environment] = []
        self.tasks: list[Task] = []
        self.states: list[str] = []
        self.steps: list[list[Step]] = []
        self.ids: list[str] = []

    def start(self, tasks: Sequence[Task]) -> list[Observation]:
        self.close()
        self.envs = [self.open_environment(task) for task in tasks]
        self.tasks, self.steps = list(tasks), [[] for _ in tasks]
        self.ids = [f"real-{uuid.uuid4().hex}" for _ in tasks]
        self.failed_resets: dict[int, str] = {}  # episode index -> why
        observations = []
        for i, (env, task) in enumerate(zip(self.envs, tasks, strict=True)):
            try:
                observations.append(env.reset(task))
            except EnvironmentFailure as error:
                self.failed_resets[i] = str(error)
                observations.append(Observation(failed_reset(str(error)).next_state))
        self.states = [o.state for o in observations]
        return observations

    def step(self, indices: Sequence[int], actions: Sequence[str]) -> list[StepResult]:
        results = []
        for i, action in zip(indices, actions, strict=True):
            if i in self.failed_resets:
                step = failed_reset(self.failed_resets[i])
                self.steps[i].append(step)
                results.append(StepResult(Observation(step.next_state), 0.0, True, dict(step.info)))
                continue
            result = self.envs[i].step(action)
            self.steps[i].append(Step(self.states[i], action, result.observation.state, result.reward, result.done,
                                      {k: v for k, v in result.info.items() if k != "success"}))
            self.states[i] = result.observation.state
            results.append(result)
        return results

    def trajectory(self, index: int) -> Trajectory:
        steps = self.steps[index]
        success = bool(steps) and steps[-1].done and steps[-1].reward > 0
        return Trajectory(self.ids[index], self.tasks[index], list(steps), success,
                          sum(s.reward for s in steps), self.source)

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.envs = []


@dataclass
class RolloutStats:
    policy_seconds: float = 0.0  # generating actions
    env_seconds: float = 0.0  # stepping environments (the experience model, for synthetic ones)
    turns: int = 0
    policy_tokens: int = 0

    @classmethod
    def of_processes(cls, parts: Sequence[RolloutStats]) -> RolloutStats:
        """Several processes' stats of one rollout played side by side: the slowest one's time, every one's counts."""
        return cls(max(p.policy_seconds for p in parts), max(p.env_seconds for p in parts),
                   sum(p.turns for p in parts), sum(p.policy_tokens for p in parts))


class ChatSegments:
    """Token pieces of the chat template, so a conversation can grow turn by turn without re-rendering it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        sentinel = "\x00"
        system = [{"role": "system", "content": SYSTEM}]
        base = tokenizer.apply_chat_template(system, tokenize=False)
        with_user = tokenizer.apply_chat_template(system + [{"role": "user", "content": sentinel}], tokenize=False,
                                                  add_generation_prompt=True)
        if not with_user.startswith(base):
            raise ValueError("the chat template is not prefix-stable; multi-turn rollouts need one that is (ChatML)")
        self.user_before, self.user_after = with_user[len(base):].split(sentinel)
        replied = tokenizer.apply_chat_template(system + [{"role": "user", "content": "u"},
                                                          {"role": "assistant", "content": sentinel}], tokenize=False)
        self.assistant_end = replied.split(sentinel, 1)[1]  # e.g. "<|im_end|>\n"
        self.eos_text = tokenizer.eos_token or ""

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, task: Task, observation: Observation, fmt: PolicyFormat) -> list[int]:
        messages = [{"role": "system", "content": SYSTEM}, state_message(observation, fmt, task)]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def environment_turn(self, observation: Observation, fmt: PolicyFormat, ended_with_eos: bool) -> list[int]:
        """What follows an action: the rest of the assistant turn's end, the state as a user turn, the next header."""
        end = self.assistant_end
        if ended_with_eos and end.startswith(self.eos_text):
            end = end[len(self.eos_text):]  # the policy generated the end-of-turn token itself
        return self.encode(end + self.user_before + state_message(observation, fmt)["content"] + self.user_after)


def generate_actions(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, contexts: Sequence[list[int]],
                     max_new_tokens: int, temperature: float,
                     conversations: Sequence[ConversationBackend] | None = None,
                     seeds: Sequence[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Sample one reply per context; return its tokens up to and with the first end-of-turn, and their
    log-probabilities under the sampling distribution (temperature applied, as the trainers score them).

    Without `conversations`: one left-padded batch, every context encoded whole. With one `ConversationBackend` per
    context: one context at a time, each encoding only what its cache has not seen (the same tokens reach the model),
    and, with `seeds`, each sampled from its own seed: a reply then depends on its context and seed alone, not on
    which other contexts (or process) shared the call. Batched, `seeds` seed the batch's one draw together."""
    import torch

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    keywords = dict(pad_token_id=pad, eos_token_id=eos, output_scores=True, return_dict_in_generate=True)
    if conversations is not None:
        seeds = seeds if seeds is not None else [None] * len(contexts)
        replies = []
        for conversation, context, seed in zip(conversations, contexts, seeds, strict=True):
            with random_stream(seed, model.device):
                output = conversation.extend(context, max_new_tokens, temperature, **keywords)
            replies.append(_reply(output, len(context), 0, eos))
        return [tokens for tokens, _ in replies], [logprobs for _, logprobs in replies]
    width = max(len(c) for c in contexts)
    input_ids = torch.tensor([[pad] * (width - len(c)) + list(c) for c in contexts])
    attention = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
    # one batch, one draw: from the batch's seeds together (processes playing other episodes draw other numbers)
    with random_stream(stream_seed(*seeds) if seeds is not None else None, model.device), \
            torch.inference_mode():
        output = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention.to(model.device),
                                max_new_tokens=max_new_tokens, **keywords, **sampling_settings(temperature))
    replies = [_reply(output, width, row, eos) for row in range(len(contexts))]
    return [tokens for tokens, _ in replies], [logprobs for _, logprobs in replies]


def _reply(output, width: int, row: int, eos: int) -> tuple[list[int], list[float]]:
    """Row `row` of a generate output: the new tokens up to and with the first end-of-turn, and their log-probs."""
    import torch

    ids = output.sequences[row, width:].tolist()
    end = ids.index(eos) + 1 if eos in ids else len(ids)
    logprobs = torch.log_softmax(torch.stack([score[row] for score in output.scores[:end]]).float(), dim=-1) \
        if end else None
    return ids[:end], [logprobs[i, ids[i]].item() for i in range(end)]


def rollout(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch: EpisodeBatch, tasks: Sequence[Task],
            fmt: PolicyFormat, *, max_turns: int, batched: bool, max_action_tokens: int = 24, max_tokens: int = 4096,
            temperature: float = 1.0, stats: RolloutStats | None = None,
            seeds: Sequence[int] | None = None) -> list[Episode]:
    """Play one episode per task (repeat a task G times for a group); returns them in order and closes `batch`.
    `batched`: every episode's turn in one `generate` over its whole context (pays on a GPU); else one episode at a
    time, each carrying its key/value cache across turns (pays on a CPU: benchmarks/evaluation_speed.py), and with
    `seeds` (one per episode) each episode samples from its own: the same episode whichever batch or process plays
    it."""
    stats = stats if stats is not None else RolloutStats()
    segments = ChatSegments(tokenizer)
    was_training = model.training
    model.eval()
    try:
        started = time.monotonic()
        observations = batch.start(tasks)
        stats.env_seconds += time.monotonic() - started
        episodes = [Episode(task, segments.prompt(task, obs, fmt))
                    for task, obs in zip(tasks, observations, strict=True)]
        conversations = None if batched else [ConversationBackend(model, tokenizer) for _ in episodes]
        for turn in range(max_turns):
            active = [i for i, e in enumerate(episodes) if not e.finished]
            if not active:
                break
            if turn:  # a turn of a large batch takes minutes on a CPU: say where the rollout is
                log.info("rollout turn %d/%d: %d of %d episodes playing | policy %.0fs, environment %.0fs so far",
                         turn + 1, max_turns, len(active), len(episodes), stats.policy_seconds, stats.env_seconds)
            started = time.monotonic()
            replies, logprobs = generate_actions(
                model, tokenizer, [episodes[i].prompt_ids + episodes[i].completion_ids for i in active],
                max_action_tokens, temperature, None if batched else [conversations[i] for i in active],
                None if seeds is None else [stream_seed(seeds[i], turn) for i in active])
            stats.policy_seconds += time.monotonic() - started
            actions = [parse_action(tokenizer.decode(ids, skip_special_tokens=True)) for ids in replies]
            started = time.monotonic()
            results = batch.step(active, actions)
            stats.env_seconds += time.monotonic() - started
            stats.turns += len(active)
            for i, ids, lps, action, result in zip(active, replies, logprobs, actions, results, strict=True):
                episode = episodes[i]
                episode.action_starts.append(len(episode.completion_ids))
                episode.completion_ids += ids
                episode.env_mask += [1] * len(ids)
                episode.logprobs += lps
                episode.actions.append(action)
                episode.rewards.append(result.reward)
                stats.policy_tokens += len(ids)
                if result.done:
                    episode.done, episode.success = True, bool(result.info.get("success", result.reward > 0))
                    episode.env_failure = result.info.get(ENV_FAILURE)
                    continue
                ended = bool(ids) and ids[-1] == tokenizer.eos_token_id
                follow = segments.environment_turn(result.observation, fmt, ended)
                length = len(episode.prompt_ids) + len(episode.completion_ids) + len(follow) + max_action_tokens
                if length > max_tokens:  # the next turn would not fit: stop here rather than cut the context
                    episode.truncated = True
                    continue
                episode.completion_ids += follow
                episode.env_mask += [0] * len(follow)
                episode.logprobs += [0.0] * len(follow)
        for i, episode in enumerate(episodes):
            episode.truncated = episode.truncated or not episode.done
            episode.trajectory = batch.trajectory(i)
    finally:
        model.train(was_training)
        batch.close()
    return episodes
