"""Pipeline stages as plain functions: params in, files and a metrics dict out.

DVC (`dreamgym stage NAME`) and Prefect (`flows/`) call these same functions, so both run identical work.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from components.artifacts import open_artifact_store
from components.config import Params
from components.data.contract import (
    COLLECTED,
    QUARANTINE,
    TRAJECTORIES,
    Trajectory,
    is_heldout_task,
    read_records,
    read_trajectories,
    transitions,
    write_records,
    write_trajectories,
)
from components.data.onboarding import OnboardingResult, onboard, version_with_dvc
from components.data.validation import Limits, read_raw_records, validate_records
from components.llm import backends
from components.reports import GAMES_FILE, markdown_table, metrics_path, report_path, write_csv, write_stage_outputs

log = logging.getLogger(__name__)
PREDICTIONS_FILE = "reports/evaluate_experience_model_predictions.jsonl"  # evaluate_experience_model's
EPISODES_FILE = "reports/evaluate_policies_episodes.jsonl"  # evaluate_policies' episodes, to replay failures


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
    from components.data.collection import ENV_FAILURE_ATTEMPTS, collect_environment, collectable, env_failures_path

    root = Path(root)
    environments, seed_only = collectable(params.collect_seed.environments)
    (root / params.collect_seed.out_dir).mkdir(parents=True, exist_ok=True)  # DVC's output, even when empty
    metrics: dict[str, Any] = {"skipped": seed_only}
    collected: list[Trajectory] = []
    failures = []  # a line per environment: its environment failures
    for environment in environments:
        out_path = root / params.collect_seed.out_dir / f"{environment}.jsonl"
        progress_path = root / ".cache" / "collect_seed" / f"{environment}.jsonl"
        result = collect_environment(params, environment, out_path, progress_path)
        trajectories = result.trajectories
        collected += trajectories
        metrics[environment] = {
            "trajectories": len(trajectories),
            "steps": sum(len(t.steps) for t in trajectories),
            "success_rate": sum(t.success for t in trajectories) / len(trajectories),
            **{f"success_rate_{source}": sum(t.success for t in group) / len(group)
               for (_, source), group in _by_source(trajectories).items()},
            "env_failures": len(result.env_failures),  # plays an environment failure ended, retried or not
            "env_failures_left_out": len(result.left_out),  # planned episodes no play of which was collected
        }
        kept = (f", kept in `{env_failures_path(out_path).relative_to(root)}`" if result.env_failures else "")
        failures.append(f"- {environment}: {len(result.env_failures)} play(s) ended by an environment failure, "
                        f"{len(result.left_out)} episode(s) left out{kept}")
    settings = params.collect_seed
    text = (f"# Seed collection\n\n{settings.train_tasks} training tasks per environment; per task "
            f"{settings.episodes.expert} expert, {settings.episodes.noisy_expert} noisy-expert "
            f"(epsilon {settings.noisy_epsilon}), {settings.episodes.skipping_expert} skipping-expert (one "
            f"walkthrough step left out; TextWorld only) and {settings.episodes.random} random episode(s); the noisy "
            f"and skipping experts' source is `policy`. "
            f"Onboard them with `dreamgym data onboard {settings.out_dir}/*.jsonl`.\n\n"
            + _source_table(_by_source(collected))
            + (f"\nEnvironment failures (a hung or crashed engine or browser, not the policy: never collected; the "
               f"episode is played again, up to {ENV_FAILURE_ATTEMPTS} times in all, then left out):\n\n"
               + "\n".join(failures) + "\n" if failures else "")
            + (f"\nSkipped (no real-environment adapter): {', '.join(seed_only)}\n" if seed_only else ""))
    write_stage_outputs("collect_seed", metrics, text, root)
    return metrics


def evaluate(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Expert and random baselines on held-out tasks of each real environment (success with confidence intervals)."""
    from components.results.evaluation import evaluate_baselines

    metrics, report = evaluate_baselines(params)
    write_stage_outputs("evaluate", metrics, report, root)
    return metrics


