"""`dreamgym simulator export`: a trained simulator as a self-contained bundle, and the Gymnasium environment over
it, on a real (tiny) experience model trained by the pipeline's own stages."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from components.data.contract import is_heldout_task
from components.files import directory_sha256, sha256_file
from components.simulator.bundle import BundleError, load_bundle
from tests.conftest import SMALL_RUN, copy_project, run, set_params, tiny_experience_model, tiny_policy

ENV = "demo-kitchen"  # a seed-only domain: the bundle is all there is of it


@pytest.fixture(scope="module")
def trained(project_template, tmp_path_factory, tiny_model_dir):
    """A project with the demo seed onboarded and a tiny experience model trained on it, and the first export."""
    root = copy_project(project_template, tmp_path_factory.mktemp("simulator"))
    run("dreamgym", "data", "onboard", "examples/seed/demo-kitchen.jsonl", cwd=root)
    refused = run("dreamgym", "simulator", "export", "bundle", cwd=root, check=False)
    assert refused.returncode == 1 and "no trained experience model; run `dvc repro train_experience_model`" in \
        refused.stderr and not (root / "bundle").exists()
    set_params(root, {**tiny_experience_model(tiny_model_dir, ENV), **tiny_policy(tiny_model_dir),
                      "policy.environments": [ENV],
                      "data.heldout_task_fraction": 0.3})
    for stage in ("annotate", "index_buffer", "train_experience_model", "evaluate_experience_model"):
        run("dreamgym", "stage", stage, cwd=root)
    exported = run("dreamgym", "simulator", "export", "bundle", cwd=root)
    return root, exported


def test_export_is_self_contained_verified_and_the_same_bytes_again(trained):
    root, exported = trained
    bundle = load_bundle(root / "bundle")
    assert "simulates demo-kitchen" in exported.stdout and "dreamgym/Simulator-v0" in exported.stdout
    manifest = bundle.manifest
    assert bundle.environments == [ENV] and manifest["simulator"]["max_turns"] == 2
    assert (root / "bundle" / "model" / "config.json").is_file()
    assert (root / "bundle" / "buffer" / "buffer.json").is_file()
    # what it was made from, and how good it is
    assert manifest["identity"]["data_sha256"] == sha256_file(root / "data" / "trajectories.jsonl")
    assert manifest["fidelity"]["seed_heldout"]["n"] > 0 and "fallback_rate" in manifest["fidelity"]
    # training tasks only, each with its first state: held-out games never leave the project
    tasks = bundle.tasks()
    assert tasks and manifest["tasks"] == len(tasks)
    assert not any(is_heldout_task(t.task_id, 0.3) for t in tasks) and all(t.parameters["initial_state"] for t in tasks)

    before = directory_sha256(root / "data")
    refused = run("dreamgym", "simulator", "export", "data", cwd=root, check=False)  # a typo must not delete data/
    assert refused.returncode == 1 and "data exists and is not a bundle" in refused.stderr
    assert directory_sha256(root / "data") == before

    run("dreamgym", "simulator", "export", "again", cwd=root)  # unchanged inputs: the same bundle, byte for byte
    assert directory_sha256(root / "again") == directory_sha256(root / "bundle")

    tasks_file = root / "again" / "tasks.jsonl"
    tasks_file.write_text(tasks_file.read_text().replace("kitchen", "garden"))
    with pytest.raises(BundleError, match="1 file\\(s\\) differ from the manifest \\(tasks.jsonl\\)"):
        load_bundle(root / "again")
    (root / "bundle" / "model" / "extra.json").write_text("{}")  # an added file changes the model too
    with pytest.raises(BundleError, match="differ from the manifest \\(model/extra.json\\)"):
        load_bundle(root / "bundle")
    (root / "bundle" / "model" / "extra.json").unlink()


def test_the_gymnasium_environment_passes_the_checker_and_plays_an_episode(trained, tmp_path):
    root, _ = trained
    make = "components.simulator.gym_env:dreamgym/Simulator-v0"
    # the project's quick params keep the state on a fallback (the tiny model falls back on every step)
    env = gymnasium.make(make, bundle=str(root / "bundle"), cache_dir=str(tmp_path))
    check_env(env.unwrapped)  # spaces, seeded resets, step determinism, returned data not reused

    observation, info = env.reset(seed=3)
    pool = {t.task_id: t for t in load_bundle(root / "bundle").tasks()}
    assert info["task_id"] in pool and observation == pool[info["task_id"]].parameters["initial_state"]
    assert env.reset(seed=3)[1]["task_id"] == info["task_id"]  # the seed draws the task
    chosen = sorted(pool)[-1]
    assert env.reset(options={"task_id": chosen})[1]["task_id"] == chosen

    turns, terminated, truncated = 0, False, False
    while not (terminated or truncated):
        observation, reward, terminated, truncated, info = env.step("open fridge")
        turns += 1
        assert isinstance(observation, str) and isinstance(reward, float)
        assert isinstance(info["fallback"], bool) and isinstance(info["retrieved"], list)
    assert turns <= 2 and (terminated or turns == 2)  # the bundle's turn limit truncates
    assert json.loads((root / "bundle" / "manifest.json").read_text())["simulator"]["max_turns"] == 2
    env.close()

    # as the cpu and gpu profiles have it, a step the model could not predict ends the episode, truncated: no
    # outcome rests on the fallback
    env = gymnasium.make(make, bundle=str(root / "bundle"), cache_dir=str(tmp_path), end_on_fallback=True)
    env.reset(seed=3)
    _, reward, terminated, truncated, info = env.step("open fridge")
    assert info["fallback"] and (reward, terminated, truncated) == (0.0, False, True)
    assert "experience model fell back" in info["env_failure"]
    env.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _ask(connection, message: dict) -> dict:
    connection.send(json.dumps(message))
    return json.loads(connection.recv(timeout=120))


@dataclass
class Served:
    port: int
    health: dict
    output: str = ""  # what the server printed, once it stopped

    def get(self, path: str) -> dict:
        return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30).read())


@contextmanager
def _served(bundle: Path, cwd: Path, *options: str) -> Iterator[Served]:
    """`dreamgym simulator serve` on a free port, until it is healthy; stopped with SIGTERM, which must exit 0."""
    port = _free_port()
    server = subprocess.Popen(["dreamgym", "simulator", "serve", str(bundle), "--port", str(port), *options],
                              cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    served = Served(port, {})
    try:
        for _ in range(600):
            try:
                served.health = served.get("/health")
                break
            except OSError:
                assert server.poll() is None, server.stdout.read()
                time.sleep(0.2)
        yield served
    finally:
        server.send_signal(signal.SIGTERM)  # a clean shutdown
        served.output = server.communicate(timeout=120)[0]
    assert server.returncode == 0, served.output


def test_the_served_simulator_speaks_openenvs_protocol_batches_sessions_and_refuses_past_capacity(trained, tmp_path):
    from websockets.sync.client import connect

    root, _ = trained
    # outside any project: the bundle is enough
    with _served(root / "bundle", tmp_path, "--max-sessions", "3") as served:
        port, health, base = served.port, served.health, f"http://127.0.0.1:{served.port}"
        assert health["status"] == "healthy" and health["max_sessions"] == 3 and health["shadow"] is None
        schema = json.loads(urllib.request.urlopen(f"{base}/schema").read())
        assert schema["action"]["required"] == ["message"]

        def episode(seed: int) -> list[dict]:
            with connect(f"ws://127.0.0.1:{port}/ws") as connection:
                replies = [_ask(connection, {"type": "reset", "data": {"seed": seed}})]
                while not replies[-1]["data"]["done"]:
                    replies.append(_ask(connection, {"type": "step", "data": {"message": "open fridge"}}))
                state = _ask(connection, {"type": "state"})
                after = _ask(connection, {"type": "step", "data": {"message": "open fridge"}})
                connection.send(json.dumps({"type": "close"}))
            return [*replies, state, after]

        with ThreadPoolExecutor(3) as pool:  # three sessions at once: their steps share batches
            played = list(pool.map(episode, [0, 1, 2]))
        pool_tasks = {t.task_id for t in load_bundle(root / "bundle").tasks()}
        for replies in played:
            first, *steps, state, after = replies
            assert first["type"] == "observation" and first["data"]["reward"] is None
            assert first["data"]["observation"]["task_id"] in pool_tasks and first["data"]["observation"]["text"]
            assert 1 <= len(steps) <= 2 and all(isinstance(s["data"]["reward"], float) for s in steps)
            last = steps[-1]["data"]["observation"]
            # the turn limit (2) truncates, as does a fallback, which says why; the model's own end does not
            assert steps[-1]["data"]["done"] and (len(steps) == 2 or bool(last["env_failure"]) == last["truncated"])
            assert last["env_failure"] is None or last["fallback"]
            assert state["data"]["step_count"] == len(steps)
            assert after["type"] == "error" and "send a reset" in after["data"]["message"]
        stats = json.loads(urllib.request.urlopen(f"{base}/health").read())
        assert stats["steps"] == sum(len(r) - 3 for r in played) and stats["batches"] <= stats["steps"]
        assert stats["active_sessions"] == 0  # closed sessions are gone

        held = [connect(f"ws://127.0.0.1:{port}/ws") for _ in range(3)]
        for connection in held:  # the sessions exist once the server has answered them
            assert _ask(connection, {"type": "reset", "data": {"seed": 0}})["type"] == "observation"
        with connect(f"ws://127.0.0.1:{port}/ws") as extra:
            refused = json.loads(extra.recv(timeout=30))
        assert refused["data"]["code"] == "CAPACITY_REACHED" and refused["data"]["max_sessions"] == 3
        with held[0] as connection:
            assert _ask(connection, {"type": "dance"})["data"]["code"] == "UNKNOWN_TYPE"
            connection.send("not json")
            assert json.loads(connection.recv(timeout=30))["data"]["code"] == "INVALID_JSON"
        for connection in held[1:]:
            connection.close()


@pytest.fixture(scope="module")
def openenv_client_python(tmp_path_factory) -> Path:
    """A separate environment with OpenEnv's client (openenv-core pulls gradio and MCP, which the project does not
    install), over this project's packages for the rest: a third party's training environment."""
    import site

    side = tmp_path_factory.mktemp("openenv-client")
    subprocess.run([sys.executable, "-m", "venv", str(side)], check=True)  # on the base interpreter, as any venv
    (side / "lib" / "python3.11" / "site-packages" / "project.pth").write_text(site.getsitepackages()[0] + "\n")
    installed = subprocess.run([str(side / "bin" / "pip"), "install", "--quiet", "openenv-core==0.3.0"],
                               capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return side / "bin" / "python"


def _tool_calling_policy(save_dir: Path, prompt: str) -> None:
    """A tiny policy with a chat template TRL parses tool calls from (Qwen2.5's), taught to answer `prompt` with one
    call of the `act` tool: a random tiny model would never call it, and the environment would see no step."""
    import torch
    import trl

    from components.llm.models import build_tiny_causal_lm

    call = '<tool_call>\n{"name": "act", "arguments": {"action": "open fridge"}}\n</tool_call>'
    model, tokenizer = build_tiny_causal_lm([call] * 20 + [prompt])
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()

    def act(action: str) -> str:
        """Do one thing in the environment and see what happens.

        Args:
            action: What to do, in a few words, for example "open fridge".
        """

    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tools=[act], tokenize=False,
                                         add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + tokenizer(call + "<|im_end|>", add_special_tokens=False)["input_ids"]])
    labels = ids.clone()
    labels[0, :len(prompt_ids)] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        loss = model(input_ids=ids, labels=labels).loss
        if loss.item() < 0.01:
            break
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)


@pytest.mark.slow  # installs OpenEnv's client from the package registry (about 30 s), then TRL trains a step
def test_trls_grpo_trainer_trains_against_the_served_simulator_through_openenvs_client(trained, tmp_path,
                                                                                      openenv_client_python):
    """examples/train_with_trl.py, a training script with no code of ours, runs one GRPO step of TRL's own
    environment integration (`environment_factory`) against the served bundle."""
    root, _ = trained
    script = Path(__file__).resolve().parents[1] / "examples" / "train_with_trl.py"
    prompt = script.read_text().split('PROMPT = "')[1].split('"')[0]
    _tool_calling_policy(tmp_path / "policy", prompt)
    with _served(root / "bundle", tmp_path, "--max-sessions", "4") as served:
        port = served.port
        trained_run = subprocess.run(
            [str(openenv_client_python), str(script), "--model", str(tmp_path / "policy"), "--output-dir",
             str(tmp_path / "out"), "--episodes", "2", "--max-steps", "1", "--num-generations", "2",
             "--max-completion-length", "256", "--max-tool-calls", "2"],
            cwd=tmp_path, capture_output=True, text=True, timeout=900,
            env={**os.environ, "SIMULATOR_URL": f"http://127.0.0.1:{port}", "TRL_EXPERIMENTAL_SILENCE": "1"})
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())
    assert trained_run.returncode == 0, trained_run.stderr[-4000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()  # the trained policy, saved
    logged = trained_run.stdout + trained_run.stderr
    assert "'train_runtime'" in logged and "tools/call_frequency" in logged, logged[-3000:]
    # the rollouts played in the simulator: its steps came from the policy's tool calls
    assert health["steps"] > 0 and health["batches"] >= 1


@pytest.fixture(scope="module")
def textworld_bundle(project_template, tmp_path_factory, tiny_model_dir) -> Path:
    """A bundle of a tiny experience model trained on two collected TextWorld games: an environment with an
    adapter, which shadow mode replays in."""
    root = copy_project(project_template, tmp_path_factory.mktemp("textworld-simulator"))
    set_params(root, {**SMALL_RUN, **tiny_experience_model(tiny_model_dir, "textworld-cooking"),
                      **tiny_policy(tiny_model_dir), "data.heldout_task_fraction": 0.0})
    run("dreamgym", "stage", "collect_seed", cwd=root)
    run("dreamgym", "data", "onboard", *sorted(str(p) for p in (root / "seed").glob("*.jsonl")), cwd=root)
    for stage in ("annotate", "index_buffer", "train_experience_model"):
        run("dreamgym", "stage", stage, cwd=root)
    run("dreamgym", "simulator", "export", "bundle", cwd=root)
    return root / "bundle"


def test_shadow_mode_replays_its_share_of_episodes_in_the_real_game_and_reports_agreement(trained, textworld_bundle,
                                                                                         tmp_path):
    from websockets.sync.client import connect

    root, _ = trained
    refused = run("dreamgym", "simulator", "serve", str(root / "bundle"), "--shadow", "0.5", cwd=tmp_path, check=False)
    assert refused.returncode == 2 and "demo-kitchen has no real-environment adapter" in refused.stderr
    refused = run("dreamgym", "simulator", "serve", str(textworld_bundle), "--shadow", "2", cwd=tmp_path, check=False)
    assert refused.returncode == 2 and "a share between 0 and 1" in refused.stderr

    played = []  # steps of each episode, in the order the server saw them
    with _served(textworld_bundle, tmp_path, "--shadow", "0.5") as served:
        assert served.health["shadow"] == {"share": 0.5, "replayed": 0, "failed": 0, "pending": 0}
        stateless = urllib.request.Request(f"http://127.0.0.1:{served.port}/reset", data=b'{"seed": 9}',
                                           headers={"Content-Type": "application/json"})
        assert json.loads(urllib.request.urlopen(stateless, timeout=60).read())["done"] is False  # plays no step
        for seed in range(4):
            with connect(f"ws://127.0.0.1:{served.port}/ws") as connection:
                reply = _ask(connection, {"type": "reset", "data": {"seed": seed}})
                steps = 0
                while not reply["data"]["done"]:  # commands the game refuses: it answers them, nothing changes
                    reply = _ask(connection, {"type": "step", "data": {"message": "dance wildly"}})
                    steps += 1
                played.append(steps)
                connection.send(json.dumps({"type": "close"}))
        for _ in range(600):  # the replays run beside serving
            shadow = served.get("/health")["shadow"]
            if shadow["replayed"] + shadow["failed"] == 2:
                break
            time.sleep(0.5)
        summary = served.get("/shadow")
    # half the played episodes, evenly spread: the first and the third (the stateless reset played none)
    assert summary["episodes_served"] == 4 and summary["failed_replays"] == 0 and summary["pending"] == 0
    outcomes, steps = summary["outcomes"], summary["steps"]
    assert outcomes["episodes"] + outcomes["env_failures"] == 2
    assert steps["n"] == played[0] + played[2]  # every served step against its replay
    assert steps["refused_n"] == steps["n"]  # the real game refused each command, and says so
    assert 0 <= steps["reward_accuracy"] <= 1 and steps["false_wins"] <= steps["unrewarded_n"]
    assert "shadow: 1 episodes replayed" in served.output or "shadow: 2 episodes replayed" in served.output
