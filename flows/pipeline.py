"""Prefect flows: thin wrappers that run the component stages as named tasks. No ML logic lives here."""
from __future__ import annotations

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # offline: no telemetry calls

from prefect import flow, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402

from components import stages  # noqa: E402
from components.config import load_params  # noqa: E402
from components.reports import report_path  # noqa: E402


@task(name="validate")
def validate_task(params_path: str) -> dict:
    metrics = stages.validate(load_params(params_path))
    create_markdown_artifact(key="validate-report", markdown=report_path("validate").read_text(encoding="utf-8"),
                             description="Seed data validation")
    return metrics


@flow(name="validate")
def validate_flow(params_path: str = "params.yaml") -> dict:
    return validate_task(params_path)


@task(name="publish", retries=2, retry_delay_seconds=5)  # uploads are idempotent: safe to retry
def publish_task(params_path: str, run_id: str, stage: str) -> list[str]:
    uris = stages.publish(load_params(params_path), run_id, stage)
    create_markdown_artifact(key=f"{stage}-outputs", markdown="\n".join(f"- <{uri}>" for uri in uris),
                             description=f"Stored outputs of {stage}")
    return uris


@flow(name="pipeline")
def pipeline_flow(params_path: str = "params.yaml") -> dict:
    """Every stage in order, each stage's outputs stored under this run; later issues add their stages here."""
    run_id = os.environ.get("DREAMGYM_RUN_ID") or str(flow_run.id)
    results = {"run_id": run_id}
    for stage, stage_flow in STAGE_FLOWS.items():
        results[stage] = stage_flow(params_path)
        publish_task(params_path, run_id, stage)
    return results


STAGE_FLOWS = {"validate": validate_flow}  # in pipeline order
FLOWS = {**STAGE_FLOWS, "pipeline": pipeline_flow}
