"""The results study as a Prefect flow: every variant of components/results/study.py as one `dvc exp run`, then
the table.

Thin, like flows/pipeline.py: DVC reruns only what a variant's params change (the ablations reuse the cached
warm start, sim-to-real variants the cached synthetic RL, and real-environment rows leave synthetic RL out), each
finished run's metrics are kept in
`study.results_dir/<environment>/<variant>-seed<k>/` so a rerun skips it, and the report is a Prefect artifact.

With `study.on_work_pool`, each run is a flow run of the `study_row` deployment on `prefect.work_pool` instead: a
worker runs it in a workspace of its own (components/results/workspace.py) and returns its files, which this flow
keeps; the pool's workers run as many rows at once as they take (`prefect worker start --limit 1` each, one per
machine or per core budget).
"""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.states import Cancelled, State

from components.config import Params, active_profile, load_params, write_params
from components.data.contract import TRAJECTORIES
from components.files import atomic_write_text
from components.results import study
from components.results.workspace import (
    claimed,
    keeping_commits,
    make_workspace,
    park,
    reattach_head,
    unpark,
    working_state,
)
from flows import deployments
from flows.pipeline import PARAMS, CommandFailed, onboard_collected_seed, reproduce, run_logged
from stages import outputs, sim_to_real
from stages.common import StageError
from stages.correction_rounds import round_path

# The user's params.yaml while a run's overrides are in it: a study killed mid-run (a session's end, a crash) would
# otherwise leave them there, and every later run would inherit them (an ablation would train the killed run's
# algorithm). The next study puts the file back first.
PARAMS_BACKUP = Path(".dvc/tmp/study-params.yaml")

log = logging.getLogger(__name__)

# A row's wall time over its invocations: a study killed mid-row (a session's end) cannot record what the row took,
# so the running row's clock is written here every minute and the row's next invocation goes on from it.
ROW_CLOCKS = Path(".dvc/tmp/study-clocks")
# Prefect's messages for a flow run whose process was ended by SIGTERM or SIGINT (its Crashed state)
STOPPED_FLOW_RUN_MESSAGES = ("aborted by a termination signal", "aborted by an interrupt signal")
TICK_SECONDS = 60.0  # between a running row's clock saves (and, with study.parked_rows, parking passes)


class RowFailed(Exception):
    """A row's failed attempt, raised by its flow run so that Prefect ends it Failed and keeps this exception as the
    run's result: `record` (the attempt's time over all invocations, its stage, why) is what the study keeps."""

    def __init__(self, message: str, record: dict[str, Any]):
        super().__init__(message, record)  # both in args: the exception pickles into the result store and back
        self.record = record

    def __str__(self) -> str:
        return self.args[0]


class RowClock:
    """A row's wall time: `earlier`, its stopped invocations' (the clock file they left), and this invocation's."""

    def __init__(self, path: Path) -> None:
        self.path, self.recorded = path, False
        self.earlier = float(json.loads(path.read_text(encoding="utf-8"))["seconds"]) if path.is_file() else 0.0
        self.started = time.monotonic()

    @property
    def seconds(self) -> float:
        return self.earlier + time.monotonic() - self.started

    def save(self) -> None:
        if self.recorded:  # the row's record holds its time now
            return
        atomic_write_text(self.path, json.dumps({"seconds": round(self.seconds, 1)}))


@contextmanager
def row_clock(name: str, every: float = TICK_SECONDS, on_tick: Callable[[], None] | None = None) -> Iterator[RowClock]:
    """The clock named `name` (`RowClock`), saved every `every` seconds while the row runs, and `on_tick` called
    then. Its file goes when the caller has recorded the row's time (`clock.recorded`: finished, or a failed attempt
    kept); a stopped row (SIGTERM, SIGKILL) leaves it for the next invocation."""
    clock, stop = RowClock(ROW_CLOCKS / f"{name}.json"), threading.Event()

    def tick() -> None:
        while not stop.wait(every):
            clock.save()
            if on_tick is not None and not clock.recorded:  # recorded: the row is done, its workspace going
                on_tick()

    clock.save()
    ticking = threading.Thread(target=tick, name=f"clock {name}", daemon=True)
    ticking.start()
    try:
        yield clock
    finally:
        stop.set()
        ticking.join()
        if clock.recorded:
            clock.path.unlink(missing_ok=True)
        else:
            clock.save()


