"""Issue 7, item 3, end to end on the real local S3 store (configured only through the AWS_* variables):
every stage's outputs stored under a run id, every DVC output pushed to the remote, and a fresh clone that pulls
them and rebuilds a report without retraining anything; and a pipeline run that outlives an unreachable remote."""
from __future__ import annotations

import json
import shutil
import socket
import uuid

import pytest

from components.artifacts import open_artifact_store
from components.config import load_params
from components.files import sha256_file
from stages.evaluate_experience_model import PREDICTIONS_FILE
from stages.outputs import publish
from tests.conftest import REPO, run, set_params, tiny_experience_model

# onboarded data -> annotate -> index_buffer -> train_experience_model -> evaluate_experience_model (the report)
STAGES = ("annotate", "index_buffer", "train_experience_model", "evaluate_experience_model")
REPORT_STAGE = STAGES[-1]


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow  # about 2 minutes here: four stages on tiny models, then a clone that pulls and rebuilds a report
def test_stage_outputs_stored_pushed_and_rebuilt_in_a_fresh_clone(project, s3_server, tiny_model_dir, tmp_path,
                                                                   monkeypatch):
    from prefect.logging import disable_run_logger

    from flows.pipeline import push

    bucket = f"e2e-{uuid.uuid4().hex[:10]}"  # the DVC remote and the artifact store share it, as in params.yaml
    run("dreamgym", "data", "onboard", "examples/seed/demo-kitchen.jsonl", cwd=project)
    set_params(project, {**tiny_experience_model(tiny_model_dir, "demo-kitchen"), "data.heldout_task_fraction": 0.3})
    run("dvc", "repro", REPORT_STAGE, cwd=project)

    # every declared output of every stage, under the run id, in S3
    params = load_params(project / "params.yaml", {"storage.backend": "s3", "storage.s3.bucket": bucket})
    for stage in STAGES:
        uris = publish(params, "run-e2e", stage, root=project)
        assert uris[:2] == [f"s3://{bucket}/runs/run-e2e/{stage}-metrics", f"s3://{bucket}/runs/run-e2e/{stage}-report"]
    store = open_artifact_store(params.storage)
    assert set(store.list_artifacts("run-e2e")) == {
        *(f"{stage}-{kind}" for stage in STAGES for kind in ("metrics", "report")),
        "annotate-annotated", "index_buffer-buffer", "train_experience_model-models-experience-model",
        f"evaluate_experience_model-{PREDICTIONS_FILE.replace('/', '-')}",
    }
    model = project / "models" / "experience" / "model"
    stored = store.manifest("run-e2e", "train_experience_model-models-experience-model")
    assert stored["kind"] == "dir" and "config.json" in str(stored["files"])
    assert {rel: meta["sha256"] for rel, meta in stored["files"].items()} == {
        rel: sha256_file(model / rel) for rel in _files(model)}
    keys = {o["Key"] for o in s3_server.client().list_objects_v2(
        Bucket=bucket, Prefix="runs/run-e2e/train_experience_model-models-experience-model/")["Contents"]}
    assert {f"runs/run-e2e/train_experience_model-models-experience-model/{rel}" for rel in stored["files"]} < keys

    # the flow's push task: a clear no-op without a remote, then every DVC output to the remote
    monkeypatch.chdir(project)
    with disable_run_logger():
        assert push.fn() is None
        run("dvc", "remote", "add", "-d", "storage", f"s3://{bucket}/dvc", cwd=project)
        assert push.fn() == "storage"
    assert "in sync" in run("dvc", "status", "--cloud", cwd=project).stdout

    # a fresh clone of the committed project, the same remote (its .dvc/config), pulls instead of retraining
    shutil.copy(REPO / ".gitignore", project / ".gitignore")
    run("git", "add", "-A", cwd=project)
    run("git", "-c", "user.name=test", "-c", "user.email=test@example.com", "commit", "-q", "-m", "run",
        cwd=project)
    clone = tmp_path / "clone"
    run("git", "clone", "-q", str(project), str(clone), cwd=tmp_path)
    assert not (clone / "models" / "experience" / "model").exists()
    # (this project never ran the policy stages: a clone of a whole pipeline run pulls with a plain `dvc pull`)
    run("dvc", "pull", "--with-deps", REPORT_STAGE, cwd=clone)
    assert _files(clone / "data") == _files(project / "data")
    assert _files(clone / "models" / "experience" / "model") == _files(model)
    assert _files(clone / "buffer") == _files(project / "buffer")
    assert "up to date" in run("dvc", "status", "--with-deps", REPORT_STAGE, cwd=clone).stdout
    again = run("dvc", "repro", REPORT_STAGE, cwd=clone).stdout
    assert "Running stage" not in again and all(f"'{stage}' didn't change" in again for stage in STAGES)

    # the report rebuilt from the pulled model and buffer, and nothing upstream of it runs
    (clone / "reports" / f"{REPORT_STAGE}.md").unlink()
    rebuilt = run("dvc", "repro", "--force", "--single-item", REPORT_STAGE, cwd=clone).stdout
    assert f"Running stage '{REPORT_STAGE}'" in rebuilt
    assert not any(f"Running stage '{stage}'" in rebuilt for stage in STAGES[:-1])
    assert "copy nearest neighbour" in (clone / "reports" / f"{REPORT_STAGE}.md").read_text()
    assert json.loads((clone / "metrics" / f"{REPORT_STAGE}.json").read_text())["transitions"] == 3


def test_pipeline_flow_completes_when_the_dvc_remote_cannot_be_reached(project, monkeypatch, prefect_server):
    """A configured remote without credentials is skipped with a reason; one that is down (credentials, no store)
    fails the push task, not the pipeline run."""
    from flows import pipeline

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(project / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(project / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    run("dreamgym", "data", "onboard", "examples/seed/demo-kitchen.jsonl", cwd=project)
    run("dvc", "remote", "add", "-d", "storage", "s3://dreamgym/dvc", cwd=project)
    monkeypatch.setattr(pipeline, "STAGE_FLOWS", {})  # the push at the end is what this test is about
    monkeypatch.setattr(pipeline, "push", pipeline.push.with_options(retries=0))
    monkeypatch.chdir(project)
    assert "no AWS credentials for s3://dreamgym/dvc" in pipeline._cannot_push("storage", pipeline._dvc_config())
    state = pipeline.pipeline_flow(return_state=True)
    assert state.is_completed() and state.result()["dvc_push"] is None

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore would retry a refused connection for ~10 s
    assert pipeline._cannot_push("storage", pipeline._dvc_config()) is None
    state = pipeline.pipeline_flow(return_state=True)
    assert state.is_completed() and state.result()["dvc_push"] == "failed"
