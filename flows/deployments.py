"""Deployments of the `pipeline` flow: retraining on a cron schedule, and when new seed data is onboarded.

`dreamgym deploy` registers them on the Prefect server that PREFECT_API_URL names, in a process work pool; a
worker of that pool (infra/prefect/start.sh starts one) runs the flow in this checkout. Deploy rather than serve,
because that is what a platform team runs: server and workers are long-lived services, the deployments and
their schedules live on the server and outlast the command that registered them, and any worker of the pool
can pick up the runs. `flow.serve` would tie schedules and triggers to one foreground process (and pause the
schedule whenever that process stops), which suits a notebook, not a retraining service.

The onboarding trigger: `dreamgym data onboard` emits the event SEED_ONBOARDED about the data directory it wrote
(`announce_onboarded`); the deployment's DeploymentEventTrigger matches that directory of this checkout, so
onboarding elsewhere retrains nothing here. The pipeline's own onboarding of collected seed emits nothing, or
each run would trigger the next.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from uuid import UUID

from components.config import Params

SEED_ONBOARDED = "dreamgym.seed.onboarded"
PIPELINE_ENTRYPOINT = "flows/pipeline.py:pipeline_flow"  # relative to the checkout: the worker runs it there
STUDY_ROW_ENTRYPOINT = "flows/study.py:study_row_flow"
STUDY_ROW_DEPLOYMENT = "rows"  # study_row/rows in the UI
CRON_SLUG = "retrain-cron"  # a named schedule: a later deploy updates it in place instead of adding another

logger = logging.getLogger(__name__)


def seed_resource_id(data_dir: str | Path) -> str:
    """The Prefect resource an onboarding event is about: one data directory, by absolute path."""
    return f"dreamgym.seed.{Path(data_dir).resolve()}"


def retraining_deployment(root: Path, params: Params):
    """The pipeline flow of the checkout at `root` as a RunnerDeployment: schedule, trigger, work pool."""
    from prefect import Flow
    from prefect.events import DeploymentEventTrigger
    from prefect.schedules import Cron

    settings = params.prefect
    # from_source on a local directory: the deployment's pull step sets the worker's working directory to the
    # checkout, where the flow finds params.yaml and dvc.yaml, as `dreamgym flow pipeline` does.
    pipeline = Flow.from_source(source=str(root), entrypoint=PIPELINE_ENTRYPOINT)
    schedules = [Cron(settings.retrain_cron, timezone=settings.timezone, slug=CRON_SLUG)] \
        if settings.retrain_cron else []
    triggers = [DeploymentEventTrigger(
        name="retrain on onboarded seed",
        expect={SEED_ONBOARDED},
        match={"prefect.resource.id": seed_resource_id(root / params.data.dir)},
    )] if settings.retrain_on_onboard else []
    return pipeline.to_deployment(
        name=settings.deployment,
        schedules=schedules,
        triggers=triggers,
        # One run at a time: a scheduled and a triggered run in one checkout would fight over DVC's lock.
        concurrency_limit=1,
        work_pool_name=settings.work_pool,
        description=f"Retrain the DreamGym pipeline in {root}",
        tags=["dreamgym", "retrain"],
    )


def deploy(root: Path, params: Params) -> list[UUID]:
    """Register the deployments on the configured server, creating the process work pool if it is missing."""
    from prefect import deploy as prefect_deploy

    ensure_process_pool(params.prefect.work_pool)
    if not params.prefect.retrain_cron:
        remove_retrain_schedule(params.prefect.deployment)
    return prefect_deploy(retraining_deployment(root, params), work_pool_name=params.prefect.work_pool,
                          build=False, push=False, print_next_steps_message=False, ignore_warnings=True)


def deploy_study_row(root: Path, params: Params) -> UUID:
    """Register the study_row flow of the checkout at `root` on the configured server (the results study's runs,
    with study.on_work_pool), in the process work pool; no schedule: the study submits its runs. Any number at once:
    each has a workspace of its own, and the pool's workers decide how many run together."""
    from prefect import Flow
    from prefect import deploy as prefect_deploy

    ensure_process_pool(params.prefect.work_pool)
    row = Flow.from_source(source=str(root), entrypoint=STUDY_ROW_ENTRYPOINT).to_deployment(
        name=STUDY_ROW_DEPLOYMENT, work_pool_name=params.prefect.work_pool,
        description=f"A results-study run of {root}, in a workspace of its own", tags=["dreamgym", "study"])
    [deployment_id] = prefect_deploy(row, work_pool_name=params.prefect.work_pool, build=False, push=False,
                                     print_next_steps_message=False, ignore_warnings=True)
    return deployment_id


def online_workers(pool: str) -> list[str]:
    """The names of the pool's workers the server sees online."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import WorkerStatus

    with get_client(sync_client=True) as client:
        return [worker.name for worker in client.read_workers_for_work_pool(pool)
                if worker.status == WorkerStatus.ONLINE]


def remove_retrain_schedule(deployment: str) -> None:
    """A deploy updates the named schedules it sends and keeps the others, so a schedule set to null in
    params.yaml is deleted here, with its future runs. Before the deploy, not after: the update that follows is
    what the server's scheduler looks at, and it then finds no schedule to create runs from."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            deployment_id = client.read_deployment_by_name(f"pipeline/{deployment}").id
        except ObjectNotFound:
            return
        for schedule in client.read_deployment_schedules(deployment_id):
            if schedule.slug == CRON_SLUG:
                client.delete_deployment_schedule(deployment_id, schedule.id)


def ensure_process_pool(name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
        except ObjectAlreadyExists:
            pass


def configured_api_url() -> str | None:
    """PREFECT_API_URL from the environment or the active Prefect profile (`prefect config set ...`)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # offline: no telemetry calls
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def announce_onboarded(data_dir: str | Path, added: int, replaced: int, unchanged: int, rejected: int) -> bool:
    """Emit SEED_ONBOARDED to the configured Prefect server, if there is one and it answers. True when sent.

    Without a server, onboarding goes on: the event is a notification, not part of storing the data.
    """
    api_url = configured_api_url()
    if not api_url:
        # Without one Prefect would start a temporary server just to receive an event nobody listens to.
        return False
    from prefect.client.orchestration import get_client
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    with get_client(sync_client=True) as client:
        unreachable = client.api_healthcheck()
    if unreachable is not None:
        logger.warning("Prefect API %s did not answer (%s): no retraining triggered", api_url, unreachable)
        return False
    event = emit_event(
        SEED_ONBOARDED,
        resource={"prefect.resource.id": seed_resource_id(data_dir), "prefect.resource.name": str(data_dir)},
        payload={"added": added, "replaced": replaced, "unchanged": unchanged, "rejected": rejected},
    )
    EventsWorker.drain_all()  # events are sent in the background; this process is about to exit
    return event is not None
