"""The `dreamgym` command: onboarding, stage entry points for DVC, and Prefect flows.

  dreamgym data onboard PATH... [--data-dir DIR]   validate and store seed trajectories (exit 0 / 1 / 2)
  dreamgym stage NAME                              run one pipeline stage, stages/NAME.py (what dvc.yaml calls)
  dreamgym flow NAME                               run a stage, or the whole `pipeline`, as a Prefect flow
  dreamgym flow results_study                      the paper's Table 1: every variant of params.yaml `study`
  dreamgym study run|report [ROW...]               the study's rows not finished (or those named), or its report
  dreamgym study supersede ROW... --reason TEXT    mark finished study runs a change to the method outdates
  dreamgym study park [--profile P]                copy the running work-pool rows' resume state to study.parked_rows
  dreamgym deploy                                  register the retraining deployment on PREFECT_API_URL's server
  dreamgym params check                            load params.yaml and report problems
  dreamgym params use PROFILE                      write a profile (profiles/NAME.yaml: quick, cpu, gpu) into it
  dreamgym coverage miniwob [TASK...]              what the text interface covers of each MiniWoB task (resumable)
  dreamgym simulator export DIR                    the trained simulator as a self-contained bundle (Gymnasium: DIR)
  dreamgym simulator serve DIR [--port N]          a bundle behind OpenEnv's protocol, for many rollout workers;
                        [--shadow SHARE]           that share of its episodes replayed in the real environment
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

import yaml

from components import distributed
from components.config import ParamsError, active_profile, load_params, profile_values
from components.envs.base import EveryEpisodeFailed
from components.simulator.experience_model import ExperienceModelFailure
from stages.common import RANK_AWARE_STAGES, RENAMED, STAGES, StageError

EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE = 0, 1, 2  # onboarding: 1 also means "some records were quarantined"
# Prefect gives its temporary server 20 s to start, which a machine busy training can miss ("Timed out while
# attempting to connect to ephemeral Prefect API server"); the Makefile sets the same for `make run`.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dreamgym", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml", help="path to params.yaml (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a param for this run, e.g. --set collect_seed.train_tasks=2 (YAML value)")
    commands = parser.add_subparsers(dest="command", required=True)

    data = commands.add_parser("data", help="seed data").add_subparsers(dest="action", required=True)
    onboard = data.add_parser("onboard", help="validate seed trajectories and store the good ones")
    onboard.add_argument("paths", nargs="+", help="JSONL or Parquet files of trajectory records")
    onboard.add_argument("--data-dir", help="data directory (default: data.dir in params.yaml)")
    onboard.add_argument("--no-version", action="store_true", help="do not `dvc add` the data directory")

    stage = commands.add_parser("stage", help="run one pipeline stage (DVC calls this)")
    stage.add_argument("name", choices=sorted([*STAGES, *RENAMED]))
    flow = commands.add_parser("flow", help="run a Prefect flow (it reads params.yaml, as DVC does)")
    flow.add_argument("name", choices=sorted([*STAGES, *RENAMED]) + ["pipeline", "results_study"])
    commands.add_parser("deploy", help="register the pipeline's retraining deployment (schedule, onboarding "
                        "trigger; params.yaml `prefect`) on the Prefect server PREFECT_API_URL names")
    artifacts = commands.add_parser("artifacts", help="the artifact store (params.yaml `storage`): list or prune runs")
    artifacts.add_argument("action", choices=["list", "prune"])
    artifacts.add_argument("--keep", type=int, default=5,
                           help="prune: runs to keep, newest first (default: %(default)s)")
    artifacts.add_argument("--dry-run", action="store_true", help="prune: say what would be deleted, delete nothing")
    study_command = commands.add_parser("study", help="the results study (params.yaml `study`): `run [ROW...]` runs "
                                        "its rows not finished yet, or only those named; `report` remakes its report "
                                        "from the runs kept in study.results_dir (runs copied in from other "
                                        "checkouts), running none; `supersede ROW... --reason TEXT` marks finished "
                                        "runs that a later change to the method outdates: kept, out of the results, "
                                        "run again; `park` copies the resume state of the work-pool rows running "
                                        "here into study.parked_rows now (their flow runs do it every minute), to "
                                        "commit before this machine goes")
    study_command.add_argument("action", choices=["run", "report", "supersede", "park"])
    study_command.add_argument("rows", nargs="*", help="run, supersede: rows named <environment>/<variant>-seed<k>, "
                               "as the report's planned runs list them (run's default: every row)")
    study_command.add_argument("--reason", default="", help="supersede: why the runs no longer stand (the report "
                               "prints it)")
    study_command.add_argument("--profile", help="report, park: the study of params.yaml with this profile's values "
                               "(quick, cpu, gpu or a path), as `params use` would set them, without changing "
                               "params.yaml")
    coverage = commands.add_parser("coverage", help="per task of an environment: reset, interactive elements the "
                                   "state shows, expert or random success; writes reports/<env>_coverage.md")
    coverage.add_argument("environment", choices=["miniwob"])
    coverage.add_argument("tasks", nargs="*", help="task names (default: every task; rows already measured are kept)")
    simulator = commands.add_parser("simulator", help="the trained simulator as a product: `export DIR` writes a "
                                    "self-contained bundle (experience model, buffer, tasks, manifest); `serve DIR` "
                                    "serves one over OpenEnv's protocol (WebSocket /ws, /health)")
    simulator.add_argument("action", choices=["export", "serve"])
    simulator.add_argument("directory", type=Path, help="the bundle's directory (export: replaced whole)")
    simulator.add_argument("--host", default="127.0.0.1", help="serve: interface (default: %(default)s)")
    simulator.add_argument("--port", type=int, default=8000, help="serve: port (default: %(default)s)")
    simulator.add_argument("--max-sessions", type=_positive, default=64,
                           help="serve: sessions at once; one more is refused (default: %(default)s)")
    simulator.add_argument("--environment", help="serve: which environment of a bundle that simulates several")
    simulator.add_argument("--backend", choices=["hf", "llamacpp"], help="serve: run the weights in this backend "
                           "instead of the bundle's")
    simulator.add_argument("--shadow", type=_share, default=0.0, metavar="SHARE",
                           help="serve: replay this share of the episodes in the real environment and report how "
                           "far they agree (GET /shadow and the log); needs an adapter (default: off)")
    params_command = commands.add_parser("params", help="params.yaml: check it, or switch profile")
    params_command.add_argument("action", choices=["check", "use"])
    params_command.add_argument("profile", nargs="?", help="for `use`: quick, cpu, gpu (profiles/NAME.yaml) or a path")

    args = parser.parse_args(argv)
    # `kill` (SIGTERM) ends the command as Ctrl-C does, through finally blocks and atexit: browsers and engine
    # processes are closed, checkpoints stay whole. Unhandled, it would leave a browser running.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _command(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _command(args: argparse.Namespace) -> int:
    if args.command in ("stage", "flow") and args.name in RENAMED:
        print(f"warning: the stage {args.name!r} is deprecated, renamed {RENAMED[args.name]!r}; the old name goes in "
              "the next release", file=sys.stderr)
        args.name = RENAMED[args.name]
    # components log progress (training steps, generation batches) at INFO; show it in DVC and Prefect output
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "datasets", "filelock", "faiss"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if differing := _code_elsewhere():
        print(f"error: this checkout's code differs from the code Python imports ({', '.join(differing[:3])}), so "
              "its stages and flows would run other code than they record. Install this checkout "
              "(`make setup` or `pip install -e .`), or run with PYTHONPATH=$PWD", file=sys.stderr)
        return EXIT_UNUSABLE
    if args.command == "simulator" and args.action == "serve":  # a bundle is all it needs: no project here
        return _serve_simulator(args)
    try:
        params = load_params(args.params, set_overrides(args.set))
    except ParamsError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_UNUSABLE
    if args.command == "data":
        return _onboard(args, params)
    if args.command == "stage":
        if distributed.world_size() > 1 and args.name not in RANK_AWARE_STAGES:
            print(f"error: the stage {args.name} is not rank-aware: under a launcher every process would run all of "
                  f"it and write its outputs. Run it as one process (`dreamgym stage {args.name}`); these run on "
                  f"several: {', '.join(RANK_AWARE_STAGES)}", file=sys.stderr)
            return EXIT_UNUSABLE
        distributed.join()
        return _run(lambda: importlib.import_module(f"stages.{args.name}").run(params))
    if args.command == "flow":
        from flows import pipeline

        if message := _reads_params_yaml(args):
            print(f"error: {message}", file=sys.stderr)
            return EXIT_UNUSABLE
        if args.name == "results_study":
            from flows.study import results_study_flow
            return _run(results_study_flow)
        return _run(lambda: pipeline.FLOWS[args.name]())
    if args.command == "deploy":
        return _deploy(args, params)
    if args.command == "artifacts":
        return _artifacts(args, params)
    if args.command == "study":
        return _study(args, params)
    if args.command == "coverage":
        return _coverage(args, params)
    if args.command == "simulator":
        return _export_simulator(args, params)
    if args.action == "use":
        from components.config import use_profile

        if not args.profile:
            print("error: `dreamgym params use` needs a profile: quick, cpu, gpu, or a path", file=sys.stderr)
            return EXIT_UNUSABLE
        try:
            changed = use_profile(args.profile, args.params)
        except ParamsError as error:
            print(f"error: {error}", file=sys.stderr)
            return EXIT_UNUSABLE
        print(f"{args.params}: profile {args.profile}, {len(changed)} values changed"
              + "".join(f"\n  {key}: {value}" for key, value in changed.items()))
        return EXIT_OK
    print(f"{args.params}: ok")
    return EXIT_OK


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def _coverage(args: argparse.Namespace, params) -> int:
    from components.envs import miniwob_coverage as coverage

    settings = params.environments.miniwob
    names = args.tasks or coverage.task_names()
    if unknown := sorted(set(names) - set(coverage.task_names())):
        print(f"error: no MiniWoB task {', '.join(unknown)}; see `ls {coverage.HTML_DIR / 'miniwob'}`", file=sys.stderr)
        return EXIT_UNUSABLE
    report = Path("reports/miniwob_coverage.md")
    rows = coverage.run_coverage(report.with_suffix(".jsonl"), names, episodes=settings.coverage_episodes,
                                 max_steps=settings.max_steps, step_timeout_s=settings.step_timeout_s,
                                 episode_time_limit_s=settings.episode_time_limit_s)
    report.write_text("# MiniWoB++ coverage of the text interface\n\nMade by `dreamgym coverage miniwob`.\n\n"
                      + coverage.coverage_markdown(rows, episodes=settings.coverage_episodes,
                                                   max_steps=settings.max_steps), encoding="utf-8")
    print(f"{report}: {len(rows)} tasks")
    return EXIT_OK


def _export_simulator(args: argparse.Namespace, params) -> int:
    from components.simulator.bundle import BundleError, export_bundle, load_bundle

    try:
        bundle = load_bundle(export_bundle(params, Path("."), args.directory), verify=False)  # hashed as it was written
    except BundleError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILED
    manifest = bundle.manifest
    print(f"{args.directory}: simulates {', '.join(bundle.environments)} over {manifest['tasks']} training tasks; "
          f"{len(manifest['files'])} files; fidelity {json.dumps(manifest['fidelity'].get('seed_heldout', {}))}\n"
          f"  gymnasium.make(\"components.simulator.gym_env:dreamgym/Simulator-v0\", bundle=\"{args.directory}\")")
    return EXIT_OK


def _serve_simulator(args: argparse.Namespace) -> int:
    from components.simulator.bundle import BundleError
    from components.simulator.server import serve

    try:
        serve(args.directory, host=args.host, port=args.port, max_sessions=args.max_sessions, backend=args.backend,
              environment=args.environment, shadow=args.shadow)
    except (BundleError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_UNUSABLE
    except KeyboardInterrupt:  # uvicorn shuts down gracefully, then passes Ctrl-C on
        pass
    except SystemExit as stop:  # the same for SIGTERM: how a server is stopped
        if stop.code != 128 + signal.SIGTERM:
            raise
    return EXIT_OK


def _share(text: str) -> float:
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not 0 <= share <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a share between 0 and 1, e.g. 0.1 for one episode in ten")
    return share


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return int(text)


def _code_elsewhere() -> list[str]:
    """When the working directory is a checkout of this project whose code is not the code Python imported (a clone
    sharing a virtual environment installed from another checkout), the files that differ; else none. DVC hashes
    the checkout's files as the stages' dependencies, so they must be what runs. A project directory with no
    `components/` of its own runs the installed package, as it should."""
    imported, here = Path(sys.modules["components"].__file__).resolve().parent.parent, Path.cwd().resolve()
    if imported == here or not (here / "components" / "__init__.py").is_file():
        return []
    files = {path.relative_to(root).as_posix() for root in (imported, here)
             for package in ("components", "stages", "flows")
             for path in (root / package).rglob("*.py")}
    return sorted(name for name in files if not (imported / name).is_file() or not (here / name).is_file()
                  or (imported / name).read_bytes() != (here / name).read_bytes())


def set_overrides(items: list[str]) -> dict:
    """`--set KEY=VALUE` items as the dotted-key overrides load_params takes (each value read as YAML)."""
    pairs = [item.partition("=") for item in items]
    if any(not sep for _, sep, _ in pairs):
        raise ParamsError("--set takes KEY=VALUE, e.g. --set evaluate.workers=1")
    return {key: yaml.safe_load(value) for key, _, value in pairs}


def _onboard(args: argparse.Namespace, params) -> int:
    from components.data.onboarding import onboard
    from components.data.validation import Limits, UnusableInput

    try:
        result = onboard(args.paths, args.data_dir or params.data.dir, Limits.of(params.data),
                         version=not args.no_version)
    except UnusableInput as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_UNUSABLE
    print(result.summary())
    if result.added or result.replaced:  # new training data: tell Prefect, whose trigger may start a retraining run
        _announce_onboarded(result)
    return result.exit_code


def _announce_onboarded(result) -> None:
    from flows.deployments import SEED_ONBOARDED, announce_onboarded

    try:
        sent = announce_onboarded(result.data_dir, added=result.added, replaced=result.replaced,
                                  unchanged=result.unchanged, rejected=len(result.rejected))
    except Exception as error:  # the data is stored; a notification that failed must not fail the onboarding
        logging.getLogger(__name__).warning("could not notify Prefect of the onboarding: %s", error)
        return
    if sent:
        print(f"Sent Prefect the event {SEED_ONBOARDED}: the deployed pipeline retrains if `dreamgym deploy` "
              "registered its onboarding trigger")


def _artifacts(args: argparse.Namespace, params) -> int:
    import time

    from components.artifacts import ArtifactError, open_artifact_store

    try:
        store = open_artifact_store(params.storage)
        if args.action == "list":
            runs = store.stored_runs()
            for run in runs:
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(run.stored_at)) if run.stored_at else (
                    "time unknown")  # stored before manifests recorded it; prune treats these as oldest
                print(f"{run.run_id}  {when}  {', '.join(run.artifacts)}")
            print(f"{len(runs)} runs in {store!r}")
            return EXIT_OK
        removed = store.prune(args.keep, dry_run=args.dry_run)
    except (ArtifactError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILED
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(removed)} runs, kept the newest {args.keep}" + "".join(f"\n  {run}" for run in removed))
    return EXIT_OK


def _reads_params_yaml(args: argparse.Namespace) -> str | None:
    """Why a flow cannot run with --set/--params (its DVC stages read params.yaml), or None."""
    if args.set or args.params != "params.yaml":
        return ("flows run the DVC stages, which read params.yaml: edit it (or use `dvc exp run -S`) instead of "
                "--set/--params")
    return None


def _study(args: argparse.Namespace, params) -> int:
    from components.results import study
    from stages import sim_to_real

    try:
        profile = active_profile(args.params)
        if args.profile:
            if args.action == "run":
                raise ParamsError("`study run` runs the study params.yaml holds: `dreamgym params use PROFILE` first")
            params = load_params(args.params, {**profile_values(args.profile), **set_overrides(args.set)})
            profile = "custom" if Path(args.profile).suffix else args.profile  # as active_profile names a path's
        if args.action in ("report", "park") and args.rows:
            does = "reports every kept run" if args.action == "report" else "parks every row running here"
            raise ParamsError(f"`study {args.action}` takes no rows: it {does}")
        if args.action == "park":
            return _park(params, profile)
        results_dir, algorithms = Path(params.study.results_dir), tuple(params.study.algorithms)
        if args.action == "supersede":
            if not args.rows:
                raise ParamsError("`study supersede` needs the rows to mark, as the report's runs table names them")
            for path in study.supersede(results_dir, args.rows, args.reason):
                print(f"{path}: superseded ({args.reason.strip()}); `dreamgym study report` to remake the report")
            return EXIT_OK
        planned = study.plan(params, sim_to_real.iteration_cost(params))
        if args.action == "run":
            study.select_rows(planned, args.rows, params.study.variants)  # a wrong name fails before the flow starts
            if message := _reads_params_yaml(args):
                raise ParamsError(message)
            from flows.study import results_study_flow
            return _run(lambda: results_study_flow(rows=args.rows))
        metrics, _ = study.write_report(results_dir, params.evaluate.confidence, algorithms, planned=planned,
                                        profile=profile, budget=study.run_budget(params))
    except ParamsError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_UNUSABLE
    print(f"{results_dir / 'README.md'}: {len(study.finished_runs(results_dir, algorithms))} runs, {len(metrics)} "
          "methods; also reports/results_study.md and metrics/results_study.json")
    return EXIT_OK


def _park(params, profile: str) -> int:
    """`study park`: every row workspace of `profile` in this checkout parked in study.parked_rows."""
    from flows.study import ROW_WORKSPACES, park_row

    if not params.study.parked_rows:
        raise ParamsError(f"study.parked_rows is not set at profile {profile}: nowhere to park the rows (the cpu and "
                          "gpu profiles set it; `--profile cpu` reads theirs)")
    if params.models.kept_trainings:  # resolved here: a workspace's own copy of the folder is not where rows keep
        kept = str(Path(params.models.kept_trainings).resolve())
        params = params.model_copy(update={"models": params.models.model_copy(update={"kept_trainings": kept})})
    workspaces = sorted(path.parent for path in (ROW_WORKSPACES / profile).glob("*/*/.git"))
    if not workspaces:
        print(f"no row workspace of profile {profile} in {ROW_WORKSPACES / profile}: nothing to park")
    for workspace in workspaces:
        name = workspace.relative_to(ROW_WORKSPACES / profile).as_posix()
        parked = Path(params.study.parked_rows) / name
        copied = park_row(name, profile, workspace, parked, params)
        held = sum(f.stat().st_size for f in parked.rglob("*") if f.is_file())
        print(f"{name}: parked in {parked} ({copied / 2**20:.1f} MB copied now, {held / 2**20:.1f} MB held); "
              "commit it once, as the machine goes (each commit of it adds its size to what is pushed): a new "
              "workspace of the row on another machine goes on from it")
    return EXIT_OK


def _deploy(args: argparse.Namespace, params) -> int:
    from flows.deployments import configured_api_url, deploy

    if not configured_api_url():  # a temporary server would forget the deployment when this command exits
        print("error: set PREFECT_API_URL to the Prefect server to deploy to (infra/prefect/start.sh starts one)",
              file=sys.stderr)
        return EXIT_UNUSABLE
    root = Path(args.params).resolve().parent  # the checkout whose params.yaml and dvc.yaml the worker runs
    ids = deploy(root, params)
    settings = params.prefect
    schedule = f"cron '{settings.retrain_cron}' ({settings.timezone})" if settings.retrain_cron else "no schedule"
    trigger = ", runs when new seed data is onboarded" if settings.retrain_on_onboard else ""
    print(f"Deployed pipeline/{settings.deployment} ({ids[0]}): {schedule}{trigger}; "
          f"work pool '{settings.work_pool}', working directory {root}")
    return EXIT_OK


def _run(call) -> int:
    try:
        call()
    except (StageError, ParamsError, ExperienceModelFailure, EveryEpisodeFailed) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