def restore_params() -> bool:
    """Put back the params.yaml a killed study left with a run's overrides (`put_back_params`); whether there was
    one to put back."""
    if not PARAMS_BACKUP.is_file():
        return False
    put_back_params(PARAMS_BACKUP.read_text(encoding="utf-8"))
    PARAMS_BACKUP.unlink()
    return True


def put_back_params(original: str) -> None:
    """The user's params.yaml, `original`, in place of a run's. A `dvc exp run` that was stopped also leaves the
    overridden file staged, and with it in the index every later `dvc exp run` fails ("Stash apply resulted in merge
    conflicts"): a staged params.yaml that is not the user's file is unstaged."""
    Path(PARAMS).write_text(original, encoding="utf-8")
    staged = subprocess.run(["git", "show", f":{PARAMS}"], capture_output=True, text=True)
    if staged.returncode == 0 and staged.stdout != original:
        subprocess.run(["git", "reset", "--quiet", "--", PARAMS], capture_output=True, check=True)


ROW_WORKSPACES = Path(".dvc/tmp/study_rows")  # a row's workspace, by profile and row, in the worker's checkout
PARKED_CLOCK, PARKED_FILES = "clock.json", "workspace"  # in a row's folder of study.parked_rows


def park_row(name: str, profile: str, workspace: Path, parked: Path, params: Params) -> int:
    """The resume state of the row's workspace (`outputs.resume_state` by its `params`) and its clock mirrored in
    `parked`, the row's folder of study.parked_rows (`workspace.park`); bytes copied. Parking runs beside the row,
    which may remove a file it is copying (a pruned checkpoint): that pass is given up with a warning, and the next
    one parks it."""
    try:
        copied = park(outputs.resume_state(params, workspace), workspace, parked / PARKED_FILES)
        if (clock := ROW_CLOCKS / profile / f"{name}.json").is_file():
            parked.mkdir(parents=True, exist_ok=True)  # a row with no resume state yet has a clock to park
            shutil.copy2(clock, parked / PARKED_CLOCK)
    except OSError as error:  # a file gone mid-copy; the workspace removed as the row ended
        log.warning("%s: parking its resume state in %s failed this time (%s); the next pass tries again", name,
                    parked, error)
        return 0
    return copied


def unpark_clock(name: str, profile: str, parked: Path) -> None:
    """The row's clock from `parked` where this checkout has none: the machine that parked it is gone, or a stop
    ended the row's last run here before it could save its clock."""
    clock = ROW_CLOCKS / profile / f"{name}.json"
    if (parked / PARKED_CLOCK).is_file() and not clock.is_file():
        clock.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(parked / PARKED_CLOCK, clock)


def run_command(overrides: dict, target: str, cwd: str | Path | None = None) -> list[str]:
    """The row's DVC command up to `target`: `dvc exp run` with the overrides. A row that leaves out the stages it
    needs nothing from (`study.stages_not_needed`) runs `dvc repro --single-item` of the stages `target` needs without
    them, in DVC's order (each still run when it changed), on a params.yaml holding its overrides and with stand-ins
    for their outputs (`run_row`): `dvc exp run` first checks out every output upstream of its targets, which removes
    a stand-in, so that row is not recorded as a DVC experiment."""
    if skipped := study.stages_not_needed(overrides, target):
        return ["dvc", "repro", "--single-item", *stages_without(target, skipped, cwd)]
    return ["dvc", "exp", "run", *[f"--set-param={key}={json.dumps(value)}" for key, value in overrides.items()],
            target]


def stages_without(target: str, skipped: tuple[str, ...], cwd: str | Path | None = None) -> list[str]:
    """The pipeline stages `target` needs, itself last, in the order DVC runs them, leaving out `skipped` and what
    only they need."""
    with _pipeline(cwd) as (graph, stages):
        return [stage.name for stage in _kept(graph, stages, target, skipped)]


def unneeded_dependencies(skipped: tuple[str, ...], target: str, cwd: str | Path | None = None) -> list[str]:
    """The outputs of the `skipped` stages that the stages run without them depend on (as dvc.yaml names them)."""
    with _pipeline(cwd) as (graph, stages):
        outputs = {out.def_path for name in skipped for out in stages[name].outs}
        return sorted({dep.def_path for stage in _kept(graph, stages, target, skipped) for dep in stage.deps}
                      & outputs)


