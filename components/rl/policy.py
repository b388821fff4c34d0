"""The agent policy: a chat LM that reads the task and the states so far and replies with one action.

One conversation per episode. The system turn says what to do; the first user turn holds the task and the first
state; each assistant turn is one action; each later user turn is the state that action led to. The same format
serves the SFT warm start (seed trajectories rendered as conversations), rollouts in the synthetic or the real
environment, and evaluation, so what the policy learns in one place holds in the others.

History is bounded by the episode's turn limit and by clipping each state to `max_state_chars` (head and tail:
states put the goal first and the inventory last). The whole conversation is kept rather than a sliding window
because GRPO trains on one token sequence per episode (see components/rl/grpo.py): a window would make the context
the policy acted on differ from the one it is trained on.
"""
from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from components.data.contract import Task, Trajectory
from components.envs.base import Environment, Observation, Policy
from components.files import directory_identity
from components.llm.backends import ConversationBackend, HFGenerationBackend, Message, random_stream, stream_seed
from components.simulator.experience_model import clip

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SYSTEM = ("You are an agent acting in an environment to complete a task. Each user turn shows the current state. "
          "Reply with exactly one action, on one line, and nothing else.")


@dataclass(frozen=True)
class PolicyFormat:
    """params policy.prompt: no defaults here, every value comes from params."""

    max_state_chars: int  # each state in the conversation
    # The seed and synthetic states carry no list of valid actions (only real engines know them), so a policy
    # trained there would meet the list first at evaluation: off for such data, on for data that carries them.
    show_valid_actions: bool
    max_valid_actions: int


def state_message(observation: Observation, fmt: PolicyFormat, task: Task | None = None) -> Message:
    """A user turn: the state (and, in the first turn, the task)."""
    parts = [f"Task: {task.instruction}"] if task is not None else []
    parts.append(f"State:\n{clip(observation.state, fmt.max_state_chars)}")
    if fmt.show_valid_actions and observation.valid_actions:
        shown = observation.valid_actions[:fmt.max_valid_actions]
        parts.append("Valid actions: " + " | ".join(shown))
    return {"role": "user", "content": "\n\n".join(parts)}


def conversation(task: Task, observations: Sequence[Observation], actions: Sequence[str],
                 fmt: PolicyFormat) -> list[Message]:
    """The messages up to the policy's next turn: one state per observation, one action between each two."""
    if len(observations) != len(actions) + 1:
        raise ValueError(f"{len(observations)} observations need {len(observations) - 1} actions, got {len(actions)}")
    messages: list[Message] = [{"role": "system", "content": SYSTEM}]
    for turn, observation in enumerate(observations):
        messages.append(state_message(observation, fmt, task if turn == 0 else None))
        if turn < len(actions):
            messages.append({"role": "assistant", "content": actions[turn]})
    return messages


_PREFIX = re.compile(r"^(?:action|command|next command)\s*:\s*", re.IGNORECASE)


def parse_action(reply: str) -> str:
    """The action in a reply: its first non-empty line, without an "Action:" label, backticks or the quotes that
    wrap the whole line. Quotes inside an action stay: `type [2] "Ann"` keeps the closing quote the web needs.

    Never raises: an empty reply gives "", which the environment treats as an invalid action (a failed step).
    """
    line = next((line.strip() for line in reply.splitlines() if line.strip()), "")
    line = _PREFIX.sub("", line).strip().strip("`").strip()
    for quote in ('"', "'"):
        if len(line) > 1 and line[0] == quote and line[-1] == quote:
            line = line[1:-1].strip()
        elif line.count(quote) % 2:  # one stray quote at an end, not an argument's
            line = (line.removeprefix(quote) if line.startswith(quote) else line.removesuffix(quote)).strip()
    return line


def normalise_action(action: str) -> str:
    """For comparing actions: case and spacing do not matter."""
    return " ".join(action.lower().split())


# ---- SFT warm start --------------------------------------------------------------------------------------------


