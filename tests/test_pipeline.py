"""The pipeline as it exists, through DVC and through a real (temporary) Prefect server."""
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from components.data.contract import read_trajectories
from components.rl.loop import TIME_SPLIT
from stages.common import STAGES
from tests.conftest import BIN, REPO, SMALL_RUN, copy_project, run, set_params, tiny_experience_model, tiny_policy


@pytest.fixture(scope="module")
def onboarded_template(project_template, tmp_path_factory):
    """The demo seed onboarded once (Great Expectations takes ~10 s); tests get copies."""
    root = copy_project(project_template, tmp_path_factory.mktemp("onboarded"))
    run("dreamgym", "data", "onboard", "examples/seed/demo-kitchen.jsonl", cwd=root)
    return root


@pytest.fixture
def onboarded(onboarded_template, tmp_path):
    return copy_project(onboarded_template, tmp_path)


def test_dvc_repro_runs_validate_then_is_up_to_date(onboarded):
    run("dvc", "repro", "validate", cwd=onboarded)
    metrics = json.loads((onboarded / "metrics" / "validate.json").read_text())
    assert metrics["trajectories"] == 24 and 0 < metrics["success_rate"] < 1
    assert "| demo-kitchen | expert | 24 |" in (onboarded / "reports" / "validate.md").read_text()
    again = run("dvc", "repro", "validate", cwd=onboarded)
    assert "didn't change, skipping" in again.stdout or "up to date" in again.stdout


def test_validate_stage_rejects_hand_edited_data(onboarded):
    path = onboarded / "data" / "trajectories.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[0])
    record["steps"][0]["reward"] = 9.0
    path.write_text("\n".join([json.dumps(record)] + lines[1:]) + "\n")
    result = run("dreamgym", "stage", "validate", cwd=onboarded, check=False)
    assert result.returncode == 1 and "break the contract" in result.stderr and "steps[0].reward" in result.stderr


def test_prefect_pipeline_flow(project, monkeypatch, prefect_server, tiny_model_dir):
    """The whole pipeline flow on a real Prefect server: it drives DVC, onboards the collected seed, publishes."""
    from prefect.client.orchestration import get_client

    from flows.pipeline import pipeline_flow

    set_params(project, {**SMALL_RUN, **tiny_experience_model(tiny_model_dir, "textworld-cooking"),
                         **tiny_policy(tiny_model_dir),
                         "data.heldout_task_fraction": 0.4})  # splits the two tasks: one trains, one is held out
    monkeypatch.chdir(project)
    state = pipeline_flow(return_state=True)
    assert state.is_completed()
    result = state.result()
    assert result["collect_seed"]["textworld-cooking"]["trajectories"] == 4
    assert result["onboard"] == {"added": 4, "unchanged": 0, "replaced": 0, "removed": 0}
    assert result["validate"]["trajectories"] == 4 and result["validate"]["success_rate"] == 0.5
    assert (project / "data.dvc").exists() and (project / "dvc.lock").exists()
    stored = project / "artifacts" / result["run_id"]  # storage.backend local in params.yaml
    assert (stored / "validate-report" / "validate.md").read_bytes() == (project / "reports/validate.md").read_bytes()
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs()
        names = {client.read_flow(r.flow_id).name for r in runs}
        artifacts = {a.key: a for a in client.read_artifacts()}
    assert {"pipeline", *STAGES} <= names and all(r.state.is_completed() for r in runs)
    assert result["evaluate_baselines"]["textworld-cooking"]["expert"]["success_rate"] == 1.0
    s2r = result["sim_to_real"]  # real TextWorld games, on the budget
    assert s2r["iterations"] == 1 and 0 < s2r["real_transitions_used"] <= s2r["real_transitions_budget"] == 4
    assert "sim-to-real" in result["evaluate_policies"]
    replay = result["evaluate_policies"]["synthetic_replay"]["textworld-cooking"]  # synthetic RL's episodes, replayed
    assert replay["episodes"] + replay["unreplayable"] == result["synthetic_rl"]["episodes"]
    assert replay["real_successes"] >= replay["both"] <= replay["synthetic_successes"]
    assert "textworld-cooking" in artifacts["validate-report"].data
    assert result["run_id"] in artifacts["validate-outputs"].data
    model = project / "models/policy/sft/model"  # every declared output, models included, is stored
    assert {p.name for p in (stored / "train_policy_sft-models-policy-sft-model").iterdir()} == {
        "_manifest.json", *(p.name for p in model.iterdir())}
    assert result["dvc_push"] is None  # the project has no DVC remote: nothing pushed, and the run stands

    second = run("dvc", "repro", cwd=project)  # the flow left nothing for DVC to redo
    assert all(f"'{stage}' didn't change" in second.stdout for stage in STAGES)


def test_seed_data_and_outputs_round_trip_through_s3(onboarded, s3_server):
    """The project's own DVC remote and artifact store on the real store, configured only through AWS_* env."""
    import boto3

    from components.config import load_params
    from stages.outputs import publish

    boto3.client("s3").create_bucket(Bucket="dreamgym")  # endpoint and keys from the AWS_* variables
    run("dvc", "remote", "add", "-d", "storage", "s3://dreamgym/dvc", cwd=onboarded)
    data = onboarded / "data"
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    run("dvc", "push", "data.dvc", cwd=onboarded)
    for path in (onboarded / ".dvc" / "cache", data):
        shutil.rmtree(path)
    run("dvc", "pull", "data.dvc", cwd=onboarded)
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before

    run("dreamgym", "stage", "validate", cwd=onboarded)
    params = load_params(onboarded / "params.yaml", {"storage.backend": "s3"})
    uris = publish(params, "run-1", "validate", root=onboarded)
    assert uris == ["s3://dreamgym/runs/run-1/validate-metrics", "s3://dreamgym/runs/run-1/validate-report"]
    from components.artifacts import open_artifact_store

    fetched = open_artifact_store(params.storage).get("run-1", "validate-report", onboarded / "fetched.md")
    assert fetched.read_bytes() == (onboarded / "reports" / "validate.md").read_bytes()


def test_index_buffer_stage_saves_a_buffer_of_training_tasks(onboarded):
    """index_buffer embeds real training-task transitions (MiniLM, packaged) and saves a loadable buffer."""
    from components.builders import buffer_index
    from components.config import load_params
    from components.data.contract import is_heldout_task, read_trajectories
    from components.simulator.replay_buffer import SentenceEncoder, load_replay_buffer

    run("dreamgym", "--set", "data.heldout_task_fraction=0.3", "stage", "index_buffer", cwd=onboarded)
    metrics = json.loads((onboarded / "metrics" / "index_buffer.json").read_text())
    trajectories = read_trajectories(onboarded / "data" / "trajectories.jsonl")
    train = [t for t in trajectories if not is_heldout_task(t.task.task_id, 0.3)]
    assert 0 < len(train) < len(trajectories)  # the split keeps some tasks out
    assert metrics["transitions"] == sum(len(t.steps) for t in train)

    params = load_params(onboarded / "params.yaml")
    encoder = SentenceEncoder(params.models.embedder, onboarded / params.models.cache_dir)
    buffer = load_replay_buffer(onboarded / params.buffer.out_dir, encoder, buffer_index(params))
    step = train[0].steps[1]
    hits = buffer.retrieve(step.state, step.action, environment="demo-kitchen", k=3)
    assert hits[0].state == step.state and hits[0].action == step.action and hits[0].source == "real"
    assert not buffer.retrieve(step.state, step.action, environment="miniwob", k=3)


def test_annotate_stage_traces_every_transition_deterministically(onboarded):
    from components.simulator.annotation import read_annotated

    run("dreamgym", "stage", "annotate", cwd=onboarded)
    path = onboarded / "annotated" / "transitions.jsonl"
    first = path.read_bytes()
    records = read_annotated(path)
    assert len(records) == 24 * 3  # every step of the 24 three-step demo trajectories
    assert all(r.reasoning and r.annotator == "deterministic-v1" for r in records)
    run("dreamgym", "stage", "annotate", cwd=onboarded)
    assert path.read_bytes() == first  # versioned data: same seed, same bytes


def test_annotate_stage_fails_when_the_teacher_never_answers(onboarded):
    # nothing listens on port 9 (discard): every batch fails, and the stage must say so rather than cache
    # deterministic traces as the teacher's
    teacher = {"kind": "openai", "model": "teacher", "base_url": "http://127.0.0.1:9/v1",
               "api_key_env": "OPENAI_API_KEY", "batch_size": 64, "max_new_tokens": 8}
    set_params(onboarded, {"annotate.teacher": teacher})
    result = run("dreamgym", "stage", "annotate", cwd=onboarded, check=False)
    assert result.returncode != 0 and "gave no usable trace for any of 72 transitions" in result.stderr
    assert not (onboarded / "annotated" / "transitions.jsonl").exists()


def test_experience_model_stages_train_and_score_fidelity(onboarded, tiny_model_dir):
    """annotate -> index_buffer -> train_experience_model -> evaluate_experience_model, on a tiny local model."""
    set_params(onboarded, {**tiny_experience_model(tiny_model_dir, "demo-kitchen"), "data.heldout_task_fraction": 0.3})
    for stage in ("annotate", "index_buffer", "train_experience_model", "evaluate_experience_model"):
        run("dreamgym", "stage", stage, cwd=onboarded)
    trained = json.loads((onboarded / "metrics" / "train_experience_model.json").read_text())
    assert trained["global_step"] == 1 and trained["examples"] > 0
    assert trained["precision"] in ("fp32", "bf16") and trained["hardware"].startswith(("cpu: ", "cuda: "))
    assert (onboarded / "models" / "experience" / "model" / "config.json").exists()
    fidelity = json.loads((onboarded / "metrics" / "evaluate_experience_model.json").read_text())
    assert fidelity["transitions"] == 3 and fidelity["prediction"]["requests"] == 3
    for predictor in ("experience model", "copy nearest neighbour", "state unchanged"):
        overall = fidelity[predictor]["overall"]
        assert overall["n"] == 3 and 0 <= overall["token_f1"] <= 1 and 0 <= overall["reward_accuracy"] <= 1
    assert "copy nearest neighbour" in (onboarded / "reports" / "evaluate_experience_model.md").read_text()
    lines = (onboarded / "reports" / "evaluate_experience_model_predictions.jsonl").read_text().splitlines()
    assert len(lines) == 3 and {"action", "next_state", "predicted"} <= json.loads(lines[0]).keys()

    # the tiny model never answers in the format (16 tokens): under a budget of 50% the stage stops and says why
    assert fidelity["prediction"]["fallbacks"] == 3
    set_params(onboarded, {"experience_model.max_fallback_rate": 0.5})
    failed = run("dreamgym", "stage", "evaluate_experience_model", cwd=onboarded, check=False)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert "fell back on 3 of 3 predictions (100%, above experience_model.max_fallback_rate of 50% at 95% " \
           "confidence)" in failed.stderr
    assert "train it longer" in failed.stderr and "max_new_tokens (16)" in failed.stderr


