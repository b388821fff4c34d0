"""Stages under a multi-process launcher (torchrun; `accelerate launch --multi_gpu` starts the same gloo group on a
CPU): one process writes, and N processes train what one does."""
from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import textwrap

import pytest

from tests.conftest import (
    BIN,
    REPO,
    SMALL_RUN,
    copy_project,
    run,
    set_params,
    tiny_experience_model,
    tiny_policy,
)

TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2"]  # --standalone: a free port


def test_only_the_main_process_writes_outputs_and_models(tmp_path):
    """Rank 1 goes through the writers first while rank 0 waits: nothing is there until rank 0 writes it."""
    script = tmp_path / "writers.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        from components import distributed
        from components.llm.models import build_tiny_causal_lm
        from components.llm.sft import _save_model
        from components.reports import write_stage_outputs
        from tests.conftest import settings_from_params

        root, rank = Path({str(tmp_path)!r}), 0 if distributed.is_main_process() else 1
        if rank == 0:  # work the main process does by itself: its collectives must not wait for rank 1
            with distributed.alone():
                assert distributed.all_gather("x") == ["x"] and distributed.share(4) == range(4)
                distributed.wait_for_everyone()
        model, tokenizer = build_tiny_causal_lm(["a tiny model"])
        settings = settings_from_params("training", lora=None)
        if rank == 1:
            write_stage_outputs("probe", {{"written_by": rank}}, "rank 1", root)
            distributed.wait_for_everyone()
            _save_model(model, tokenizer, root / "out", settings, "a training")  # returns once rank 0 has saved
        else:
            distributed.wait_for_everyone()  # rank 1 has been through write_stage_outputs
            seen = {{"metrics": (root / "metrics" / "probe.json").exists(), "model": (root / "out").exists()}}
            write_stage_outputs("probe", {{"written_by": rank}}, "rank 0", root)
            _save_model(model, tokenizer, root / "out", settings, "a training")
            (root / "seen_by_rank_0.json").write_text(json.dumps(seen))
    """))
    done = subprocess.run([*TORCHRUN, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads((tmp_path / "seen_by_rank_0.json").read_text()) == {"metrics": False, "model": False}
    assert json.loads((tmp_path / "metrics" / "probe.json").read_text()) == {"written_by": 0}
    assert (tmp_path / "reports" / "probe.md").read_text() == "rank 0"
    assert (tmp_path / "out" / "model" / "config.json").is_file() and not (tmp_path / "out" / ".model.partial").exists()
    assert (tmp_path / "out" / "model" / "made_from.txt").read_text() == "sft a training\n"  # by the main process
    assert (tmp_path / "out" / "model" / "made_from.txt").read_text() == "sft a training\n"


@pytest.mark.slow  # two trainings and a torchrun start: about a minute
def test_two_processes_train_the_experience_model_one_process_trains(project_template, tmp_path, tiny_model_dir):
    """`torchrun --nproc_per_node 2 dreamgym stage train_experience_model` on the CPU (gloo): the same optimizer
    steps on the same examples as one process (the effective batch kept), so the same weights; outputs written once."""
    one = copy_project(project_template, tmp_path / "one")
    run("dreamgym", "data", "onboard", "examples/seed/demo-kitchen.jsonl", cwd=one)
    set_params(one, {**tiny_experience_model(tiny_model_dir, "demo-kitchen"),
                     "experience_model.training.max_steps": 4, "experience_model.training.warmup": 0,
                     "experience_model.training.batch_size": 1,
                     "experience_model.training.gradient_accumulation_steps": 2,
                     # LoRA dropout draws other masks in other processes: without it the runs must agree exactly
                     "experience_model.training.lora": {"r": 8, "alpha": 16, "dropout": 0.0,
                                                        "target_modules": "all-linear", "top_layers": None}})
    two, launched = _run_once_and_launched(one, tmp_path / "two", ("annotate", "index_buffer"),
                                           "train_experience_model")

    from safetensors.torch import load_file

    weights = [load_file(p / "models" / "experience" / "model" / "model.safetensors") for p in (one, two)]
    base = load_file(tiny_model_dir / "model.safetensors")
    assert max((weights[0][k] - base[k]).abs().max().item() for k in base) > 1e-4  # it trained
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in base) < 1e-6
    metrics = [json.loads((p / "metrics" / "train_experience_model.json").read_text()) for p in (one, two)]
    for key in ("global_step", "examples", "train_loss", "final_loss"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-6), key
    assert not (two / "models" / "experience" / ".model.partial").exists()
    assert launched.count("step 4/4 loss") == 1  # one progress log, the main process's


@pytest.mark.slow  # four small trainings and a torchrun start: about two minutes
@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_two_processes_take_the_rl_step_one_process_takes(project_template, tmp_path, tiny_model_dir, algorithm):
    """`torchrun --nproc_per_node 2 dreamgym stage synthetic_rl` on the CPU: the main process serves the synthetic
    environment, each process plays its half of the iteration there (each episode from its own seed: the episodes a
    single process plays), each process trains on half of its micro-batches (PPO: every other one, gradients
    summed; GRPO: TRL's share of the iteration, gradients averaged over token-normalised losses), so the policy is
    the one a single process trains; the outputs are written once."""
    one = copy_project(project_template, tmp_path / "one")
    run("dreamgym", "data", "onboard", "examples/seed/demo-kitchen.jsonl", cwd=one)
    simulator = _ScriptedExperienceServer()  # rewards that vary with the action: without them PPO has no gradient
    set_params(one, {**tiny_experience_model(tiny_model_dir, "demo-kitchen"), **tiny_policy(tiny_model_dir),
                     "policy.environments": ["demo-kitchen"], "synthetic_rl.algorithm": algorithm,
                     "synthetic_rl.iterations": 1, "synthetic_rl.group_size": 4, "synthetic_rl.micro_batch_size": 1,
                     "synthetic_rl.learning_rate": 1e-3, "synthetic_rl.curriculum.enabled": False,
                     "experience_model.inference.backend": "openai",
                     "experience_model.inference.base_url": simulator.url})
    two, launched = _run_once_and_launched(one, tmp_path / "two",
                                           ("annotate", "index_buffer", "train_experience_model", "train_policy_sft"),
                                           "synthetic_rl")

    from safetensors.torch import load_file

    weights = [load_file(p / "models" / "policy" / "rl" / "model" / "model.safetensors") for p in (one, two)]
    warm = load_file(one / "models" / "policy" / "sft" / "model" / "model.safetensors")
    moved = max((weights[0][k] - warm[k]).abs().max().item() for k in warm)
    assert moved > 1e-4  # it trained
    if algorithm == "ppo":  # the same micro-batches, the same shapes: the same gradients up to summation order
        assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in warm) < 1e-3 * moved
    else:  # TRL pads each process's half of the iteration to its own longest episode: the gradients agree to about
        # 1e-4, and Adam's first step (about lr x sign of the gradient) turns that float noise into other signs where
        # a gradient is near zero, so the updates agree in direction, not element by element
        import torch

        updates = [torch.cat([(w[k] - warm[k]).flatten() for k in warm]) for w in weights]
        assert torch.nn.functional.cosine_similarity(*updates, dim=0) > 0.5
    played = [[json.loads(line)["trajectory"]["steps"] for line in
               (p / "models" / "policy" / "rl" / "checkpoints" / "episodes.jsonl").open()] for p in (one, two)]
    assert played[0] == played[1]  # the processes played their shares of the iteration: the same episodes
    logs = [(p / "metrics" / "synthetic_rl_iterations.csv").read_text().splitlines() for p in (one, two)]
    assert len(logs[1]) == 2  # one iteration, logged once
    rows = [dict(zip(log[0].split(","), log[1].split(","), strict=True)) for log in logs]
    for key in ("reward_mean", "success_rate", "loss", "value_loss", "grad_norm"):
        if key in rows[0]:
            # GRPO's gradient norm: the float noise of TRL's per-process padding (above), 2.5e-3 of it measured
            within = 5e-3 if (algorithm, key) == ("grpo", "grad_norm") else 1e-3
            assert float(rows[0][key]) == pytest.approx(float(rows[1][key]), rel=within, abs=1e-6), key
    assert simulator.calls > 0
    # one simulator server stepped both processes' episodes (8 steps), several processes' steps in a call
    served = re.search(r"simulator server for demo-kitchen \(http://127.0.0.1:\d+\): (\d+) steps of 2 processes in "
                       r"(\d+) experience-model calls", launched)
    assert served and int(served[1]) == int(rows[1]["env_transitions"]) and int(served[2]) < int(served[1])
    refused = subprocess.run([*TORCHRUN, str(BIN / "dreamgym"), "stage", "index_buffer"], cwd=two,
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "index_buffer is not rank-aware" in refused.stderr


@pytest.mark.slow  # TextWorld games, a small training, three stages both ways: about two minutes
def test_two_processes_share_the_real_games_of_sim_to_real_and_of_the_evaluations(project_template, tmp_path,
                                                                                  tiny_model_dir):
    """`torchrun --nproc_per_node 2 dreamgym stage sim_to_real`: each process plays its episode of the iteration in a
    real TextWorld game of its own, from the episode's own sampling seed, so the episodes and the real transitions
    spent are the ones a single process plays (the tiny policy wins nothing in a real game: no advantage, no update
    either way; that the processes' update is one process's, the synthetic_rl test above shows, with rewards). Then
    evaluate_baselines and evaluate_policies: each process plays its share of the held-out games; the same games,
    outcomes and metrics as one process. Every output is written once."""
    one = copy_project(project_template, tmp_path / "one")
    set_params(one, {**SMALL_RUN, **tiny_policy(tiny_model_dir), "sim_to_real.start_from": "sft",
                     "data.heldout_task_fraction": 0.4,  # of the two games, one trains and one is held out
                     "policy.eval_tasks": 2, "synthetic_rl.algorithm": "ppo", "synthetic_rl.micro_batch_size": 1,
                     # the learning curve: the main process plays a held-out game by itself after the iteration
                     "evaluate.curve_every": 1, "evaluate.curve_games": 1})
    run("dreamgym", "stage", "collect_seed", cwd=one)
    run("dreamgym", "data", "onboard", *map(str, sorted((one / "seed").glob("*.jsonl"))), "--no-version", cwd=one)
    two, launched = _run_once_and_launched(one, tmp_path / "two", ("validate", "train_policy_sft"),
                                           ("sim_to_real", "evaluate_baselines", "evaluate_policies"))

    from safetensors.torch import load_file

    weights = [load_file(p / "models" / "policy" / "s2r" / "model" / "model.safetensors") for p in (one, two)]
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0]) < 1e-6
    metrics = [json.loads((p / "metrics" / "sim_to_real.json").read_text()) for p in (one, two)]
    for key in ("iterations", "episodes", "real_transitions_used", "on_policy_transitions_kept"):
        assert metrics[0][key] == metrics[1][key], key
    assert metrics[1]["real_transitions_used"] > 0
    kept = [[json.loads(line)["steps"] for line in (p / "models" / "policy" / "s2r" / "on_policy.jsonl").open()]
            for p in (one, two)]
    assert kept[0] == kept[1]  # the same real episodes, in the same order
    assert launched.count("iteration 1/1 reward") == 1  # logged once, by the main process
    curves = [list(csv.DictReader((p / "metrics" / "sim_to_real_iterations.csv").open())) for p in (one, two)]
    assert curves[0][0]["heldout_success"] == curves[1][0]["heldout_success"] != ""

    def without_wall_time(metrics):
        if isinstance(metrics, dict):
            return {key: without_wall_time(value) for key, value in metrics.items() if key != "wall_s"}
        return metrics

    for stage in ("evaluate_baselines", "evaluate_policies"):
        evaluated = [json.loads((p / "metrics" / f"{stage}.json").read_text()) for p in (one, two)]
        assert without_wall_time(evaluated[0]) == without_wall_time(evaluated[1]), stage
    assert evaluated[1]["sim-to-real"]["textworld-cooking"]["episodes"] == 2  # both held-out games, one per process
    games = [(p / "reports" / "evaluate_policies_games.csv").read_text() for p in (one, two)]
    assert games[0] == games[1] and len(games[1].splitlines()) == 1 + 2 * 2  # 2 policies x 2 games, in order
    assert "this process's share of 2" in launched  # progress from the main process, on its share


@pytest.mark.slow  # TextWorld games, small trainings, two rounds both ways: about four minutes
def test_two_processes_run_the_correction_rounds_one_process_runs(project_template, tmp_path, tiny_model_dir):
    """`torchrun --nproc_per_node 2 dreamgym stage evaluate_experience_model`, then `correction_rounds`: the
    rank-aware steps on both processes, the rest on the main one, each round's rows read back from its steps' files by
    both. With a deterministic experience model (the scripted endpoint) and PPO, the fidelity and the two rounds come
    out as one process's: the same predictions, real transitions, on-policy episodes, audits, fidelity and held-out
    success; the outputs are written once."""
    simulator = _ScriptedExperienceServer()
    one = copy_project(project_template, tmp_path / "one")
    set_params(one, {**SMALL_RUN, **tiny_experience_model(tiny_model_dir, "textworld-cooking"),
                     **tiny_policy(tiny_model_dir), "data.heldout_task_fraction": 0.4,
                     "correction.heldout_games": 1, "experience_model.on_policy_games": 1, "correction.rounds": 2,
                     "correction.real_transitions": 4, "correction.training_steps": 1,
                     "synthetic_rl.algorithm": "ppo", "synthetic_rl.micro_batch_size": 1,
                     "synthetic_rl.curriculum.enabled": False,  # the scripted endpoint writes no tasks
                     "experience_model.inference.backend": "openai",
                     "experience_model.inference.base_url": simulator.url})
    run("dreamgym", "stage", "collect_seed", cwd=one)
    run("dreamgym", "data", "onboard", *map(str, sorted((one / "seed").glob("*.jsonl"))), "--no-version", cwd=one)
    two, launched = _run_once_and_launched(
        one, tmp_path / "two", ("annotate", "index_buffer", "train_experience_model", "train_policy_sft"),
        ("evaluate_experience_model", "correction_rounds"))

    # evaluate_experience_model: each process predicts its share; the same predictions and fidelity as one process
    for name in ("evaluate_experience_model_predictions.jsonl", "evaluate_experience_model_on_policy.jsonl"):
        assert (one / "reports" / name).read_text() == (two / "reports" / name).read_text() != "", name
    fidelity = [json.loads((p / "metrics" / "evaluate_experience_model.json").read_text()) for p in (one, two)]
    for scored in fidelity:  # backend calls and generations are per process; the predictions are what counts
        scored.pop("prediction"), scored["on_policy"].pop("prediction")
    assert fidelity[0] == fidelity[1] and fidelity[1]["on_policy"]["games"] == 1

    tables = [(p / "metrics" / "correction_rounds.csv").read_text().splitlines() for p in (one, two)]
    rows = [[dict(zip(table[0].split(","), line.split(","), strict=True)) for line in table[1:]] for table in tables]
    assert len(rows[1]) == 2 and int(rows[1][1]["real_transitions_total"]) > 0
    for mine, theirs in zip(*rows, strict=True):
        assert {k: v for k, v in mine.items() if k != "minutes"} == {k: v for k, v in theirs.items() if k != "minutes"}
    # the same on-policy episodes (a round lists its replays by their synthetic episodes' random ids)
    played = [sorted(json.dumps(t["steps"]) for t in map(json.loads, (p / "models" / "correction" /
                                                                       "on_policy.jsonl").open())) for p in (one, two)]
    assert played[0] == played[1] and played[1]
    assert launched.count("round 2/2 done") == 1 and launched.count("round 1/2: synthetic RL from") == 1
    assert (two / "models" / "correction" / "experience_model" / "config.json").is_file()


def _run_once_and_launched(one, two, inputs: tuple[str, ...], stages: str | tuple[str, ...]) -> tuple:
    """Run the `inputs` stages in the project `one`, copy it to `two`, then `stages` as one process in `one` and as
    two (torchrun) in `two`; the copy and the launches' output (stdout and stderr)."""
    for name in inputs:
        run("dreamgym", "stage", name, cwd=one)
    shutil.copytree(one, two, symlinks=True)
    output = ""
    for stage in (stages,) if isinstance(stages, str) else stages:
        run("dreamgym", "stage", stage, cwd=one)
        launched = subprocess.run([*TORCHRUN, str(BIN / "dreamgym"), "stage", stage], cwd=two, capture_output=True,
                                  text=True, timeout=900)
        assert launched.returncode == 0, launched.stderr[-4000:]
        output += launched.stdout + launched.stderr
    return two, output


class _ScriptedExperienceServer:
    """An OpenAI-compatible endpoint standing in for the experience model (as tests/scripted_backend.py does in
    process): a well-formed reply whose reward is 1, ending the episode, when the action's characters sum to an odd
    number, else 0."""

    def __init__(self) -> None:
        import re
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from components.simulator.experience_model import format_target

        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server interface
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                action = re.findall(r"^Action: (.*)$", body["messages"][-1]["content"], re.M)[-1]
                won = sum(map(ord, action)) % 2 == 1
                server.calls += 1
                reply = format_target(f"after {action}", float(won), won, f"did {action}")
                answer = json.dumps({"choices": [{"message": {"content": reply}, "finish_reason": "stop"}]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(answer.encode())

            def log_message(self, *args: object) -> None:
                pass

        self.calls = 0
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