def index_buffer(params: Params, root: str | Path = ".", log=print) -> dict[str, Any]:
    """Embed the real seed transitions of training tasks into the replay buffer and save it (buffer.out_dir)."""
    from components.simulator.replay_buffer import SentenceEncoder, open_replay_buffer, open_seed_buffer

    root = Path(root)
    trajectories = read_trajectories(root / params.data.dir / TRAJECTORIES)
    fraction = params.data.heldout_task_fraction
    train = [t for t in trajectories if not is_heldout_task(t.task.task_id, fraction)]
    pending = [transition for trajectory in train for transition in transitions(trajectory)]
    encoder = SentenceEncoder(params.models.embedder, root / params.models.cache_dir, params.buffer.encode_batch_size)
    if params.buffer.backend == "weaviate":  # a collection named by these transitions, the embedder and the schema
        buffer = open_seed_buffer(encoder, pending, **params.buffer.weaviate.model_dump())
    else:
        buffer = open_replay_buffer(params.buffer.backend, encoder)
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
    from components.simulator import annotation

    root = Path(root)
    trajectories = read_trajectories(root / params.data.dir / TRAJECTORIES)
    spec = params.annotate.teacher
    teacher = annotation.make_teacher(annotation.TeacherSpec(**spec.model_dump()) if spec else None,
                                      root / params.models.cache_dir)
    # Outside annotate.out_dir: the kept replies are a resume cache, not a versioned output.
    records = annotation.annotate(trajectories, teacher, replies_path=root / ".cache" / "annotate" / "replies.jsonl")
    metrics = annotation.annotation_summary(records, teacher.name if teacher else None)
    if teacher is not None and records and metrics["teacher_fallbacks"] == len(records):
        # A teacher that never answered (an endpoint down, a wrong model) is a broken run, not deterministic
        # traces under the teacher's name for DVC to cache; partial failures are counted in the metrics.
        raise StageError(f"the teacher {teacher.name} gave no usable trace for any of {len(records)} transitions "
                         "(its errors are logged above); fix annotate.teacher (model, base_url, the key in its "
                         "api_key_env) or set annotate.teacher: null for deterministic traces")
    annotation.write_annotated(records, root / params.annotate.out_dir / "transitions.jsonl")
    examples = {record.task.environment: record for record in records if record.step_index == 1}
    text = (f"# Reasoning traces\n\n{metrics['transitions']} transitions of {metrics['trajectories']} trajectories "
            f"annotated by `{metrics['annotator']}`; traces average {metrics['mean_trace_words']:.0f} words.\n\n"
            + "".join(f"## Example: {env}\n\nAction `{r.action}`, reward {r.reward}, done {r.done}.\n\n"
                      f"> {r.reasoning}\n\n" for env, r in sorted(examples.items())))
    write_stage_outputs("annotate", metrics, text, root)
    return metrics


def _sft_summary(result) -> str:
    """An SFT result's losses and time for a report (sft.TrainingResult)."""
    losses = (f"training loss {result.train_loss:.4f} on average, {result.final_loss:.4f} at the last logged step"
              if result.train_loss is not None else "no training loss logged")
    resumed = f" (this run's only: it resumed from `{Path(result.resumed_from).name}`)" if result.resumed_from else ""
    return f"{losses}, {result.seconds:.0f} s{resumed}"


def _saved_buffer(params: Params, root: Path, directory: str | Path | None = None):
    """The buffer index_buffer saved (or one saved in `directory`), with the encoder it was built with (also used to
    score similarity; the model loads on the first encoding only)."""
    from components.simulator.replay_buffer import SentenceEncoder, load_replay_buffer

    encoder = SentenceEncoder(params.models.embedder, root / params.models.cache_dir, params.buffer.encode_batch_size)
    return load_replay_buffer(root / (directory or params.buffer.out_dir), encoder)


def _experience_trajectories(params: Params, root: Path) -> list[Trajectory]:
    """Seed trajectories of the environments the experience model simulates."""
    return [t for t in read_trajectories(root / params.data.dir / TRAJECTORIES)
            if t.task.environment in params.experience_model.environments]


