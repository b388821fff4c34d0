from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's console scripts: dreamgym, dvc, prefect

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
# Test models are tiny: intra-op threads gain nothing and, on a busy 2-core machine, their spin-waiting makes every
# forward pass several times slower. Set before torch is imported, here and in the stages tests run as subprocesses.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@functools.cache
def repo_params():
    """The repository's own params.yaml, loaded into the schema once per test process."""
    from components.config import load_params

    return load_params(REPO / "params.yaml")


def settings_from_params(kind: str, **overrides: Any) -> Any:
    """A runtime settings object built from the repository's params.yaml by the builders the stages use
    (components/builders.py), with `overrides` put in by `dataclasses.replace`. The settings classes have no defaults:
    a test states the values its assertions depend on and takes the rest from params.

    kind: "prompt" (PromptFormat), "policy_prompt" (PolicyFormat), "rl" (RLSettings), "ppo" (its PPOSettings),
    "lora" (its LoraSettings), "curriculum" (CurriculumSettings), "training" (the experience model's
    TrainingSettings), "inference" (the experience model's InferenceSettings), "buffer_index" (the embedded replay
    buffer's IndexSettings).
    """
    from components import builders

    params = repo_params()
    build = {
        "prompt": lambda: builders.prompt_format(params),
        "policy_prompt": lambda: builders.policy_format(params),
        "rl": lambda: builders.rl_settings(params),
        "ppo": lambda: builders.rl_settings(params).ppo,
        "lora": lambda: builders.rl_settings(params).lora,
        "curriculum": lambda: builders.curriculum_settings(params),
        "training": lambda: builders.training_settings(params.experience_model.training, params.seed),
        "inference": lambda: builders.inference_settings(params),
        "buffer_index": lambda: builders.buffer_index(params),
    }
    if kind not in build:
        raise ValueError(f"unknown settings kind {kind!r}: one of {', '.join(build)}")
    return dataclasses.replace(build[kind](), **overrides)


def run(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command with the venv's scripts on PATH, as a user in the project would."""
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
    # errors="replace": a game engine may print a byte that is not UTF-8
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, errors="replace")
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="session")
def project_template(tmp_path_factory) -> Path:
    """A git + DVC checkout of the pipeline's files, made once; tests get copies (`project`)."""
    root = tmp_path_factory.mktemp("template") / "project"
    root.mkdir()
    for name in ("params.yaml", "dvc.yaml", "components", "stages", "flows", "examples"):
        source = REPO / name
        copy = shutil.copytree if source.is_dir() else shutil.copy
        copy(source, root / name)
    run("git", "init", "-q", cwd=root)
    run("dvc", "init", "-q", cwd=root)
    run("dvc", "config", "core.analytics", "false", cwd=root)
    return root


def copy_project(template: Path, tmp_path: Path) -> Path:
    """A private copy of a template project (git and DVC state included: they hold relative paths only)."""
    return Path(shutil.copytree(template, tmp_path / "project", symlinks=True))


@pytest.fixture
def project(project_template: Path, tmp_path: Path) -> Path:
    """A throwaway git + DVC checkout of the pipeline's files, so tests never touch the real repository."""
    return copy_project(project_template, tmp_path)