def _train_experience_model(project, model_dir, environment, **overrides):
    set_params(project, {**tiny_experience_model(model_dir, environment), **tiny_policy(model_dir),
                         "policy.environments": [environment], **overrides})
    for stage in ("annotate", "index_buffer", "train_experience_model"):
        run("dreamgym", "stage", stage, cwd=project)


def test_seed_only_domain_runs_the_whole_pipeline(onboarded, tiny_model_dir):
    """A domain with no environment adapter (demo-kitchen, onboarded from a JSONL file alone) through `dvc repro`:
    experience model, buffer, policy, synthetic RL with curriculum, evaluation inside the experience model; the
    real-environment stages skip with a reason."""
    set_params(onboarded, {**tiny_experience_model(tiny_model_dir, "demo-kitchen"), **tiny_policy(tiny_model_dir),
                           "collect_seed.environments": ["demo-kitchen"], "evaluate.environments": ["demo-kitchen"],
                           "policy.environments": ["demo-kitchen"], "data.heldout_task_fraction": 0.3,
                           # 0: the curriculum varies a task after every iteration, whatever the tiny policy earns
                           "synthetic_rl.curriculum.min_variance": 0})
    run("dvc", "repro", cwd=onboarded)
    assert json.loads((onboarded / "metrics" / "collect_seed.json").read_text())["skipped"] == ["demo-kitchen"]
    assert json.loads((onboarded / "metrics" / "evaluate_baselines.json").read_text())["skipped"] == ["demo-kitchen"]
    warm = json.loads((onboarded / "metrics" / "train_policy_sft.json").read_text())
    assert warm["global_step"] == 1 and warm["demonstrations"] > 0 and warm["heldout_next_action"]["steps"] > 0
    assert warm["precision"] in ("fp32", "bf16") and warm["hardware"].startswith(("cpu: ", "cuda: "))
    rl = json.loads((onboarded / "metrics" / "synthetic_rl.json").read_text())
    assert rl["iterations"] == 2 and rl["episodes"] == 4 and rl["synthetic_transitions"] > 0
    rows = (onboarded / "metrics" / "synthetic_rl_iterations.csv").read_text().splitlines()
    assert rows[0].startswith("iteration,reward_mean") and len(rows) == 3
    assert (onboarded / "reports" / "synthetic_rl.png").stat().st_size > 1000
    assert (onboarded / "models" / "policy" / "rl" / "replay_buffer" / "buffer.json").exists()
    # the tiny backbone writes no parsable variation: every proposal is rejected, counted, and training goes on
    curriculum = rl["curriculum"]
    assert curriculum["proposed"] == 2 and curriculum["accepted"] + curriculum["rejected"] == 2
    assert (onboarded / "models" / "policy" / "rl" / "generated_tasks.jsonl").is_file()
    s2r = json.loads((onboarded / "metrics" / "sim_to_real.json").read_text())
    assert s2r["iterations"] == 0 and "seed-only domain" in s2r["reason"]  # skipped with a reason, not an error
    evaluated = json.loads((onboarded / "metrics" / "evaluate_policies.json").read_text())
    assert evaluated["skipped"] == ["demo-kitchen"] and "sim-to-real" not in evaluated  # nothing to evaluate there
    for label in ("sft_warm_start", "synthetic_grpo"):  # closed loop inside the experience model, on held-out tasks
        simulated = evaluated[label]["demo-kitchen (simulated)"]
        assert simulated["episodes"] == 1 and 0 <= simulated["success_rate"] <= 1
    report = (onboarded / "reports" / "evaluate_policies.md").read_text()
    assert "next-action accuracy" in report and "demo-kitchen (in the experience model)" in report
    # what the RL policy saw, from the log saved with it; only of the policies evaluated
    assert (f"The synthetic RL policy ({rl['iterations']} iterations) saw {rl['synthetic_transitions']} synthetic "
            "transitions") in report and "Sim-to-real" not in report
    episodes = read_trajectories(onboarded / "reports" / "evaluate_policies_episodes.jsonl")  # kept for replay
    assert len(episodes) == 2 and all(e.steps and e.task.environment == "demo-kitchen" for e in episodes)
    with (onboarded / "reports" / "evaluate_policies_games.csv").open() as handle:  # one row per policy and game
        games = list(csv.DictReader(handle))
    assert sorted((g["policy"], g["task_id"]) for g in games) == sorted(
        (label, e.task.task_id) for label, e in zip(("sft_warm_start", "synthetic_grpo"), episodes, strict=True))
    assert {g["environment"] for g in games} == {"demo-kitchen (simulated)"} and {g["won"] for g in games} <= {"0", "1"}
    assert "Running stage" not in run("dvc", "repro", cwd=onboarded).stdout  # a second run has nothing to do

    learning_rate = yaml.safe_load((onboarded / "params.yaml").read_text())["synthetic_rl"]["learning_rate"]
    set_params(onboarded, {"synthetic_rl.learning_rate": 2e-5})  # one param: only the stages downstream of it rerun
    ran = re.findall(r"Running stage '(\w+)'", run("dvc", "repro", cwd=onboarded).stdout)
    # evaluate_policies follows only if the RL policy's bytes changed: with zero advantages (every tiny episode
    # earned the same) the update is zero whatever the learning rate, and DVC rightly skips it; the correction
    # rounds run synthetic RL with these settings (here none: correction.rounds 0), so they rerun too
    assert ran[:2] == ["synthetic_rl", "sim_to_real"] and set(ran) <= {"synthetic_rl", "sim_to_real",
                                                                        "evaluate_policies", "correction_rounds"}
    # set back, nothing runs: DVC's run cache restores what these params made (as a study row restores the warm start
    # another row trained); it keeps none for a stage with an uncached output that is not a metric or plot
    set_params(onboarded, {"synthetic_rl.learning_rate": learning_rate})
    back = run("dvc", "repro", cwd=onboarded).stdout
    assert "Running stage" not in back and "Stage 'synthetic_rl' is cached - skipping run" in back


