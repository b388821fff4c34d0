"""Pipeline stages as plain functions: params in, files and a metrics dict out.

DVC (`dreamgym stage NAME`) and Prefect (`flows/`) call these same functions, so both run identical work.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from components.artifacts import open_artifact_store
from components.config import Params
from components.contract import Trajectory, is_heldout_task, read_trajectories, transitions
from components.onboarding import QUARANTINE, TRAJECTORIES, OnboardingResult, onboard
from components.reports import markdown_table, metrics_path, report_path, write_stage_outputs
from components.validation import Limits, read_raw_records, validate_records


class StageError(RuntimeError):
    """A stage cannot run on what it was given; the message says what to do."""


def _by_source(trajectories: list[Trajectory]) -> dict[tuple[str, str], list[Trajectory]]:
    groups: dict[tuple[str, str], list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        groups[(trajectory.task.environment, trajectory.source)].append(trajectory)
    return dict(sorted(groups.items()))


def _source_table(groups: dict[tuple[str, str], list[Trajectory]]) -> str:
    rows = [[env, source, len(group), sum(len(t.steps) for t in group) / len(group),
             sum(t.success for t in group) / len(group)] for (env, source), group in groups.items()]
    return markdown_table(["environment", "source", "trajectories", "mean steps", "success rate"], rows)


def validate(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Re-check the versioned seed set against the contract and summarise it (metrics/validate.json)."""
    data_dir = Path(root) / params.data.dir
    path = data_dir / TRAJECTORIES
    if not path.exists():
        raise StageError(f"no seed data at {path}; onboard some first: dreamgym data onboard FILE.jsonl")
    report = validate_records(read_raw_records(path), Limits.of(params.data))
    if report.rejected:
        first = report.rejected[0]
        raise StageError(f"{len(report.rejected)} stored trajectories break the contract (edited by hand?); "
                         f"first: {first.record.where}: {first.reasons[0]}. Re-onboard the original files.")
    trajectories = [trajectory for _, trajectory in report.accepted]
    quarantine = data_dir / QUARANTINE
    metrics = {
        "trajectories": len(trajectories),
        "steps": sum(len(t.steps) for t in trajectories),
        "tasks": len({t.task.task_id for t in trajectories}),
        "quarantined": len(quarantine.read_text(encoding="utf-8").splitlines()) if quarantine.exists() else 0,
        "success_rate": sum(t.success for t in trajectories) / len(trajectories),
        "trajectories_by_environment": dict(sorted(Counter(t.task.environment for t in trajectories).items())),
    }
    text = (f"# Seed data validation\n\n{metrics['trajectories']} trajectories, {metrics['steps']} steps, "
            f"{metrics['tasks']} tasks in `{params.data.dir}/`, all within the contract "
            f"(rewards in {params.data.reward_range}, texts up to {params.data.max_text_length} characters). "
            f"{metrics['quarantined']} record(s) sit in quarantine.\n\n" + _source_table(_by_source(trajectories)))
    write_stage_outputs("validate", metrics, text, root)
    return metrics