def _kept(graph: Any, stages: dict[str, Any], target: str, skipped: tuple[str, ...]) -> list[Any]:
    """`stages_without`'s stages, from DVC's graph (changed: `skipped` are removed from it)."""
    import networkx as nx

    graph.remove_nodes_from(stages[name] for name in skipped)
    return [stage for stage in nx.dfs_postorder_nodes(graph, stages[target]) if getattr(stage, "cmd", None)]


@contextmanager
def _pipeline(cwd: str | Path | None) -> Iterator[tuple[Any, dict[str, Any]]]:
    """DVC's stage graph (a stage -> the stages it depends on; a copy) and its stages by name."""
    from dvc.repo import Repo

    with Repo(str(cwd or ".")) as repo:
        graph = repo.index.graph.copy()
        yield graph, {getattr(stage, "name", None): stage for stage in graph.nodes}


@contextmanager
def stand_ins(overrides: dict, target: str, cwd: str | Path | None = None) -> Iterator[list[Path]]:
    """While a row runs without the stages it needs nothing from (`study.stages_not_needed`): a stand-in for each of
    their outputs that a stage it runs depends on and that is missing (a fresh workspace's), since DVC refuses to run
    a stage with a missing dependency; a directory with NOT_RUN.md, a JSON file `{"not_run": why}` or a note. Removed
    afterwards: they are no stage's output, and a later row that needs the stage runs it. Yields what it made."""
    skipped = study.stages_not_needed(overrides, target)
    why = (f"not run: this row needs nothing of {' or '.join(skipped)} (study.stages_not_needed); a stand-in, so "
           "that DVC finds the dependency it declares")
    root, made = Path(cwd or ".").resolve(), []
    try:
        for name in unneeded_dependencies(skipped, target, cwd) if skipped else []:
            path = root / name
            if path.exists():
                continue
            made.append(path)
            marker = path / "NOT_RUN.md" if not path.suffix else path
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"not_run": why}) if path.suffix == ".json" else why + "\n", encoding="utf-8")
        yield made
    finally:
        for path in made:  # only what it wrote: never an output a stage made meanwhile
            marker = path / "NOT_RUN.md" if not path.suffix else path
            marker.unlink(missing_ok=True)
            for folder in [path] * (not path.suffix) + list(path.parents):
                if folder == root or not folder.is_dir() or any(folder.iterdir()):
                    break
                folder.rmdir()  # the folders it made, now empty


def results_folder(run_dir: Path, name: str) -> Path:
    """The study's results folder, from a row's folder in it (`<environment>/<variant>-seed<k>`)."""
    return run_dir.parents[len(Path(name).parts) - 1]


def head_commit(cwd: str | Path = ".") -> str:
    """HEAD's hash; "" in a repository with no commit (where `git rev-parse` prints "HEAD" back)."""
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=cwd)
    return done.stdout.strip() if done.returncode == 0 else ""


def run_record(name: str, overrides: dict, profile: str, seconds: float, cwd: str | Path = ".",
               simulator_not_scored: str | None = None, earlier_seconds: float = 0.0) -> dict:
    """What the study keeps about a run; `seconds` is its wall time over all its invocations, `earlier_seconds` the
    part of it that invocations stopped before the last one took (`RowClock`)."""
    return {"run": name, "params_set": overrides, "profile": profile, "commit": head_commit(cwd),
            "seconds": round(seconds, 1), **({"earlier_seconds": round(earlier_seconds, 1)} if earlier_seconds else {}),
            **({"simulator_not_scored": simulator_not_scored} if simulator_not_scored else {})}


