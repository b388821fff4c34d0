"""params.yaml sections made into the objects the stages run: the saved buffer, the seed splits, prompt formats,
RL settings, the experience model as a backend, predictor or synthetic environment, the curriculum.

Shared by the stages (`stages/`), the research scripts and the benchmarks, so they all build from params alike. Settings
objects get every field from params (`section.model_dump()`), never a class default. Heavy modules load inside the
functions that need them.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from components.config import Params, TrainingParams
from components.data.contract import ON_POLICY, TRAJECTORIES, Trajectory, is_heldout_task, read_trajectories
from components.llm import backends

log = logging.getLogger(__name__)


def buffer_index(params: Params):
    """buffer.index as the embedded buffer's `IndexSettings`."""
    from components.simulator.replay_buffer import IndexSettings

    return IndexSettings(**params.buffer.index.model_dump())


def saved_buffer(params: Params, root: Path, directory: str | Path | None = None):
    """The buffer index_buffer saved (or one saved in `directory`), with the encoder it was built with (also used to
    score similarity; the model loads on the first encoding only)."""
    from components.simulator.replay_buffer import SentenceEncoder, load_replay_buffer

    encoder = SentenceEncoder(params.models.embedder, root / params.models.cache_dir, params.buffer.encode_batch_size)
    return load_replay_buffer(root / (directory or params.buffer.out_dir), encoder, buffer_index(params))


def experience_trajectories(params: Params, root: Path) -> list[Trajectory]:
    """Seed trajectories of the environments the experience model simulates."""
    return [t for t in read_trajectories(root / params.data.dir / TRAJECTORIES)
            if t.task.environment in params.experience_model.environments]


def experience_sft_data(params: Params, root: Path) -> tuple[list, Any]:
    """What train_experience_model trains on: the annotated transitions of the experience model's training tasks and
    the SFT examples made of them (`experience_model.sft_examples`; None when there is no transition). The data
    directory's `on_policy.jsonl`, where correction rounds keep the policy's real play they fed back, names the
    trajectories weighed by `experience_model.policy_share`."""
    from components.simulator.annotation import read_annotated
    from components.simulator.experience_model import sft_examples

    settings, fraction = params.experience_model, params.data.heldout_task_fraction
    train_ids = {t.trajectory_id for t in experience_trajectories(params, root)
                 if not is_heldout_task(t.task.task_id, fraction)}
    annotated = [r for r in read_annotated(root / params.annotate.out_dir / "transitions.jsonl")
                 if r.trajectory_id in train_ids]
    if not annotated:
        return annotated, None
    fmt = prompt_format(params)
    buffer = saved_buffer(params, root) if fmt.use_retrieval else None
    fed_back_path = root / params.data.dir / ON_POLICY
    fed_back = {t.trajectory_id for t in read_trajectories(fed_back_path)} if fed_back_path.is_file() else set()
    return annotated, sft_examples(annotated, buffer, fmt, settings.outcome_repeats, settings.lookalike_repeats,
                                   settings.policy_share, settings.refusal_repeats, fed_back)


def policy_trajectories(params: Params, root: Path, heldout: bool) -> list[Trajectory]:
    """Seed trajectories of the policy's environments, of training tasks (or of held-out ones)."""
    fraction = params.data.heldout_task_fraction
    return [t for t in read_trajectories(root / params.data.dir / TRAJECTORIES)
            if t.task.environment in params.policy.environments
            and is_heldout_task(t.task.task_id, fraction) == heldout]


def demonstrations(params: Params, trajectories: list[Trajectory]) -> list[Trajectory]:
    """What the warm start imitates: successful episodes of the configured sources."""
    return [t for t in trajectories if t.success and t.source in params.policy.sft.sources]


def heldout_demonstrations(params: Params, root: Path) -> list[Trajectory]:
    """Held-out seed demonstrations scored for next-action accuracy (at most policy.accuracy_trajectories)."""
    heldout = demonstrations(params, policy_trajectories(params, root, heldout=True))
    return heldout[:params.policy.accuracy_trajectories]


def training_settings(training: TrainingParams, seed: int):
    """An SFT section (experience_model.training, policy.sft.training) as `sft.TrainingSettings`."""
    from components.llm import sft

    lora = sft.LoraSettings(**training.lora.model_dump()) if training.lora else None
    return sft.TrainingSettings(**training.model_dump(exclude={"lora"}), lora=lora, seed=seed)


def kept_trainings(params: Params, root: Path) -> Path | None:
    """The folder of kept LoRA trainings (models.kept_trainings) under the stage root, or None."""
    return root / params.models.kept_trainings if params.models.kept_trainings else None


def prompt_format(params: Params):
    """The experience model's prompt format (experience_model.prompt), an `experience_model.PromptFormat`."""
    from components.simulator.experience_model import PromptFormat

    return PromptFormat(**params.experience_model.prompt.model_dump())


def policy_format(params: Params):
    """The policy's prompt format (policy.prompt), a `policy.PolicyFormat`."""
    from components.rl.policy import PolicyFormat

    return PolicyFormat(**params.policy.prompt.model_dump())


