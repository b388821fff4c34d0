"""components/rl/grpo.py on TRL's GRPOTrainer: a tiny real policy, the real synthetic environment with a scripted
experience model (tests/scripted_backend.py), a real faiss buffer."""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from components.builders import curve_probe
from components.config import overridden
from components.data.contract import Task
from components.llm.models import build_tiny_causal_lm, load_causal_lm
from components.rl.curriculum import Curriculum
from components.rl.grpo import train_grpo
from components.rl.loop import (
    CURRICULUM_FILE,
    LOG_FILE,
    kept_episodes,
    progress,
    read_iteration_log,
    sidecars_complete,
)
from components.rl.rollouts import SyntheticBatch
from components.simulator.replay_buffer import FaissReplayBuffer
from components.simulator.synthetic import SyntheticEnvironment
from tests.conftest import repo_params, settings_from_params
from tests.hashing_encoder import HashingEncoder
from tests.scripted_backend import ScriptedBackend, ScriptedTaskWriter

ENV = "textworld-cooking"
TASKS = [Task(f"tw-{i}", ENV, "Cook a meal, then eat it.", {"initial_state": f"Kitchen {i}."}) for i in range(3)]
SETTINGS = settings_from_params("rl", algorithm="grpo", iterations=2, tasks_per_iteration=2, group_size=2, max_turns=2,
                               max_action_tokens=4, max_tokens=512, micro_batch_size=2, save_every=1,
                               save_total_limit=2, beta=0.02, learning_rate=1e-3,
                               lora=settings_from_params("lora", r=4, alpha=8, top_layers=None))
NO_CURRICULUM = settings_from_params("curriculum", enabled=False)
POLICY_FORMAT = settings_from_params("policy_prompt")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("policy")
    build_tiny_causal_lm(["open fridge", "eat meal", "State: Kitchen", "Task: Cook a meal"] * 20, save_dir=directory)
    return directory


def _batch():
    return SyntheticBatch(SyntheticEnvironment(ENV, ScriptedBackend(), None,
                                               settings_from_params("prompt", use_retrieval=False),
                                               settings=settings_from_params("inference", retries=0)))


def test_grpo_trains_logs_iterations_writes_back_and_resumes(policy_dir, tmp_path):
    buffer = FaissReplayBuffer(HashingEncoder(), settings_from_params("buffer_index"))
    result = train_grpo(str(policy_dir), Curriculum(TASKS, NO_CURRICULUM), _batch, buffer,
                        POLICY_FORMAT, SETTINGS, tmp_path / "rl", cache_dir=tmp_path)

    assert result.iterations == 2 and [row["iteration"] for row in result.log] == [1, 2]
    first = result.log[0]
    for key in ("reward_mean", "success_rate", "kl", "entropy", "loss", "policy_tokens_mean", "turns_mean",
                "policy_generation_s", "environment_s", "optimisation_s"):
        assert key in first, key
    assert 0 <= first["fallback_steps"] <= first["turns_mean"] * SETTINGS.episodes_per_iteration
    assert 0 <= first["ended_rate"] <= 1
    # every episode's transitions went into the buffer as synthetic experience: 2 iterations x 4 episodes
    turns = sum(row["turns_mean"] * SETTINGS.episodes_per_iteration for row in result.log)
    assert len(buffer) == buffer.count(source="synthetic") == round(turns)
    assert result.log[-1]["buffer_size"] == len(buffer)
    model, _ = load_causal_lm(str(result.model_dir), cache_dir=tmp_path)  # the merged policy loads
    assert read_iteration_log(result.model_dir) == json.loads(json.dumps(result.log))  # its history travels with it
    checkpoint = tmp_path / "rl" / "checkpoints" / "checkpoint-2"
    assert (checkpoint / "replay_buffer" / "buffer.json").is_file()
    assert len((checkpoint / LOG_FILE).read_text().splitlines()) == 2
    played = kept_episodes(tmp_path / "rl")  # every episode, once, as contract trajectories
    assert len(played) == 2 * SETTINGS.episodes_per_iteration
    assert sum(len(t.steps) for t in played) == sum(row["env_transitions"] for row in result.log)

    # the same settings again: nothing left to do, the log and buffer come back from the last checkpoint
    fresh = FaissReplayBuffer(HashingEncoder(), settings_from_params("buffer_index"))
    again = train_grpo(str(policy_dir), Curriculum(TASKS, NO_CURRICULUM), _batch, fresh,
                       POLICY_FORMAT, SETTINGS, tmp_path / "rl", cache_dir=tmp_path)
    assert again.resumed_from and again.iterations == 2 and again.log == json.loads(json.dumps(result.log))
    assert len(fresh) == len(buffer)  # restored in place: the caller's buffer object holds the synthetic transitions

    # extended by one iteration: the run goes on from its last checkpoint instead of starting over
    longer = train_grpo(str(policy_dir), Curriculum(TASKS, NO_CURRICULUM), _batch, fresh,
                        POLICY_FORMAT, replace(SETTINGS, iterations=3), tmp_path / "rl", cache_dir=tmp_path)
    assert longer.resumed_from and [row["iteration"] for row in longer.log] == [1, 2, 3]
    assert longer.log[:2] == again.log
    assert kept_episodes(tmp_path / "rl")[:len(played)] == played
    assert len(kept_episodes(tmp_path / "rl")) == 3 * SETTINGS.episodes_per_iteration
    # pruned to save_total_limit (2), and only once the newest checkpoint's side-cars were written
    kept = sorted((tmp_path / "rl" / "checkpoints").glob("checkpoint-*"))
    assert [p.name for p in kept] == ["checkpoint-2", "checkpoint-3"]
    assert all(sidecars_complete(p, with_buffer=True) for p in kept)


