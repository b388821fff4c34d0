"""Prefect flows: thin wrappers that run the component stages as named tasks. No ML logic lives here."""
from __future__ import annotations

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # offline: no telemetry calls

from prefect import flow, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact  # noqa: E402

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


@flow(name="pipeline")
def pipeline_flow(params_path: str = "params.yaml") -> dict:
    """Every stage in order; later issues add their stages here."""
    return {"validate": validate_flow(params_path)}


FLOWS = {"validate": validate_flow, "pipeline": pipeline_flow}