def run_row(name: str, overrides: dict, target: str, measures_simulator: bool, cwd: str | Path | None = None
            ) -> str | None:
    """The row's DVC run up to `target` (`run_command`), then, for a row whose policies come from synthetic RL, the
    scoring of its experience model in a run of its own (`study.scoring_overrides`: fallbacks measured, not a reason
    to stop), so that its failing loses none of the row's evaluation; why the model was not scored, or None. Rows
    sharing an experience model score it once: DVC restores the others from its run cache."""
    if study.stages_not_needed(overrides, target):  # `dvc repro`: its overrides go into params.yaml first
        write_params(overrides, Path(cwd or ".") / PARAMS)
    with stand_ins(overrides, target, cwd), commits_kept(name, cwd):
        run_logged(run_command(overrides, target, cwd), cwd=cwd)
    if not measures_simulator:
        return None
    try:
        with commits_kept(name, cwd):
            run_logged(run_command(study.scoring_overrides(overrides), "evaluate_experience_model"), cwd=cwd)
    except RuntimeError:
        get_run_logger().warning("%s: evaluate_experience_model failed (its output is above); the row is kept "
                                 "without the simulator's fidelity", name)
        return "evaluate_experience_model failed (the row's log says why)"
    return None


@contextmanager
def commits_kept(name: str, cwd: str | Path | None = None) -> Iterator[None]:
    """The commits made in the checkout while a row's `dvc exp run` ran, put back on the branch that run takes them
    off (`workspace.keeping_commits`), with a warning either way."""
    try:
        with keeping_commits(cwd or ".") as made:
            yield
    finally:
        if made.commits:
            get_run_logger().warning(
                "%s: %d commit(s) made in this checkout while the row ran (%s) %s. `dvc exp run` detaches HEAD while "
                "it runs: commit in another clone while a study row runs here", name, len(made.commits),
                ", ".join(sha[:8] for sha in made.commits), "are back on the branch" if made.restored else
                f"fell off the branch (their files are in the working tree): `git reset {made.commits[-1][:8]}` "
                "puts them back")


@task(task_run_name="{name}")
def run_variant(name: str, overrides: dict, run_dir: Path, target: str, evaluated_in: Path | None = None,
                measures_simulator: bool = False) -> None:
    """One pipeline run with `overrides` up to the stage `target` (`run_row`); its metrics (from the stage root
    `evaluated_in` where it is not the project's) and record are kept in `run_dir`."""
    original, profile = Path(PARAMS).read_text(encoding="utf-8"), active_profile(PARAMS)  # before the overrides
    atomic_write_text(PARAMS_BACKUP, original)  # a half-written backup would be restored over the user's file
    with row_clock(f"{profile}/{name}") as clock:  # the same row at another profile is another run
        try:  # `dvc exp run -S` writes the overrides into params.yaml: put the user's file back after every run
            not_scored = run_row(name, overrides, target, measures_simulator)
        except CommandFailed as error:  # kept: what the attempt cost and why it failed, for the plan to show
            if not error.stopped:  # a stopped run failed nothing: its clock goes on in the row's next run
                study.record_failure(results_folder(run_dir, name), {
                    **run_record(name, overrides, profile, clock.seconds, earlier_seconds=clock.earlier),
                    "stage": error.stage, "reason": error.reason})
                clock.recorded = True
            raise
        finally:  # a stopped run (SIGTERM) comes here too
            put_back_params(original)
            PARAMS_BACKUP.unlink(missing_ok=True)
        study.keep_run(run_dir, run_record(name, overrides, profile, clock.seconds, simulator_not_scored=not_scored,
                                           earlier_seconds=clock.earlier),
                       evaluated_in=evaluated_in, simulator=measures_simulator and not not_scored,
                       not_needed=study.stages_not_needed(overrides, target))
        clock.recorded = True