def test_synthetic_rl_killed_mid_run_resumes_to_the_same_end(onboarded, tiny_model_dir):
    """SIGKILL during iteration 3 of 4; the rerun resumes from checkpoint 2 and ends like an uninterrupted run."""
    import os
    import signal
    import subprocess
    import time

    from tests.conftest import BIN

    _train_experience_model(onboarded, tiny_model_dir, "demo-kitchen",
                            **{"data.heldout_task_fraction": 0.3, "synthetic_rl.iterations": 4})
    run("dreamgym", "stage", "train_policy_sft", cwd=onboarded)
    seeded = json.loads((onboarded / "metrics" / "index_buffer.json").read_text())["transitions"]
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
    process = subprocess.Popen(["dreamgym", "stage", "synthetic_rl"], cwd=onboarded, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    done_marker = onboarded / "models" / "policy" / "rl" / "checkpoints" / "checkpoint-2" / "iterations.jsonl"
    deadline = time.monotonic() + 300
    while not done_marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert done_marker.exists() and process.poll() is None, "training ended or stalled before checkpoint 2"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (onboarded / "metrics" / "synthetic_rl.json").exists()

    run("dreamgym", "stage", "synthetic_rl", cwd=onboarded)
    rl = json.loads((onboarded / "metrics" / "synthetic_rl.json").read_text())
    rows = (onboarded / "metrics" / "synthetic_rl_iterations.csv").read_text().splitlines()[1:]
    assert rl["resumed"] and rl["iterations"] == 4
    # its time counts the killed invocation's iterations too (their logged time split), not only the resumed ones
    with (onboarded / "metrics" / "synthetic_rl_iterations.csv").open() as handle:
        split = sum(float(row[field] or 0) for row in csv.DictReader(handle) for field in TIME_SPLIT)
    assert rl["seconds"] >= round(split, 1) - 0.1
    assert [int(row.split(",")[0]) for row in rows] == [1, 2, 3, 4]  # none lost, none repeated
    # the tiny experience model never ends an episode, so every episode lasts max_turns (2): 4 iterations x 2 x 2
    assert rl["synthetic_transitions"] == 16 and rl["buffer_size"] == seeded + 16


def test_synthetic_rl_stops_before_paying_for_an_iteration_on_a_simulator_that_never_answers(onboarded,
                                                                                               tiny_model_dir):
    _train_experience_model(onboarded, tiny_model_dir, "demo-kitchen",
                            **{"data.heldout_task_fraction": 0.3, "synthetic_rl.iterations": 3,
                               "experience_model.max_fallback_rate": 0.5})
    run("dreamgym", "stage", "train_policy_sft", cwd=onboarded)
    failed = run("dreamgym", "stage", "synthetic_rl", cwd=onboarded, check=False)
    assert failed.returncode == 1 and "error: synthetic_rl: the experience model is over" in failed.stderr
    assert "fell back on 4 of 4 predictions (100%" in failed.stderr  # iteration 1: 2 episodes x 2 turns
    checkpoints = onboarded / "models" / "policy" / "rl" / "checkpoints"
    assert (checkpoints / "checkpoint-1").is_dir() and not (checkpoints / "checkpoint-2").exists()
    assert not (onboarded / "metrics" / "synthetic_rl.json").exists()

    # where a fallback ends its episode (the cpu profile), iteration 1's two episodes both end on their first turn:
    # 2 of 2 does not show a 50% budget exceeded, so the stop says every episode failed, as one error line
    set_params(onboarded, {"experience_model.inference.fallback_ends_episode": True})
    shutil.rmtree(checkpoints)
    failed = run("dreamgym", "stage", "synthetic_rl", cwd=onboarded, check=False)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert "error: RL iteration 1: an environment failure ended every episode (2)" in failed.stderr
    assert "the experience model fell back" in failed.stderr


def demo_kitchen_study(tiny_model_dir) -> dict:
    """Params of a results study on the demo seed, with tiny models: the warm start's row and two GRPO variants."""
    return {**tiny_experience_model(tiny_model_dir, "demo-kitchen"), **tiny_policy(tiny_model_dir),
            "collect_seed.environments": ["demo-kitchen"], "evaluate.environments": ["demo-kitchen"],
            "policy.environments": ["demo-kitchen"], "data.heldout_task_fraction": 0.3,
            "study.environments": ["demo-kitchen"], "study.algorithms": ["grpo"],
            "study.variants": ["sft-only", "dreamgym-grpo", "no-curriculum"]}


def commit_project(project, monkeypatch) -> str:
    """Commit everything in `project` as a user would (the study runs a commit); the commit."""
    for variable in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"):
        monkeypatch.setenv(variable, "study test")
    for variable in ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"):
        monkeypatch.setenv(variable, "study@example.invalid")
    run("git", "add", "-A", cwd=project)
    run("git", "commit", "-q", "-m", "the user's project", cwd=project)
    return run("git", "rev-parse", "HEAD", cwd=project).stdout.strip()


def test_results_study_flow_runs_each_variant_once(onboarded, monkeypatch, prefect_server, tiny_model_dir):
    """`dreamgym flow results_study` on a real Prefect server: each variant is a `dvc exp run` whose metrics are
    kept with a record (the warm start's row a `dvc repro` without sim-to-real and synthetic RL); the report pools
    them; a second call runs nothing; params.yaml is left as the user wrote it."""
    from prefect.client.orchestration import get_client

    from flows.study import results_study_flow

    set_params(onboarded, demo_kitchen_study(tiny_model_dir))
    commit_project(onboarded, monkeypatch)  # `dvc exp run` needs a commit
    params_before = (onboarded / "params.yaml").read_text()
    monkeypatch.chdir(onboarded)

    results_study_flow()

    results = onboarded / "reports" / "results_study"
    assert [p.name for p in results.iterdir() if p.is_dir()] == ["demo-kitchen"]  # a folder per environment
    # the tiny model's curriculum writes no task: the ablation would play DreamGym's schedule, so the study skips it
    assert sorted(p.name for p in (results / "demo-kitchen").iterdir()) == ["dreamgym-grpo-seed0", "sft-only-seed0"]
    warm_start = results / "demo-kitchen" / "sft-only-seed0"
    played = json.loads((warm_start / "evaluate_policies.json").read_text())
    assert "sft_warm_start" in played and not {"synthetic_grpo", "sim-to-real"} & set(played)
    assert not (warm_start / "sim_to_real.json").exists() and not (warm_start / "synthetic_rl.json").exists()
    assert "| demo-kitchen/no-curriculum-seed0 | not informative: " in (results / "README.md").read_text()
    # DreamGym's run scored its experience model too (held-out seed steps: a seed-only domain has no game to play)
    fidelity = json.loads((results / "demo-kitchen" / "dreamgym-grpo-seed0" / "evaluate_experience_model.json"
                           ).read_text())
    assert fidelity["experience model"]["overall"]["n"] > 0 and "on_policy" not in fidelity

    metrics = results_study_flow(rows=["demo-kitchen/no-curriculum-seed0"])  # named, it runs

    runs = sorted(p.name for p in (results / "demo-kitchen").iterdir())
    assert runs == ["dreamgym-grpo-seed0", "no-curriculum-seed0", "sft-only-seed0"]
    record = json.loads((results / "demo-kitchen" / "no-curriculum-seed0" / "run.json").read_text())
    assert record["params_set"]["synthetic_rl.curriculum.enabled"] is False and record["profile"] == "custom"
    assert record["seconds"] > 0 and len(record["commit"]) == 40
    assert record["params_set"]["policy.environments"] == record["params_set"]["experience_model.environments"] == [
        "demo-kitchen"]
    ablation = json.loads((results / "demo-kitchen" / "no-curriculum-seed0" / "evaluate_policies.json").read_text())
    assert "synthetic_grpo" in ablation and "sft_warm_start" not in ablation  # only its row is played
    games = (results / "demo-kitchen" / "no-curriculum-seed0" / "evaluate_policies_games.csv").read_text().splitlines()
    assert len(games) == 2 and games[1].startswith("synthetic_grpo,")  # its one held-out game, kept for pairing
    simulated = "demo-kitchen (simulated)"  # a seed-only domain: policies are scored inside the experience model
    # no DreamGym-S2R row: sim-to-real skips a domain with no real environment
    assert set(metrics) == {"SFT only", "DreamGym (GRPO)", "DreamGym (GRPO) w/o curriculum"}
    assert metrics["DreamGym (GRPO) w/o curriculum"][simulated]["episodes"] == 1
    readme = (results / "README.md").read_text()
    assert "The curriculum helps" in readme and "| demo-kitchen/no-curriculum-seed0 | custom |" in readme
    assert (results / "results_study_curves.png").stat().st_size > 1000
    assert (onboarded / "reports" / "results_study_curves.png").is_file()  # beside reports/results_study.md
    assert (onboarded / "params.yaml").read_text() == params_before
    with get_client(sync_client=True) as client:
        published = [a.data for a in client.read_artifacts() if a.key == "results-study"]
    assert published and "DreamGym (GRPO) w/o curriculum" in published[0]

    kept = (results / "demo-kitchen" / "dreamgym-grpo-seed0" / "run.json").stat().st_mtime_ns
    results_study_flow()  # every run is kept: nothing reruns
    assert (results / "demo-kitchen" / "dreamgym-grpo-seed0" / "run.json").stat().st_mtime_ns == kept


def test_a_row_that_fails_is_kept_with_the_stage_it_failed_in_why_and_what_it_cost(onboarded, monkeypatch,
                                                                                   prefect_server):
    """A command's failure names the DVC stage it was in and its `error:` line; a study row that fails is kept as a
    failed attempt (what it cost, why) for the plan to show, and params.yaml is put back."""
    import sys

    from prefect import flow

    from components.results.study import read_failures
    from flows.pipeline import CommandFailed, run_logged
    from flows.study import run_variant

    script = "print(\"Running stage 'synthetic_rl':\"); print('error: over budget'); print('Traceback'); exit(3)"

    @flow
    def failing_command() -> None:
        run_logged([sys.executable, "-c", script])

    with pytest.raises(CommandFailed, match=r"exited 3 in stage synthetic_rl: over budget \(its output") as failed:
        failing_command()
    assert (failed.value.stage, failed.value.reason) == ("synthetic_rl", "over budget")

    commit = commit_project(onboarded, monkeypatch)  # `dvc exp run` needs a commit
    monkeypatch.chdir(onboarded)
    params_before = (onboarded / "params.yaml").read_text()
    name = "demo-kitchen/dreamgym-grpo-seed0"

    @flow
    def failing_row() -> None:  # a real `dvc exp run` of a stage dvc.yaml does not have
        run_variant(name, {"seed": 0}, Path("results") / name, "no_such_stage")

    with pytest.raises(CommandFailed):
        failing_row()
    [attempt] = read_failures("results")[name]
    assert attempt["commit"] == commit and attempt["stage"] is None and "no_such_stage" in attempt["reason"]
    assert attempt["seconds"] > 0 and attempt["params_set"] == {"seed": 0}
    assert (onboarded / "params.yaml").read_text() == params_before and not (onboarded / "results" / name).exists()


def test_a_study_row_workspace_is_the_commit_with_the_studys_working_state_and_the_projects_cache(onboarded, tmp_path,
                                                                                                   monkeypatch):
    from components.config import load_params
    from components.results.workspace import claimed, make_workspace, project_cache_dir, working_state

    commit = commit_project(onboarded, monkeypatch)
    set_params(onboarded, {"study.seeds": [4]})  # not committed: the study runs what params.yaml says now
    (onboarded / "flows" / "pipeline.py").write_text("uncommitted code is not the study's\n")
    state = working_state(onboarded)

    workspace = make_workspace(onboarded, commit, tmp_path / "row", state)
    assert run("git", "rev-parse", "HEAD", cwd=workspace).stdout.strip() == commit
    assert (workspace / "params.yaml").read_text() == (onboarded / "params.yaml").read_text()
    assert (workspace / "flows" / "pipeline.py").read_text() == (REPO / "flows" / "pipeline.py").read_text()
    assert project_cache_dir(workspace) == project_cache_dir(onboarded)  # one cache: the run cache is shared
    assert (workspace / "data" / "trajectories.jsonl").read_bytes() == \
        (onboarded / "data" / "trajectories.jsonl").read_bytes()
    # a row stopped mid-run resumes in its workspace: what it wrote stays, what the stopped run changed goes
    (workspace / "models" / "policy").mkdir(parents=True, exist_ok=True)
    (workspace / "models" / "policy" / "checkpoint").write_text("a stopped row's checkpoint")
    (workspace / "flows" / "pipeline.py").write_text("changed by the stopped run\n")
    (onboarded / "flows" / "pipeline.py").write_text((REPO / "flows" / "pipeline.py").read_text())
    later = commit_project(onboarded, monkeypatch)  # the study goes on at a newer commit
    resumed = make_workspace(onboarded, later, tmp_path / "row", state)
    assert run("git", "rev-parse", "HEAD", cwd=resumed).stdout.strip() == later
    assert (resumed / "models" / "policy" / "checkpoint").read_text() == "a stopped row's checkpoint"
    assert (resumed / "flows" / "pipeline.py").read_text() == (REPO / "flows" / "pipeline.py").read_text()
    (tmp_path / "not-a-checkout").mkdir()
    (tmp_path / "not-a-checkout" / "stale").write_text("no workspace")
    assert not (make_workspace(onboarded, commit, tmp_path / "not-a-checkout", state) / "stale").exists()
    with claimed(tmp_path / "row"):  # one process at a time runs a row in its workspace
        with pytest.raises(RuntimeError, match="in use: another process runs this row"):
            with claimed(tmp_path / "row"):
                pass
    with claimed(tmp_path / "row"):
        pass
    set_params(onboarded, {"models.kept_trainings": "kept"})  # a training a row keeps outlives its workspace
    workspace = make_workspace(onboarded, commit, tmp_path / "row", working_state(onboarded))
    assert load_params(workspace / "params.yaml").models.kept_trainings == str(onboarded.resolve() / "kept")


def test_a_study_submitting_a_row_again_cancels_its_flow_runs_no_worker_took(project, monkeypatch, prefect_api):
    """A study stopped before a worker took its row leaves that flow run scheduled; the next study's submission of
    the row cancels it (else both would run the row), not the row's runs of another profile."""
    from uuid import UUID

    from prefect import flow
    from prefect.client.orchestration import get_client

    import flows.study as study_flows
    from components.config import load_params
    from flows.deployments import deploy_study_row

    set_params(project, {"prefect.work_pool": "study-rows-no-worker"})  # nobody takes them: they stay scheduled
    monkeypatch.chdir(project)
    deploy_study_row(project, load_params(project / "params.yaml"))
    row = ("demo-kitchen/sft-only-seed0", {"seed": 0}, "evaluate_policies", None, "0" * 40, {})

    @flow
    def submit(profile: str) -> str:  # as a study submits it: a task of its flow run
        return study_flows.submit_row(*row, profile, False)

    stopped_study, other_profile, this_study = submit("quick"), submit("cpu"), submit("quick")
    with get_client(sync_client=True) as client:
        states = {run: client.read_flow_run(UUID(run)).state for run in (stopped_study, other_profile, this_study)}
    assert states[stopped_study].is_cancelled()
    assert states[other_profile].is_scheduled() and states[this_study].is_scheduled()


class Killed(BaseException):
    """What a worker killed at a session's end sees: no Exception, so nothing records it as a failed attempt."""


def killed_then_run_again(monkeypatch, name: str, commit: str, state: dict, stopped, goes_on, between):
    """The row's flow run with `stopped(cwd)` as its DVC run (`run_row`, covered by the work-pool test), killed,
    `between()`, then its next flow run with `goes_on(cwd)` as its run, which ends writing the row's metrics; that
    flow run's final state."""
    import flows.study as study_flows

    def row_flow():
        return study_flows.study_row_flow(name, {"seed": 0}, "evaluate_policies", None, commit, state, "quick",
                                          return_state=True)

    def killed(row, overrides, target, measures_simulator, cwd):
        stopped(Path(cwd))
        raise Killed

    def finishing(row, overrides, target, measures_simulator, cwd):
        goes_on(Path(cwd))
        (Path(cwd) / "metrics").mkdir(exist_ok=True)
        (Path(cwd) / "metrics" / "evaluate_policies.json").write_text('{"synthetic_grpo": {}}')

    monkeypatch.setattr(study_flows, "run_row", killed)
    with pytest.raises(Killed):
        row_flow()
    between()
    monkeypatch.setattr(study_flows, "run_row", finishing)
    return row_flow()


def test_a_work_pool_row_stopped_mid_run_goes_on_in_its_workspace(onboarded, monkeypatch, prefect_server):
    """A row's flow run killed mid-run leaves its workspace and clock; the row's next flow run (another id) goes on
    there, from what the first wrote, and its record counts both invocations' time. Here the row's DVC run is a
    stand-in that writes what a run leaves."""
    import flows.study as study_flows
    from components.results.workspace import working_state

    commit = commit_project(onboarded, monkeypatch)
    monkeypatch.chdir(onboarded)
    name, state = "demo-kitchen/dreamgym-grpo-seed0", working_state(onboarded)
    workspace = onboarded / study_flows.ROW_WORKSPACES / "quick" / name

    def stopped(cwd):
        (cwd / "models" / "checkpoint-5").mkdir(parents=True)
        time.sleep(0.5)

    def goes_on(cwd):
        assert (cwd / "models" / "checkpoint-5").is_dir()  # the first invocation's checkpoint, resumed from

    def killed_workspace_kept():
        assert (workspace / "models" / "checkpoint-5").is_dir()

    files = killed_then_run_again(monkeypatch, name, commit, state, stopped, goes_on, killed_workspace_kept).result()
    record = json.loads(files["run.json"])
    assert files["evaluate_policies.json"] == '{"synthetic_grpo": {}}'
    assert record["commit"] == commit and record["seconds"] >= record["earlier_seconds"] >= 0.5
    assert not workspace.exists() and not (onboarded / study_flows.ROW_CLOCKS / "quick" / f"{name}.json").exists()


def test_a_work_pool_row_that_fails_after_a_kill_is_kept_with_both_invocations_time_its_stage_and_why(
        onboarded, monkeypatch, prefect_server):
    """A row's flow run killed, then its next one failing in a stage: the study keeps the failed attempt (from the
    flow run's state) with the time of both invocations, the stage and DVC's reason, as a row run here would be."""
    import flows.study as study_flows
    from components.results.study import read_failures
    from components.results.workspace import working_state
    from flows.pipeline import CommandFailed

    commit = commit_project(onboarded, monkeypatch)
    monkeypatch.chdir(onboarded)
    name = "demo-kitchen/dreamgym-grpo-seed0"
    run_dir = onboarded / "results" / name

    def fails(cwd):
        raise CommandFailed(["dvc", "exp", "run"], 1, "synthetic_rl", "over its failure budget")

    final = killed_then_run_again(monkeypatch, name, commit, working_state(onboarded), lambda cwd: time.sleep(0.5),
                                  fails, lambda: None)
    assert final.is_failed()
    with pytest.raises(RuntimeError, match="ended Failed"):
        study_flows.keep_row.fn(name, str(final.state_details.flow_run_id), run_dir)
    [attempt] = read_failures(onboarded / "results")[name]
    assert (attempt["stage"], attempt["reason"], attempt["commit"]) == ("synthetic_rl", "over its failure budget",
                                                                        commit)
    assert attempt["seconds"] >= attempt["earlier_seconds"] >= 0.5  # the killed invocation's time counts
    assert (onboarded / study_flows.ROW_WORKSPACES / "quick" / name).is_dir()  # kept: the next attempt goes on there
    assert not (onboarded / study_flows.ROW_CLOCKS / "quick" / f"{name}.json").exists()  # its time is in the record


def test_a_command_ended_by_sigterm_or_sigint_is_a_stop_not_a_failure(prefect_server):
    """A session's end kills the stage DVC runs (`pkill`): the command, or the stage in DVC's error line, ended by
    SIGTERM or SIGINT is `stopped`; any other exit, SIGKILL (the out-of-memory killer's) included, is a failure."""
    import sys

    from prefect import flow

    from flows.pipeline import CommandFailed, run_logged

    @flow
    def ended_by(script: str) -> CommandFailed:
        with pytest.raises(CommandFailed) as failed:
            run_logged([sys.executable, "-c", script])
        return failed.value

    assert ended_by("import os, signal; os.kill(os.getpid(), signal.SIGTERM)").stopped
    assert not ended_by("exit(3)").stopped
    assert not ended_by("import os, signal; os.kill(os.getpid(), signal.SIGKILL)").stopped
    dvc = "ERROR: failed to reproduce 'synthetic_rl': failed to run: dreamgym stage synthetic_rl, exited with {}"
    assert ended_by(f"print({dvc.format(143)!r}); exit(255)").stopped  # DVC's shell: 128 + SIGTERM
    assert ended_by(f"print({dvc.format(-2)!r}); exit(255)").stopped
    assert not ended_by(f"print({dvc.format(1)!r}); exit(255)").stopped


def test_a_stopped_command_takes_the_stage_it_started_with_it(tmp_path, monkeypatch):
    """A task stopped mid-command (its flow run's process got SIGTERM) kills the command and what it started: the
    stage DVC runs would otherwise run on, orphaned, beside the row's next run in the same workspace."""
    import sys

    import flows.pipeline as pipeline

    class Stopped(BaseException):
        """What the task sees when Prefect turns the signal into an exception."""

    class StoppedAtFirstLine:
        def info(self, line: str) -> None:
            raise Stopped

    stage_pid = tmp_path / "stage.pid"
    command = ("import subprocess, sys, time; "
               "stage = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
               f"open({str(stage_pid)!r}, 'w').write(str(stage.pid)); "
               "print(\"Running stage 'synthetic_rl':\", flush=True); time.sleep(120)")
    monkeypatch.setattr(pipeline, "get_run_logger", StoppedAtFirstLine)
    with pytest.raises(Stopped):
        pipeline.run_logged([sys.executable, "-c", command])
    stage = Path(f"/proc/{stage_pid.read_text()}/stat")
    deadline = time.monotonic() + 10
    while stage.exists() and stage.read_text().split()[2] != "Z" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not stage.exists() or stage.read_text().split()[2] == "Z"  # killed (a zombie until its new parent reaps it)


def test_a_work_pool_row_whose_flow_run_gets_sigterm_is_no_failed_attempt(onboarded, monkeypatch, prefect_server):
    """A session's end may stop a row's flow run process itself (`pkill -TERM -f prefect.engine`) while the study
    waits for it: Prefect ends it Crashed. The study keeps no failed attempt (the row's clock holds that time and its
    next run counts it), and the workspace stays. The flow run is a real process that gets a real SIGTERM."""
    import sys
    import textwrap

    from prefect.settings import PREFECT_API_URL

    import flows.study as study_flows
    from components.results.study import read_failures
    from components.results.workspace import working_state

    commit = commit_project(onboarded, monkeypatch)
    monkeypatch.chdir(onboarded)
    name = "demo-kitchen/dreamgym-grpo-seed0"
    row = (name, {"seed": 0}, "evaluate_policies", None, commit, working_state(onboarded), "quick")
    flow_run_process = textwrap.dedent(f"""
        import time
        from prefect.runtime import flow_run
        import flows.study as study_flows

        def running(*args, **kwargs):
            print(flow_run.id, flush=True)
            time.sleep(300)

        study_flows.run_row = running
        study_flows.study_row_flow(*{row!r})
        """)
    process = subprocess.Popen([sys.executable, "-c", flow_run_process], cwd=onboarded, stdout=subprocess.PIPE,
                               text=True, env=dict(os.environ, PREFECT_API_URL=PREFECT_API_URL.value(),
                                                   PYTHONPATH=str(REPO)))
    flow_run_id = process.stdout.readline().strip()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)
    with pytest.raises(RuntimeError, match="was stopped"):
        study_flows.keep_row.fn(name, flow_run_id, onboarded / "results" / name)
    assert name not in read_failures(onboarded / "results")
    assert (onboarded / study_flows.ROW_WORKSPACES / "quick" / name).is_dir()
    assert (onboarded / study_flows.ROW_CLOCKS / "quick" / f"{name}.json").is_file()


