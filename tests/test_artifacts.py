"""Artifacts round-trip byte for byte through the local store and the real S3 store infra/s3 starts."""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from components.artifacts import (
    ArtifactCorruptError,
    ArtifactError,
    ArtifactNotFoundError,
    LocalArtifactStore,
    S3ArtifactStore,
    open_artifact_store,
)
from components.config import S3Params, StorageParams

BIG = 12 * 1024 * 1024  # above boto3's 8 MB multipart threshold: uploaded in two parts


def _bucket() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalArtifactStore(tmp_path / "store")
    request.getfixturevalue("s3_server")
    return S3ArtifactStore(_bucket(), prefix="runs")  # a fresh bucket: also exercises creating it


@pytest.fixture
def model_dir(tmp_path) -> Path:
    root = tmp_path / "model"
    (root / "tokenizer").mkdir(parents=True)
    (root / "config.json").write_text('{"layers": 2}\n')
    (root / "tokenizer" / "vocab.txt").write_text("a\nb\nc\n")
    (root / "weights.bin").write_bytes(os.urandom(BIG))
    return root


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _tamper(store, run_id: str, name: str, rel: str) -> None:
    """Change stored bytes behind the store's back."""
    if isinstance(store, LocalArtifactStore):
        (store.root / run_id / name / rel).write_bytes(b"tampered")
    else:
        store._s3.put_object(Bucket=store.bucket, Key=f"{store.prefix}/{run_id}/{name}/{rel}", Body=b"tampered")


def test_file_round_trip(store, tmp_path):
    src = tmp_path / "metrics.json"
    src.write_text('{"reward": 0.5}\n')
    uri = store.put(src, "run-1", "metrics")
    assert uri.endswith("/run-1/metrics")
    assert store.exists("run-1", "metrics")
    out = store.get("run-1", "metrics", tmp_path / "out" / "metrics.json")
    assert out.read_bytes() == src.read_bytes()


def test_directory_round_trip_with_multipart_file(store, model_dir, tmp_path):
    store.put(model_dir, "run-1", "policy")
    out = store.get("run-1", "policy", tmp_path / "restored")
    assert _tree(out) == _tree(model_dir)
    manifest = store.manifest("run-1", "policy")
    assert manifest["kind"] == "dir" and manifest["files"]["weights.bin"]["size"] == BIG
    if isinstance(store, S3ArtifactStore):  # a multipart upload's ETag ends in -<number of parts>
        head = store._s3.head_object(Bucket=store.bucket, Key="runs/run-1/policy/weights.bin")
        assert head["ETag"].strip('"').endswith("-2")


def test_put_replaces_earlier_artifact(store, model_dir, tmp_path):
    store.put(model_dir, "run-1", "policy")
    store.put(model_dir / "config.json", "run-1", "policy")
    assert store.manifest("run-1", "policy")["files"].keys() == {"config.json"}
    out = store.get("run-1", "policy", tmp_path / "config.json")
    assert out.read_bytes() == (model_dir / "config.json").read_bytes()


def test_get_detects_sha256_mismatch(store, model_dir, tmp_path):
    store.put(model_dir, "run-1", "policy")
    _tamper(store, "run-1", "policy", "tokenizer/vocab.txt")
    dest = tmp_path / "restored"
    with pytest.raises(ArtifactCorruptError, match=r"tokenizer/vocab.txt: sha256 .* does not match"):
        store.get("run-1", "policy", dest)
    assert not dest.exists()  # nothing half-verified is left behind


def test_missing_artifact(store, tmp_path):
    assert not store.exists("run-1", "nothing")
    with pytest.raises(ArtifactNotFoundError, match="no artifact 'nothing' for run 'run-1'"):
        store.get("run-1", "nothing", tmp_path / "out")