@flow(name="study_row", flow_run_name="{name}", persist_result=True)
def study_row_flow(name: str, overrides: dict, target: str, evaluated_in: str | None, commit: str,
                   state: dict[str, str], profile: str, measures_simulator: bool = False) -> dict[str, str] | State:
    """One study run on a worker: a workspace of the study's `commit` and working `state` (params.yaml, data.dvc,
    dvc.lock) sharing this checkout's DVC cache, the run there, and its files (what `study.keep_run` keeps, by name)
    returned to the study; a run that fails raises `RowFailed` with the attempt's record (its time over all
    invocations, its stage, why), which Prefect keeps as the Failed run's result for the study. The workspace is the
    row's (by profile and name): a row stopped mid-run (a worker killed at a session's end) goes on from its
    checkpoints there in the next flow run, its wall time too (`row_clock`). It is removed after a run that finished,
    kept after one that failed."""
    workspace = ROW_WORKSPACES / profile / name
    with claimed(workspace), ExitStack() as running:
        fresh = not workspace.exists()
        workspace = make_workspace(".", commit, workspace, state)
        params = load_params(workspace / PARAMS)
        parked = Path(params.study.parked_rows) / name if params.study.parked_rows else None
        if parked is not None:
            unpark_clock(name, profile, parked)
        if fresh and parked is not None and parked.is_dir():
            get_run_logger().info("%s: a new workspace; put back %d parked file(s) of the row from %s", name,
                                  unpark(parked / PARKED_FILES, workspace), parked)
        clock = running.enter_context(row_clock(f"{profile}/{name}", TICK_SECONDS, None if parked is None else
                                                lambda: park_row(name, profile, workspace, parked, params)))
        get_run_logger().info("%s: running in %s%s", name, workspace,
                              f" (resumed: {clock.earlier / 60:.0f} min before)" if clock.earlier else "")
        try:
            not_scored = run_row(name, overrides, target, measures_simulator, cwd=workspace)
        except Exception as error:  # a failed attempt, its workspace kept; a kill is no Exception
            if getattr(error, "stopped", False):  # its stage stopped by a signal: workspace and clock go on next run
                get_run_logger().warning("%s: stopped: %s", name, error)
                return Cancelled(message=f"{name}: stopped ({error}); its next run goes on from its workspace")
            # no traceback here: Prefect logs the raised RowFailed with it, this error chained
            get_run_logger().error("%s: failed: %s", name, error)
            clock.recorded = True  # the attempt's record, raised with RowFailed, holds its time
            if parked is not None:  # that record holds the parked clock's time too
                (parked / PARKED_CLOCK).unlink(missing_ok=True)
            raise RowFailed(str(error), {
                **run_record(name, overrides, profile, clock.seconds, workspace, earlier_seconds=clock.earlier),
                "stage": getattr(error, "stage", None), "reason": getattr(error, "reason", str(error))}) from error
        record = run_record(name, overrides, profile, clock.seconds, workspace, not_scored,
                            earlier_seconds=clock.earlier)
        files = {**study.run_files(workspace, workspace / evaluated_in if evaluated_in else None,
                                   measures_simulator and not not_scored, study.stages_not_needed(overrides, target)),
                 study.RUN_RECORD: json.dumps(record, indent=2, sort_keys=True) + "\n"}
        clock.recorded = True
        shutil.rmtree(workspace)
        if parked is not None:
            shutil.rmtree(parked, ignore_errors=True)
    return files


@task(task_run_name="on the work pool: {name}")
def submit_row(name: str, overrides: dict, target: str, evaluated_in: Path | None, commit: str,
               state: dict[str, str], profile: str, measures_simulator: bool) -> str:
    """A flow run of the study_row deployment for this run, left to the pool's workers; its id. The row's flow runs
    that an earlier study submitted and no worker took (that study was stopped) are cancelled first
    (`cancel_unstarted`): they would run the row a second time."""
    from prefect.deployments import run_deployment

    if cancelled := cancel_unstarted(name, profile):
        get_run_logger().warning("%s: cancelled %d flow run(s) of it that an earlier study submitted and no worker "
                                 "took", name, cancelled)
    submitted = run_deployment(f"study_row/{deployments.STUDY_ROW_DEPLOYMENT}", timeout=0, flow_run_name=name,
                               parameters={"name": name, "overrides": overrides, "target": target,
                                           "evaluated_in": str(evaluated_in) if evaluated_in else None,
                                           "commit": commit, "state": state, "profile": profile,
                                           "measures_simulator": measures_simulator})
    return str(submitted.id)


