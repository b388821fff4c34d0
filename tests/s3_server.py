"""Session fixture `s3_server`: a real S3-compatible store (infra/s3/start.sh: Swift + s3api) for the tests.

It runs on free loopback ports with its own state directory, exports the AWS_* variables boto3 and DVC read for
as long as it runs, and is stopped and purged (infra/s3/stop.sh --purge) at the end of the session. The first
start on a fresh machine installs the Debian packages (about a minute); later starts take a few seconds.
"""
from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

INFRA = Path(__file__).resolve().parents[1] / "infra" / "s3"
PORTS_USED = 5  # start.sh listens on PORT..PORT+4


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    access_key_id: str
    secret_access_key: str
    region: str
    state_dir: Path

    def client(self):  # a boto3 client for assertions that look behind the code under test
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region,
            aws_access_key_id=self.access_key_id, aws_secret_access_key=self.secret_access_key,
            config=Config(s3={"addressing_style": "path"}),
        )


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port_block() -> int:
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + PORTS_USED <= 65535 and all(_port_free(p) for p in range(port, port + PORTS_USED)):
            return port
    raise RuntimeError(f"found no {PORTS_USED} consecutive free ports on 127.0.0.1")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    state_dir = tmp_path_factory.mktemp("s3-store")
    port = _free_port_block()
    env = {**os.environ, "DREAMGYM_S3_PORT": str(port), "DREAMGYM_S3_DIR": str(state_dir)}
    env.setdefault("DREAMGYM_S3_TIMEOUT", "180")  # generous: CI machines running other suites can be slow
    started = subprocess.run([str(INFRA / "start.sh")], check=False, env=env, capture_output=True, text=True,
                             timeout=900)
    if started.returncode != 0:
        pytest.fail(f"infra/s3/start.sh failed (exit {started.returncode}):\n{started.stderr[-4000:]}", pytrace=False)
    # start.sh prints the one line a user would eval: export AWS_ENDPOINT_URL=... AWS_ACCESS_KEY_ID=... ...
    exported = dict(item.split("=", 1) for item in started.stdout.strip().splitlines()[-1].split()[1:])
    server = S3Server(
        endpoint_url=exported["AWS_ENDPOINT_URL"],
        access_key_id=exported["AWS_ACCESS_KEY_ID"],
        secret_access_key=exported["AWS_SECRET_ACCESS_KEY"],
        region=exported["AWS_DEFAULT_REGION"],
        state_dir=state_dir,
    )
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, value in exported.items():
                mp.setenv(name, value)
            # Nothing of the developer's own AWS setup may leak in: profiles, config files, instance metadata.
            for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_PROFILE"):
                mp.delenv(name, raising=False)
            mp.setenv("AWS_CONFIG_FILE", str(state_dir / "no-aws-config"))
            mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(state_dir / "no-aws-credentials"))
            mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
            yield server
    finally:
        stopped = subprocess.run([str(INFRA / "stop.sh"), "--purge"], check=False, env=env, capture_output=True,
                                 text=True, timeout=120)
        if stopped.returncode != 0:
            pytest.fail(f"infra/s3/stop.sh failed (exit {stopped.returncode}):\n{stopped.stderr}", pytrace=False)