def test_grpo_rerun_of_a_finished_run_trains_nothing_even_mid_epoch(policy_dir, tmp_path):
    # 10 tasks, 2 per iteration: one iteration is a fifth of an epoch of TRL's sampler, so a resume lands
    # mid-epoch, where Trainer.train takes a step before it tests max_steps (sim-to-real overspent its budget so).
    tasks = [Task(f"tw-{i}", ENV, "Cook a meal, then eat it.", {"initial_state": f"Kitchen {i}."}) for i in range(10)]
    one = replace(SETTINGS, iterations=1)
    first = train_grpo(str(policy_dir), Curriculum(tasks, NO_CURRICULUM), _batch, None,
                       POLICY_FORMAT, one, tmp_path / "rl", cache_dir=tmp_path)
    again = train_grpo(str(policy_dir), Curriculum(tasks, NO_CURRICULUM), _batch, None,
                       POLICY_FORMAT, one, tmp_path / "rl", cache_dir=tmp_path)
    assert again.resumed_from and again.iterations == 1 and again.log == json.loads(json.dumps(first.log))
    assert read_iteration_log(again.model_dir) == again.log
    assert sorted(p.name for p in (tmp_path / "rl" / "checkpoints").glob("checkpoint-*")) == ["checkpoint-1"]
    load_causal_lm(str(again.model_dir), cache_dir=tmp_path)  # the final policy, rebuilt from the checkpoint


def test_a_run_cut_below_its_checkpoints_resumes_the_last_one_within_the_cut(policy_dir, tmp_path):
    """Sim-to-real's budget cut from two iterations to one must end at iteration 1, not finish from checkpoint 2
    (which spent more real transitions than the new budget)."""
    first = train_grpo(str(policy_dir), Curriculum(TASKS, NO_CURRICULUM), _batch, None,
                       POLICY_FORMAT, SETTINGS, tmp_path / "rl", cache_dir=tmp_path)
    cut = train_grpo(str(policy_dir), Curriculum(TASKS, NO_CURRICULUM), _batch, None,
                     POLICY_FORMAT, replace(SETTINGS, iterations=1), tmp_path / "rl", cache_dir=tmp_path)
    assert first.iterations == 2 and cut.resumed_from.endswith("checkpoint-1") and cut.iterations == 1
    assert cut.log == json.loads(json.dumps(first.log[:1])) and read_iteration_log(cut.model_dir) == cut.log
    assert sorted(p.name for p in (tmp_path / "rl" / "checkpoints").glob("checkpoint-*")) == ["checkpoint-1"]