def collect_seed(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Collect the default seed set in the real environments (seed/<environment>.jsonl), to be onboarded."""
    from components.collection import collect_environment, collectable

    root = Path(root)
    environments, seed_only = collectable(params.collect_seed.environments)
    metrics: dict[str, Any] = {"skipped": seed_only}
    collected: list[Trajectory] = []
    for environment in environments:
        out_path = root / params.collect_seed.out_dir / f"{environment}.jsonl"
        progress_path = root / ".cache" / "collect_seed" / f"{environment}.jsonl"
        trajectories = collect_environment(params, environment, out_path, progress_path)
        collected += trajectories
        metrics[environment] = {
            "trajectories": len(trajectories),
            "steps": sum(len(t.steps) for t in trajectories),
            "success_rate": sum(t.success for t in trajectories) / len(trajectories),
            **{f"success_rate_{source}": sum(t.success for t in group) / len(group)
               for (_, source), group in _by_source(trajectories).items()},
        }
    settings = params.collect_seed
    text = (f"# Seed collection\n\n{settings.train_tasks} training tasks per environment; per task "
            f"{settings.episodes.expert} expert, {settings.episodes.noisy_expert} noisy-expert "
            f"(epsilon {settings.noisy_epsilon}, source `policy`) and {settings.episodes.random} random episode(s). "
            f"Onboard them with `dreamgym data onboard {settings.out_dir}/*.jsonl`.\n\n"
            + _source_table(_by_source(collected))
            + (f"\nSkipped (no real-environment adapter): {', '.join(seed_only)}\n" if seed_only else ""))
    write_stage_outputs("collect_seed", metrics, text, root)
    return metrics


def evaluate(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Expert and random baselines on held-out tasks of each real environment (success with confidence intervals)."""
    from components.evaluation import evaluate_baselines

    metrics, report = evaluate_baselines(params)
    write_stage_outputs("evaluate", metrics, report, root)
    return metrics


def index_buffer(params: Params, root: str | Path = ".", log=print) -> dict[str, Any]:
    """Embed the real seed transitions of training tasks into the replay buffer and save it (buffer.out_dir)."""
    from components.replay_buffer import SentenceEncoder, open_replay_buffer

    root = Path(root)
    trajectories = read_trajectories(root / params.data.dir / TRAJECTORIES)
    fraction = params.data.heldout_task_fraction
    train = [t for t in trajectories if not is_heldout_task(t.task.task_id, fraction)]
    pending = [transition for trajectory in train for transition in transitions(trajectory)]
    encoder = SentenceEncoder(params.models.embedder, root / params.models.cache_dir, params.buffer.encode_batch_size)
    settings = params.buffer.weaviate.model_dump() if params.buffer.backend == "weaviate" else {}
    buffer = open_replay_buffer(params.buffer.backend, encoder, **settings)
    start, chunk = time.monotonic(), 256
    for done in range(0, len(pending), chunk):
        buffer.add(pending[done:done + chunk], source="real")
        rate = (done + chunk) / (time.monotonic() - start)
        log(f"[index_buffer] {min(done + chunk, len(pending))}/{len(pending)} transitions, {rate:.0f}/s, "
            f"ETA {max(0.0, (len(pending) - done - chunk) / rate):.0f}s")
    buffer.save(root / params.buffer.out_dir)
    environments = sorted({t.task.environment for t in trajectories})
    metrics = {
        "transitions": len(buffer),
        "transitions_by_environment": {env: buffer.count(environment=env) for env in environments},
        "train_tasks": len({t.task.task_id for t in train}),
        "heldout_tasks": len({t.task.task_id for t in trajectories}) - len({t.task.task_id for t in train}),
        "encode_per_s": round(len(pending) / (time.monotonic() - start), 1),
    }
    buffer.close()
    rows = [[env, count] for env, count in metrics["transitions_by_environment"].items()]
    text = (f"# Replay buffer\n\n{metrics['transitions']} real transitions from {metrics['train_tasks']} training "
            f"tasks, embedded with `{params.models.embedder}` (backend `{params.buffer.backend}`); "
            f"{metrics['heldout_tasks']} seed tasks ({fraction:.0%}) are held out for fidelity evaluation.\n\n"
            + markdown_table(["environment", "transitions"], rows))
    write_stage_outputs("index_buffer", metrics, text, root)
    return metrics


def annotate(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Give every seed transition a reasoning trace (annotate.out_dir/transitions.jsonl)."""
    from components import annotation

    root = Path(root)
    trajectories = read_trajectories(root / params.data.dir / TRAJECTORIES)
    spec = params.annotate.teacher
    teacher = annotation.make_teacher(annotation.TeacherSpec(**spec.model_dump()) if spec else None,
                                      root / params.models.cache_dir)
    records = annotation.annotate(trajectories, teacher)
    annotation.write_annotated(records, root / params.annotate.out_dir / "transitions.jsonl")
    metrics = annotation.annotation_summary(records, teacher.name if teacher else None)
    examples = {record.task.environment: record for record in records if record.step_index == 1}
    text = (f"# Reasoning traces\n\n{metrics['transitions']} transitions of {metrics['trajectories']} trajectories "
            f"annotated by `{metrics['annotator']}`; traces average {metrics['mean_trace_words']:.0f} words.\n\n"
            + "".join(f"## Example: {env}\n\nAction `{r.action}`, reward {r.reward}, done {r.done}.\n\n"
                      f"> {r.reasoning}\n\n" for env, r in sorted(examples.items())))
    write_stage_outputs("annotate", metrics, text, root)
    return metrics


def _saved_buffer(params: Params, root: Path):
    """The buffer index_buffer saved, with the encoder it was built with (also used to score similarity)."""
    from components.replay_buffer import SentenceEncoder, load_replay_buffer

    encoder = SentenceEncoder(params.models.embedder, root / params.models.cache_dir, params.buffer.encode_batch_size)
    return load_replay_buffer(root / params.buffer.out_dir, encoder)


def _experience_trajectories(params: Params, root: Path) -> list[Trajectory]:
    """Seed trajectories of the environments the experience model simulates."""
    return [t for t in read_trajectories(root / params.data.dir / TRAJECTORIES)
            if t.task.environment in params.experience_model.environments]


def train_experience_model(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """SFT the experience model (models.experience) on annotated training-task transitions: trace, then outcome."""
    from components import experience_model as em
    from components import sft
    from components.annotation import read_annotated

    root, settings = Path(root), params.experience_model
    fraction = params.data.heldout_task_fraction
    train_ids = {t.trajectory_id for t in _experience_trajectories(params, root)
                 if not is_heldout_task(t.task.task_id, fraction)}
    annotated = [r for r in read_annotated(root / params.annotate.out_dir / "transitions.jsonl")
                 if r.trajectory_id in train_ids]
    if not annotated:
        raise StageError(f"no annotated training transitions for {settings.environments}; run annotate first")
    fmt = em.PromptFormat(**settings.prompt.model_dump())
    buffer = _saved_buffer(params, root) if fmt.use_retrieval else None
    dataset = em.sft_examples(annotated, buffer, fmt)
    training = settings.training
    lora = sft.LoraSettings(**training.lora.model_dump()) if training.lora else None
    result = sft.train_sft(
        dataset, params.models.experience, root / settings.out_dir,
        sft.TrainingSettings(**training.model_dump(exclude={"lora"}), lora=lora, seed=params.seed),
        cache_dir=root / params.models.cache_dir)
    metrics = {"examples": result.examples, "too_long": result.too_long, "global_step": result.global_step,
               "train_loss": result.train_loss, "seconds": round(result.seconds, 1),
               "resumed": result.resumed_from is not None}
    text = (f"# Experience model training\n\n`{params.models.experience}` fine-tuned on {result.examples} annotated "
            f"transitions of training tasks in {', '.join(settings.environments)} ({result.too_long} left out as "
            f"longer than {training.max_seq_len} tokens): {result.global_step} optimizer steps, final training loss "
            f"{result.train_loss}, {result.seconds:.0f} s. Reasoning in the target: {fmt.use_reasoning}; retrieved "
            f"examples in the prompt: {fmt.use_retrieval} (top {fmt.top_k}). Model: `{result.model_dir}`.\n")
    write_stage_outputs("train_experience_model", metrics, text, root)
    return metrics


def evaluate_experience_model(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Fidelity on held-out real transitions: the experience model against copy-nearest-neighbour and no-change."""
    from components import experience_model as em
    from components import fidelity

    root, settings = Path(root), params.experience_model
    heldout = fidelity.heldout_transitions(_experience_trajectories(params, root), params.data.heldout_task_fraction)
    if settings.fidelity_max_transitions:
        per_environment: dict[str, list] = defaultdict(list)
        for transition in heldout:
            per_environment[transition.task.environment].append(transition)
        heldout = [t for group in per_environment.values() for t in group[:settings.fidelity_max_transitions]]
    buffer = _saved_buffer(params, root)
    fmt, inference = em.PromptFormat(**settings.prompt.model_dump()), settings.inference
    model = params.models.experience if inference.backend == "openai" else str(root / settings.out_dir / "model")
    backend = em.make_backend(inference.backend, model, inference.batch_size, inference.base_url)
    stats = em.PredictionStats()
    predictors = {
        "experience model": fidelity.model_predictor(
            backend, fmt, buffer, retries=inference.retries, max_new_tokens=inference.max_new_tokens,
            temperature=inference.temperature, retry_temperature=inference.retry_temperature, stats=stats),
        "copy nearest neighbour": fidelity.copy_nearest_neighbour(buffer),
        "state unchanged": fidelity.state_unchanged,
    }
    results = fidelity.evaluate(predictors, heldout, encoder=buffer.encoder)
    metrics = {"transitions": len(heldout), "prediction": stats.as_dict(), **results}
    text = (fidelity.fidelity_report(results)
            + f"\n{len(heldout)} held-out transitions (tasks never seen in training or in the buffer). The experience "
              f"model ran with reasoning {fmt.use_reasoning} and retrieval {fmt.use_retrieval}; "
              f"{stats.fallbacks} of {stats.requests} predictions fell back after {inference.retries} retry(ies) "
              f"(an unparsable reply becomes 'state unchanged, reward 0').\n")
    write_stage_outputs("evaluate_experience_model", metrics, text, root)
    return metrics


def onboard_collected(params: Params, root: str | Path = ".") -> OnboardingResult:
    """Onboard the collected seed set (collect_seed's output) into the versioned data directory."""
    root = Path(root)
    paths = sorted((root / params.collect_seed.out_dir).glob("*.jsonl"))
    if not paths:
        raise StageError(f"nothing collected in {params.collect_seed.out_dir}/; run `dvc repro collect_seed` first")
    # replace: re-collecting a task (after a param change) supersedes the episode collected before; MiniWoB pages
    # can differ in DOM numbering from run to run, so an "identical" re-collection is not guaranteed
    return onboard(paths, root / params.data.dir, Limits.of(params.data), replace=True)


def publish(params: Params, run_id: str, stage: str, root: str | Path = ".") -> list[str]:
    """Store a stage's metrics and report under the run in the configured artifact store; return their URIs."""
    store = open_artifact_store(params.storage)
    outputs = {"metrics": metrics_path(stage, root), "report": report_path(stage, root)}
    return [store.put(path, run_id, f"{stage}-{kind}") for kind, path in outputs.items() if path.exists()]


# stage name (in dvc.yaml and as a Prefect flow) -> function, in pipeline order; later stages join here
STAGES = {"collect_seed": collect_seed, "validate": validate, "annotate": annotate, "index_buffer": index_buffer,
          "train_experience_model": train_experience_model, "evaluate_experience_model": evaluate_experience_model,
          "evaluate": evaluate}