def cancel_unstarted(name: str, profile: str) -> int:
    """Cancel the study_row flow runs of the row `name` at `profile` that never started (scheduled or pending); how
    many. One that started is left alone: if its worker is still running it, the row's workspace lock
    (`workspace.claimed`) stops a second run of it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterName,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    unstarted = FlowRunFilter(name=FlowRunFilterName(any_=[name]), state=FlowRunFilterState(
        type=FlowRunFilterStateType(any_=[StateType.SCHEDULED, StateType.PENDING])))
    rows = DeploymentFilter(name=DeploymentFilterName(any_=[deployments.STUDY_ROW_DEPLOYMENT]))
    with get_client(sync_client=True) as client:
        found = client.read_flow_runs(flow_run_filter=unstarted, deployment_filter=rows)
        runs = [run for run in found if run.parameters.get("profile") == profile]
        for run in runs:
            client.set_flow_run_state(run.id, Cancelled(message="a later study submitted this row again"), force=True)
    return len(runs)


@task(task_run_name="keep {name}")
def keep_row(name: str, flow_run_id: str, run_dir: Path) -> None:
    """Wait for the row's flow run; keep its files in `run_dir` when it completed, else fail naming its state."""
    from uuid import UUID

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        while not (run := client.read_flow_run(UUID(flow_run_id))).state.is_final():
            time.sleep(5)
    if was_stopped(run.state):  # not failed: its time is in its clock, its work in its workspace
        raise RuntimeError(f"{name}: its flow run {run.name} was stopped: {run.state.message} (run the row again: "
                           "it goes on where it stopped)")
    if not run.state.is_completed():
        study.record_failure(results_folder(run_dir, name), failed_attempt(name, run))
        raise RuntimeError(f"{name}: its flow run {run.name} ended {run.state.name}: {run.state.message} (its log "
                           "is in the Prefect UI; the workspace is kept in the worker's .dvc/tmp/study_rows/)")
    study.keep_files(run_dir, run.state.result())


def was_stopped(state: State) -> bool:
    """Whether a row's flow run was stopped, not failed: Cancelled (its stage ended by a signal, `study_row_flow`),
    or Crashed because its own process got SIGTERM or SIGINT (a session's end stopping the flow runs)."""
    return state.is_cancelled() or (state.is_crashed() and any(
        stop in (state.message or "") for stop in STOPPED_FLOW_RUN_MESSAGES))


def failed_attempt(name: str, run: Any) -> dict[str, Any]:
    """The record of the row `name`'s flow run that failed or crashed: the one it failed with (`study_row_flow`),
    else what its state says (its time: this flow run's only)."""
    try:
        returned = run.state.result(raise_on_failure=False) if run.state.is_failed() else None
    except Exception:  # MissingResult: no result was persisted
        returned = None
    if isinstance(returned, RowFailed):
        return returned.record
    return {"run": name, "commit": run.parameters.get("commit"), "profile": run.parameters.get("profile"),
            "seconds": run.total_run_time.total_seconds() if run.total_run_time else None, "stage": None,
            "reason": f"{run.state.name}: {run.state.message}"}


def seed_data(data_dir: str, results_dir: Path) -> None:
    """The seed data the runs train on, in a fresh clone too: data.dvc's data from the DVC cache, else the default
    seed set collected and onboarded as the pipeline flow does (a warning if data.dvc then tracks other data). Not
    where `results_dir` keeps runs and data.dvc tracks data that is not here: those runs trained on that data, and
    rows run on another seed set would be pooled with them (StageError, saying how to get it back)."""
    trajectories = Path(data_dir) / TRAJECTORIES
    if trajectories.is_file():
        return
    tracked = Path("data.dvc").read_text(encoding="utf-8") if Path("data.dvc").is_file() else None
    if tracked is not None and subprocess.run(["dvc", "checkout", "--quiet", "data.dvc"], capture_output=True,
                                              ).returncode == 0 and trajectories.is_file():
        return
    if tracked is not None and (kept := study.kept_runs(results_dir)):
        raise StageError(
            f"data.dvc tracks seed data that is neither in {data_dir}/ nor in the DVC cache, and the {len(kept)} "
            f"run(s) kept in {results_dir} (such as {kept[0].name}) trained on it: a seed set collected now would "
            "be another one, pooled with theirs. `dvc pull data.dvc` fetches it from the DVC remote that holds it; "
            "without one, collect it with the code that made it (docs/results_study.md, \"The study's seed data\"), "
            "then run the study again")
    logger = get_run_logger()
    logger.info("no seed data in %s/ and none in the DVC cache: collecting and onboarding the default seed set "
                "first, as the pipeline flow does (`dvc pull data.dvc` fetches what data.dvc tracks instead)", data_dir)
    reproduce("collect_seed")
    onboard_collected_seed()
    if tracked is not None and Path("data.dvc").read_text(encoding="utf-8") != tracked:
        logger.warning("data.dvc now tracks the collected seed set, not the data it tracked before, which was neither "
                       "here nor in the DVC cache: `git diff data.dvc` shows it; to study that data, `git checkout "
                       "data.dvc && dvc pull data.dvc` and run the study again")