def train_experience_model(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """SFT the experience model (models.experience) on annotated training-task transitions: trace, then outcome."""
    from components.llm import sft
    from components.simulator import experience_model as em
    from components.simulator.annotation import read_annotated

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
    dataset = em.sft_examples(annotated, buffer, fmt, settings.outcome_repeats, settings.lookalike_repeats)
    training = settings.training
    lora = sft.LoraSettings(**training.lora.model_dump()) if training.lora else None
    result = sft.train_sft(
        dataset, params.models.experience, root / settings.out_dir,
        sft.TrainingSettings(**training.model_dump(exclude={"lora"}), lora=lora, seed=params.seed),
        cache_dir=root / params.models.cache_dir)
    metrics = {"examples": result.examples, "too_long": result.too_long, "global_step": result.global_step,
               "train_loss": result.train_loss, "final_loss": result.final_loss, "seconds": round(result.seconds, 1),
               "resumed": result.resumed_from is not None}
    text = (f"# Experience model training\n\n`{params.models.experience}` fine-tuned on {result.examples} examples of "
            f"annotated training-task transitions in {', '.join(settings.environments)}, rewarded or terminal ones "
            f"repeated {settings.outcome_repeats} times, look-alikes {settings.lookalike_repeats} times "
            f"({result.too_long} left out as "
            f"longer than {training.max_seq_len} tokens): {result.global_step} optimizer steps, "
            f"{_sft_summary(result)}. Reasoning in the target: {fmt.use_reasoning}; retrieved examples in the "
            f"prompt: {fmt.use_retrieval} (top {fmt.top_k}). Model: `{result.model_dir}`.\n")
    write_stage_outputs("train_experience_model", metrics, text, root)
    return metrics


def evaluate_experience_model(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Fidelity on held-out real transitions: the experience model against copy-nearest-neighbour and no-change."""
    from components.simulator import experience_model as em
    from components.simulator import fidelity

    root, settings = Path(root), params.experience_model
    heldout = fidelity.heldout_transitions(_experience_trajectories(params, root), params.data.heldout_task_fraction)
    if settings.fidelity_max_transitions:
        heldout = fidelity.outcomes_first_sample(heldout, settings.fidelity_max_transitions)
    buffer = _saved_buffer(params, root)
    fmt, inference = em.PromptFormat(**settings.prompt.model_dump()), settings.inference
    stats = em.PredictionStats()
    predictions = _experience_predictor(params, root, buffer, stats)(heldout)
    predictors = {
        "experience model": lambda _: predictions,
        "copy nearest neighbour": fidelity.copy_nearest_neighbour(buffer),
        "state unchanged": fidelity.state_unchanged,
    }
    results = fidelity.evaluate(predictors, heldout, encoder=buffer.encoder)
    # each prediction beside its gold transition, to read where the model goes wrong
    write_records(({"trajectory_id": t.trajectory_id, "step_index": t.step_index, "action": t.action,
                    "next_state": t.next_state, "reward": t.reward, "done": t.done,
                    "predicted": {"next_state": p.next_state, "reward": p.reward, "done": p.done,
                                  "reasoning": p.reasoning, "fallback": p.fallback}}
                   for t, p in zip(heldout, predictions, strict=True)), root / PREDICTIONS_FILE)
    _fallback_budget(params).check(stats, f"evaluate_experience_model (predictions beside the gold transitions: "
                                          f"{PREDICTIONS_FILE})", inference.max_new_tokens)
    metrics = {"transitions": len(heldout), "prediction": stats.as_dict(), **results}
    text = (fidelity.fidelity_report(results)
            + f"\n{len(heldout)} held-out transitions (tasks never seen in training or in the buffer). The experience "
              f"model ran with reasoning {fmt.use_reasoning} and retrieval {fmt.use_retrieval}; "
              f"{stats.fallbacks} of {stats.requests} predictions fell back after {inference.retries} retry(ies) "
              f"(an unparsable reply becomes 'state unchanged, reward 0'). Each prediction beside its gold "
              f"transition: `{PREDICTIONS_FILE}`.\n")
    write_stage_outputs("evaluate_experience_model", metrics, text, root)
    return metrics


def _policy_trajectories(params: Params, root: Path, heldout: bool) -> list[Trajectory]:
    """Seed trajectories of the policy's environments, of training tasks (or of held-out ones)."""
    fraction = params.data.heldout_task_fraction
    return [t for t in read_trajectories(root / params.data.dir / TRAJECTORIES)
            if t.task.environment in params.policy.environments
            and is_heldout_task(t.task.task_id, fraction) == heldout]


def _demonstrations(params: Params, trajectories: list[Trajectory]) -> list[Trajectory]:
    """What the warm start imitates: successful episodes of the configured sources."""
    return [t for t in trajectories if t.success and t.source in params.policy.sft.sources]


def _heldout_demonstrations(params: Params, root: Path) -> list[Trajectory]:
    """Held-out seed demonstrations scored for next-action accuracy (at most policy.accuracy_trajectories)."""
    heldout = _demonstrations(params, _policy_trajectories(params, root, heldout=True))
    return heldout[:params.policy.accuracy_trajectories]


def _policy_format(params: Params):
    from components.rl.policy import PolicyFormat

    return PolicyFormat(**params.policy.prompt.model_dump())


def train_policy_sft(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Warm-start the policy (models.policy) by SFT on successful seed episodes of training tasks."""
    from components.llm import sft
    from components.llm.backends import HFGenerationBackend
    from components.rl import policy

    root, settings = Path(root), params.policy.sft
    demonstrations = _demonstrations(params, _policy_trajectories(params, root, heldout=False))
    if not demonstrations:
        raise StageError(f"no successful {settings.sources} seed episodes of training tasks in "
                         f"{params.policy.environments}: onboard some, or change policy.sft.sources")
    fmt = _policy_format(params)
    training = settings.training
    lora = sft.LoraSettings(**training.lora.model_dump()) if training.lora else None
    result = sft.train_sft(policy.sft_examples(demonstrations, fmt), params.models.policy, root / settings.out_dir,
                           sft.TrainingSettings(**training.model_dump(exclude={"lora"}), lora=lora, seed=params.seed),
                           cache_dir=root / params.models.cache_dir)
    heldout = _heldout_demonstrations(params, root)
    accuracy = None
    if heldout:
        model, tokenizer = sft.load_trained_model(result.model_dir)
        accuracy = policy.next_action_accuracy(HFGenerationBackend(model, tokenizer), heldout, fmt,
                                               params.policy.max_action_tokens)
    metrics = {"demonstrations": len(demonstrations), "examples": result.examples, "too_long": result.too_long,
               "global_step": result.global_step, "train_loss": result.train_loss, "final_loss": result.final_loss,
               "seconds": round(result.seconds, 1), "heldout_next_action": accuracy}
    text = (f"# Policy warm start (SFT)\n\n`{params.models.policy}` fine-tuned on {result.examples} steps of "
            f"{len(demonstrations)} successful {'/'.join(settings.sources)} seed episodes of training tasks "
            f"({result.too_long} steps left out as longer than {training.max_seq_len} tokens): {result.global_step} "
            f"optimizer steps, {_sft_summary(result)}.\n\n")
    if accuracy:
        text += (f"Teacher-forced next-action accuracy on {len(heldout)} held-out seed episodes: "
                 f"**{accuracy['accuracy']:.3f}** ({accuracy['correct']}/{accuracy['steps']} steps). By step:\n\n"
                 + markdown_table(["step", "accuracy"], [[k, v] for k, v in accuracy["by_step"].items()]))
    write_stage_outputs("train_policy_sft", metrics, text, root)
    return metrics


def _rl_tasks(params: Params, root: Path) -> list:
    """Training tasks of the policy's environments, each with its seed first state (the synthetic reset)."""
    from components.simulator.synthetic import first_state_tasks

    tasks = first_state_tasks(_policy_trajectories(params, root, heldout=False))
    return sorted(tasks, key=lambda task: task.task_id)


def _rl_settings(params: Params):
    from components.llm.sft import LoraSettings
    from components.rl.loop import RLSettings

    rl = params.synthetic_rl
    return RLSettings(
        **rl.model_dump(exclude={"out_dir", "lora", "ppo", "curriculum"}),
        lora=LoraSettings(**rl.lora.model_dump()) if rl.lora else None,
        max_turns=params.policy.max_turns, max_action_tokens=params.policy.max_action_tokens,
        ppo_epochs=rl.ppo.epochs, gamma=rl.ppo.gamma, gae_lambda=rl.ppo.gae_lambda, value_coef=rl.ppo.value_coef,
        value_learning_rate=rl.ppo.value_learning_rate, seed=params.seed)


def _experience_backend(params: Params, root: Path) -> Any:
    """The trained experience model behind the configured inference backend; replies stop at their last tag."""
    from components.simulator import experience_model as em

    inference, out_dir = params.experience_model.inference, params.experience_model.out_dir
    model = params.models.experience if inference.backend == "openai" else str(root / out_dir / "model")
    return backends.make_backend(inference.backend, model, inference.batch_size, inference.base_url,
                                 stop=(em.REPLY_END,))


def _experience_predictor(params: Params, root: Path, buffer: Any, stats: Any) -> Any:
    """The trained experience model as a fidelity predictor (`fidelity.model_predictor`), with the prompt format and
    inference settings in params; `stats` (an `experience_model.PredictionStats`) counts its requests and fallbacks."""
    from components.simulator import experience_model as em
    from components.simulator import fidelity

    settings = params.experience_model
    inference = settings.inference
    return fidelity.model_predictor(
        _experience_backend(params, root), em.PromptFormat(**settings.prompt.model_dump()), buffer,
        retries=inference.retries, max_new_tokens=inference.max_new_tokens, temperature=inference.temperature,
        retry_temperature=inference.retry_temperature, stats=stats, reward_range=_reward_range(params))


def _success_rewards(params: Params, root: Path) -> dict[str, float]:
    """Per environment, the final reward that wins in a simulated episode: the lowest of the seed's successes on
    training tasks (held-out games only measure)."""
    from components.data.contract import success_rewards

    fraction = params.data.heldout_task_fraction
    return success_rewards(t for t in read_trajectories(root / params.data.dir / TRAJECTORIES)
                           if not is_heldout_task(t.task.task_id, fraction))


def _reward_range(params: Params) -> tuple[float, float]:
    low, high = params.data.reward_range
    return low, high


def _fallback_budget(params: Params) -> Any:
    """How often the experience model may fail before a stage using it stops (experience_model.FallbackBudget)."""
    from components.simulator.experience_model import FallbackBudget

    settings = params.experience_model
    return FallbackBudget(settings.max_fallback_rate, settings.max_backend_error_rate)


def _synthetic_environments(params: Params, root: Path, buffer: Any, names: list[str]) -> tuple[list, Any]:
    """Synthetic environments imitating `names` (the trained experience model + `buffer`) and their shared
    prediction counters."""
    from components.simulator import experience_model as em
    from components.simulator.synthetic import SyntheticEnvironment

    experience = params.experience_model
    fmt, inference = em.PromptFormat(**experience.prompt.model_dump()), experience.inference
    backend = _experience_backend(params, root)
    stats = em.PredictionStats()
    wins = _success_rewards(params, root)
    envs = [SyntheticEnvironment(name, backend, buffer, fmt, top_k=fmt.top_k, retries=inference.retries,
                                 stats=stats, max_history=fmt.history_length, max_new_tokens=inference.max_new_tokens,
                                 temperature=inference.temperature, reward_range=_reward_range(params),
                                 success_reward=wins.get(name))
            for name in names]
    return envs, stats


def _identity(*parts: Any) -> str:
    """Where an RL run's episodes come from, for its checkpoints' fingerprint: directories (the experience model,
    the buffer) by content, settings by value."""
    from components.files import directory_sha256

    return json.dumps([directory_sha256(p) if isinstance(p, Path) and p.is_dir() else
                       p.model_dump() if hasattr(p, "model_dump") else p for p in parts], sort_keys=True, default=str)


def _curriculum(params: Params, root: Path, tasks: list, buffer: Any) -> tuple[Any, Any]:
    """The curriculum over the RL tasks and the backend that writes its variations: the experience model's backbone
    (models.experience, the base model: the fine-tuned one only answers in the simulation format). PPO measures
    reward variance over clusters of similar tasks, since its episodes are not grouped by task."""
    from components.rl.curriculum import INSTRUCTION_END, Curriculum, CurriculumSettings, cluster_tasks

    settings = params.synthetic_rl.curriculum
    clusters = None
    if params.synthetic_rl.algorithm == "ppo" and settings.enabled:
        clusters = cluster_tasks(tasks, buffer.encoder, settings.clusters, params.seed)
    curriculum = Curriculum(tasks, CurriculumSettings(**settings.model_dump()), clusters=clusters)
    if not settings.enabled or settings.top_tasks == 0:
        return curriculum, None
    inference = params.experience_model.inference
    if inference.backend == "openai":
        return curriculum, backends.make_backend("openai", params.models.experience, inference.batch_size,
                                           inference.base_url, stop=(INSTRUCTION_END,))
    from components.llm.models import resolve_model

    backbone = resolve_model(params.models.experience, root / params.models.cache_dir)
    return curriculum, backends.make_backend(inference.backend, str(backbone), inference.batch_size,
                                       stop=(INSTRUCTION_END,))


def _curriculum_sentence(curriculum: Any) -> str:
    if not curriculum.settings.enabled:
        return "Curriculum off (the ablation): base tasks only."
    summary = curriculum.summary()
    return (f"The curriculum proposed {summary['proposed']} task variations and accepted {summary['accepted']} "
            f"({summary['rejected']} rejected: " + ", ".join(
                f"{reason[9:]} {count}" for reason, count in summary.items()
                if reason.startswith("rejected_") and count) + "); generated tasks are in "
            "`generated_tasks.jsonl` next to the model.")


def synthetic_rl(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """RL of the warm-started policy inside the synthetic environment (experience model + replay buffer)."""
    from components.reports import line_plot, write_csv
    from components.rl.rollouts import SyntheticBatch

    root, settings = Path(root), params.synthetic_rl
    tasks = _rl_tasks(params, root)
    if len(tasks) < settings.tasks_per_iteration:
        raise StageError(f"{len(tasks)} training tasks in {params.policy.environments} with seed episodes; "
                         f"synthetic_rl.tasks_per_iteration is {settings.tasks_per_iteration}")
    buffer = _saved_buffer(params, root)  # embedded: a copy in memory; weaviate: the seed collection, copied below
    curriculum, generator = _curriculum(params, root, tasks, buffer)
    if settings.algorithm == "grpo":
        from components.rl.grpo import train_grpo as train
    else:
        from components.rl.ppo import train_ppo as train
    warm_start = str(root / params.policy.sft.out_dir / "model")
    experience = params.experience_model
    simulator = _identity(root / experience.out_dir / "model", root / params.buffer.out_dir, experience.prompt,
                          experience.inference, params.models.experience)
    if buffer.backend == "weaviate":
        # Synthetic experience never alters index_buffer's collection: the run adds to its own copy, named by what
        # resumes its checkpoints (and its out_dir), so a resumed run finds it again and no other run shares it.
        from components.rl.loop import settings_fingerprint
        from components.simulator.replay_buffer import run_collection_name

        run = settings_fingerprint(_rl_settings(params), warm_start, curriculum, simulator)
        seed, buffer = buffer, buffer.copy(run_collection_name(buffer.collection_name, f"{run}/{settings.out_dir}"))
        seed.close()
    envs, stats = _synthetic_environments(params, root, buffer, params.policy.environments)
    budget = _fallback_budget(params)

    def next_batch() -> SyntheticBatch:
        # the iterations so far: stop before paying for another on a simulator that does not answer
        budget.check(stats, "synthetic_rl", experience.inference.max_new_tokens)
        return SyntheticBatch(*envs)

    result = train(warm_start, curriculum, next_batch, buffer, _policy_format(params),
                   _rl_settings(params), root / settings.out_dir, cache_dir=root / params.models.cache_dir,
                   generator=generator, environment=simulator)
    budget.check(stats, "synthetic_rl", experience.inference.max_new_tokens)
    buffer.save(root / settings.out_dir / "replay_buffer")
    curriculum.write_tasks(root / settings.out_dir / "generated_tasks.jsonl")
    rows = result.log
    write_csv(rows, root / "metrics" / "synthetic_rl_iterations.csv")
    curves = ["reward_mean", "success_rate", "kl", "entropy", "reward_variance_mean", "generated_tasks"]
    line_plot(rows, "iteration", curves, root / "reports" / "synthetic_rl.png",
              f"{settings.algorithm.upper()} in the synthetic environment")
    metrics = {"algorithm": settings.algorithm, "iterations": result.iterations, "tasks": len(tasks),
               "episodes": len(rows) * settings.tasks_per_iteration * settings.group_size,
               "synthetic_transitions": sum(row["synthetic_transitions"] for row in rows),
               "buffer_size": len(buffer), "experience_model": _predictions_of_run(rows, stats),
               "curriculum": curriculum.summary(),
               "final": {key: rows[-1].get(key) for key in ("reward_mean", "success_rate", "kl")} if rows else {},
               "seconds": round(result.seconds, 1), "resumed": result.resumed_from is not None}
    shown = ["iteration", "reward_mean", "success_rate", "kl", "entropy", "turns_mean", "policy_tokens_mean",
             "synthetic_transitions", "generated_tasks_played", "generated_tasks", "policy_generation_s",
             "environment_s", "curriculum_s", "optimisation_s"]
    text = (f"# Synthetic RL ({settings.algorithm.upper()})\n\nThe warm-started policy trained for "
            f"{result.iterations} iterations inside the synthetic environment ({len(tasks)} training tasks, "
            f"{settings.tasks_per_iteration} per iteration x {settings.group_size} episodes, at most "
            f"{params.policy.max_turns} turns). {metrics['synthetic_transitions']} synthetic transitions were "
            f"generated and appended to the replay buffer (now {len(buffer)}); the experience model fell back on "
            f"{metrics['experience_model']['fallbacks']} of {metrics['experience_model']['requests']} predictions. "
            f"{_curriculum_sentence(curriculum)} "
            f"Wall time {result.seconds:.0f} s.\n\n"
            "![learning curves](synthetic_rl.png)\n\n"
            + markdown_table(shown, [[row.get(key) for key in shown] for row in rows]))
    write_stage_outputs("synthetic_rl", metrics, text, root)
    buffer.close()
    return metrics


def _predictions_of_run(rows: list[dict[str, Any]], stats: Any) -> dict[str, Any]:
    """The experience model's predictions and fallbacks over the whole run, from the iteration log (one prediction
    per synthetic step): `stats` counts only this process's, which after a resume is the iterations since it."""
    requests = sum(row["env_transitions"] for row in rows)
    fallbacks = sum(row["fallback_steps"] for row in rows)
    return {"requests": requests, "fallbacks": fallbacks, "fallback_rate": fallbacks / requests if requests else 0.0,
            "this_process": stats.as_dict()}


def sim_to_real(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Sim-to-real: RL goes on in the real environments from the synthetic-RL policy (or, for the real-RL baseline,
    from the warm start), on a budget of real transitions that is counted exactly and never exceeded."""
    import dataclasses

    from components.envs.registry import has_adapter, real_environment
    from components.reports import line_plot, write_csv
    from components.rl.curriculum import Curriculum, CurriculumSettings
    from components.rl.loop import iterations_within_budget
    from components.rl.rollouts import RealBatch

    root, settings = Path(root), params.sim_to_real
    model_dir = root / settings.out_dir / "model"
    # the training tasks as their real environments reset them (no synthetic initial_state)
    tasks = sorted({t.task.task_id: t.task for t in _policy_trajectories(params, root, heldout=False)
                    if has_adapter(t.task.environment)}.values(), key=lambda task: task.task_id)
    skipped = [name for name in params.policy.environments if not has_adapter(name)]
    rl = dataclasses.replace(_rl_settings(params), iterations=settings.max_iterations,
                             tasks_per_iteration=settings.tasks_per_iteration, group_size=settings.group_size,
                             learning_rate=settings.learning_rate)
    iterations = iterations_within_budget(rl, settings.real_transitions)
    why_not = ("no environment of policy.environments has a real-environment adapter (a seed-only domain)"
               if not tasks else
               f"a budget of {settings.real_transitions} real transitions pays for no iteration (one costs up to "
               f"{rl.episodes_per_iteration * rl.max_turns}: tasks_per_iteration x group_size x policy.max_turns)"
               if iterations == 0 else None)
    if why_not is not None:
        log.warning("sim_to_real skipped: %s", why_not)
        shutil.rmtree(model_dir, ignore_errors=True)
        model_dir.mkdir(parents=True)
        (model_dir / "SKIPPED.md").write_text(f"Sim-to-real was skipped: {why_not}.\n", encoding="utf-8")
        write_csv([], root / "metrics" / "sim_to_real_iterations.csv")  # no iterations (outputs DVC expects)
        line_plot([], "iteration", [], root / "reports" / "sim_to_real.png", "Sim-to-real (skipped)")
        metrics = {"skipped": skipped, "reason": why_not, "iterations": 0, "real_transitions_used": 0,
                   "real_transitions_budget": settings.real_transitions}
        write_stage_outputs("sim_to_real", metrics, f"# Sim-to-real\n\nSkipped: {why_not}.\n", root)
        return metrics

    start = {"synthetic_rl": params.synthetic_rl.out_dir, "sft": params.policy.sft.out_dir}[settings.start_from]
    if params.synthetic_rl.algorithm == "grpo":
        from components.rl.grpo import train_grpo as train
    else:
        from components.rl.ppo import train_ppo as train
    rl = dataclasses.replace(rl, iterations=iterations)
    # Real tasks cannot be invented: the curriculum is off here, the tasks are the training tasks' real games.
    result = train(str(root / start / "model"), Curriculum(tasks, CurriculumSettings(enabled=False)),
                   lambda: RealBatch(lambda task: real_environment(task.environment).open(params.environments)),
                   None, _policy_format(params), rl, root / settings.out_dir, cache_dir=root / params.models.cache_dir,
                   environment=_identity(params.environments))
    rows = result.log
    used = sum(row["env_transitions"] for row in rows)
    if used > settings.real_transitions:  # cannot happen: iterations_within_budget charges every worst case
        raise RuntimeError(f"sim_to_real used {used} real transitions, over its budget {settings.real_transitions}")
    write_csv(rows, root / "metrics" / "sim_to_real_iterations.csv")
    line_plot(rows, "iteration", ["reward_mean", "success_rate", "kl", "env_transitions"],
              root / "reports" / "sim_to_real.png", f"Sim-to-real {params.synthetic_rl.algorithm.upper()}")
    metrics = {"skipped": skipped, "start_from": settings.start_from, "algorithm": params.synthetic_rl.algorithm,
               "iterations": result.iterations, "real_transitions_budget": settings.real_transitions,
               "real_transitions_used": used, "episodes": len(rows) * rl.episodes_per_iteration,
               # episodes an environment failure ended: out of success_rate and reward_mean, given no advantage
               "env_failures": sum(row.get("env_failures", 0) for row in rows),
               "final": {key: rows[-1].get(key) for key in ("reward_mean", "success_rate", "kl")} if rows else {},
               "seconds": round(result.seconds, 1), "resumed": result.resumed_from is not None}
    shown = ["iteration", "reward_mean", "success_rate", "kl", "turns_mean", "env_transitions", "env_failures",
             "policy_generation_s", "environment_s", "optimisation_s"]
    text = (f"# Sim-to-real ({params.synthetic_rl.algorithm.upper()})\n\nFrom the {settings.start_from} policy, "
            f"{result.iterations} iterations in the real environments ({len(tasks)} training tasks, "
            f"{rl.tasks_per_iteration} per iteration x {rl.group_size} episodes, at most {rl.max_turns} turns) used "
            f"**{used} real transitions** of a budget of {settings.real_transitions} (each iteration is charged its "
            f"worst case, {rl.episodes_per_iteration * rl.max_turns}, before it runs). Wall time "
            f"{result.seconds:.0f} s. {metrics['env_failures']} episode(s) ended by an environment failure (a hung "
            "or crashed engine or browser): counted in `env_failures`, left out of success and reward, given no "
            "advantage.\n\n![learning curves](sim_to_real.png)\n\n"
            + markdown_table(shown, [[row.get(key) for key in shown] for row in rows])
            + (f"\nSkipped (no real-environment adapter): {', '.join(skipped)}.\n" if skipped else ""))
    write_stage_outputs("sim_to_real", metrics, text, root)
    return metrics


def evaluate_policies(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """The warm start, the synthetic-RL and the sim-to-real policies on held-out tasks: closed-loop success (with
    confidence intervals) in the real environment, or inside the experience model for a seed-only domain, and
    teacher-forced next-action accuracy on held-out seed episodes."""
    from components.envs.registry import has_adapter, real_environment
    from components.llm import sft
    from components.llm.backends import HFGenerationBackend
    from components.results.evaluation import (
        ENV_FAILURES_COLUMN,
        ENV_FAILURES_NOTE,
        evaluate_in_simulation,
        evaluate_policy,
        format_success,
    )
    from components.rl import policy
    from components.rl.loop import read_iteration_log
    from components.rl.rollouts import SyntheticBatch
    from components.simulator.synthetic import first_state_tasks

    root, fmt = Path(root), _policy_format(params)
    rl_label = f"synthetic {params.synthetic_rl.algorithm}"
    candidates = {"sft warm start": ("train_policy_sft", root / params.policy.sft.out_dir / "model"),
                  rl_label: ("synthetic_rl", root / params.synthetic_rl.out_dir / "model"),
                  "sim-to-real": ("sim_to_real", root / params.sim_to_real.out_dir / "model")}
    candidates = {label: path for label, (stage, path) in candidates.items()
                  if stage in params.evaluate.policies and sft.has_trained_model(path)}
    heldout = _heldout_demonstrations(params, root)
    environments = [name for name in params.policy.environments if has_adapter(name)]
    skipped = [name for name in params.policy.environments if not has_adapter(name)]
    tasks = {name: real_environment(name).make_tasks(params.environments, "heldout", params.policy.eval_tasks,
                                                     params.seed) for name in environments}
    # A seed-only domain has no application to play: its held-out seed tasks are played in the experience model.
    heldout_tasks = first_state_tasks(_policy_trajectories(params, root, heldout=True)) if skipped else []
    simulated = {name: [t for t in heldout_tasks if t.environment == name][: params.policy.eval_tasks]
                 for name in skipped}
    simulators, simulator_stats = (_synthetic_environments(params, root, _saved_buffer(params, root), skipped)
                                   if skipped else ([], None))
    metrics: dict[str, Any] = {"skipped": skipped}
    rows, episodes, games = [], [], []
    for label, model_dir in candidates.items():
        key = label.replace(" ", "_")  # the policy's name in the metrics and the games file
        model, tokenizer = sft.load_trained_model(model_dir)
        entry: dict[str, Any] = {}
        if heldout:
            entry["next_action"] = policy.next_action_accuracy(HFGenerationBackend(model, tokenizer), heldout, fmt,
                                                               params.policy.max_action_tokens)
        for name in environments:
            result = evaluate_policy(real_environment(name), params.environments, tasks[name],
                                     policy.policy_factory(model, tokenizer, fmt, params.policy.max_action_tokens),
                                     workers=params.evaluate.workers, confidence=params.evaluate.confidence,
                                     name=label.replace(" ", "-"), max_steps=params.policy.max_turns)
            entry[name] = result.metrics()
            episodes += result.trajectories
            games += result.games(key)
            accuracy = entry.get("next_action", {}).get("accuracy")
            rows.append([name, label, result.episodes, format_success(result),
                         f"{accuracy:.3f}" if accuracy is not None else "n/a", f"{result.mean_steps:.1f}",
                         f"{result.wall_s:.0f}", result.env_failures])
        for env in simulators:
            if not simulated[env.name]:
                continue
            result = evaluate_in_simulation(model, tokenizer, SyntheticBatch(env), simulated[env.name], fmt,
                                            max_turns=params.policy.max_turns,
                                            max_action_tokens=params.policy.max_action_tokens,
                                            confidence=params.evaluate.confidence, name=label)
            entry[f"{env.name} (simulated)"] = result.metrics()
            episodes += result.trajectories
            games += result.games(key, f"{env.name} (simulated)")
            accuracy = entry.get("next_action", {}).get("accuracy")
            rows.append([f"{env.name} (in the experience model)", label, result.episodes, format_success(result),
                         f"{accuracy:.3f}" if accuracy is not None else "n/a", f"{result.mean_steps:.1f}",
                         f"{result.wall_s:.0f}", result.env_failures])
        metrics[key] = entry
    if simulator_stats is not None:
        _fallback_budget(params).check(simulator_stats, "evaluate_policies (held-out games of seed-only domains)",
                                       params.experience_model.inference.max_new_tokens)
        metrics["experience_model"] = simulator_stats.as_dict()
    replayed = ""
    if rl_label in candidates:
        metrics["synthetic_replay"], replays, replayed = _replay_synthetic_episodes(params, root, environments)
        episodes += replays
    # What the RL policies saw, read from the iteration log saved with each model (a checkpoint's too), so it is
    # that model's history even when a study points the out_dirs at another run's.
    provenance = ""
    logs = {label: read_iteration_log(model_dir) for label, model_dir in candidates.items()}
    if rl_log := logs.get(rl_label):
        provenance += (f" The synthetic RL policy ({len(rl_log)} iterations) saw "
                       f"{sum(row['synthetic_transitions'] for row in rl_log)} synthetic transitions and no real ones "
                       "beyond the seed.")
    if s2r_log := logs.get("sim-to-real"):
        provenance += f" Sim-to-real then used {sum(row['env_transitions'] for row in s2r_log)} real transitions."
    confidence = params.evaluate.confidence
    text = ("# Policies on held-out tasks\n\n"
            + markdown_table(["environment", "policy", "episodes", f"success [{confidence:.0%} CI]",
                              "next-action accuracy", "mean steps", "wall time (s)", ENV_FAILURES_COLUMN], rows)
            + f"\nClosed loop: each policy plays {params.policy.eval_tasks} held-out real tasks per environment once "
              f"(greedy, at most {params.policy.max_turns} turns); Wilson intervals. Next-action accuracy is "
              f"teacher-forced on {len(heldout)} held-out seed episodes. {ENV_FAILURES_NOTE}{provenance} Every "
              f"episode, step by step: `{EPISODES_FILE}`; each game's outcome: `{GAMES_FILE}` (`won` empty and "
              "`env_failure` saying why where an environment failure ended the game).\n"
            + (f"\nNo real-environment adapter (seed-only domains): {', '.join(skipped)}. Their held-out seed tasks "
               "are played inside the experience model instead: that success is the simulator's verdict, a check "
               "of the policy against the learned dynamics, not of the application.\n" if skipped else "")
            + replayed)
    write_trajectories(episodes, root / EPISODES_FILE)
    write_csv(games, root / GAMES_FILE)
    write_stage_outputs("evaluate_policies", metrics, text, root)
    return metrics


def _replay_synthetic_episodes(params: Params, root: Path,
                               environments: list[str]) -> tuple[dict[str, Any], list[Trajectory], str]:
    """Synthetic RL's episodes on real training tasks, replayed action by action in the real environment: how many
    synthetic wins the application confirms (metrics, the replays, a report section)."""
    from components.envs.registry import real_environment
    from components.results.evaluation import outcome_agreement, replay_in_real
    from components.simulator.synthetic import episodes_from_buffer

    buffer_dir = Path(params.synthetic_rl.out_dir) / "replay_buffer"  # under root, as _saved_buffer takes it
    if not (root / buffer_dir).is_dir():
        return {}, [], ""
    buffer = _saved_buffer(params, root, buffer_dir)
    records, _ = buffer.export(source="synthetic")
    buffer.close()
    tasks = {t.task.task_id: t.task for t in read_trajectories(root / params.data.dir / TRAJECTORIES)}
    metrics: dict[str, Any] = {}
    rows, replays = [], []
    for name in environments:
        synthetic, unreplayable = episodes_from_buffer([r for r in records if r.environment == name], tasks,
                                                       _success_rewards(params, root).get(name))
        real = replay_in_real(real_environment(name), params.environments, synthetic)
        metrics[name] = {**outcome_agreement(synthetic, real), "unreplayable": unreplayable}
        replays += real
        m = metrics[name]
        rows.append([name, m["episodes"], m["synthetic_successes"], m["both"], m["synthetic_only"], m["real_only"],
                     unreplayable])
    if not rows:
        return metrics, replays, ""
    text = ("\n## Synthetic episodes replayed in the real environment\n\n"
            "Every episode synthetic RL played inside the experience model on a real training task, its actions "
            "replayed in order in the real environment (`replay-*` in the episodes file). A synthetic win the real "
            "game does not give is a simulator error the policy was rewarded for.\n\n"
            + markdown_table(["environment", "episodes", "synthetic wins", "of them real wins",
                              "synthetic wins not real", "real wins the simulator missed",
                              "not replayable (generated tasks)"], rows))
    return metrics, replays, text


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


# stage name (in dvc.yaml and as a Prefect flow) -> function, in pipeline order; later stages join here
STAGES = {"collect_seed": collect_seed, "validate": validate, "annotate": annotate, "index_buffer": index_buffer,
          "train_experience_model": train_experience_model, "evaluate_experience_model": evaluate_experience_model,
          "train_policy_sft": train_policy_sft, "synthetic_rl": synthetic_rl, "sim_to_real": sim_to_real,
          "evaluate_policies": evaluate_policies,
          "evaluate": evaluate}