def test_a_work_pool_row_whose_stage_is_stopped_is_no_failed_attempt_and_its_next_run_counts_its_time(
        onboarded, monkeypatch, prefect_server):
    """A row's stage ended by SIGTERM ends its flow run Cancelled, not Failed: the study keeps no failed attempt, the
    workspace and the clock stay, and the row's next run counts the stopped run's time, from the parked clock where
    the local one is gone."""
    import flows.study as study_flows
    from components.results.study import read_failures
    from components.results.workspace import working_state
    from flows.pipeline import CommandFailed

    set_params(onboarded, {"study.parked_rows": "parked"})
    commit = commit_project(onboarded, monkeypatch)
    monkeypatch.chdir(onboarded)
    monkeypatch.setattr(study_flows, "TICK_SECONDS", 0.2)
    name, state = "demo-kitchen/dreamgym-grpo-seed0", working_state(onboarded)
    clock = onboarded / study_flows.ROW_CLOCKS / "quick" / f"{name}.json"

    def row_flow():
        return study_flows.study_row_flow(name, {"seed": 0}, "evaluate_policies", None, commit, state, "quick",
                                          return_state=True)

    def stopped(*args, **kwargs):
        time.sleep(1.0)  # ticks park the clock
        raise CommandFailed(["dvc", "exp", "run"], 255, "synthetic_rl", "failed to reproduce 'synthetic_rl': failed "
                            "to run: dreamgym stage synthetic_rl, exited with 143")

    def finishing(row, overrides, target, measures_simulator, cwd):
        (Path(cwd) / "metrics").mkdir(exist_ok=True)
        (Path(cwd) / "metrics" / "evaluate_policies.json").write_text('{"synthetic_grpo": {}}')

    monkeypatch.setattr(study_flows, "run_row", stopped)
    final = row_flow()
    assert final.is_cancelled()
    with pytest.raises(RuntimeError, match="was stopped"):
        study_flows.keep_row.fn(name, str(final.state_details.flow_run_id), onboarded / "results" / name)
    assert name not in read_failures(onboarded / "results")
    assert (onboarded / study_flows.ROW_WORKSPACES / "quick" / name).is_dir()
    assert json.loads(clock.read_text())["seconds"] >= 1.0
    clock.unlink()  # as a stop that ended the row's run before it saved its clock leaves it

    monkeypatch.setattr(study_flows, "run_row", finishing)
    record = json.loads(row_flow().result()["run.json"])
    assert record["seconds"] >= record["earlier_seconds"] >= 0.8  # the parked clock's last tick


