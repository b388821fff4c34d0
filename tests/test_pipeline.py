"""The pipeline as it exists, through DVC and through a real (temporary) Prefect server."""
import json

import pytest

from tests.conftest import run


@pytest.fixture
def onboarded(project):
    run("dreamgym", "data", "onboard", "examples/seed/demo-kitchen.jsonl", cwd=project)
    return project


def test_dvc_repro_runs_validate_then_is_up_to_date(onboarded):
    run("dvc", "repro", cwd=onboarded)
    metrics = json.loads((onboarded / "metrics" / "validate.json").read_text())
    assert metrics["trajectories"] == 24 and 0 < metrics["success_rate"] < 1
    assert "| demo-kitchen | expert | 24 |" in (onboarded / "reports" / "validate.md").read_text()
    again = run("dvc", "repro", cwd=onboarded)
    assert "didn't change, skipping" in again.stdout or "up to date" in again.stdout


def test_validate_stage_rejects_hand_edited_data(onboarded):
    path = onboarded / "data" / "trajectories.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[0])
    record["steps"][0]["reward"] = 9.0
    path.write_text("\n".join([json.dumps(record)] + lines[1:]) + "\n")
    result = run("dreamgym", "stage", "validate", cwd=onboarded, check=False)
    assert result.returncode == 1 and "break the contract" in result.stderr and "steps[0].reward" in result.stderr


def test_prefect_pipeline_flow(onboarded, monkeypatch, prefect_server):
    from prefect.client.orchestration import get_client

    from flows.pipeline import pipeline_flow

    monkeypatch.chdir(onboarded)
    state = pipeline_flow(return_state=True)
    assert state.is_completed()
    assert state.result()["validate"]["trajectories"] == 24
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs()
        names = {client.read_flow(r.flow_id).name for r in runs}
        artifact = client.read_artifacts()[0]
    assert {"pipeline", "validate"} <= names and all(r.state.is_completed() for r in runs)
    assert artifact.key == "validate-report" and "demo-kitchen" in artifact.data