def sft_examples(trajectories: Sequence[Trajectory], fmt: PolicyFormat) -> Dataset:
    """One prompt/completion pair per step: the conversation up to the step's state -> the step's action."""
    from datasets import Dataset

    rows = []
    for trajectory in trajectories:
        observations = [Observation(step.state) for step in trajectory.steps]
        actions = [step.action for step in trajectory.steps]
        for index in range(len(actions)):
            rows.append({
                "prompt": conversation(trajectory.task, observations[:index + 1], actions[:index], fmt),
                "completion": [{"role": "assistant", "content": actions[index]}],
                "trajectory_id": trajectory.trajectory_id,
                "step_index": index,
            })
    if not rows:
        raise ValueError("no steps to train the policy on: the selected seed trajectories are empty")
    return Dataset.from_list(rows)


def next_action_accuracy(backend: HFGenerationBackend, trajectories: Sequence[Trajectory], fmt: PolicyFormat,
                         max_action_tokens: int) -> dict[str, float | int]:
    """Teacher-forced: the share of steps where the policy's greedy action equals the trajectory's (normalised).

    A cheap signal before closed-loop evaluation: each step is predicted from the true conversation so far, so
    one early mistake does not spoil the rest. `by_step` shows where in the episodes the policy is right.
    """
    dataset = sft_examples(trajectories, fmt)
    replies = backend.generate(list(dataset["prompt"]), max_new_tokens=max_action_tokens, temperature=0.0)
    hits = [normalise_action(parse_action(reply)) == normalise_action(row[0]["content"])
            for reply, row in zip(replies, dataset["completion"], strict=True)]
    by_step: dict[int, list[bool]] = {}
    for step, hit in zip(dataset["step_index"], hits, strict=True):
        by_step.setdefault(step, []).append(hit)
    return {"steps": len(hits), "correct": sum(hits), "accuracy": sum(hits) / len(hits),
            "by_step": {str(step): round(sum(v) / len(v), 3) for step, v in sorted(by_step.items())}}


# ---- acting in an environment ----------------------------------------------------------------------------------


def llm_policy(backend: HFGenerationBackend, fmt: PolicyFormat, max_action_tokens: int,
               temperature: float = 0.0, seed: int | None = None) -> Policy:
    """A `Policy` for the evaluation harness: one call per step; it keeps its episode's observations, so make a
    new one per episode (the harness does: `make_policy(env)` per task). Sampled (`temperature` > 0) with a `seed`,
    each action draws from a stream of its own (the seed, the task, the turn): an episode plays the same whichever
    worker plays it, and whatever else that worker played. The stream is torch's one, held while the action is
    generated, so sampling workers (threads) take turns to generate; greedy ones do not."""
    observations: list[Observation] = []

    def act(task: Task, observation: Observation, history: Sequence[tuple[str, str]]) -> str:
        if len(observations) != len(history):  # a new episode on a reused policy: start over
            observations.clear()
        observations.append(observation)
        messages = conversation(task, observations, [action for _, action in history], fmt)
        sampled = seed is not None and temperature > 0
        with random_stream(stream_seed(seed, zlib.crc32(task.task_id.encode()), len(history)),
                           backend.model.device) if sampled else nullcontext():
            return parse_action(backend.generate([messages], max_new_tokens=max_action_tokens,
                                                 temperature=temperature)[0])

    return act


def policy_factory(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, fmt: PolicyFormat,
                   max_action_tokens: int, temperature: float = 0.0, seed: int | None = None):
    """`make_policy(env)` for `evaluation.evaluate_policy`: actions from one shared model (greedy, or sampled at
    `temperature` from `seed`: `llm_policy`), each episode's conversation encoded once and extended turn by turn
    (`ConversationBackend`: the same actions as re-encoding it whole every turn, at a fraction of the cost)."""
    def make(env: Environment) -> Policy:
        return llm_policy(ConversationBackend(model, tokenizer), fmt, max_action_tokens, temperature, seed)

    return make


def factory_identity(model_dir: str | Path, fmt: PolicyFormat, max_action_tokens: int, temperature: float = 0.0,
                     seed: int | None = None) -> str:
    """What makes `policy_factory`'s policy of the model saved in `model_dir` play as it does (the model by content):
    `evaluate_policy`'s `policy_identity`, so a journal of its games is resumed only by the same policy."""
    return json.dumps([directory_identity(model_dir), asdict(fmt), max_action_tokens, temperature, seed])