@task
def report(results_dir: Path, confidence: float, algorithms: tuple[str, ...], planned: list[study.PlannedRun],
           profile: str, budget: str) -> dict:
    metrics, text = study.write_report(results_dir, confidence, algorithms, planned=planned, profile=profile,
                                       budget=budget)
    create_markdown_artifact(key="results-study", markdown=text, description="The paper's Table 1, ours")
    get_run_logger().info("results study: %s (metrics/results_study.json, artifact results-study)",
                          results_dir / "README.md")
    return metrics


@flow(name="results_study")
def results_study_flow(rows: list[str] | None = None) -> dict:
    """Every run of params.yaml's `study` not run yet (or only the `rows` named `<environment>/<variant>-seed<k>`),
    then the table and plot.

    A run that fails does not stop the others (a study is hours of runs): the table is made from those that
    finished, and the flow fails at the end naming the failed runs, which a rerun tries again.
    """
    if restore_params():
        get_run_logger().warning("params.yaml held the overrides of a study run that was killed; restored the file "
                                 "it had before that run (from %s)", PARAMS_BACKUP)
    if branch := reattach_head():
        get_run_logger().warning("a killed `dvc exp run` had left HEAD detached from %s at its commit; HEAD is back "
                                 "on %s", branch, branch)
    params, profile = load_params(PARAMS), active_profile(PARAMS)
    settings, confidence = params.study, params.evaluate.confidence
    results_dir = Path(settings.results_dir)
    planned = study.plan(params, sim_to_real.iteration_cost(params))
    chosen = study.select_rows(planned, rows or (), settings.variants)
    seed_data(params.data.dir, results_dir)
    failed, submitted = [], []
    if settings.on_work_pool:
        deployments.deploy_study_row(Path.cwd(), params)
        if not deployments.online_workers(params.prefect.work_pool):
            get_run_logger().warning("no worker of the work pool %r is online: the study's runs wait for one "
                                     "(`prefect worker start --pool %s --type process --limit 1` in this checkout)",
                                     params.prefect.work_pool, params.prefect.work_pool)
        commit = head_commit()
        state = working_state(".")
    # one experience model and one policy per environment: each run trains on one, its folder under the environment's
    for row in chosen:
        run_dir = results_dir / row.name
        if row.why_not:  # a row params switch off is no failure; one this budget cannot pay for is
            get_run_logger().warning("%s: not run: %s", row.name, row.why_not)
            failed += [] if row.switched_off else [f"{row.name} (not run: {row.why_not})"]
            continue
        if study.is_finished(run_dir, profile, row.overrides):
            continue
        # a row named is run whatever the finished runs say; the whole study skips one they show would tell nothing
        if not rows and (reason := study.uninformative(row, study.finished_runs(results_dir,
                                                                                tuple(settings.algorithms)))):
            get_run_logger().warning("%s: not run: %s", row.name, reason)
            continue
        target = row.variant.target
        evaluated_in = round_path(params) if target == "correction_rounds" else None
        if settings.on_work_pool:
            submitted.append((row.name, run_dir, submit_row(row.name, row.overrides, target, evaluated_in, commit,
                                                            state, profile, row.variant.measures_simulator)))
        elif not run_variant(row.name, row.overrides, run_dir, target, evaluated_in, row.variant.measures_simulator,
                             return_state=True).is_completed():
            failed.append(row.name)
    for name, run_dir, flow_run_id in submitted:  # in the order submitted; the workers run them at once
        if not keep_row(name, flow_run_id, run_dir, return_state=True).is_completed():
            failed.append(name)
    metrics = report(results_dir, confidence, tuple(settings.algorithms), planned, profile, study.run_budget(params))
    if failed:
        raise StageError(f"results study: {len(failed)} run(s) failed: {', '.join(failed)} (their logs are above; "
                           "a rerun of the flow runs them again and skips the finished ones)")
    return metrics