def test_a_work_pool_row_that_fails_ends_failed_and_the_study_keeps_its_attempt(onboarded, monkeypatch, prefect_server):
    """A row whose stage fails raises `RowFailed`: Prefect ends its flow run Failed, the engine hands back that
    exception (not a TypeError over the state's data), and the study keeps the attempt's record, its stage and why,
    from the run's persisted result; the workspace stays."""
    import flows.study as study_flows
    from components.results.study import read_failures
    from components.results.workspace import working_state
    from flows.pipeline import CommandFailed

    commit = commit_project(onboarded, monkeypatch)
    monkeypatch.chdir(onboarded)
    name, state = "demo-kitchen/dreamgym-grpo-seed0", working_state(onboarded)

    def failing(*args, **kwargs):
        raise CommandFailed(["dvc", "exp", "run"], 255, "synthetic_rl", "RL iteration 4: an environment failure "
                            "ended every episode (8)")

    monkeypatch.setattr(study_flows, "run_row", failing)
    row = (name, {"seed": 0}, "evaluate_policies", None, commit, state, "quick")
    with pytest.raises(study_flows.RowFailed, match="environment failure ended every episode"):
        study_flows.study_row_flow(*row)
    final = study_flows.study_row_flow(*row, return_state=True)
    assert final.is_failed()
    with pytest.raises(RuntimeError, match="ended Failed"):
        study_flows.keep_row.fn(name, str(final.state_details.flow_run_id), onboarded / "results" / name)
    [attempt] = read_failures(onboarded / "results")[name]
    assert attempt["stage"] == "synthetic_rl" and "ended every episode" in attempt["reason"]
    assert attempt["seconds"] >= 0 and attempt["params_set"] == {"seed": 0}
    assert (onboarded / study_flows.ROW_WORKSPACES / "quick" / name).is_dir()


def test_parking_keeps_a_rows_newest_settled_checkpoint_and_its_journals_and_a_new_workspace_gets_them(tmp_path):
    """`park` mirrors resume state in a folder that outlives the machine: of the checkpoints only the newest settled
    one (a checkpoint still being written is not copied; a training's last one without its optimizer), pruned ones
    go, journals follow; `unpark` puts it back into a new workspace. `resume_state` leaves out a training the kept
    trainings hold."""
    from components.config import load_params
    from components.files import LAST_CHECKPOINT_MARK
    from components.results.workspace import park, unpark
    from stages.outputs import resume_state

    workspace, parked, kept = tmp_path / "workspace", tmp_path / "parked", tmp_path / "kept"
    rl = workspace / "models" / "policy" / "rl" / "checkpoints"
    long_ago = time.time() - 3600

    def checkpoint(number: int, settled: bool) -> None:
        (rl / f"checkpoint-{number}").mkdir(parents=True)
        (rl / f"checkpoint-{number}" / "adapter.safetensors").write_text(f"weights {number}")
        if settled:
            os.utime(rl / f"checkpoint-{number}" / "adapter.safetensors", (long_ago, long_ago))

    checkpoint(1, settled=True)
    checkpoint(2, settled=True)
    checkpoint(3, settled=False)  # mid-save
    (rl / "fingerprint.txt").write_text("rl run\n")
    journal = workspace / ".cache" / "evaluate_policies" / "synthetic_grpo.jsonl"
    journal.parent.mkdir(parents=True)
    journal.write_text('{"game": 1}\n')
    sft = workspace / "models" / "policy" / "sft" / "checkpoints"
    (sft / "checkpoint-9").mkdir(parents=True)
    (sft / "fingerprint.txt").write_text("0123456789abcdef0123\n")
    (kept / "0123456789abcdef").mkdir(parents=True)
    (kept / "0123456789abcdef" / "fingerprint.txt").write_text("0123456789abcdef0123\n")
    params = load_params(REPO / "params.yaml", {"models.kept_trainings": str(kept)})

    paths = resume_state(params, workspace)
    assert sorted(p.relative_to(workspace).as_posix() for p in paths) == [
        ".cache/evaluate_policies", "models/policy/rl/checkpoints"]  # the warm start is kept: not parked
    park(paths, workspace, parked)
    held = sorted(p.relative_to(parked).as_posix() for p in parked.rglob("*") if p.is_file())
    assert held == [".cache/evaluate_policies/synthetic_grpo.jsonl",
                    "models/policy/rl/checkpoints/checkpoint-2/adapter.safetensors",
                    "models/policy/rl/checkpoints/fingerprint.txt"]

    shutil.rmtree(rl / "checkpoint-1")  # the run prunes, checkpoint 3 settles, a game is played
    os.utime(rl / "checkpoint-3" / "adapter.safetensors", (long_ago, long_ago))
    journal.write_text('{"game": 1}\n{"game": 2}\n')
    park(resume_state(params, workspace), workspace, parked)
    held = sorted(p.relative_to(parked).as_posix() for p in parked.rglob("*") if p.is_file())
    assert held == [".cache/evaluate_policies/synthetic_grpo.jsonl",
                    "models/policy/rl/checkpoints/checkpoint-3/adapter.safetensors",
                    "models/policy/rl/checkpoints/fingerprint.txt"]

    # a trainer's last checkpoint (sim-to-real stopped at its budget) is parked without the optimizer's state
    s2r = workspace / "models" / "policy" / "s2r" / "checkpoints" / "checkpoint-4"
    s2r.mkdir(parents=True)
    control = {"TrainerControl": {"args": {"should_training_stop": True}}}
    (s2r / "trainer_state.json").write_text(json.dumps(
        {"global_step": 4, "max_steps": 10, "stateful_callbacks": control}))
    for name in ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (s2r / name).write_text(name)
        os.utime(s2r / name, (long_ago, long_ago))
    os.utime(s2r / "trainer_state.json", (long_ago, long_ago))
    park(resume_state(params, workspace), workspace, parked)
    assert sorted(p.name for p in (parked / s2r.relative_to(workspace)).iterdir()) == [
        "adapter_model.safetensors", "trainer_state.json"]

    # so is PPO's last checkpoint (our own loop marks it), and sim-to-real's folder keeps only its newest
    ppo = s2r.parent / "checkpoint-6"
    ppo.mkdir()
    for name in ("adapter_model.safetensors", "value_head.pt", "optimizer.pt", "rng.pt", LAST_CHECKPOINT_MARK):
        (ppo / name).write_text(name)
        os.utime(ppo / name, (long_ago, long_ago))
    park(resume_state(params, workspace), workspace, parked)
    assert sorted(p.name for p in (parked / s2r.parent.relative_to(workspace)).iterdir()) == ["checkpoint-6"]
    assert sorted(p.name for p in (parked / ppo.relative_to(workspace)).iterdir()) == [
        "adapter_model.safetensors", LAST_CHECKPOINT_MARK, "rng.pt", "value_head.pt"]

    fresh = tmp_path / "another machine"
    assert unpark(parked, fresh) == 7
    assert (fresh / "models/policy/rl/checkpoints/checkpoint-3/adapter.safetensors").read_text() == "weights 3"
    assert (fresh / ".cache/evaluate_policies/synthetic_grpo.jsonl").read_text() == '{"game": 1}\n{"game": 2}\n'


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_git_keeps_every_kind_of_resume_state_a_study_profile_parks(profile):
    """Parked rows are committed so that the next machine goes on from them: an ignore rule that caught a kind of
    resume state (the evaluations' journals under `.cache/`) would silently drop it from every commit."""
    from components.config import profile_values
    from stages import evaluate_baselines, evaluate_experience_model, evaluate_policies

    parked = Path(profile_values(REPO / "profiles" / f"{profile}.yaml")["study.parked_rows"])
    workspace = parked / "miniwob" / "a-row-seed0" / "workspace"
    journals = [f"{stage.JOURNALS}/a-journal.jsonl"
                for stage in (evaluate_policies, evaluate_experience_model, evaluate_baselines)]
    kinds = [*journals, "models/policy/rl/checkpoints/checkpoint-3/adapter_model.safetensors",
             "models/policy/rl/curriculum_writer/checkpoints/checkpoint-2/adapter_model.safetensors",
             "models/correction/rounds/round_1/round.json"]
    paths = [(workspace / kind).as_posix() for kind in kinds] + [(workspace.parent / "clock.json").as_posix()]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=REPO, capture_output=True, text=True)
    assert ignored.returncode == 1 and ignored.stdout == "", f"git ignores parked state: {ignored.stdout}"


def test_a_parked_work_pool_row_goes_on_in_a_new_workspace_when_its_machine_is_gone(onboarded, monkeypatch,
                                                                                    prefect_server):
    """With study.parked_rows a running row parks its resume state and clock every tick; killed, and its workspace
    and clock gone with the machine, its next flow run makes a new workspace, puts the parked checkpoint and journal
    back, goes on from them, counts the first machine's time, and removes the parked folder once finished."""
    import flows.study as study_flows
    from components.results.workspace import working_state

    set_params(onboarded, {"study.parked_rows": "parked"})
    commit = commit_project(onboarded, monkeypatch)
    monkeypatch.chdir(onboarded)
    monkeypatch.setattr(study_flows, "TICK_SECONDS", 0.2)
    name, state = "demo-kitchen/dreamgym-grpo-seed0", working_state(onboarded)
    checkpoint = Path("models") / "policy" / "rl" / "checkpoints" / "checkpoint-2"
    journal = Path(".cache") / "evaluate_policies" / "synthetic_grpo.jsonl"
    parked = onboarded / "parked" / name

    def stopped(cwd):
        (cwd / checkpoint).mkdir(parents=True)
        (cwd / checkpoint / "adapter.safetensors").write_text("weights 2")
        os.utime(cwd / checkpoint / "adapter.safetensors", (time.time() - 3600,) * 2)  # settled
        (cwd / journal).parent.mkdir(parents=True)
        (cwd / journal).write_text('{"game": 1}\n')
        time.sleep(1.5)  # ticks park it

    def goes_on(cwd):
        assert (cwd / checkpoint / "adapter.safetensors").read_text() == "weights 2"
        assert (cwd / journal).read_text() == '{"game": 1}\n'

    def machine_gone():
        assert (parked / "workspace" / checkpoint / "adapter.safetensors").is_file()
        assert json.loads((parked / "clock.json").read_text())["seconds"] >= 1.0
        shutil.rmtree(onboarded / study_flows.ROW_WORKSPACES)  # and with it what git ignores
        shutil.rmtree(onboarded / study_flows.ROW_CLOCKS)

    record = json.loads(killed_then_run_again(monkeypatch, name, commit, state, stopped, goes_on,
                                              machine_gone).result()["run.json"])
    assert record["seconds"] >= record["earlier_seconds"] >= 1.0
    assert not parked.exists()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 1])