def test_a_transition_budget_plays_iterations_while_their_worst_case_fits_and_resumes_to_the_same_plan(policy_dir,
                                                                                                     tmp_path):
    """Sim-to-real's budget: one-turn episodes spend 4 of an iteration's worst case of 8 (4 episodes x 2 turns), so a
    budget of 16 pays for 3 iterations (the third starts with 8 left), not the 2 a count fixed by the worst case
    would give; the last iteration is saved though save_every is larger, a rerun plays nothing more, a larger budget
    goes on and a smaller one resumes only the checkpoint within it."""
    def batch():
        return SyntheticBatch(SyntheticEnvironment(ENV, ScriptedBackend(one_turn=True), None,
                                                   settings_from_params("prompt", use_retrieval=False),
                                                   settings=settings_from_params("inference", retries=0)))

    def train(budget, save_every=5):
        return train_grpo(str(policy_dir), Curriculum(TASKS, NO_CURRICULUM), batch, None, POLICY_FORMAT,
                          replace(SETTINGS, iterations=10, transition_budget=budget, save_every=save_every,
                                  save_total_limit=10), tmp_path / "rl", cache_dir=tmp_path)

    first = train(16)
    assert SETTINGS.transitions_per_iteration == 8 and [row["env_transitions"] for row in first.log] == [4, 4, 4]
    assert first.iterations == 3 and read_iteration_log(first.model_dir) == first.log
    assert sorted(p.name for p in (tmp_path / "rl" / "checkpoints").glob("checkpoint-*")) == ["checkpoint-3"]
    again = train(16)
    assert again.resumed_from.endswith("checkpoint-3") and again.log == json.loads(json.dumps(first.log))
    more = train(20, save_every=1)  # 8 left after 12: one more iteration
    assert more.resumed_from.endswith("checkpoint-3") and len(more.log) == 4 and more.log[:3] == again.log
    cut = train(12)  # the third iteration started with 8 left of 16, but with 4 of 12: only 2 are this run's
    assert cut.resumed_from is None and len(cut.log) == 2
    assert sum(row["env_transitions"] for row in cut.log) == 8
    with pytest.raises(ValueError, match="a transition budget of 7 pays for no iteration"):
        train(7)


def test_a_budgeted_runs_progress_line_counts_the_iterations_its_mean_spending_leaves():
    settings = replace(SETTINGS, iterations=100, transition_budget=70, max_turns=7)  # worst case 4 x 7 = 28
    # 6 spent in 1 iteration: the next one, then more while 28 fit in what is left at 6 an iteration,
    # (70 - 6 - 28) // 6 = 6 more: 7 in all
    assert progress(settings, 1, 6, 10.0) == ("1/100 (6/70 transitions)", "10s/iteration, ETA 70s")
    assert progress(settings, 8, 48, 10.0)[1] == "10s/iteration, ETA 0s"  # 22 left: no worst case fits
    assert progress(replace(settings, transition_budget=None), 1, 6, 10.0) == ("1/100", "10s/iteration, ETA 990s")


def test_checkpoints_of_another_environment_or_warm_start_are_never_resumed(policy_dir, tmp_path, caplog):
    """The study's ablations share out_dir: a run on another simulator, or from a warm start retrained in place,
    must start afresh, not finish from the previous run's checkpoint, and says so (a row parked on one machine and
    going on on another tells from its log whether it resumed)."""
    import shutil

    warm_start = Path(shutil.copytree(policy_dir, tmp_path / "warm-start"))
    one = replace(SETTINGS, iterations=1)

    def train(environment):
        return train_grpo(str(warm_start), Curriculum(TASKS, NO_CURRICULUM), _batch, None,
                          POLICY_FORMAT, one, tmp_path / "rl", cache_dir=tmp_path, environment=environment)

    assert train("simulator A").resumed_from is None
    assert train("simulator A").resumed_from  # the same run again: resumed
    with caplog.at_level(logging.INFO, logger="components.rl.loop"):
        assert train("simulator B").resumed_from is None
    assert "were for another warm start, environment or settings: starting over" in caplog.text
    build_tiny_causal_lm(["take knife", "cook meal"] * 20, save_dir=warm_start)  # retrained at the same path
    assert train("simulator B").resumed_from is None


