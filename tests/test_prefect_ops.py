"""Prefect operations on a real server (infra/prefect/start.sh: `prefect server start` + a process worker).

The ephemeral test-harness server runs no scheduler, so a schedule never produces runs there: these tests use
the real server of the `prefect_service` fixture, which runs every service. Deployments of the ML pipeline go to
params.yaml's pool `dreamgym`, which no worker polls here: their runs are created and stay scheduled, and
nothing trains.
"""
from __future__ import annotations

import socket
import tempfile
import time
from datetime import timezone
from pathlib import Path

import pytest

from tests.conftest import run, set_params


def wait_for(read, timeout_s: float = 90, every_s: float = 1):
    """Call `read` until it returns something truthy; the server's services work on their own loops."""
    deadline = time.monotonic() + timeout_s
    while not (value := read()):
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing after {timeout_s:g} s")
        time.sleep(every_s)
    return value


def deployment_runs(client, deployment_id):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


def test_deploy_schedules_weekly_retraining_runs(project, prefect_api):
    """`dreamgym deploy` registers pipeline/retrain with params.yaml's cron; the server's scheduler creates runs."""
    from prefect.client.orchestration import get_client

    deployed = run("dreamgym", "deploy", cwd=project)
    assert "Deployed pipeline/retrain" in deployed.stdout and "cron '0 3 * * 0' (UTC)" in deployed.stdout
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("pipeline/retrain")
        runs = wait_for(lambda: deployment_runs(client, deployment.id))
    assert deployment.work_pool_name == "dreamgym" and deployment.entrypoint == "flows/pipeline.py:pipeline_flow"
    assert deployment.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(project)}}]
    [schedule] = deployment.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone, schedule.active) == ("0 3 * * 0", "UTC", True)
    assert all(r.state.is_scheduled() and "auto-scheduled" in r.tags for r in runs)
    for start in (r.expected_start_time.astimezone(timezone.utc) for r in runs):  # Sundays at 03:00 UTC
        assert (start.weekday(), start.hour, start.minute) == (6, 3, 0)

    # Deploying again with another cron updates the one named schedule in place: no second schedule appears.
    run("dreamgym", "--set", "prefect.retrain_cron=30 4 * * 1", "deploy", cwd=project)
    with get_client(sync_client=True) as client:
        [schedule] = client.read_deployment_by_name("pipeline/retrain").schedules
        assert schedule.schedule.cron == "30 4 * * 1"
        # With the cron set to null, the schedule and its scheduled runs are gone.
        run("dreamgym", "--set", "prefect.retrain_cron=null", "deploy", cwd=project)
        assert client.read_deployment_by_name("pipeline/retrain").schedules == []
        time.sleep(8)  # the scheduler looks at recently updated deployments every 5 s: it must create nothing
        assert deployment_runs(client, deployment.id) == []


def test_onboarding_new_seed_data_triggers_a_retraining_run(project, prefect_api):
    """`dreamgym data onboard` emits dreamgym.seed.onboarded; the deployment's event trigger creates a run."""
    from prefect.client.orchestration import get_client

    # A deployment of its own, without a schedule: every run of it is a triggered one.
    set_params(project, {"prefect.retrain_cron": None, "prefect.deployment": "retrain-on-onboard"})
    run("dreamgym", "deploy", cwd=project)
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("pipeline/retrain-on-onboard")
        assert not deployment.schedules and not deployment_runs(client, deployment.id)

        onboarded = run("dreamgym", "data", "onboard", "examples/seed/demo-kitchen.jsonl", cwd=project)
        assert "24 new" in onboarded.stdout and "Sent Prefect the event dreamgym.seed.onboarded" in onboarded.stdout
        [triggered] = wait_for(lambda: deployment_runs(client, deployment.id))
        [event] = wait_for(lambda: _onboarding_events(client))
    assert triggered.state.type.value == "SCHEDULED"  # Scheduled or Late: no worker polls the pool `dreamgym`
    assert triggered.created_by is not None and triggered.created_by.type == "AUTOMATION"
    assert event.resource.id == f"dreamgym.seed.{project / 'data'}"
    assert event.payload == {"added": 24, "replaced": 0, "unchanged": 0, "rejected": 0}

    again = run("dreamgym", "data", "onboard", "examples/seed/demo-kitchen.jsonl", cwd=project)
    assert "24 already stored" in again.stdout and "Sent Prefect" not in again.stdout  # nothing new: no retraining


def _onboarding_events(client):
    from prefect.events.filters import EventFilter, EventNameFilter

    # limit: the client defaults to 100, which this server (at most 50) rejects
    return client.read_events(EventFilter(event=EventNameFilter(name=["dreamgym.seed.onboarded"])), limit=50).events


def test_onboarding_without_a_reachable_server_still_stores_the_data(project, monkeypatch):
    """A PREFECT_API_URL nobody answers costs one log line; the onboarding itself succeeds."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{closed_port}/api")
    result = run("dreamgym", "data", "onboard", "--no-version", "examples/seed/demo-kitchen.jsonl", cwd=project)
    assert "24 new" in result.stdout and "did not answer" in result.stderr
    assert (project / "data" / "trajectories.jsonl").exists()


def test_worker_from_start_script_runs_a_deployed_flow(prefect_api, tmp_path):
    """The process worker started by infra/prefect/start.sh runs a deployment made from a local directory, the way
    `dreamgym deploy` makes the pipeline's (a small flow here: the pipeline itself would train)."""
    from prefect import Flow
    from prefect.deployments import run_deployment

    (tmp_path / "small.py").write_text("from prefect import flow\n\n\n@flow(name='small')\n"
                                       "def small() -> int:\n    return 42\n")
    deployment_id = Flow.from_source(source=str(tmp_path), entrypoint="small.py:small").deploy(
        name="worker-check", work_pool_name=prefect_api.worker_pool, print_next_steps=False, ignore_warnings=True)
    finished = run_deployment(deployment_id, timeout=180)
    assert finished.state.is_completed(), finished.state


def test_prefect_ui_lists_a_flow_run(prefect_api, tmp_path):
    """The Prefect UI of the real server, in headless Chromium, shows a run of a small flow on its runs page."""
    if not (Path("/usr/bin/chromium").exists() and Path("/usr/bin/chromedriver").exists()):
        pytest.skip("needs Debian chromium and chromium-driver")
    from prefect import flow
    from prefect.client.orchestration import get_client
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.wait import WebDriverWait

    from components.envs.miniwob import CHROME_FLAGS, DEBIAN_BINARIES

    @flow(name="ui-check")
    def ui_check() -> str:
        return "shown"

    state = ui_check(return_state=True)
    with get_client(sync_client=True) as client:
        name = client.read_flow_run(state.state_details.flow_run_id).name

    options = webdriver.ChromeOptions()
    for flag in (*CHROME_FLAGS, f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.binary_location = DEBIAN_BINARIES["MINIWOB_CHROME_BINARY"]
    driver = webdriver.Chrome(service=Service(DEBIAN_BINARIES["MINIWOB_CHROMEDRIVER"]), options=options)
    try:
        driver.get(f"{prefect_api.ui_url}/runs")
        try:  # the page renders client-side from the API: wait for the run to appear in the list
            WebDriverWait(driver, 90, poll_frequency=1).until(lambda d: name in d.find_element("tag name", "body").text)
        finally:
            driver.save_screenshot(str(tmp_path / "runs.png"))  # for a failing run: what the browser saw
        assert "ui-check" in driver.find_element("tag name", "body").text
    finally:
        driver.quit()