def test_the_work_pools_workers_run_study_rows_at_once(onboarded, monkeypatch, prefect_api, tiny_model_dir, workers):
    """With study.on_work_pool each run is a flow run of the study_row deployment: two process workers of the pool
    (one run at a time each) run rows at the same time, one worker runs them one after the other, each in a workspace
    of its own sharing the project's DVC cache; the study keeps what they return, leaves params.yaml alone and no
    workspace behind."""
    from prefect.client.orchestration import get_client

    from flows.study import results_study_flow

    pool = f"study-rows-test-{workers}"
    set_params(onboarded, {**demo_kitchen_study(tiny_model_dir), "study.on_work_pool": True, "prefect.work_pool": pool})
    head = commit_project(onboarded, monkeypatch)
    params_before = (onboarded / "params.yaml").read_text()
    monkeypatch.chdir(onboarded)
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    started = [subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process",
                                 "--limit", "1", "--name", f"worker-{k}"], env=env, cwd=onboarded,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for k in range(workers)]
    try:
        metrics = results_study_flow()
    finally:
        for worker in started:
            worker.terminate()
        for worker in started:
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:  # a loaded machine can keep a worker's shutdown from ending
                worker.kill()
                worker.wait()

    results = onboarded / "reports" / "results_study" / "demo-kitchen"
    names = ["dreamgym-grpo-seed0", "no-curriculum-seed0", "sft-only-seed0"]
    assert sorted(p.name for p in results.iterdir()) == names
    for name in names:
        record = json.loads((results / name / "run.json").read_text())
        assert record["commit"] == head and record["seconds"] > 0
        policy = "sft_warm_start" if name.startswith("sft-only") else "synthetic_grpo"  # what each row plays
        assert json.loads((results / name / "evaluate_policies.json").read_text())[policy]
    assert set(metrics) == {"SFT only", "DreamGym (GRPO)", "DreamGym (GRPO) w/o curriculum"}
    assert (onboarded / "params.yaml").read_text() == params_before
    assert not any(path.is_file() for path in (onboarded / ".dvc" / "tmp" / "study_rows").rglob("*"))  # removed
    with get_client(sync_client=True) as client:
        rows = [r for r in client.read_flow_runs() if r.name.startswith("demo-kitchen/")
                and r.work_pool_name == pool]
    assert sorted(r.name for r in rows) == [f"demo-kitchen/{name}" for name in names]
    assert all(r.state.is_completed() for r in rows)
    rows.sort(key=lambda r: r.start_time)
    overlaps = [later.start_time < earlier.end_time for earlier, later in zip(rows, rows[1:])]
    assert any(overlaps) == (workers == 2)  # at the same time only with two workers


def test_results_study_goes_on_past_a_failed_run_and_names_it(project, monkeypatch, prefect_server):
    """Each run fails here (`dvc exp run` needs a commit and the project has none): the flow still runs the next
    one, writes the (empty) report, keeps params.yaml, and fails at the end naming both runs. The project has no
    seed data yet (a fresh clone): the study collects and onboards it first, as the pipeline does."""
    from flows.study import results_study_flow
    from stages.common import StageError

    set_params(project, {**SMALL_RUN, "collect_seed.train_tasks": 1, "study.algorithms": ["grpo"],
                         "study.variants": ["dreamgym-grpo", "no-curriculum"]})
    params_before = (project / "params.yaml").read_text()
    # an earlier study was killed mid-run: params.yaml still holds that run's overrides, its backup the user's file
    (project / ".dvc" / "tmp").mkdir(parents=True, exist_ok=True)
    (project / ".dvc" / "tmp" / "study-params.yaml").write_text(params_before)
    set_params(project, {"synthetic_rl.algorithm": "ppo", "sim_to_real.real_transitions": 33})
    monkeypatch.chdir(project)

    with pytest.raises(StageError, match="2 run\\(s\\) failed: textworld-cooking/dreamgym-grpo-seed0, "
                                         "textworld-cooking/no-curriculum-seed0"):
        results_study_flow()

    readme = (project / "reports" / "results_study" / "README.md").read_text()
    assert "from 0 finished runs" in readme and "0 of 2 planned runs finished; 2 to run" in readme
    # each failed attempt is kept with DVC's reason, and the plan says so
    assert "| textworld-cooking/no-curriculum-seed0 | not run yet; 1 failed attempt (0 min); the last, at ?, in an " \
           "unknown stage: unexpected error - Empty git repo | not measured yet | `dreamgym study run " \
           "textworld-cooking/no-curriculum-seed0` |" in readme
    assert [t.source for t in read_trajectories(project / "data" / "trajectories.jsonl")] == ["expert", "random"]
    assert (project / "params.yaml").read_text() == params_before  # the killed run's overrides are gone
    assert not (project / ".dvc" / "tmp" / "study-params.yaml").exists()


def test_a_study_with_kept_runs_refuses_to_collect_another_seed_set_when_data_dvcs_is_not_here(tmp_path, monkeypatch):
    """A fresh clone has data.dvc but not its data: where the results folder keeps runs, they trained on that data,
    and a seed set collected now (by today's collect_seed) would be another one pooled with theirs. The study stops
    and says how to get the data back, before collecting anything."""
    from flows.study import seed_data
    from stages.common import StageError

    run("git", "init", "-q", cwd=tmp_path)
    run("dvc", "init", "-q", cwd=tmp_path)
    (tmp_path / "data.dvc").write_text("outs:\n- md5: 23fcde66882814338918804aa25dade7.dir\n  size: 1924732\n"
                                       "  nfiles: 4\n  hash: md5\n  path: data\n")
    kept = tmp_path / "results" / "textworld-cooking" / "real-grpo-seed0"
    kept.mkdir(parents=True)
    (kept / "evaluate_policies.json").write_text("{}")
    monkeypatch.chdir(tmp_path)

    with pytest.raises(StageError, match=r"data.dvc tracks seed data that is neither in data/ nor in the DVC cache, "
                                         r"and the 1 run\(s\) kept in results \(such as textworld-cooking/"
                                         r"real-grpo-seed0\) trained on it.*`dvc pull data.dvc`.*seed data"):
        seed_data("data", Path("results"))
    assert not (tmp_path / "data").exists() and not (tmp_path / "seed").exists()  # nothing collected


