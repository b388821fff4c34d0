"""The results study as a Prefect flow: every variant of components/results/study.py as one `dvc exp run`, then
the table.

Thin, like flows/pipeline.py: DVC reruns only what a variant's params change (the ablations reuse the cached
warm start, sim-to-real variants the cached synthetic RL), each finished run's metrics are kept in
`study.results_dir/<environment>/<variant>-seed<k>/` so a rerun skips it, and the report is a Prefect artifact.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from components.config import ParamsError, active_profile, load_params
from components.results import study
from flows.pipeline import PARAMS, run_logged
from stages import sim_to_real
from stages.common import StageError
from stages.correction_rounds import round_path

# The user's params.yaml while a run's overrides are in it: a study killed mid-run (a session's end, a crash) would
# otherwise leave them there, and every later run would inherit them (an ablation would train the killed run's
# algorithm). The next study puts the file back first.
PARAMS_BACKUP = Path(".dvc/tmp/study-params.yaml")


def restore_params() -> bool:
    """Put back the params.yaml a killed study left with a run's overrides; whether there was one to put back."""
    if not PARAMS_BACKUP.is_file():
        return False
    Path(PARAMS).write_text(PARAMS_BACKUP.read_text(encoding="utf-8"), encoding="utf-8")
    PARAMS_BACKUP.unlink()
    return True


@task(task_run_name="{name}")
def run_variant(name: str, overrides: dict, run_dir: Path, target: str, evaluated_in: Path | None = None) -> None:
    """One pipeline run with `overrides` up to the stage `target`; its metrics (from the stage root `evaluated_in`
    where it is not the project's) and record are kept in `run_dir`."""
    original, profile = Path(PARAMS).read_text(encoding="utf-8"), active_profile(PARAMS)  # before the overrides
    PARAMS_BACKUP.parent.mkdir(parents=True, exist_ok=True)
    partial = PARAMS_BACKUP.with_suffix(".partial")
    partial.write_text(original, encoding="utf-8")
    partial.replace(PARAMS_BACKUP)  # whole or not at all: a half-written backup would be restored over the user's file
    started = time.monotonic()
    try:  # `dvc exp run -S` writes the overrides into params.yaml: put the user's file back after every run
        run_logged(["dvc", "exp", "run", *[f"--set-param={key}={json.dumps(value)}"
                                            for key, value in overrides.items()], target])
    finally:
        Path(PARAMS).write_text(original, encoding="utf-8")
        PARAMS_BACKUP.unlink(missing_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    study.keep_run(run_dir, {"run": name, "params_set": overrides, "profile": profile, "commit": commit,
                             "seconds": round(time.monotonic() - started, 1)}, evaluated_in=evaluated_in)


@task
def report(results_dir: Path, confidence: float, algorithms: tuple[str, ...]) -> dict:
    metrics, text = study.write_report(results_dir, confidence, algorithms)
    create_markdown_artifact(key="results-study", markdown=text, description="The paper's Table 1, ours")
    get_run_logger().info("results study: %s (metrics/results_study.json, artifact results-study)",
                          results_dir / "README.md")
    return metrics


@flow(name="results_study")
def results_study_flow() -> dict:
    """Every variant x seed of params.yaml's `study` section not run yet, then the table and plot.

    A run that fails does not stop the others (a study is hours of runs): the table is made from those that
    finished, and the flow fails at the end naming the failed runs, which a rerun tries again.
    """
    if restore_params():
        get_run_logger().warning("params.yaml held the overrides of a study run that was killed; restored the file "
                                 "it had before that run (from %s)", PARAMS_BACKUP)
    params, profile = load_params(PARAMS), active_profile(PARAMS)
    settings, confidence = params.study, params.evaluate.confidence
    results_dir = Path(settings.results_dir)
    failed = []
    # one experience model and one policy per environment: each run trains on one, its folder under the environment's
    runs = [(environment, seed, variant) for environment in settings.environments for seed in settings.seeds
            for variant in study.select_variants(tuple(settings.algorithms), settings.variants)]
    for environment, seed, variant in runs:
        name = f"{environment}/{variant.name}-seed{seed}"
        run_dir = results_dir / name
        if variant.target == "correction_rounds" and not params.correction.rounds:
            get_run_logger().warning("%s: not run, correction.rounds is 0", name)
            continue
        try:
            overrides = study.run_overrides(variant, seed, settings.real_budget, settings.s2r_share,
                                            params.correction.rounds, sim_to_real.iteration_cost(params),
                                            environment, params.policy.max_turns)
        except ParamsError as error:  # a row this budget cannot pay for: the others still run
            get_run_logger().warning("%s: not run: %s", name, error)
            failed.append(f"{name} (not run: {error})")
            continue
        if study.is_finished(run_dir, profile, overrides):
            continue
        evaluated_in = round_path(params) if variant.target == "correction_rounds" else None
        state = run_variant(name, overrides, run_dir, variant.target, evaluated_in, return_state=True)
        if not state.is_completed():
            failed.append(name)
    metrics = report(results_dir, confidence, tuple(settings.algorithms))
    if failed:
        raise StageError(f"results study: {len(failed)} run(s) failed: {', '.join(failed)} (their logs are above; "
                           "a rerun of the flow runs them again and skips the finished ones)")
    return metrics