def rl_tasks(params: Params, root: Path) -> list:
    """Training tasks of the policy's environments, each with its seed first state (the synthetic reset)."""
    from components.simulator.synthetic import first_state_tasks

    tasks = first_state_tasks(policy_trajectories(params, root, heldout=False))
    return sorted(tasks, key=lambda task: task.task_id)


def rl_settings(params: Params):
    """synthetic_rl with the policy's turn and action limits and the run seed, as `loop.RLSettings` (no transition
    budget: synthetic transitions are what the experience model makes)."""
    from components.llm.sft import LoraSettings
    from components.rl.loop import PPOSettings, RLSettings

    rl = params.synthetic_rl
    return RLSettings(
        **rl.model_dump(exclude={"out_dir", "lora", "ppo", "curriculum"}),
        lora=LoraSettings(**rl.lora.model_dump()) if rl.lora else None, ppo=PPOSettings(**rl.ppo.model_dump()),
        max_turns=params.policy.max_turns, max_action_tokens=params.policy.max_action_tokens,
        batched_rollouts=params.policy.batched_rollouts, seed=params.seed, transition_budget=None)


def curve_probe(params: Params):
    """The RL stages' learning curve (`loop.CurveProbe`): held-out success every evaluate.curve_every iterations on
    the first evaluate.curve_games held-out games of each policy environment with a real adapter, played greedily,
    its progress logged (on a CPU the games take many minutes); None when curve_every is 0 or no environment has an
    adapter."""
    from components.envs.registry import has_adapter, real_environment
    from components.results.evaluation import evaluate_policy
    from components.rl.loop import CurveProbe
    from components.rl.policy import policy_factory

    settings = params.evaluate
    environments = [name for name in params.policy.environments if has_adapter(name)]
    if not settings.curve_every or not environments:
        return None
    tasks = {name: real_environment(name).make_tasks(params.environments, "heldout", settings.curve_games,
                                                     params.seed) for name in environments}
    fmt = policy_format(params)

    def measure(model: Any, tokenizer: Any) -> float:
        results = [evaluate_policy(real_environment(name), params.environments, tasks[name],
                                   policy_factory(model, tokenizer, fmt, params.policy.max_action_tokens),
                                   workers=settings.workers, confidence=settings.confidence, name="curve",
                                   progress=log.info, max_steps=params.policy.max_turns) for name in environments]
        return sum(r.successes for r in results) / max(1, sum(r.episodes for r in results))

    return CurveProbe(settings.curve_every, measure)


def experience_backend(params: Params, root: Path) -> Any:
    """The trained experience model behind the configured inference backend; replies stop at their last tag."""
    from components.simulator import experience_model as em

    inference, out_dir = params.experience_model.inference, params.experience_model.out_dir
    model = params.models.experience if inference.backend == "openai" else str(root / out_dir / "model")
    return generation_backend(params, root, model, stop=(em.REPLY_END,))


def generation_backend(params: Params, root: Path, model: str, stop: tuple[str, ...]) -> Any:
    """`model` (a model directory, or the served name for openai) behind params experience_model.inference's backend."""
    inference = params.experience_model.inference
    return backends.make_backend(inference.backend, model, batch_size=inference.batch_size,
                                 base_url=inference.base_url, weight_type=inference.llamacpp.weight_type,
                                 threads=inference.llamacpp.threads, context=inference.llamacpp.context,
                                 draft_tokens=inference.llamacpp.draft_tokens, cache_dir=root / params.models.cache_dir,
                                 stop=stop)


def experience_predictor(params: Params, root: Path, buffer: Any, stats: Any) -> Any:
    """The trained experience model as a fidelity predictor (`fidelity.model_predictor`), with the prompt format and
    inference settings in params; `stats` (an `experience_model.PredictionStats`) counts its requests and fallbacks."""
    from components.simulator import fidelity

    return fidelity.model_predictor(experience_backend(params, root), prompt_format(params),
                                    inference_settings(params), buffer, stats=stats)


def inference_settings(params: Params):
    """How the experience model is asked: params experience_model.inference and the contract's reward range."""
    from components.simulator.experience_model import InferenceSettings

    inference = params.experience_model.inference
    return InferenceSettings(retries=inference.retries, max_new_tokens=inference.max_new_tokens,
                             temperature=inference.temperature, retry_temperature=inference.retry_temperature,
                             reward_range=reward_range(params))


def success_rewards(params: Params, root: Path) -> dict[str, float]:
    """Per environment, the final reward that wins in a simulated episode: the lowest of the seed's successes on
    training tasks (held-out games only measure)."""
    from components.data import contract

    fraction = params.data.heldout_task_fraction
    return contract.success_rewards(t for t in read_trajectories(root / params.data.dir / TRAJECTORIES)
                                    if not is_heldout_task(t.task.task_id, fraction))


def reward_range(params: Params) -> tuple[float, float]:
    """The contract's reward range (data.reward_range) as a (low, high) pair."""
    low, high = params.data.reward_range
    return low, high


