"""DVC-tracked data round-trips through an S3 remote on the real store: push, wipe cache and data, pull."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

# The dvc of the interpreter running the tests, not whatever is first on PATH.
DVC = str(Path(sys.executable).with_name("dvc"))


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_dvc_push_wipe_pull(s3_server, tmp_path):
    repo = tmp_path / "repo"
    data = repo / "data"
    (data / "episodes").mkdir(parents=True)
    (data / "seed.jsonl").write_text('{"state": "start", "action": "look"}\n' * 100)
    (data / "episodes" / "blob.bin").write_bytes(os.urandom(10 * 1024 * 1024))
    expected = _tree(data)

    # Credentials reach DVC only through its --local config below, as a user would set them.
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env["DVC_NO_ANALYTICS"] = "1"
    bucket = f"dvc-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)

    _run(["git", "init", "-q"], repo, env)
    _run([DVC, "init", "-q"], repo, env)
    _run([DVC, "add", "-q", "data"], repo, env)
    _run([DVC, "remote", "add", "-d", "store", f"s3://{bucket}/dvcstore"], repo, env)
    _run([DVC, "remote", "modify", "store", "endpointurl", s3_server.endpoint_url], repo, env)
    _run([DVC, "remote", "modify", "store", "region", s3_server.region], repo, env)
    _run([DVC, "remote", "modify", "--local", "store", "access_key_id", s3_server.access_key_id], repo, env)
    _run([DVC, "remote", "modify", "--local", "store", "secret_access_key", s3_server.secret_access_key], repo, env)
    assert "secret_access_key" not in (repo / ".dvc" / "config").read_text()  # the shared config stays clean

    _run([DVC, "push", "-q"], repo, env)
    pushed = s3_server.client().list_objects_v2(Bucket=bucket, Prefix="dvcstore/")
    assert pushed["KeyCount"] >= 3  # two files plus the directory's .dir listing

    shutil.rmtree(repo / ".dvc" / "cache")
    shutil.rmtree(data)
    _run([DVC, "pull", "-q"], repo, env)
    assert _tree(data) == expected
