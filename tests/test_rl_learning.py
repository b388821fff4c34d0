"""RL tests that fail when learning is broken: rewards that vary within groups and the sign of the update checked,
and the tokens trained on compared with the tokens the policy generated.

A tiny real policy is taught to answer either "eat meal" or "open fridge" (about half each) and plays one-turn
episodes in the real synthetic environment, whose scripted experience model (tests/scripted_backend.py) rewards
"eat meal". Every group then holds both outcomes, so the advantages are not zero: after one GRPO iteration and after
one PPO iteration the rewarded reply must be likelier and the other one less likely. A wrong advantage sign, group
or loss mask turns these tests red (docs/policy_and_rl.md, "Tests that can fail", lists the bugs planted to check it).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from components.data.contract import Task
from components.envs.base import Observation
from components.llm.models import build_tiny_causal_lm, load_causal_lm
from components.rl import ppo
from components.rl.curriculum import Curriculum
from components.rl.grpo import train_grpo
from components.rl.ppo import train_ppo
from components.rl.rollouts import ChatSegments, SyntheticBatch
from components.simulator.synthetic import SyntheticEnvironment
from tests.conftest import settings_from_params
from tests.scripted_backend import ScriptedBackend

ENV = "textworld-cooking"
TASKS = [Task(f"tw-{i}", ENV, "Cook a meal, then eat it.", {"initial_state": f"Kitchen {i}."}) for i in range(2)]
REWARDED, OTHER = "eat meal", "open fridge"
# one iteration: 2 tasks x a group of 4 one-turn episodes; full fine-tuning and no KL, so the update is the
# policy gradient alone; sampled at temperature 1, so a group's rewards vary
ONE_STEP = settings_from_params("rl", algorithm="grpo", iterations=1, tasks_per_iteration=2, group_size=4, max_turns=1,
                                max_action_tokens=6, max_tokens=512, micro_batch_size=4, save_every=1, beta=0.0,
                                learning_rate=2e-3, temperature=1.0, lora=None,
                                ppo=settings_from_params("ppo", epochs=1), seed=0)
NO_CURRICULUM = settings_from_params("curriculum", enabled=False)
POLICY_FORMAT = settings_from_params("policy_prompt")


def _batch():
    return SyntheticBatch(SyntheticEnvironment(ENV, ScriptedBackend(), None,
                                               settings_from_params("prompt", use_retrieval=False),
                                               settings=settings_from_params("inference", retries=0)))


def _prompt(segments: ChatSegments, task: Task) -> list[int]:
    return segments.prompt(task, Observation(task.parameters["initial_state"]), POLICY_FORMAT)


def _reply_logprob(model, tokenizer, reply: str) -> float:
    """Mean over the tasks of log p(reply, then end of turn | the task's first prompt)."""
    segments = ChatSegments(tokenizer)
    answer = segments.encode(reply) + [tokenizer.eos_token_id]
    total = 0.0
    for task in TASKS:
        prompt = _prompt(segments, task)
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
        total += logprobs.gather(-1, torch.tensor(answer).unsqueeze(-1)).sum().item()
    return total / len(TASKS)


@pytest.fixture(scope="module")
def two_answer_policy(tmp_path_factory):
    """The tiny Llama taught, on the rollout prompts themselves, to reply "eat meal" or "open fridge"."""
    directory = tmp_path_factory.mktemp("two-answers")
    model, tokenizer = build_tiny_causal_lm([REWARDED, OTHER, "State: Kitchen", "Task: Cook a meal"] * 20)
    segments = ChatSegments(tokenizer)
    sequences = [(_prompt(segments, task), segments.encode(reply) + [tokenizer.eos_token_id])
                 for task in TASKS for reply in (REWARDED, OTHER)]
    torch.manual_seed(0)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(80):
        optimiser.zero_grad()
        for prompt, answer in sequences:
            ids = torch.tensor([prompt + answer])
            labels = torch.tensor([[-100] * len(prompt) + answer])
            model(input_ids=ids, labels=labels).loss.backward()
        optimiser.step()
    model.eval()
    both = (_reply_logprob(model, tokenizer, REWARDED), _reply_logprob(model, tokenizer, OTHER))
    assert all(logprob > -1.5 for logprob in both), both  # each reply sampled often: groups will hold both
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _shift(before_dir, after_dir, cache_dir) -> tuple[float, float]:
    """How much the log-probability of the rewarded and of the other reply moved from `before_dir` to `after_dir`."""
    before, tokenizer = load_causal_lm(str(before_dir), cache_dir=cache_dir)
    after, _ = load_causal_lm(str(after_dir), cache_dir=cache_dir)
    return (_reply_logprob(after, tokenizer, REWARDED) - _reply_logprob(before, tokenizer, REWARDED),
            _reply_logprob(after, tokenizer, OTHER) - _reply_logprob(before, tokenizer, OTHER))


def _assert_learned(result, policy_dir, cache_dir):
    [row] = result.log
    assert 0 < row["reward_mean"] < 1, f"every episode earned the same ({row['reward_mean']}): no advantage to test"
    rewarded, other = _shift(policy_dir, result.model_dir, cache_dir)
    assert rewarded > 0.01 and other < -0.01, (
        f"one update moved log p('{REWARDED}') by {rewarded:+.4f} and log p('{OTHER}') by {other:+.4f}: the "
        "rewarded reply should have become likelier and the unrewarded one less likely (an advantage, group or "
        "mask bug?)")


def test_one_grpo_step_makes_the_rewarded_reply_likelier(two_answer_policy, tmp_path):
    result = train_grpo(str(two_answer_policy), Curriculum(TASKS, NO_CURRICULUM), _batch, None,
                        POLICY_FORMAT, ONE_STEP, tmp_path / "rl", cache_dir=tmp_path)
    assert result.log[0]["reward_std"] > 0  # TRL's own view: the groups' rewards varied
    _assert_learned(result, two_answer_policy, tmp_path)


def test_one_ppo_step_makes_the_rewarded_reply_likelier(two_answer_policy, tmp_path):
    result = train_ppo(str(two_answer_policy), Curriculum(TASKS, NO_CURRICULUM), _batch, None,
                       POLICY_FORMAT, replace(ONE_STEP, algorithm="ppo"), tmp_path / "rl", cache_dir=tmp_path)
    _assert_learned(result, two_answer_policy, tmp_path)


# --- the tokens trained on are the tokens generated ------------------------------------------------------------------

MULTI_TURN = replace(ONE_STEP, max_turns=3, group_size=2, micro_batch_size=2, learning_rate=1e-4)


@pytest.fixture
def generated(monkeypatch):
    """Every reply `generate` produced during the test, as (context tokens, new tokens up to the end of turn)."""
    from transformers.generation.utils import GenerationMixin

    rows: list[tuple[list[int], list[int]]] = []
    original = GenerationMixin.generate

    def recording_generate(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        inputs, attention = kwargs["input_ids"], kwargs["attention_mask"]
        eos = self.generation_config.eos_token_id if kwargs.get("eos_token_id") is None else kwargs["eos_token_id"]
        for row in range(inputs.shape[0]):
            new = output.sequences[row, inputs.shape[1]:].tolist()
            rows.append((inputs[row][attention[row] > 0].tolist(), new[:new.index(eos) + 1] if eos in new else new))
        return output

    monkeypatch.setattr(GenerationMixin, "generate", recording_generate)
    return rows


def _assert_trained_on_generated(generated, trained):
    """`trained`: (sequence, mask) per episode as the loss saw it, mask 1 on the tokens it trains the policy on.
    Each maximal run of trained tokens must be one generated reply, given exactly the context before it, and every
    generated reply must be trained on once."""
    unused = list(generated)
    for sequence, mask in trained:
        assert len(sequence) == len(mask)
        start = None
        for position, flag in enumerate([*mask, 0]):
            if flag and start is None:
                start = position
            elif not flag and start is not None:
                reply = (sequence[:start], sequence[start:position])
                assert reply in unused, (f"trained tokens {sequence[start:position]} at {start} are not what the "
                                         f"policy generated in that context")
                unused.remove(reply)
                start = None
    assert not unused, f"{len(unused)} generated replies were never trained on: {unused[:2]}"


def test_grpo_trains_on_exactly_the_generated_tokens(two_answer_policy, generated, monkeypatch, tmp_path):
    from trl import GRPOTrainer

    trained = []
    original = GRPOTrainer._compute_loss

    def recording_loss(self, model, inputs):
        for row in range(inputs["prompt_ids"].shape[0]):
            prompt = inputs["prompt_ids"][row][inputs["prompt_mask"][row] > 0].tolist()
            kept = inputs["completion_mask"][row] > 0
            completion = inputs["completion_ids"][row][kept].tolist()
            loss_mask = (inputs["completion_mask"][row] * inputs["tool_mask"][row])[kept].tolist()
            trained.append((prompt + completion, [0] * len(prompt) + loss_mask))
        return original(self, model, inputs)

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", recording_loss)
    result = train_grpo(str(two_answer_policy), Curriculum(TASKS, NO_CURRICULUM), _batch, None,
                        POLICY_FORMAT, MULTI_TURN, tmp_path / "rl", cache_dir=tmp_path)
    assert result.log[0]["turns_mean"] > 1  # multi-turn: environment tokens sit between the policy's
    assert len(trained) == MULTI_TURN.episodes_per_iteration
    _assert_trained_on_generated(generated, trained)


def test_ppo_trains_on_exactly_the_generated_tokens(two_answer_policy, generated, monkeypatch, tmp_path):
    trained: list[tuple[list[int], list[int]]] = []  # built once per iteration, for every epoch
    original = ppo.make_micro_batch

    def recording_batch(episodes, pad_id, device="cpu"):
        batch = original(episodes, pad_id, device)
        scored = batch.positions + 1
        for row in range(batch.input_ids.shape[0]):
            length = int(batch.attention_mask[row].sum())
            mask = torch.zeros(batch.input_ids.shape[1], dtype=torch.long)
            mask[scored] = batch.policy_mask[row].long()
            trained.append((batch.input_ids[row, :length].tolist(), mask[:length].tolist()))
        return batch

    monkeypatch.setattr(ppo, "make_micro_batch", recording_batch)
    settings = replace(MULTI_TURN, algorithm="ppo", ppo=replace(MULTI_TURN.ppo, epochs=2))
    result = train_ppo(str(two_answer_policy), Curriculum(TASKS, NO_CURRICULUM), _batch, None, POLICY_FORMAT, settings,
                       tmp_path / "rl", cache_dir=tmp_path)
    assert result.log[0]["turns_mean"] > 1
    assert len(trained) == MULTI_TURN.episodes_per_iteration
    _assert_trained_on_generated(generated, trained)