def fallback_budget(params: Params) -> Any:
    """How often the experience model may fail before a stage using it stops (experience_model.FallbackBudget)."""
    from components.simulator.experience_model import FallbackBudget

    settings = params.experience_model
    return FallbackBudget(settings.max_fallback_rate, settings.max_backend_error_rate)


def synthetic_environments(params: Params, root: Path, buffer: Any, names: list[str]) -> tuple[list, Any]:
    """Synthetic environments imitating `names` (the trained experience model + `buffer`) and their shared
    prediction counters."""
    from components.simulator import experience_model as em
    from components.simulator.synthetic import SyntheticEnvironment

    fmt, settings = prompt_format(params), inference_settings(params)
    backend = experience_backend(params, root)
    stats = em.PredictionStats()
    wins = success_rewards(params, root)
    ends = params.experience_model.inference.fallback_ends_episode
    envs = [SyntheticEnvironment(name, backend, buffer, fmt, settings, stats=stats, success_reward=wins.get(name),
                                 end_on_fallback=ends) for name in names]
    return envs, stats


def run_identity(*parts: Any) -> str:
    """Where an RL run's episodes come from, for its checkpoints' fingerprint: directories (the experience model,
    the buffer) by content, settings by value."""
    from components.files import directory_identity

    return json.dumps([directory_identity(p) if isinstance(p, Path) and p.is_dir() else
                       p.model_dump() if hasattr(p, "model_dump") else p for p in parts], sort_keys=True, default=str)


def curriculum_settings(params: Params, enabled: bool | None = None):
    """synthetic_rl.curriculum as `curriculum.CurriculumSettings`; `enabled` overrides its switch (sim_to_real
    turns the curriculum off: real tasks cannot be invented)."""
    from components.rl.curriculum import CurriculumSettings

    settings = params.synthetic_rl.curriculum.model_dump(exclude={"writer_pairs_per_task", "writer_training"})
    return CurriculumSettings(**settings if enabled is None else {**settings, "enabled": enabled})


WRITER_DIR = "curriculum_writer"  # under synthetic_rl.out_dir: the curriculum writer's teaching


def curriculum_writer(params: Params, root: Path, tasks: list) -> str:
    """The model that writes the curriculum's variations: the experience model's backbone (models.experience, the
    base model: the fine-tuned one only answers in the simulation format), first taught its role by SFT on
    `curriculum.variation_pairs` of the seed `tasks` where synthetic_rl.curriculum.writer_training is set (resumed
    and kept like every SFT); the untaught backbone where the tasks give no pair, with a warning."""
    from components.llm import sft
    from components.llm.models import resolve_model
    from components.rl.curriculum import variation_examples, variation_pairs

    settings = params.synthetic_rl.curriculum
    backbone = resolve_model(params.models.experience, root / params.models.cache_dir)
    if settings.writer_training is None:
        return backbone
    pairs = variation_pairs(tasks, settings.writer_pairs_per_task)
    if not pairs:
        log.warning("curriculum: no two seed tasks of one family have different instructions, so there is nothing "
                    "to teach the writer from; %s writes untaught", params.models.experience)
        return backbone
    from datasets import Dataset

    try:
        result = sft.train_sft(Dataset.from_list(variation_examples(pairs, settings.max_state_chars)),
                               params.models.experience, root / params.synthetic_rl.out_dir / WRITER_DIR,
                               training_settings(settings.writer_training, params.seed),
                               cache_dir=root / params.models.cache_dir, kept=kept_trainings(params, root))
    except ValueError as error:  # no pair fits: say which knobs make them fit
        raise ValueError(f"the curriculum writer's teaching: {error} (synthetic_rl.curriculum.writer_training."
                         "max_seq_len, or a smaller synthetic_rl.curriculum.max_state_chars)") from error
    log.info("curriculum: the writer was taught on %d pairs of related seed tasks (%s)", len(pairs),
             result.summary())
    return str(result.model_dir)


def curriculum_and_writer(params: Params, root: Path, tasks: list, buffer: Any,
                          with_writer: bool = True) -> tuple[Any, Any]:
    """The curriculum over the RL tasks and the backend that writes its variations (`curriculum_writer`); no backend
    with `with_writer` False (a process that does not play). PPO measures reward variance over clusters of similar
    tasks, since its episodes are not grouped by task."""
    from components.rl.curriculum import INSTRUCTION_END, Curriculum, cluster_tasks

    settings = params.synthetic_rl.curriculum
    clusters = None
    if params.synthetic_rl.algorithm == "ppo" and settings.enabled:
        clusters = cluster_tasks(tasks, buffer.encoder, settings.clusters, params.seed)
    curriculum = Curriculum(tasks, curriculum_settings(params), clusters=clusters)
    if not settings.enabled or settings.top_tasks == 0 or not with_writer:
        return curriculum, None
    if params.experience_model.inference.backend == "openai":
        return curriculum, generation_backend(params, root, params.models.experience, stop=(INSTRUCTION_END,))
    return curriculum, generation_backend(params, root, curriculum_writer(params, root, tasks), stop=(INSTRUCTION_END,))
