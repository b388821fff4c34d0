"""Stages under a multi-process launcher (torchrun; `accelerate launch --multi_gpu` starts the same gloo group on a
CPU): one process writes, and N processes train what one does."""
from __future__ import annotations

import json
import shutil
import subprocess
import textwrap

import pytest

from tests.conftest import BIN, REPO, copy_project, run, set_params, tiny_experience_model

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
        model, tokenizer = build_tiny_causal_lm(["a tiny model"])
        settings = settings_from_params("training", lora=None)
        if rank == 1:
            write_stage_outputs("probe", {{"written_by": rank}}, "rank 1", root)
            distributed.wait_for_everyone()
            _save_model(model, tokenizer, root / "out", settings)  # returns once rank 0 has saved
        else:
            distributed.wait_for_everyone()  # rank 1 has been through write_stage_outputs
            seen = {{"metrics": (root / "metrics" / "probe.json").exists(), "model": (root / "out").exists()}}
            write_stage_outputs("probe", {{"written_by": rank}}, "rank 0", root)
            _save_model(model, tokenizer, root / "out", settings)
            (root / "seen_by_rank_0.json").write_text(json.dumps(seen))
    """))
    done = subprocess.run([*TORCHRUN, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads((tmp_path / "seen_by_rank_0.json").read_text()) == {"metrics": False, "model": False}
    assert json.loads((tmp_path / "metrics" / "probe.json").read_text()) == {"written_by": 0}
    assert (tmp_path / "reports" / "probe.md").read_text() == "rank 0"
    assert (tmp_path / "out" / "model" / "config.json").is_file() and not (tmp_path / "out" / ".model.partial").exists()


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
    for stage in ("annotate", "index_buffer"):
        run("dreamgym", "stage", stage, cwd=one)
    two = tmp_path / "two"
    shutil.copytree(one, two, symlinks=True)

    run("dreamgym", "stage", "train_experience_model", cwd=one)
    launched = subprocess.run([*TORCHRUN, str(BIN / "dreamgym"), "stage", "train_experience_model"], cwd=two,
                              capture_output=True, text=True, timeout=900)
    assert launched.returncode == 0, launched.stderr[-4000:]

    from safetensors.torch import load_file

    weights = [load_file(p / "models" / "experience" / "model" / "model.safetensors") for p in (one, two)]
    base = load_file(tiny_model_dir / "model.safetensors")
    assert max((weights[0][k] - base[k]).abs().max().item() for k in base) > 1e-4  # it trained
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in base) < 1e-6
    metrics = [json.loads((p / "metrics" / "train_experience_model.json").read_text()) for p in (one, two)]
    for key in ("global_step", "examples", "train_loss", "final_loss"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-6), key
    assert not (two / "models" / "experience" / ".model.partial").exists()
    assert (launched.stdout + launched.stderr).count("step 4/4 loss") == 1  # one progress log, the main process's