def test_a_study_killed_mid_run_leaves_nothing_that_stops_the_next_dvc_exp_run(tmp_path, monkeypatch):
    """A study killed inside `dvc exp run` (a session's end) leaves the run's params.yaml in the working tree and in
    the git index; with it staged, every later `dvc exp run` fails on its stash. The next study puts back the user's
    file and unstages the run's, and a file the user staged themselves stays staged."""
    from flows.study import PARAMS_BACKUP, restore_params

    run("git", "init", "-q", cwd=tmp_path)
    (tmp_path / "params.yaml").write_text("seed: 0\n")
    commit_project(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    PARAMS_BACKUP.parent.mkdir(parents=True)
    PARAMS_BACKUP.write_text("seed: 0\n")
    (tmp_path / "params.yaml").write_text("seed: 1\n")  # the killed run's overrides, staged as DVC stages them
    run("git", "add", "params.yaml", cwd=tmp_path)

    assert restore_params()
    assert (tmp_path / "params.yaml").read_text() == "seed: 0\n" and not PARAMS_BACKUP.exists()
    assert run("git", "status", "--porcelain", cwd=tmp_path).stdout == ""  # nothing staged, nothing changed

    (tmp_path / "params.yaml").write_text("seed: 2\n")  # the user's own change, staged before the study
    run("git", "add", "params.yaml", cwd=tmp_path)
    PARAMS_BACKUP.write_text("seed: 2\n")
    assert restore_params()
    assert run("git", "show", ":params.yaml", cwd=tmp_path).stdout == "seed: 2\n"


def test_a_study_row_killed_inside_dvc_exp_run_leaves_head_on_the_branch_for_the_next(tmp_path, monkeypatch):
    """`dvc exp run` detaches HEAD while it runs; killed (a session's end), it left HEAD detached for good, so the
    next study's runs and every later commit went on off the branch. The next study puts HEAD back on the branch,
    never while a DVC command runs in the checkout. A study stopped with SIGTERM puts back the user's params.yaml and
    unstages the run's, which `dvc exp run` had staged and which made the next run fail on its stash."""
    from components.results.workspace import reattach_head
    from flows.study import PARAMS_BACKUP, run_variant

    project, started = tmp_path / "project", tmp_path / "started"
    project.mkdir()
    (project / "dvc.yaml").write_text(f"""stages:
  row: {{cmd: "touch {started} && sleep 60 && cat params.yaml > out.txt", params: [seed], outs: [out.txt]}}
""")
    original = (REPO / "params.yaml").read_text()  # the user's file: a study run reads its profile from it
    (project / "params.yaml").write_text(original)
    run("git", "init", "-q", "-b", "main", cwd=project)
    run("dvc", "init", "-q", cwd=project)
    start = commit_project(project, monkeypatch)

    row = subprocess.Popen([str(BIN / "dvc"), "exp", "run", "--set-param", "seed=1"], cwd=project,
                           start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline and row.poll() is None:
        time.sleep(0.2)
    assert started.exists(), "the row's stage never started"
    assert reattach_head(project) is None  # a run in progress keeps its detached HEAD
    os.killpg(row.pid, signal.SIGKILL)
    row.wait()
    assert run("git", "symbolic-ref", "--quiet", "HEAD", cwd=project, check=False).returncode != 0  # detached

    assert reattach_head(project) == "main"
    assert run("git", "symbolic-ref", "--short", "HEAD", cwd=project).stdout.strip() == "main"
    assert run("git", "rev-parse", "HEAD", cwd=project).stdout.strip() == start
    assert reattach_head(project) is None  # once is enough

    (project / "params.yaml").write_text(original)  # what the next study's restore_params does
    (project / "dvc.yaml").write_text("stages:\n  row: {cmd: grep seed params.yaml > out.txt, params: [seed], "
                                      "outs: [out.txt]}\n")
    commit_project(project, monkeypatch)
    monkeypatch.chdir(project)

    def stopped_mid_run(*args, **kwargs):  # DVC has written and staged the run's params when SIGTERM stops the row
        (project / "params.yaml").write_text(original.replace("seed: 0", "seed: 2", 1))
        run("git", "add", "params.yaml", cwd=project)
        raise KeyboardInterrupt

    monkeypatch.setattr("flows.study.run_row", stopped_mid_run)
    with pytest.raises(KeyboardInterrupt):
        run_variant.fn("toy/row-seed2", {"seed": 2}, tmp_path / "results", "row")
    assert (project / "params.yaml").read_text() == original and not PARAMS_BACKUP.exists()
    assert run("git", "status", "--porcelain", "--untracked-files=no", cwd=project).stdout == ""  # nothing staged
    run("dvc", "exp", "run", "--set-param", "seed=3", cwd=project)  # the next run's stash applies
    assert (project / "out.txt").read_text().startswith("seed: 3")
    assert run("git", "symbolic-ref", "--short", "HEAD", cwd=project).stdout.strip() == "main"


def test_a_stopped_rows_wall_time_goes_on_in_its_next_invocation(tmp_path, monkeypatch):
    """A study killed mid-row (a session's end) records nothing of the row: its clock, saved while it runs, is where
    the row's next invocation starts, so the run's wall time counts both; the clock goes once the record holds it."""
    from flows.study import ROW_CLOCKS, row_clock, run_variant

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    run("git", "init", "-q", cwd=tmp_path)
    with row_clock("toy/ticking", every=0.05) as clock:
        time.sleep(0.3)
        assert json.loads(clock.path.read_text())["seconds"] >= 0.2  # what a SIGKILL would leave
        clock.recorded = True
    assert not clock.path.exists()

    name, run_dir = "toy/row-seed0", tmp_path / "results" / "toy" / "row-seed0"

    def stopped(*args, **kwargs):  # SIGTERM, mid-row
        time.sleep(0.3)
        raise KeyboardInterrupt

    monkeypatch.setattr("flows.study.run_row", stopped)
    with pytest.raises(KeyboardInterrupt):
        run_variant.fn(name, {"seed": 0}, run_dir, "row")
    [left] = ROW_CLOCKS.rglob("*.json")
    stopped_for = json.loads(left.read_text())["seconds"]
    assert stopped_for >= 0.3 and not run_dir.exists()

    monkeypatch.setattr("flows.study.run_row", lambda *args, **kwargs: time.sleep(0.2))
    run_variant.fn(name, {"seed": 0}, run_dir, "row")
    record = json.loads((run_dir / "run.json").read_text())
    assert record["earlier_seconds"] == stopped_for and record["seconds"] >= stopped_for + 0.2
    assert not list(ROW_CLOCKS.rglob("*.json"))

    run_variant.fn(name, {"seed": 0}, run_dir, "row")  # run again from nothing: its own time only
    record = json.loads((run_dir / "run.json").read_text())
    assert "earlier_seconds" not in record and 0.2 <= record["seconds"] < stopped_for + 0.2


def test_a_commit_made_while_a_row_runs_stays_on_the_branch(tmp_path, monkeypatch):
    """`dvc exp run` detaches HEAD while it runs and points it back at the branch's old commit after, so a commit
    made in the checkout meanwhile (results committed while a long row ran) fell off the branch. The row puts it
    back: the branch ends at that commit, its file tracked, the run's outputs in the working tree."""
    from components.results.workspace import keeping_commits

    # at seed 1 the stage commits a file of its own while it runs: a user committing in the checkout meanwhile
    (tmp_path / "dvc.yaml").write_text("""stages:
  row: {cmd: "if grep -q 'seed: 1' params.yaml; then date +%s%N > notes.txt && git add notes.txt
          && git commit -q -m 'notes while the row ran'; fi && cat params.yaml > out.txt",
        params: [seed], outs: [out.txt]}
""")
    (tmp_path / "params.yaml").write_text("seed: 0\n")
    run("git", "init", "-q", "-b", "main", cwd=tmp_path)
    run("dvc", "init", "-q", cwd=tmp_path)
    start = commit_project(tmp_path, monkeypatch)

    with keeping_commits(tmp_path) as made:
        run("dvc", "exp", "run", "--set-param", "seed=1", cwd=tmp_path)
    head = run("git", "rev-parse", "HEAD", cwd=tmp_path).stdout.strip()
    assert made.restored and made.commits == [head] and head != start
    assert run("git", "log", "-1", "--format=%s", "main", cwd=tmp_path).stdout.strip() == "notes while the row ran"
    assert run("git", "ls-files", "notes.txt", cwd=tmp_path).stdout.strip() == "notes.txt"
    assert (tmp_path / "out.txt").read_text() == "seed: 1\n"  # the experiment's output, applied to the workspace
    changed = run("git", "status", "--porcelain", cwd=tmp_path).stdout
    assert "notes.txt" not in changed and "params.yaml" in changed  # only what the run itself changed

    run("git", "commit", "-q", "-am", "the run's outputs", cwd=tmp_path)
    before = run("git", "rev-parse", "HEAD", cwd=tmp_path).stdout.strip()
    with keeping_commits(tmp_path) as made:  # a run with no commit meanwhile: nothing moves
        run("dvc", "exp", "run", "--set-param", "seed=2", cwd=tmp_path)
    assert made.commits == [] and not made.restored
    assert run("git", "rev-parse", "HEAD", cwd=tmp_path).stdout.strip() == before
    assert run("git", "symbolic-ref", "--short", "HEAD", cwd=tmp_path).stdout.strip() == "main"
    assert (tmp_path / "out.txt").read_text() == "seed: 2\n"

    (tmp_path / "params.yaml").write_text("seed: 1\n")  # `dvc repro` (a real row) leaves HEAD on the branch
    with keeping_commits(tmp_path) as made:
        run("dvc", "repro", "--force", cwd=tmp_path)  # forced: DVC's run cache would restore seed 1's output
    assert made.commits == [] and run("git", "log", "-1", "--format=%s", cwd=tmp_path).stdout.strip() == (
        "notes while the row ran")  # committed on the branch as usual: nothing fell off, nothing to report


def test_a_real_environment_row_runs_without_synthetic_rl_even_where_its_output_is_missing(tmp_path, monkeypatch):
    """A real-environment row's policy never meets synthetic RL, but sim_to_real depends on its output, so DVC reran
    it whenever its code had changed since, and a fresh workspace ran it whole. The row runs `dvc repro` of the other
    stages one by one instead, each still run when it changed; where synthetic RL's output is missing (and not in
    DVC's cache, which `dvc exp run` would check out over a stand-in), a stand-in takes its place while the row
    runs."""
    from flows.study import run_command, stand_ins

    (tmp_path / "dvc.yaml").write_text("""stages:
  train_policy_sft: {cmd: cat params.yaml > sft.txt, params: [seed], outs: [sft.txt]}
  synthetic_rl: {cmd: mkdir -p rl && cat sft.txt rl_code.txt > rl/model.txt && date > rl_log.txt,
                 deps: [sft.txt, rl_code.txt], outs: [rl, rl_log.txt]}
  sim_to_real: {cmd: cat sft.txt > s2r.txt, deps: [sft.txt, rl], params: [sim_to_real], outs: [s2r.txt]}
  evaluate_policies: {cmd: cat s2r.txt > eval.txt, deps: [s2r.txt, rl], params: [evaluate], outs: [eval.txt]}
""")

    def params(seed, start_from="synthetic_rl", policies="[sim_to_real, synthetic_rl]"):
        (tmp_path / "params.yaml").write_text(f"seed: {seed}\nsim_to_real: {{start_from: {start_from}}}\n"
                                              f"evaluate: {{policies: {policies}}}\n")
    params(0)
    (tmp_path / "rl_code.txt").write_text("v1\n")
    run("git", "init", "-q", cwd=tmp_path)
    run("dvc", "init", "-q", cwd=tmp_path)
    run("dvc", "repro", "-q", cwd=tmp_path)
    commit_project(tmp_path, monkeypatch)
    (tmp_path / "rl_code.txt").write_text("v2\n")  # synthetic RL's code changed since it ran
    commit_project(tmp_path, monkeypatch)
    real_row = {"seed": 1, "sim_to_real.start_from": "sft", "evaluate.policies": ["sim_to_real"]}

    command = run_command(real_row, "evaluate_policies", tmp_path)
    assert command == ["dvc", "repro", "--single-item", "train_policy_sft", "sim_to_real", "evaluate_policies"]
    params(1, "sft", "[sim_to_real]")  # what flows.study.run_row writes first (components.config.write_params)
    with stand_ins(real_row, "evaluate_policies", tmp_path) as made:
        assert made == []  # synthetic RL's output is there: nothing to stand in for
        ran = run(*command, cwd=tmp_path).stdout
    assert "Running stage 'train_policy_sft'" in ran and "Running stage 'evaluate_policies'" in ran  # seed changed
    assert "synthetic_rl" not in ran and (tmp_path / "rl" / "model.txt").read_text().endswith("v1\n")  # not rerun
    # a DreamGym row needs synthetic RL: `dvc exp run` the whole way, with no stand-in
    assert run_command({"seed": 1}, "evaluate_policies", tmp_path)[:3] == ["dvc", "exp", "run"]
    with stand_ins({"seed": 1}, "evaluate_policies", tmp_path) as made:
        assert made == []
    # a fresh workspace: synthetic RL's output is neither there nor in the cache. A stand-in for what the row's
    # stages depend on (rl, not rl_log.txt) while it runs, gone afterwards with the folder it made
    shutil.rmtree(tmp_path / "rl")
    shutil.rmtree(tmp_path / ".dvc" / "cache")
    params(2, "sft", "[sim_to_real]")
    with stand_ins({**real_row, "seed": 2}, "evaluate_policies", tmp_path) as made:
        assert made == [tmp_path / "rl"]
        assert "not run: this row needs nothing of synthetic_rl" in (tmp_path / "rl" / "NOT_RUN.md").read_text()
        ran = run(*run_command({**real_row, "seed": 2}, "evaluate_policies", tmp_path), cwd=tmp_path).stdout
    assert "Running stage 'evaluate_policies'" in ran and "synthetic_rl" not in ran
    assert not (tmp_path / "rl").exists() and (tmp_path / "eval.txt").read_text().startswith("seed: 2")


def test_correction_rounds_feed_the_policys_real_transitions_back_round_after_round(project, tiny_model_dir):
    """Two rounds on real TextWorld games: each plays synthetic RL, sim-to-real and the replay audit, onboards what
    the policy met beside the seed, retrains the experience model on it and measures it on held-out play; a rerun
    keeps finished rounds; without feedback the same rounds spend the same budget and correct nothing."""
    set_params(project, {**SMALL_RUN, **tiny_experience_model(tiny_model_dir, "textworld-cooking"),
                         **tiny_policy(tiny_model_dir), "data.heldout_task_fraction": 0.4,
                         "correction.heldout_games": 1, "experience_model.on_policy_games": 1,
                         "correction.rounds": 2, "correction.real_transitions": 4, "correction.training_steps": 1})
    run("dreamgym", "stage", "collect_seed", cwd=project)
    run("dreamgym", "data", "onboard", *sorted(str(p) for p in (project / "seed").glob("*.jsonl")), cwd=project)
    for stage in ("annotate", "index_buffer", "train_experience_model", "train_policy_sft"):
        run("dreamgym", "stage", stage, cwd=project)
    first = run("dreamgym", "stage", "correction_rounds", cwd=project)
    rounds = project / "models" / "correction" / "rounds"
    metrics = json.loads((project / "metrics" / "correction_rounds.json").read_text())
    with (project / "metrics" / "correction_rounds.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert metrics["rounds"] == 2 and metrics["feedback"] and [row["round"] for row in rows] == ["1", "2"]
    for number, row in enumerate(rows, start=1):
        s2r = json.loads((rounds / f"round_{number}" / "metrics" / "sim_to_real.json").read_text())
        assert 0 < s2r["real_transitions_used"] <= 4
        played = read_trajectories(rounds / f"round_{number}" / "on_policy.jsonl")
        assert played and all(t.source == "policy" for t in played)
        assert int(row["real_transitions"]) == sum(len(t.steps) for t in played)  # sim-to-real's and the replays'
        assert int(row["quarantined"]) == 0  # training tasks only: nothing of a held-out game
        corrected = read_trajectories(rounds / f"round_{number}" / "data" / "trajectories.jsonl")
        assert {t.trajectory_id for t in played} <= {t.trajectory_id for t in corrected}  # onboarded beside the seed
        # every round's feedback so far, and not the seed's own `source: policy` play, is what training weighs
        fed_back = read_trajectories(rounds / f"round_{number}" / "data" / "on_policy.jsonl")
        so_far = [read_trajectories(rounds / f"round_{n}" / "on_policy.jsonl") for n in range(1, number + 1)]
        assert {t.trajectory_id for t in fed_back} == {t.trajectory_id for kept in so_far for t in kept}
        trained = json.loads((rounds / f"round_{number}" / "metrics" / "train_experience_model.json").read_text())
        assert trained["global_step"] == 1
        fidelity = json.loads((rounds / f"round_{number}" / "metrics" / "evaluate_experience_model.json").read_text())
        assert fidelity["on_policy"]["games"] == 1  # the round's own policy on a held-out game
    assert int(rows[1]["real_transitions_total"]) == int(rows[0]["real_transitions"]) + int(rows[1]["real_transitions"])
    # round 2 starts from round 1's policy and corrected experience model
    assert f"round 2/2: synthetic RL from {rounds / 'round_1' / 'sim_to_real'} with the experience model of " \
           f"{rounds / 'round_1' / 'experience'}" in first.stdout
    assert len(read_trajectories(project / "models" / "correction" / "on_policy.jsonl")) == sum(
        len(read_trajectories(rounds / f"round_{n}" / "on_policy.jsonl")) for n in (1, 2))
    assert (project / "models" / "correction" / "experience_model" / "config.json").is_file()
    assert "| round |" in (project / "reports" / "correction_rounds.md").read_text()

    again = run("dreamgym", "stage", "correction_rounds", cwd=project)  # finished rounds are kept, not replayed
    assert again.stdout.count("finished before, kept") == 2

    # another machine: the rounds as parked (their metrics, games, replays, checkpoints; no merged model), and the
    # rerun makes their models again from their checkpoints, playing no real game again
    from components.config import load_params
    from components.results.workspace import park, unpark
    from stages.outputs import resume_state

    parked = project.parent / "parked"
    park(resume_state(load_params(project / "params.yaml"), project), project, parked, settled=0)
    assert not list(parked.rglob("model")) and (parked / "models/correction/rounds/round_2/round.json").is_file()
    shutil.rmtree(project / "models" / "correction")
    unpark(parked, project)
    remade = run("dreamgym", "stage", "correction_rounds", cwd=project)
    assert remade.stdout.count("finished before (parked), its models made again") == 2
    assert "resuming from" in remade.stdout + remade.stderr
    with (project / "metrics" / "correction_rounds.csv").open() as handle:
        assert list(csv.DictReader(handle)) == rows  # each round's row as it was played, minutes too
    # and the same summary: every round's on-policy trajectories, the final policy's games against the warm start
    assert json.loads((project / "metrics" / "correction_rounds.json").read_text()) == metrics
    assert (rounds / "round_2" / "sim_to_real" / "model" / "config.json").is_file()
    assert (project / "models" / "correction" / "experience_model" / "config.json").is_file()

    # other settings: the rounds are made again, uncorrected, the replay audit within 3 real transitions a round
    set_params(project, {"correction.feedback": False, "correction.replay_transitions": 3})
    run("dreamgym", "stage", "correction_rounds", cwd=project)
    assert not json.loads((project / "metrics" / "correction_rounds.json").read_text())["feedback"]
    assert not (rounds / "round_1" / "data").exists() and not (rounds / "round_2" / "experience").exists()
    for number in (1, 2):
        s2r = json.loads((rounds / f"round_{number}" / "metrics" / "sim_to_real.json").read_text())
        assert s2r["real_transitions_budget"] == 4
        assert sum(len(t.steps) for t in read_trajectories(rounds / f"round_{number}" / "replays.jsonl")) <= 3

    # DreamGym-S2R's shape: sim-to-real once, after the last round's synthetic RL; round 1 ends with its synthetic
    # RL policy, and its real transitions are the replay audit's alone
    set_params(project, {"correction.sim_to_real": "last_round"})
    last = run("dreamgym", "stage", "correction_rounds", cwd=project)
    with (project / "metrics" / "correction_rounds.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert not (rounds / "round_1" / "sim_to_real").exists()
    assert (rounds / "round_2" / "metrics" / "sim_to_real.json").is_file()
    assert f"round 2/2: synthetic RL from {rounds / 'round_1' / 'synthetic_rl'}" in last.stdout
    replayed = read_trajectories(rounds / "round_1" / "replays.jsonl")
    assert int(rows[0]["real_transitions"]) == sum(len(t.steps) for t in replayed) <= 3
    evaluated = json.loads((rounds / "round_1" / "metrics" / "evaluate_policies.json").read_text())
    assert "synthetic_grpo" in evaluated and "synthetic_replay" not in evaluated  # the round's audit is its own
    assert rows[0]["heldout_success"] != ""


def test_correction_rounds_refuse_a_round_budget_that_pays_for_no_sim_to_real_iteration(tmp_path):
    """Else every round's sim-to-real would be skipped and the next round would find no policy to start from."""
    from components.config import load_params
    from stages import correction_rounds, sim_to_real
    from stages.common import StageError

    cost = sim_to_real.iteration_cost(load_params(REPO / "params.yaml"))
    params = load_params(REPO / "params.yaml", {"correction.rounds": 2, "correction.real_transitions": cost - 1})
    with pytest.raises(StageError, match=f"real_transitions {cost - 1} pays for no sim-to-real iteration .*{cost}"):
        correction_rounds.run(params, tmp_path)
    assert not (tmp_path / "models").exists()  # refused before any work


@pytest.mark.slow  # a DreamGym run and a correction run of the study on real TextWorld games, ~10 minutes here
def test_results_study_runs_the_correction_row_at_dreamgym_s2rs_budget(project, monkeypatch, prefect_server,
                                                                         tiny_model_dir):
    """The study's s2r-correction variant: the stages up to correction_rounds without the pipeline's synthetic RL,
    sim-to-real and evaluation (its rounds run their own), kept from its last round, and paired with DreamGym-S2R in
    its claim."""
    from flows.study import results_study_flow

    set_params(project, {**SMALL_RUN, **tiny_experience_model(tiny_model_dir, "textworld-cooking"),
                         **tiny_policy(tiny_model_dir), "data.heldout_task_fraction": 0.4,
                         "correction.heldout_games": 1, "experience_model.on_policy_games": 1,
                         "correction.rounds": 2, "correction.training_steps": 1, "study.algorithms": ["grpo"],
                         "study.variants": ["dreamgym-grpo", "s2r-correction"], "study.real_budget": 200})
    run("dreamgym", "stage", "collect_seed", cwd=project)  # the user's seed, onboarded: what the runs train on
    run("dreamgym", "data", "onboard", *sorted(str(p) for p in (project / "seed").glob("*.jsonl")), cwd=project)
    commit_project(project, monkeypatch)
    monkeypatch.chdir(project)

    metrics = results_study_flow()

    kept = project / "reports" / "results_study" / "textworld-cooking" / "s2r-correction-seed0"
    record = json.loads((kept / "run.json").read_text())
    # 20 real transitions (10% of 200): sim-to-real after the last round, 8 (two iterations of up to 4), and 6 a round
    # of the 2 rounds' replays
    assert (record["params_set"]["correction.real_transitions"], record["params_set"]["correction.replay_transitions"]
            ) == (8, 6)
    assert not (project / "models" / "correction" / "rounds" / "round_1" / "sim_to_real").exists()
    correction = json.loads((kept / "correction_rounds.json").read_text())
    assert correction["rounds"] == 2 and correction["feedback"] and 0 < correction["real_transitions"] <= 20
    assert (kept / "correction_rounds.csv").read_text() == (project / "metrics" / "correction_rounds.csv").read_text()
    last_round = json.loads((project / "models" / "correction" / "rounds" / "round_2" / "metrics"
                             / "evaluate_policies.json").read_text())
    assert json.loads((kept / "evaluate_policies.json").read_text()) == last_round
    row = metrics["DreamGym-S2R (GRPO) + correction"]["textworld-cooking"]
    assert row["real_transitions_mean"] == correction["real_transitions"]
    study_report = (project / "reports" / "results_study" / "README.md").read_text()
    assert "On-policy correction helps sim-to-real at the same real budget" in study_report
    assert "| textworld-cooking/s2r-correction-seed0 | 2 |" in study_report  # its rounds, one by one