def test_a_warm_start_merged_again_on_another_cpu_resumes_the_checkpoints_and_another_training_does_not(
        policy_dir, tmp_path):
    """A row parked on one machine goes on on another, where its warm start is merged again from the kept training:
    other bytes by float rounding, the same training (`made_from.txt`). Its checkpoints resume there; a warm start
    another training made does not resume them. The policy RL saves says which run and how many iterations made it."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from components.files import write_made_from

    warm_start = Path(shutil.copytree(policy_dir, tmp_path / "warm-start"))
    write_made_from(warm_start, "sft training-a")
    one = replace(SETTINGS, iterations=1)

    def train():
        return train_grpo(str(warm_start), Curriculum(TASKS, NO_CURRICULUM), _batch, None,
                          POLICY_FORMAT, one, tmp_path / "rl", cache_dir=tmp_path, environment="simulator")

    first = train()
    assert first.resumed_from is None
    stamp = (tmp_path / "rl" / "checkpoints" / "fingerprint.txt").read_text().strip()
    assert (first.model_dir / "made_from.txt").read_text() == f"rl {stamp} after 1 iterations\n"
    [weights] = warm_start.glob("*.safetensors")
    save_file({name: tensor + 1e-7 * torch.sign(tensor) for name, tensor in load_file(weights).items()}, weights,
              metadata={"format": "pt"})  # merged on another CPU
    assert train().resumed_from
    write_made_from(warm_start, "sft training-b")
    assert train().resumed_from is None


def test_grpo_plays_the_curriculum_tasks_and_resumes_its_state(policy_dir, tmp_path):
    # min_variance 0: every played task may be varied, so the wiring is tested whatever the tiny policy earns
    settings = settings_from_params("curriculum", enabled=True, top_tasks=1, variations_per_task=1,
                                    max_generated_share=0.5, min_variance=0.0)
    writer = ScriptedTaskWriter()
    result = train_grpo(str(policy_dir), Curriculum(TASKS, settings), _batch, None, POLICY_FORMAT, SETTINGS,
                        tmp_path / "rl", cache_dir=tmp_path, generator=writer)

    assert len(writer.calls) == 2  # one batched proposal after each iteration
    first, second = result.log
    assert (first["generated_tasks_played"], first["accepted"]) == (0, 1)
    assert (second["generated_tasks_played"], second["generated_tasks"]) == (1, 2)  # lambda 0.5 of 2 tasks
    state = json.loads((tmp_path / "rl" / "checkpoints" / "checkpoint-2" / CURRICULUM_FILE).read_text())
    assert [t["parameters"]["generated_at_iteration"] for t in state["generated"]] == [1, 2]
    assert all(t["parameters"]["initial_state"] == f"Kitchen {t['parameters']['parent_task_id'][-1]}."
               for t in state["generated"])  # a variation resets where its parent does

    # resumed: the curriculum comes back from the checkpoint, no proposal is repeated
    curriculum, again_writer = Curriculum(TASKS, settings), ScriptedTaskWriter()
    again = train_grpo(str(policy_dir), curriculum, _batch, None, POLICY_FORMAT, SETTINGS, tmp_path / "rl",
                       cache_dir=tmp_path, generator=again_writer)
    assert again.resumed_from and not again_writer.calls
    assert [t.task_id for t in curriculum.generated] == [t["task_id"] for t in state["generated"]]


def test_a_learning_curve_measures_heldout_success_in_real_games_and_changes_no_training(policy_dir, tmp_path,
                                                                                        caplog):
    repo = Path(__file__).resolve().parents[1]
    params = overridden(repo_params(), {"environments.textworld.cache_dir": str(repo / ".cache" / "textworld"),
                                        "policy.environments": [ENV], "policy.max_turns": 2,
                                        "evaluate.curve_every": 2, "evaluate.curve_games": 2})
    curve = curve_probe(params)
    settings = replace(SETTINGS, iterations=3)
    plain = train_grpo(str(policy_dir), Curriculum(TASKS, NO_CURRICULUM), _batch, None, POLICY_FORMAT, settings,
                       tmp_path / "plain", cache_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger="components.builders"):
        measured = train_grpo(str(policy_dir), Curriculum(TASKS, NO_CURRICULUM), _batch, None, POLICY_FORMAT,
                              settings, tmp_path / "curve", cache_dir=tmp_path, curve=curve)

    assert all("heldout_success" not in row for row in plain.log)
    # every curve_every iterations and after the last: held-out success of greedy play on 2 real games, and its time
    assert [("heldout_success" in row, "curve_s" in row) for row in measured.log] == [(False, False), (True, True),
                                                                                       (True, True)]
    assert all(row["heldout_success"] in (0.0, 0.5, 1.0) and row["curve_s"] > 0 for row in measured.log[1:])
    # its games show their progress (on a CPU a curve point takes many minutes)
    assert f"[evaluate {ENV} / curve] 2/2 episodes" in caplog.text
    # it only measures: the same episodes were played and the same updates made
    def played(out: Path) -> list:
        return [(t.task.task_id, [step.action for step in t.steps]) for t in kept_episodes(out)]

    assert played(tmp_path / "curve") == played(tmp_path / "plain")
    assert [row["loss"] for row in measured.log] == pytest.approx([row["loss"] for row in plain.log])
