"""What the pipeline does with stages' outputs between stages: the seed collect_seed collected onboarded into the
versioned data, and each stage's declared outputs stored in the artifact store.

Not a stage and imported by none (the flows and tests use it): what it imports is no stage's dependency.
"""
from __future__ import annotations

from pathlib import Path

from components.artifacts import open_artifact_store
from components.config import Params
from components.data.contract import COLLECTED, ON_POLICY, read_records
from components.data.onboarding import OnboardingResult, onboard, version_with_dvc
from components.data.validation import Limits
from components.reports import metrics_path, report_path
from stages.common import StageError


def onboard_collected(params: Params, root: str | Path = ".") -> OnboardingResult | None:
    """Onboard the collected seed set (collect_seed's output) into the versioned data directory, superseding the
    previous collection; None when there is nothing to collect (every configured environment is a seed-only domain,
    whose data the user onboarded) and no earlier collection to remove."""
    from components.data.collection import collectable

    root = Path(root)
    data_dir = root / params.data.dir
    manifest = data_dir / COLLECTED
    previous = set(manifest.read_text(encoding="utf-8").split()) if manifest.is_file() else set()
    collecting = bool(collectable(params.collect_seed.environments)[0])
    paths = sorted((root / params.collect_seed.out_dir).glob("*.jsonl")) if collecting else []
    if not collecting and not previous:
        return None
    if collecting and not paths:
        raise StageError(f"nothing collected in {params.collect_seed.out_dir}/; run `dvc repro collect_seed` first")
    # replace: re-collecting a task after a param or code change supersedes the episode collected before.
    # supersedes: the earlier collection's episodes (listed in the manifest) that this one no longer holds, after
    # fewer tasks or another environment list, leave data/; records the user onboarded are never in the manifest.
    result = onboard(paths, data_dir, Limits.of(params.data), version=False, replace=True,
                     supersedes=previous)
    collected = sorted({record["trajectory_id"] for path in paths for record in read_records(path)})
    manifest.write_text("".join(f"{trajectory_id}\n" for trajectory_id in collected), encoding="utf-8")
    result.version_note = version_with_dvc(data_dir)
    return result


def onboard_on_policy(params: Params, root: str | Path = ".") -> OnboardingResult | None:
    """The correction rounds' on-policy trajectories (source: policy) onboarded into the versioned data directory,
    beside the user's seed, for the next retraining run; None when the rounds kept none. Validation applies as to a
    user's file: a record of a held-out game would be quarantined, never stored."""
    root = Path(root)
    path = root / params.correction.out_dir / ON_POLICY
    if not path.is_file() or not path.read_text(encoding="utf-8").strip():
        return None
    return onboard([path], root / params.data.dir, Limits.of(params.data), fed_back=True)


def declared_outputs(stage: str, root: str | Path = ".") -> list[str]:
    """The paths a stage declares in dvc.yaml (its outs, metrics and plots), as written there, in order."""
    import yaml

    dvc_yaml = Path(root) / "dvc.yaml"
    stages = (yaml.safe_load(dvc_yaml.read_text(encoding="utf-8")) or {}).get("stages") or {}
    if stage not in stages:
        raise ValueError(f"{dvc_yaml} has no stage {stage!r} (its stages: {', '.join(stages) or 'none'})")
    # an entry is a bare path or {path: {cache: false, ...}}
    return [entry if isinstance(entry, str) else next(iter(entry))
            for section in ("outs", "metrics", "plots") for entry in stages[stage].get(section) or []]


def artifact_name(stage: str, output: str) -> str:
    """A stage output's artifact name: `<stage>-metrics` and `<stage>-report` for its metrics and report, else
    `<stage>-<its path, '/' as '-'>` (models/policy/sft/model -> train_policy_sft-models-policy-sft-model)."""
    path = Path(output).as_posix().strip("/")
    if path == metrics_path(stage).as_posix():
        return f"{stage}-metrics"
    if path == report_path(stage).as_posix():
        return f"{stage}-report"
    return f"{stage}-{path.replace('/', '-')}"


def publish(params: Params, run_id: str, stage: str, root: str | Path = ".") -> list[str]:
    """Store every output a stage declares in dvc.yaml (model directories, the buffer, metrics, reports, CSVs,
    plots) as run_id/<artifact_name> in the configured artifact store; return the URIs, metrics and report first.

    Outputs that are not there (optional, or not written by this run) are skipped."""
    first = {f"{stage}-metrics": 0, f"{stage}-report": 1}
    outputs = sorted(declared_outputs(stage, root), key=lambda o: first.get(artifact_name(stage, o), 2))
    store = open_artifact_store(params.storage)
    return [store.put(Path(root) / output, run_id, artifact_name(stage, output))
            for output in outputs if (Path(root) / output).exists()]


def resume_state(params: Params, root: str | Path = ".") -> list[Path]:
    """What the stages under `root` keep outside git and DVC's outputs that a rerun goes on from, where it is there:
    the trainings' and RL runs' checkpoints, the evaluations' journals of the games played so far, and a correction
    row's rounds' (`correction_rounds.resume_state`). A training kept in models.kept_trainings is left out (the kept
    one restores it)."""
    from components.builders import WRITER_DIR
    from stages import correction_rounds, evaluate_baselines, evaluate_experience_model, evaluate_policies

    root = Path(root)
    kept = root / params.models.kept_trainings if params.models.kept_trainings else None
    checkpoints = [root / out_dir / "checkpoints" for out_dir in (
        params.experience_model.out_dir, params.policy.sft.out_dir, params.synthetic_rl.out_dir,
        f"{params.synthetic_rl.out_dir}/{WRITER_DIR}", params.sim_to_real.out_dir)]
    journals = [root / stage.JOURNALS for stage in (evaluate_policies, evaluate_experience_model, evaluate_baselines)]
    return [path for path in checkpoints + journals + correction_rounds.resume_state(params, root)
            if path.exists() and not _kept_training(path, kept)]


def _kept_training(checkpoints: Path, kept: Path | None) -> bool:
    """Whether `checkpoints` are a training's that `kept` holds (`sft.keep_training`: by its fingerprint)."""
    from components.llm.sft import kept_training

    stamp = checkpoints / "fingerprint.txt"
    return kept is not None and stamp.is_file() and \
        kept_training(kept, stamp.read_text(encoding="utf-8").strip()) is not None