def test_get_refuses_to_clobber_unless_asked(store, tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("new")
    store.put(src, "run-1", "a")
    dest = tmp_path / "dest.txt"
    dest.write_text("old")
    with pytest.raises(ArtifactError, match="already exists"):
        store.get("run-1", "a", dest)
    assert store.get("run-1", "a", dest, overwrite=True).read_text() == "new"


def test_list_runs_and_artifacts(store, tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("x")
    assert store.list_runs() == []
    store.put(src, "run-2", "eval")
    store.put(src, "run-1", "policy")
    store.put(src, "run-1", "data")
    assert store.list_runs() == ["run-1", "run-2"]
    assert store.list_artifacts("run-1") == ["data", "policy"]
    assert store.list_artifacts("run-3") == []


def test_prune_keeps_the_most_recently_stored_runs(store, model_dir, tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("x")
    for run_id in ["run-c", "run-a", "run-b"]:  # stored in this order; names do not sort by time
        store.put(src, run_id, "metrics")
        store.put(model_dir, run_id, "model")
        time.sleep(0.01)
    runs = store.stored_runs()
    assert [run.run_id for run in runs] == ["run-b", "run-a", "run-c"]  # newest first
    assert runs[0].artifacts == ["metrics", "model"] and runs[0].stored_at > runs[1].stored_at > runs[2].stored_at
    assert store.prune(keep=2, dry_run=True) == ["run-c"]
    assert store.list_runs() == ["run-a", "run-b", "run-c"]
    assert store.prune(keep=2) == ["run-c"]
    assert store.list_runs() == ["run-a", "run-b"]
    store.get("run-b", "model", tmp_path / "back")  # what is kept is whole
    assert _tree(tmp_path / "back") == _tree(model_dir)
    with pytest.raises(ValueError, match="keep at least"):
        store.prune(keep=0)


def test_cli_lists_and_prunes_the_configured_store(tmp_path, monkeypatch, capsys):
    from dreamgym.cli import main

    store = LocalArtifactStore(tmp_path / "artifacts")
    src = tmp_path / "a.txt"
    src.write_text("x")
    for run_id in ["old", "new"]:
        store.put(src, run_id, "metrics")
        time.sleep(0.01)
    monkeypatch.chdir(tmp_path)  # storage.local_dir (artifacts) is relative to the working directory
    params = Path(__file__).resolve().parents[1] / "params.yaml"
    assert main(["--params", str(params), "artifacts", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].startswith("new  ") and listed[0].endswith("  metrics") and listed[1].startswith("old  ")
    assert main(["--params", str(params), "artifacts", "prune", "--keep", "1"]) == 0
    assert store.list_runs() == ["new"]


def test_rejects_names_that_break_the_layout(store, tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("x")
    for run_id, name in [("a/b", "x"), ("run", "../x"), ("", "x"), ("run", "_manifest.json")]:
        with pytest.raises(ValueError):
            store.put(src, run_id, name)


def test_open_artifact_store_from_params(tmp_path, s3_server, monkeypatch):
    s3 = S3Params(bucket=_bucket(), prefix="runs", endpoint_url=None, region="us-east-1")
    monkeypatch.chdir(tmp_path)
    local = open_artifact_store(StorageParams(backend="local", local_dir="artifacts", s3=s3))
    assert isinstance(local, LocalArtifactStore) and local.root == tmp_path / "artifacts"
    remote = open_artifact_store(StorageParams(backend="s3", local_dir="artifacts", s3=s3))
    assert isinstance(remote, S3ArtifactStore)
    assert remote.endpoint == s3_server.endpoint_url  # endpoint_url null: boto3's AWS_ENDPOINT_URL
    assert s3_server.client().head_bucket(Bucket=s3.bucket)  # created on open


def test_s3_errors_name_the_fix(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(ArtifactError, match="check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"):
        S3ArtifactStore(_bucket())
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ArtifactError, match="no AWS credentials: set AWS_ACCESS_KEY_ID"):
        S3ArtifactStore(_bucket())
