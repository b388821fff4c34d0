"""Prefect flows: one per stage, and `pipeline` chaining them. Thin: no ML logic lives here.

Each stage task runs `dvc repro STAGE`, which calls `dreamgym stage STAGE` (stages/STAGE.py) only when its
inputs changed. DVC owns caching and versioning, Prefect owns orchestration, retries and what the UI shows:
a run of the flow and a run of `dvc repro` do the same work once, never twice.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # offline: no telemetry calls

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402

from components.config import load_params  # noqa: E402
from components.reports import metrics_path, report_path  # noqa: E402
from stages import outputs  # noqa: E402
from stages.common import STAGES  # noqa: E402

PARAMS = "params.yaml"  # DVC reads params.yaml from the repository root; so do the flows
# The scripts of this interpreter's environment (dvc, and the `dreamgym` that dvc.yaml calls) come first on PATH,
# so a worker started without activating the venv runs the same code.
BIN = str(Path(sys.executable).parent)


def _env() -> dict[str, str]:
    # unbuffered: a stage's progress lines reach the log as they happen, not when a pipe buffer fills
    return dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1")


# The exit codes of a command ended by SIGTERM or SIGINT, as a shell reports them (128 + the signal) and Python's
# subprocess does (minus it); DVC's error line names the stage's
STOPPED_EXITS = frozenset(code for stop in (signal.SIGINT, signal.SIGTERM) for code in (128 + stop, -stop))
STOPPED_EXIT = re.compile(rf"exited with ({'|'.join(map(str, sorted(STOPPED_EXITS)))})\b")


class CommandFailed(RuntimeError):
    """A command that exited non-zero, with the DVC stage it was running (its last `Running stage` line) and why (its
    last `error:` line, as `dreamgym` reports a failure; else DVC's last `ERROR:` line; else its last line).
    `stopped`: the command, or the stage DVC ran, was ended by SIGTERM or SIGINT (a session's end, a worker shut
    down), so the run was stopped, not failed. SIGKILL is not among them: the kernel's out-of-memory killer sends it."""

    def __init__(self, command: list[str], returncode: int, stage: str | None, reason: str) -> None:
        self.stage, self.reason = stage, reason
        self.stopped = returncode in STOPPED_EXITS or bool(STOPPED_EXIT.search(reason))
        super().__init__(f"{' '.join(command)} exited {returncode}" + (f" in stage {stage}" if stage else "")
                         + f": {reason} (its output is in the log above)")


def run_logged(command: list[str], cwd: str | Path | None = None) -> None:
    """Run a command, streaming its output into the Prefect run log (progress lines show up in the UI). In another
    checkout `cwd` it imports that checkout's code (dreamgym refuses to run one checkout's stages with another's).
    A failure raises `CommandFailed`."""
    logger = get_run_logger()
    env = _env() if cwd is None else dict(_env(), PYTHONPATH=str(Path(cwd).resolve()))
    # errors="replace": a game engine may echo a byte that is not UTF-8 (dumb-frotz on a policy's odd command)
    # its own process group: a stop reaches what it started too (the stage DVC runs)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", env=env, cwd=cwd, start_new_session=True)
    assert process.stdout is not None
    stage, error, dvc_error, last = None, None, None, ""
    try:
        for line in process.stdout:
            line = line.rstrip()
            logger.info(line)
            if found := re.match(r"Running stage '([^']+)'", line):
                stage = found.group(1)
            elif line.startswith("error: "):
                error = line.removeprefix("error: ")
            elif line.startswith("ERROR: "):  # DVC's, after the stage's own error where there is one
                dvc_error = line.removeprefix("ERROR: ")
            last = line.strip() or last
    except BaseException:  # the task stops: so do the command and its stage, or they would run on beside the next run
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    if process.wait() != 0:
        raise CommandFailed(command, process.returncode, stage, error or dvc_error or last)


@task(task_run_name="dvc repro {stage}")
def reproduce(stage: str) -> dict:
    run_logged(["dvc", "repro", stage])
    create_markdown_artifact(key=f"{stage.replace('_', '-')}-report",
                             markdown=report_path(stage).read_text(encoding="utf-8"), description=f"Report of {stage}")
    return json.loads(metrics_path(stage).read_text(encoding="utf-8"))


@task(name="onboard collected seed")
def onboard_collected_seed() -> dict:
    result = outputs.onboard_collected(load_params(PARAMS))
    if result is None:
        get_run_logger().info("nothing collected: every collect_seed environment is a seed-only domain (no "
                              "real-environment adapter), so the pipeline uses the seed data already in data/")
        return {"added": 0, "unchanged": 0, "replaced": 0, "removed": 0}
    get_run_logger().info(result.summary())
    if result.rejected:  # our own collectors wrote these: a rejection is a bug, not user data to set aside
        raise RuntimeError(f"{len(result.rejected)} collected trajectories broke the contract")
    return {"added": result.added, "unchanged": result.unchanged, "replaced": result.replaced,
            "removed": result.removed}


@task(name="onboard on-policy data")
def onboard_on_policy() -> dict:
    """The correction rounds' on-policy trajectories into data/ (correction.onboard_into_seed): what the next
    scheduled retraining trains on. No event is emitted: the run would otherwise trigger the next."""
    result = outputs.onboard_on_policy(load_params(PARAMS))
    if result is None:
        get_run_logger().info("the correction rounds kept no on-policy trajectories: nothing to onboard")
        return {"added": 0, "rejected": 0}
    get_run_logger().info(result.summary())
    return {"added": result.added, "rejected": len(result.rejected)}


@task(name="publish", retries=2, retry_delay_seconds=5)  # uploads replace whole artifacts: safe to retry
def publish(run_id: str, stage: str) -> list[str]:
    uris = outputs.publish(load_params(PARAMS), run_id, stage)
    create_markdown_artifact(key=f"{stage.replace('_', '-')}-outputs", markdown="\n".join(f"- <{u}>" for u in uris),
                             description=f"Stored outputs of {stage}")
    return uris


@task(name="dvc push", retries=2, retry_delay_seconds=5)  # uploads only what the remote lacks: safe to retry
def push() -> str | None:
    """`dvc push` every DVC-tracked output (data and all stages' cached outs) to the default remote; return its
    name, or None, with a log line saying so, when no default remote is configured."""
    logger = get_run_logger()
    config = _dvc_config()
    remote = config.get("core.remote", "")
    if not remote:
        names = sorted({key[len("remote."):].rsplit(".", 1)[0] for key in config if key.startswith("remote.")})
        logger.warning("no default DVC remote%s: outputs stay in the local DVC cache only, nothing pushed "
                       "(`dvc remote add -d NAME URL`, or `dvc remote default NAME`, then `dvc push`)",
                       f" (remotes: {', '.join(names)})" if names else " is configured")
        return None
    if reason := _cannot_push(remote, config):
        logger.warning("nothing pushed to the DVC remote %r: %s; outputs stay in the local DVC cache", remote, reason)
        return None
    run_logged(["dvc", "push", "--remote", remote])
    logger.info("pushed every DVC output to the remote %r", remote)
    return remote


def _dvc_config() -> dict[str, str]:
    """DVC's configuration, every level merged (repository, local, global, system), as `section.key` -> value."""
    listed = subprocess.run(["dvc", "config", "--list"], capture_output=True, text=True, env=_env()).stdout
    return dict(line.split("=", 1) for line in listed.splitlines() if "=" in line)


def _cannot_push(remote: str, config: dict[str, str]) -> str | None:
    """Why pushing to `remote` could only fail, else None: an S3 remote with no credentials anywhere (DVC's config
    or boto3's search: environment, ~/.aws, instance role), e.g. the repository's default remote when the local
    store (infra/s3/start.sh) is not running."""
    url = config.get(f"remote.{remote}.url", "")
    if not url.startswith("s3://") or any(config.get(f"remote.{remote}.{key}")
                                          for key in ("access_key_id", "profile", "credentialpath")):
        return None
    import boto3  # noqa: PLC0415 - only this check needs it

    if boto3.Session().get_credentials() is None:
        return (f"no AWS credentials for {url} (start infra/s3/start.sh, or export AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY), then run `dvc push`")
    return None


def _stage_flow(stage: str):
    @flow(name=stage, flow_run_name=f"{stage}")
    def stage_flow() -> dict:
        return reproduce(stage)
    return stage_flow


STAGE_FLOWS = {stage: _stage_flow(stage) for stage in STAGES}  # in pipeline order


@flow(name="pipeline")
def pipeline_flow() -> dict:
    """Every stage in order, each stage's outputs stored under this run id in the artifact store; then every DVC
    output pushed to the DVC remote, when one is configured."""
    run_id = os.environ.get("DREAMGYM_RUN_ID") or str(flow_run.id)
    results: dict = {"run_id": run_id}
    for stage, stage_flow in STAGE_FLOWS.items():
        results[stage] = stage_flow()
        if stage == "collect_seed":
            results["onboard"] = onboard_collected_seed()
        publish(run_id, stage)
    if load_params(PARAMS).correction.onboard_into_seed:
        results["onboard_on_policy"] = onboard_on_policy()
    # A remote that cannot be reached (no store running, no credentials) leaves the run's outputs local and in the
    # artifact store: the push task shows as failed in the UI and `dvc push` can be rerun by hand; the run stands.
    pushed = push(return_state=True)
    if pushed.is_completed():
        results["dvc_push"] = pushed.result()
    else:
        get_run_logger().warning("dvc push failed (its log is above); the outputs are in the local DVC cache: "
                                 "run `dvc push` once the remote is reachable")
        results["dvc_push"] = "failed"
    return results


FLOWS = {**STAGE_FLOWS, "pipeline": pipeline_flow}
