"""components/rl/ppo.py: the pieces on hand-computed numbers, then training end to end on a tiny real policy, the real
synthetic environment with a scripted experience model (tests/scripted_backend.py) and a real faiss buffer."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from components.builders import curve_probe
from components.config import overridden
from components.data.contract import Task
from components.files import LAST_CHECKPOINT_MARK
from components.llm.models import build_tiny_causal_lm, load_causal_lm
from components.results.workspace import finished_training
from components.rl.curriculum import Curriculum
from components.rl.loop import LOG_FILE, TIME_SPLIT, kept_episodes, read_iteration_log
from components.rl.ppo import (
    OPTIMIZER,
    make_micro_batch,
    ppo_loss,
    sequence_logprobs_and_values,
    train_ppo,
    turn_advantages,
)
from components.rl.rollouts import Episode, SyntheticBatch
from components.simulator.replay_buffer import FaissReplayBuffer
from components.simulator.synthetic import SyntheticEnvironment
from tests.conftest import repo_params, settings_from_params
from tests.hashing_encoder import HashingEncoder
from tests.scripted_backend import ScriptedBackend

ENV = "textworld-cooking"
TASKS = [Task(f"tw-{i}", ENV, "Cook a meal, then eat it.", {"initial_state": f"Kitchen {i}."}) for i in range(3)]
SETTINGS = settings_from_params("rl", algorithm="ppo", iterations=2, tasks_per_iteration=2, group_size=2, max_turns=2,
                               max_action_tokens=4, max_tokens=512, micro_batch_size=3, save_every=1,
                               save_total_limit=2, beta=0.02, learning_rate=1e-3,
                               ppo=settings_from_params("ppo", epochs=2),
                               lora=settings_from_params("lora", r=4, alpha=8, top_layers=None))


# --- the pieces ----------------------------------------------------------------------------------------------------

def test_turn_advantages_by_hand():
    # done after 3 turns, reward at the end: nothing follows the last turn
    advantages, returns = turn_advantages([0.0, 0.0, 1.0], [0.5, 0.6, 0.8], gamma=0.9, gae_lambda=0.8)
    # delta_2 = 1 - 0.8 = 0.2;  delta_1 = 0.9*0.8 - 0.6 = 0.12;  delta_0 = 0.9*0.6 - 0.5 = 0.04;  gamma*lambda = 0.72
    assert advantages == pytest.approx([0.04 + 0.72 * (0.12 + 0.72 * 0.2), 0.12 + 0.72 * 0.2, 0.2])
    assert returns == pytest.approx([a + v for a, v in zip(advantages, [0.5, 0.6, 0.8])])

    # cut after 2 turns, bootstrapped from the value 0.5 of the state reached: delta_1 = 0.9*0.5 - 0.6 = -0.15
    advantages, _ = turn_advantages([0.0, 0.0], [0.5, 0.6], gamma=0.9, gae_lambda=0.8, last_value=0.5)
    assert advantages == pytest.approx([0.04 + 0.72 * -0.15, -0.15])
    # the same cut with the terminal value 0 (what train_ppo uses: the turn limit is part of the task)
    advantages, _ = turn_advantages([0.0, 0.0], [0.5, 0.6], gamma=0.9, gae_lambda=0.8)
    assert advantages == pytest.approx([0.04 + 0.72 * -0.6, -0.6])

    # gamma = lambda = 1: the Monte Carlo return to go minus the value
    advantages, returns = turn_advantages([1.0, 0.0, 2.0], [0.3, 0.2, 0.1], gamma=1.0, gae_lambda=1.0)
    assert advantages == pytest.approx([3 - 0.3, 2 - 0.2, 2 - 0.1]) and returns == pytest.approx([3, 2, 2])


def test_micro_batch_scores_action_tokens_and_finds_decision_points():
    # sequence 0: prompt [10, 11], action [20, 21], env [5, 6], action [30]; sequence 1: prompt [10], action [40]
    first = Episode(TASKS[0], [10, 11], [20, 21, 5, 6, 30], [1, 1, 0, 0, 1], action_starts=[0, 4])
    second = Episode(TASKS[1], [10], [40], [1], action_starts=[0])
    batch = make_micro_batch([first, second], pad_id=0)

    assert batch.input_ids.tolist() == [[10, 11, 20, 21, 5, 6, 30], [10, 40, 0, 0, 0, 0, 0]]
    assert batch.positions.tolist() == [0, 1, 2, 5]  # positions whose next token is an action token in some row
    assert batch.targets.tolist() == [[11, 20, 21, 30], [40, 0, 0, 0]]
    assert batch.policy_mask.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    assert batch.token_turn[batch.policy_mask > 0].tolist() == [0, 0, 1, 2]  # turns numbered across the batch
    # a decision point is the position just before an action's first token
    assert batch.decision_rows.tolist() == [0, 0, 1] and batch.decision_positions.tolist() == [1, 5, 0]


def test_logprobs_are_the_temperature_scaled_distribution_at_the_action_tokens():
    model, _ = build_tiny_causal_lm(["open fridge", "eat meal"] * 10)
    model.eval()
    episode = Episode(TASKS[0], [3, 4, 5], [6, 7, 8, 9], [1, 0, 0, 1], action_starts=[0, 3])
    batch = make_micro_batch([episode], pad_id=0)
    value_head = torch.nn.Linear(model.config.hidden_size, 1)
    with torch.no_grad():
        logprobs, entropy, values = sequence_logprobs_and_values(model, value_head, batch, temperature=0.7)
        output = model(input_ids=batch.input_ids, output_hidden_states=True)
    full = torch.log_softmax(output.logits / 0.7, dim=-1)[0]
    # action tokens 6 (position 3) and 9 (position 6) are scored by the logits at positions 2 and 5
    assert logprobs[0, batch.policy_mask[0] > 0].tolist() == pytest.approx([full[2, 6].item(), full[5, 9].item()],
                                                                             abs=1e-5)
    assert entropy.shape == logprobs.shape
    expected = value_head(output.hidden_states[-1][0, [2, 5]]).squeeze(-1)
    assert values.tolist() == pytest.approx(expected.tolist(), abs=1e-5)


def test_ppo_loss_on_policy_is_minus_the_mean_advantage_and_ignores_environment_tokens():
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand((2, 5), generator=generator) - 0.1
    advantages = torch.randn((2, 5), generator=generator)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0, 0.0]])

    new = logprobs.clone().requires_grad_(True)
    loss = ppo_loss(new, logprobs, logprobs, advantages, mask, clip_epsilon=0.2, beta=0.1)
    expected = -(advantages * mask).sum() / mask.sum()
    assert loss.total.item() == pytest.approx(expected.item()) and loss.kl.item() == pytest.approx(0.0)
    assert loss.clip_ratio.item() == 0.0
    loss.total.backward()  # at ratio 1 the gradient is -advantage / tokens on the policy's tokens, 0 elsewhere
    assert torch.allclose(new.grad, -advantages * mask / mask.sum())

    # an environment token's numbers, however wild, change nothing
    changed_new, changed_old, changed_ref = logprobs.clone(), logprobs.clone(), logprobs.clone()
    changed_new[0, 2], changed_old[0, 3], changed_ref[1, 0] = -50.0, float("nan"), 7.0
    changed = ppo_loss(changed_new, changed_old, changed_ref, advantages, mask, clip_epsilon=0.2, beta=0.1)
    assert changed.total.item() == pytest.approx(loss.total.item())


def test_ppo_loss_clips_and_penalises_drift_from_the_reference():
    one = torch.ones((1, 1))
    old = torch.zeros((1, 1))
    # ratio e^0.5 > 1.2 with a positive advantage: clipped, no gradient pushes it further
    new = torch.full((1, 1), 0.5, requires_grad=True)
    loss = ppo_loss(new, old, None, one, one, clip_epsilon=0.2, beta=0.0)
    loss.total.backward()
    assert loss.total.item() == pytest.approx(-1.2) and loss.clip_ratio.item() == 1.0 and new.grad.item() == 0.0
    # k3 estimate of KL(pi || ref) for log(ref / pi) = -0.5
    drift = ppo_loss(old, old, torch.full((1, 1), -0.5), one, one, clip_epsilon=0.2, beta=2.0)
    k3 = torch.exp(torch.tensor(-0.5)) + 0.5 - 1
    assert drift.kl.item() == pytest.approx(k3.item()) and drift.total.item() == pytest.approx(-1 + 2 * k3.item())


# --- end to end ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("policy")
    build_tiny_causal_lm(["open fridge", "eat meal", "State: Kitchen", "Task: Cook a meal"] * 20, save_dir=directory)
    return directory


def _train(policy_dir, out_dir, cache_dir, backend=None, settings=SETTINGS, curve=None):
    backend = backend or ScriptedBackend()
    buffer = FaissReplayBuffer(HashingEncoder(), settings_from_params("buffer_index"))

    def make_batch():
        return SyntheticBatch(SyntheticEnvironment(ENV, backend, None,
                                                   settings_from_params("prompt", use_retrieval=False),
                                                   settings=settings_from_params("inference", retries=0)))

    return train_ppo(str(policy_dir), Curriculum(TASKS, settings_from_params("curriculum", enabled=False)), make_batch,
                     buffer, settings_from_params("policy_prompt"), settings, out_dir, cache_dir=cache_dir,
                     curve=curve), buffer


@pytest.fixture(scope="module")
def first_run(policy_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ppo") / "rl"
    result, buffer = _train(policy_dir, out_dir, out_dir.parent)
    return result, buffer, out_dir


def test_ppo_trains_logs_iterations_writes_back_and_checkpoints(first_run):
    result, buffer, out_dir = first_run
    assert result.iterations == 2 and result.resumed_from is None and [row["iteration"] for row in result.log] == [1, 2]
    for row in result.log:
        for key in ("reward_mean", "success_rate", "kl", "entropy", "loss", "policy_loss", "value_loss", "clip_ratio",
                    "policy_tokens_mean", "turns_mean", *TIME_SPLIT):
            assert row[key] is not None, key
        # every episode ran to the turn limit (the scripted experience model only ends an episode on "eat meal" or
        # "give up"), so episode lengths are the same in any rerun: the resume tests below rely on it
        assert row["turns_mean"] == SETTINGS.max_turns
    # every episode's transitions went into the buffer as synthetic experience: 2 iterations x 4 episodes x 2 turns
    assert len(buffer) == buffer.count(source="synthetic") == 2 * SETTINGS.episodes_per_iteration * SETTINGS.max_turns
    assert result.log[-1]["buffer_size"] == len(buffer)

    model, _ = load_causal_lm(str(result.model_dir), cache_dir=out_dir.parent)  # the merged policy loads
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert [row["iteration"] for row in read_iteration_log(result.model_dir)] == [1, 2]  # its history travels with it
    checkpoints = out_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    checkpoint = checkpoints / "checkpoint-2"
    for name in ("adapter_model.safetensors", "value_head.pt", "optimizer.pt", "rng.pt", "replay_buffer/buffer.json"):
        assert (checkpoint / name).is_file(), name
    assert len((checkpoint / LOG_FILE).read_text().splitlines()) == 2


def test_ppo_rerun_with_the_same_settings_has_nothing_left_to_do(first_run, policy_dir):
    result, buffer, out_dir = first_run
    backend = ScriptedBackend()
    again, _ = _train(policy_dir, out_dir, out_dir.parent, backend)
    assert again.resumed_from and again.resumed_from.endswith("checkpoint-2") and again.iterations == 2
    assert again.log == json.loads(json.dumps(result.log)) and not backend.calls  # not one more rollout
    assert again.log[-1]["buffer_size"] == len(buffer)


def test_ppo_resumes_mid_run_where_it_stopped(first_run, policy_dir, tmp_path):
    result, buffer, out_dir = first_run
    crashed = tmp_path / "rl"
    shutil.copytree(out_dir, crashed)
    shutil.rmtree(crashed / "checkpoints" / "checkpoint-2")  # as if the run died during iteration 2

    backend = ScriptedBackend()
    resumed, _ = _train(policy_dir, crashed, out_dir.parent, backend)
    assert resumed.resumed_from and resumed.resumed_from.endswith("checkpoint-1") and resumed.iterations == 2
    assert len(backend.calls) == SETTINGS.max_turns  # exactly one more iteration: one experience-model call a turn
    assert len(resumed.log) == len(result.log) == 2
    # iteration 2's episodes were kept once, by the resumed run (the crashed run's were dropped with its checkpoint)
    assert [e.task.task_id for e in kept_episodes(crashed)] == [e.task.task_id for e in kept_episodes(out_dir)]
    assert len(kept_episodes(crashed)) == 2 * SETTINGS.episodes_per_iteration
    assert resumed.log[-1]["buffer_size"] == len(buffer)
    assert (crashed / "checkpoints" / "checkpoint-2" / LOG_FILE).is_file()
    # the adapter, value head, optimizer and RNG states came back: iteration 2 is the uninterrupted run's
    original = json.loads(json.dumps(result.log))
    assert resumed.log[0] == original[0]
    assert {k: v for k, v in resumed.log[1].items() if k not in TIME_SPLIT} == \
        {k: v for k, v in original[1].items() if k not in TIME_SPLIT}


def test_ppo_plays_iterations_while_their_worst_case_fits_in_its_transition_budget(policy_dir, tmp_path):
    """One-turn episodes spend 4 of an iteration's worst case of 8: a budget of 16 pays for 3 iterations, the last one
    saved though save_every is larger and marked the last; a rerun plays nothing, a larger budget goes on from the
    checkpoint, even one copied without its optimizer (a parked row's)."""
    def train(budget, backend):
        settings = replace(SETTINGS, iterations=10, transition_budget=budget, save_every=5, save_total_limit=10)
        return _train(policy_dir, tmp_path / "rl", tmp_path, backend, settings)[0]

    first = train(16, ScriptedBackend(one_turn=True))
    assert SETTINGS.transitions_per_iteration == 8 and [row["env_transitions"] for row in first.log] == [4, 4, 4]
    assert first.iterations == 3 and read_iteration_log(first.model_dir) == first.log
    last = tmp_path / "rl" / "checkpoints" / "checkpoint-3"
    assert sorted(p.name for p in last.parent.glob("checkpoint-*")) == [last.name]
    assert json.loads((last / LAST_CHECKPOINT_MARK).read_text()) == {"iterations": 3} and finished_training(last)
    idle = ScriptedBackend(one_turn=True)
    again = train(16, idle)
    assert again.resumed_from.endswith("checkpoint-3") and again.iterations == 3 and not idle.calls
    (last / OPTIMIZER).unlink()
    more = train(20, ScriptedBackend(one_turn=True))
    assert more.iterations == 4 and more.log[:3] == json.loads(json.dumps(first.log))
    assert finished_training(last.parent / "checkpoint-4")  # the longer run's last


def test_ppo_full_fine_tuning_keeps_a_frozen_reference_and_resumes(policy_dir, tmp_path):
    settings = replace(SETTINGS, lora=None, iterations=1, tasks_per_iteration=1, micro_batch_size=2)
    result, _ = _train(policy_dir, tmp_path / "rl", tmp_path, settings=settings)
    assert result.log[0]["kl"] >= 0.0  # measured against the frozen copy of the warm start
    checkpoint = tmp_path / "rl" / "checkpoints" / "checkpoint-1"
    assert (checkpoint / "model.safetensors").is_file() and not (checkpoint / "adapter_config.json").exists()
    load_causal_lm(str(result.model_dir), cache_dir=tmp_path)

    again, _ = _train(policy_dir, tmp_path / "rl", tmp_path, settings=settings)  # whole weights and optimizer load
    assert again.resumed_from and again.log == json.loads(json.dumps(result.log))


def test_ppo_learning_curve_measures_heldout_success_in_real_games_and_changes_no_training(first_run, policy_dir,
                                                                                            tmp_path):
    result, _, out_dir = first_run
    repo = Path(__file__).resolve().parents[1]
    params = overridden(repo_params(), {"environments.textworld.cache_dir": str(repo / ".cache" / "textworld"),
                                        "policy.environments": [ENV], "policy.max_turns": 2,
                                        "evaluate.curve_every": 1, "evaluate.curve_games": 2})
    measured, _ = _train(policy_dir, tmp_path / "rl", tmp_path, curve=curve_probe(params))
    assert all(row["heldout_success"] in (0.0, 0.5, 1.0) and row["curve_s"] > 0 for row in measured.log)

    def played(out) -> list:
        return [(t.task.task_id, [step.action for step in t.steps]) for t in kept_episodes(out)]

    assert played(tmp_path / "rl") == played(out_dir)  # it only measures: the same play and the same updates
    assert [row["loss"] for row in measured.log] == pytest.approx([row["loss"] for row in result.log])