def set_params(project: Path, overrides: dict) -> None:
    """Edit the project's params.yaml in place (dotted keys), as a user would before `dvc repro`."""
    import yaml

    from components.config import set_dotted

    path = project / "params.yaml"
    tree = yaml.safe_load(path.read_text())
    for key, value in overrides.items():
        set_dotted(tree, key, value)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved as a local checkpoint: any stage that takes a model path can train and generate with it."""
    from components.llm.models import build_tiny_causal_lm

    directory = tmp_path_factory.mktemp("tiny-model")
    texts = ["<reasoning>The fridge opens.</reasoning><next_state>\nYou open the fridge.\n</next_state>"
             "<reward>0</reward><done>false</done>", "You are in the kitchen. Step 1: you did 'open fridge'."] * 20
    build_tiny_causal_lm(texts, save_dir=directory)
    return directory


def tiny_experience_model(model_dir: Path, environment: str) -> dict:
    """Overrides that train and score the experience model on `model_dir` in seconds (one step, a few predictions)."""
    return {
        "models.experience": str(model_dir),
        "experience_model.environments": [environment],
        "experience_model.training.max_steps": 1,
        "experience_model.training.lora.top_layers": None,
        "experience_model.training.max_seq_len": 4096,
        "experience_model.inference.max_new_tokens": 16,
        "experience_model.fidelity_max_transitions": 3,
    }


def tiny_policy(model_dir: Path) -> dict:
    """Overrides that warm-start, RL-train and evaluate the policy on `model_dir` in seconds."""
    return {
        "models.policy": str(model_dir),
        "policy.sft.training.max_steps": 1,
        "policy.sft.training.lora.top_layers": None,
        "policy.accuracy_trajectories": 2,
        "policy.eval_tasks": 1,
        "policy.max_turns": 2,
        "policy.max_action_tokens": 4,
        "synthetic_rl.iterations": 2,
        "synthetic_rl.tasks_per_iteration": 1,  # small runs have one training task
        "synthetic_rl.curriculum.max_generated_share": 1.0,  # so the curriculum may still play a generated task
        "synthetic_rl.group_size": 2,
        "synthetic_rl.lora.top_layers": None,
        "synthetic_rl.max_tokens": 1024,
        "sim_to_real.real_transitions": 4,  # one iteration of 1 task x 2 episodes x 2 turns
    }


# A pipeline run small enough for a test: two TextWorld training games, sharing the repository's game cache.
SMALL_RUN = {
    "collect_seed.environments": ["textworld-cooking"],
    "collect_seed.train_tasks": 2,
    "collect_seed.episodes": {"expert": 1, "noisy_expert": 0, "skipping_expert": 0, "random": 1},
    "environments.textworld.cache_dir": str(REPO / ".cache" / "textworld"),
    "evaluate.environments": ["textworld-cooking"],
    "evaluate.heldout_tasks": 2,
}


@pytest.fixture(scope="session")
def prefect_server():
    """A real temporary Prefect server (SQLite) for the whole session; slow to start on a loaded 2-core box."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@dataclass(frozen=True)
class PrefectService:
    api_url: str
    ui_url: str
    worker_pool: str  # the pool start.sh's worker polls; deployments in any other pool are never run
    state_dir: Path


@pytest.fixture(scope="session")
def prefect_service(tmp_path_factory) -> Iterator[PrefectService]:
    """A real `prefect server start` with its services (scheduler, triggers, UI) and a process worker, started by
    infra/prefect/start.sh on a free loopback port with its own state directory; stopped at the end.

    The worker polls its own pool, not params.yaml's `dreamgym`: a deployment of the ML pipeline made by a test
    stays scheduled (nothing trains), while a test can still hand this worker a small flow of its own."""
    state_dir = tmp_path_factory.mktemp("prefect-service")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "DREAMGYM_PREFECT_PORT": str(port), "DREAMGYM_PREFECT_DIR": str(state_dir),
           "DREAMGYM_PREFECT_POOL": "dreamgym-tests", "DREAMGYM_PREFECT_TIMEOUT": "180",
           "PREFECT_WORKER_QUERY_SECONDS": "2"}  # the worker looks for runs every 2 s instead of 10
    started = subprocess.run([str(REPO / "infra/prefect/start.sh")], env=env, capture_output=True, text=True,
                             timeout=400)
    if started.returncode != 0:
        pytest.fail(f"infra/prefect/start.sh failed (exit {started.returncode}):\n{started.stderr[-4000:]}",
                    pytrace=False)
    try:
        yield PrefectService(api_url=f"http://127.0.0.1:{port}/api", ui_url=f"http://127.0.0.1:{port}",
                             worker_pool="dreamgym-tests", state_dir=state_dir)
    finally:
        subprocess.run([str(REPO / "infra/prefect/stop.sh")], env=env, capture_output=True, timeout=120)


@pytest.fixture
def prefect_api(prefect_service, monkeypatch) -> Iterator[PrefectService]:
    """Point this test at `prefect_service`: Prefect clients in the test process (its settings are fixed at import,
    hence temporary_settings) and the `dreamgym` commands it runs (PREFECT_API_URL)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.setenv("PREFECT_API_URL", prefect_service.api_url)
    with temporary_settings(updates={PREFECT_API_URL: prefect_service.api_url}):
        yield prefect_service


from tests.s3_server import s3_server  # noqa: E402,F401  (session fixture: a real Swift S3 store on 127.0.0.1)
