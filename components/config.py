"""params.yaml, loaded into a typed schema: the single source of every knob.

The schema holds no defaults on purpose: a value lives in params.yaml and nowhere else, so what DVC tracks
is what ran. Neither do the runtime settings the sections become (the dataclasses a section's docstring says it
mirrors, with the same field names): the builders make them from a section's values. Unknown, missing or
mistyped keys fail loudly with the dotted key and the expected type.
"""
from __future__ import annotations

import difflib
import io
import math
import typing
import zoneinfo
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ParamsError(ValueError):
    """params.yaml is unreadable or does not match the schema."""


class Section(BaseModel):
    # strict: "12" is not an int and 1 is not a bool; a typo in params.yaml must not be coerced away.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class DataParams(Section):
    dir: str = Field(description="seed data directory versioned by data.dvc")
    heldout_task_fraction: float = Field(ge=0, lt=1, description="seed tasks kept out of training and the buffer")
    max_text_length: int = Field(gt=0, description="longest state or action accepted, in characters")
    reward_range: list[float] = Field(description="[low, high] inclusive range of a step reward")

    @field_validator("reward_range")
    @classmethod
    def _low_below_high(cls, value: list[float]) -> list[float]:
        if len(value) != 2 or not value[0] < value[1]:
            raise ValueError("must be [low, high] with low < high")
        return value


class ModelsParams(Section):
    cache_dir: str = Field(description="where packaged offline models are converted to safetensors once")
    policy: str = Field(description="packaged model name, Hugging Face id or local path")
    experience: str = Field(description="packaged model name, Hugging Face id or local path")
    embedder: str = Field(description="sentence-transformers model: packaged name, id or path")
    kept_trainings: str | None = Field(description="folder of finished LoRA trainings (adapters, a few MB) kept by "
                                                   "their data and settings and restored instead of trained again, "
                                                   "on any machine that has the folder; null: none kept")


class S3Params(Section):
    bucket: str
    prefix: str
    # None: take AWS_ENDPOINT_URL from the environment (boto3's own variable), else AWS itself.
    endpoint_url: str | None
    region: str


class StorageParams(Section):
    backend: Literal["local", "s3"]
    local_dir: str
    s3: S3Params


class TextWorldDifficulty(Section):
    recipe: int = Field(ge=1, le=5, description="ingredients in the recipe")
    take: int = Field(ge=0, description="ingredients to find (<= recipe)")
    go: int = Field(description="rooms: 1, 6, 9 or 12")
    open: bool
    cook: bool
    cut: bool


class TextWorldParams(Section):
    cache_dir: str = Field(description="generated games, cached by their parameters")
    difficulty: TextWorldDifficulty
    step_timeout_s: float = Field(gt=0)
    max_steps: int = Field(gt=0)
    generation_workers: int = Field(ge=1)
    describe_room: bool = Field(description="every state carries the room's description (a Room: section): what is "
                                "where, which a simulator needs to know whether `take X from Y` can succeed")


class MiniWoBParams(Section):
    tasks: list[str]
    step_timeout_s: float = Field(gt=0)
    episode_time_limit_s: float = Field(gt=0, description="the page's own clock, set far above what a policy takes: "
                                        "MiniWoB's (10-30 s, a person's pace) ends an LLM's slower episodes as "
                                        "failures, by the machine's speed and load")
    max_steps: int = Field(gt=0)
    coverage_episodes: int = Field(gt=0)


class EnvironmentsParams(Section):
    textworld: TextWorldParams
    miniwob: MiniWoBParams


class EpisodeMix(Section):
    """Episodes collected per training task, by policy: successes and failures for the seed set."""

    expert: int = Field(ge=0)
    noisy_expert: int = Field(ge=0)
    skipping_expert: int = Field(ge=0, description="the walkthrough with one step left out (TextWorld only)")
    random: int = Field(ge=0)


class CollectSeedParams(Section):
    environments: list[str]
    train_tasks: int = Field(gt=0, description="training tasks per environment")
    episodes: EpisodeMix
    noisy_epsilon: float = Field(ge=0, le=1)
    out_dir: str


class EvaluateParams(Section):
    environments: list[str]
    heldout_tasks: int = Field(gt=0, description="held-out tasks per environment")
    workers: int = Field(ge=1, description="environments stepped in parallel")
    confidence: float = Field(gt=0, lt=1)
    policies: list[Literal["train_policy_sft", "synthetic_rl", "sim_to_real"]] = Field(
        min_length=1, description="the policies evaluate_policies plays, by the stage that trains them")
    replay_audit: bool = Field(description="evaluate_policies replays the synthetic-RL policy's episodes in the real "
                               "games (how many synthetic wins they confirm), with every real transition it takes")
    curve_every: int = Field(ge=0, description="the RL stages measure held-out success every this many iterations "
                             "(and after the last), their learning curve; 0: never")
    curve_games: int = Field(gt=0, description="held-out games per environment of the learning curve (the same games "
                             "at every point)")


class WeaviateParams(Section):
    url: str | None = Field(description="null: WEAVIATE_URL from the environment (API key: WEAVIATE_API_KEY)")
    grpc_port: int
    collection: str = Field(pattern=r"^[A-Z][_0-9A-Za-z]*$", description=(
        "prefix of the collection names: index_buffer's is <prefix>_<hash of its transitions, embedder, schema>, "
        "each synthetic_rl run copies it to <that>_run_<hash of the run>"))


class BufferIndexParams(Section):
    """Mirrors replay_buffer.IndexSettings: the embedded backend's per-environment faiss index."""

    approximate_above: int | None = Field(ge=1000, description=(
        "rows of one environment past which its exact flat index becomes a quantized scan with exact re-ranking "
        "(null: always exact)"))
    rerank: int = Field(gt=0, description="candidates of the quantized scan re-scored exactly per query")
    subquantizer_dims: int = Field(gt=0, description="dimensions per 4-bit code of the scan; divides the embedding's")


class BufferParams(Section):
    backend: Literal["embedded", "weaviate"]
    encode_batch_size: int = Field(gt=0)
    out_dir: str = Field(description="where index_buffer saves the buffer (the Weaviate backend saves a reference)")
    index: BufferIndexParams
    weaviate: WeaviateParams


class TeacherParams(Section):
    kind: Literal["hf", "openai"]
    model: str = Field(description="hf: packaged name, hub id or path; openai: the served model's name")
    base_url: str | None = Field(description="openai only, e.g. http://127.0.0.1:8000/v1")
    api_key_env: str = Field(description="name of the environment variable holding the key (never the key)")
    batch_size: int = Field(gt=0)
    max_new_tokens: int = Field(gt=0)


class AnnotateParams(Section):
    teacher: TeacherParams | None = Field(description="null: deterministic traces derived from the data")
    describe_changes: bool = Field(description="the deterministic trace quotes what changed (false: for an experience "
                                   "model whose reply states the changes itself, experience_model.prompt.reply)")
    restate_action: bool = Field(description="the deterministic trace opens with a sentence restating the action "
                                 "(false: shorter replies; a web action's element is still named)")
    ground_objects: bool = Field(description="the deterministic trace says, before the verdict, where the state "
                                 "mentions the action's object (the fact that decides whether a command is refused)")
    out_dir: str


class PromptParams(Section):
    """Mirrors experience_model.PromptFormat: the same values at training and at inference."""

    use_reasoning: bool = Field(description="ablation: the target carries a reasoning trace")
    use_retrieval: bool = Field(description="ablation: the prompt carries top-k retrieved transitions")
    history_length: int = Field(ge=0)
    top_k: int = Field(ge=0)
    max_state_chars: int = Field(gt=0)
    history_state_chars: int = Field(gt=0)
    example_state_chars: int = Field(gt=0)
    reply: Literal["next_state", "changes"] = Field(
        description="next_state: the reply restates the whole next state; changes: only its changed sections")
    trim_context: bool = Field(description="history and example states start at their first changed section")


class LoraParams(Section):
    """Mirrors sft.LoraSettings."""

    r: int = Field(gt=0)
    alpha: int = Field(gt=0)
    dropout: float = Field(ge=0, lt=1)
    target_modules: str
    top_layers: int | None = Field(description="adapt only the top N layers (null: all)")


class TrainingParams(Section):
    """Mirrors sft.TrainingSettings."""

    epochs: float = Field(gt=0)
    max_steps: int = Field(description="> 0 overrides epochs")
    learning_rate: float = Field(gt=0)
    batch_size: int = Field(gt=0)
    gradient_accumulation_steps: int = Field(gt=0)
    max_seq_len: int = Field(gt=0)
    lora: LoraParams | None = Field(description="null: full fine-tuning")
    merge_lora: bool
    precision: Literal["auto", "fp32", "bf16"]
    activation_checkpointing: bool
    warmup: float = Field(ge=0)
    logging_steps: int = Field(gt=0)
    save_steps: int = Field(gt=0)
    save_total_limit: int = Field(gt=0)


class LlamaCppParams(Section):
    weight_type: Literal["f32", "f16", "q8_0"] = Field(description="the GGUF export's weights (norms stay f32)")
    threads: int = Field(ge=0, description="CPU threads (0: every core)")
    context: int = Field(gt=0, description="tokens a prompt and its reply may hold together")
    draft_tokens: int = Field(ge=0, description="prompt-lookup drafts: up to this many tokens copied from the prompt "
                              "are checked in one pass (0: off); greedy replies stay the same")


class InferenceParams(Section):
    backend: Literal["hf", "llamacpp", "vllm", "openai"]
    base_url: str | None = Field(description="openai only: the served experience model's endpoint")
    llamacpp: LlamaCppParams
    batch_size: int = Field(gt=0)
    max_new_tokens: int = Field(gt=0)
    temperature: float = Field(ge=0)
    retries: int = Field(ge=0)
    retry_temperature: float = Field(ge=0)
    fallback_ends_episode: bool = Field(
        description="a step the model could not predict ends its synthetic episode as an environment failure (no "
                    "outcome rests on it); false keeps the state and goes on")


class ExperienceModelParams(Section):
    environments: list[str] = Field(description="whose seed transitions train it (held-out tasks never)")
    out_dir: str
    prompt: PromptParams
    training: TrainingParams
    outcome_repeats: int = Field(ge=1, description="rewarded or terminal training transitions appear this many times")
    lookalike_repeats: int = Field(
        ge=1, description="unrewarded training steps of a command rewarded elsewhere appear this many times")
    policy_share: float = Field(
        ge=0, lt=1, description="share of the SFT examples that the policy's real play fed back by correction rounds "
                                "(the data directory's on_policy.jsonl) makes up: each of its transitions is "
                                "repeated, whole times, until they come near it (0: weighed as any seed step)")
    refusal_repeats: int = Field(ge=1, description="training steps whose command the environment refused appear this "
                                 "many times")
    verdict_weight: float = Field(
        ge=1, description="the loss weight of the trace's verdict token (accepted or rejected) against the target's "
                          "other tokens (1: plain SFT)")
    inference: InferenceParams
    max_fallback_rate: float = Field(
        ge=0, le=1, description="share of predictions that may fall back (unparsable) before a stage using the "
                                "experience model fails")
    max_backend_error_rate: float = Field(
        ge=0, le=1, description="share of backend calls that may raise before a stage using the experience model fails")
    fidelity_max_transitions: int = Field(
        ge=0, description="held-out transitions scored per environment (0: all); rewarded and terminal ones first")
    on_policy_games: int = Field(
        ge=0, description="held-out evaluation games the warm-start policy plays per environment, whose real "
                          "transitions the experience model is also scored on (0: none); they only measure")
    on_policy_temperature: float = Field(
        ge=0, description="the warm start's sampling temperature in those games (0: greedy, as evaluate_policies "
                          "plays; synthetic_rl.temperature: the states synthetic RL's sampled play reaches)")


class PolicyPromptParams(Section):
    """Mirrors policy.PolicyFormat."""

    max_state_chars: int = Field(gt=0)
    show_valid_actions: bool
    max_valid_actions: int = Field(gt=0)


class PolicySFTParams(Section):
    out_dir: str
    sources: list[Literal["expert", "policy", "random", "human", "synthetic"]] = Field(
        description="seed trajectory sources the warm start imitates (successful episodes only)")
    training: TrainingParams


class PolicyParams(Section):
    environments: list[str] = Field(description="whose tasks the policy learns (held-out tasks never)")
    prompt: PolicyPromptParams
    max_turns: int = Field(gt=0, description="episode turn limit for the policy, in rollouts and evaluation")
    max_action_tokens: int = Field(gt=0)
    batched_rollouts: bool = Field(description=(
        "RL rollouts: true, every episode's turn in one batched generate over its whole context (pays on a GPU); "
        "false, one episode at a time carrying its key/value cache across turns (pays on a CPU)"))
    sft: PolicySFTParams
    accuracy_trajectories: int = Field(ge=0, description="held-out seed trajectories for next-action accuracy")
    eval_tasks: int = Field(ge=0, description="held-out real tasks per environment for closed-loop success")


class PPOParams(Section):
    """Mirrors loop.PPOSettings."""

    epochs: int = Field(gt=0)
    gamma: float = Field(gt=0, le=1)
    gae_lambda: float = Field(ge=0, le=1)
    value_coef: float = Field(ge=0)
    value_learning_rate: float = Field(gt=0)


class CurriculumParams(Section):
    """Mirrors curriculum.CurriculumSettings."""

    enabled: bool = Field(description="off: the ablation, the base tasks only")
    top_tasks: int = Field(ge=0, description="highest-variance tasks varied per iteration")
    variations_per_task: int = Field(gt=0)
    max_generated_share: float = Field(ge=0, le=1, description="lambda: share of an iteration's tasks generated")
    min_variance: float = Field(ge=0)
    max_new_tokens: int = Field(gt=0)
    temperature: float = Field(ge=0)
    max_instruction_chars: int = Field(gt=0, description="a longer generated instruction is rejected")
    max_state_chars: int = Field(gt=0, description="the parent task's initial state in the prompt, in characters")
    clusters: int = Field(gt=0, description="PPO: k-means clusters of task embeddings that stand for groups")
    writer_pairs_per_task: int = Field(ge=0, description="teaching pairs per seed task (another task of its family's "
                                                          "instruction)")
    writer_training: TrainingParams | None = Field(description="SFT of the backbone on the teaching pairs before it "
                                                               "writes; null: the backbone writes untaught")


class SyntheticRLParams(Section):
    """Mirrors loop.RLSettings (max_turns and max_action_tokens come from policy, the seed from the top level)."""

    algorithm: Literal["grpo", "ppo"]
    out_dir: str
    iterations: int = Field(gt=0)
    tasks_per_iteration: int = Field(gt=0)
    group_size: int = Field(gt=1, description="episodes per task; GRPO compares them within the group")
    learning_rate: float = Field(gt=0)
    temperature: float = Field(gt=0)
    beta: float = Field(ge=0, description="KL penalty towards the warm start")
    clip_epsilon: float = Field(gt=0)
    max_tokens: int = Field(gt=0, description="an episode's whole token sequence")
    micro_batch_size: int = Field(gt=0)
    save_every: int = Field(gt=0)
    save_total_limit: int = Field(gt=0)
    lora: LoraParams | None = Field(description="null: full fine-tuning")
    ppo: PPOParams
    curriculum: CurriculumParams

    @model_validator(mode="after")
    def _curriculum_can_play_its_tasks(self) -> SyntheticRLParams:
        # An iteration plays at most floor(lambda * tasks_per_iteration) generated tasks (curriculum.py): at 0 the
        # curriculum would generate tasks that are never played, and its ablation would change nothing.
        curriculum = self.curriculum
        if curriculum.enabled and math.floor(curriculum.max_generated_share * self.tasks_per_iteration + 1e-9) < 1:
            share = curriculum.max_generated_share
            fix = f"raise tasks_per_iteration to {math.ceil(1 / share - 1e-9)} or more, or " if share else ""
            raise ValueError(f"the curriculum can never play a generated task: floor(curriculum.max_generated_share "
                             f"{share} x tasks_per_iteration {self.tasks_per_iteration}) is 0; {fix}set "
                             f"curriculum.enabled to false")
        return self


class SimToRealParams(Section):
    """RL in the real environments after synthetic RL; the rest of the RL settings are synthetic_rl's."""

    out_dir: str
    start_from: Literal["synthetic_rl", "sft"] = Field(
        description="synthetic_rl: DreamGym-S2R; sft: RL in the real environment only (the baseline)")
    real_transitions: int = Field(ge=0, description="budget of real transitions; another iteration starts while its "
                                  "worst case (tasks_per_iteration x group_size x policy.max_turns) fits in the rest")
    max_iterations: int = Field(gt=0, description="at most this many iterations, even if the budget pays for more")
    tasks_per_iteration: int = Field(gt=0)
    group_size: int = Field(gt=1)
    learning_rate: float = Field(gt=0)


class CorrectionParams(Section):
    """Correction rounds (stages/correction_rounds.py): synthetic RL, on-policy play in the real games, the experience
    model corrected on what the policy met, round after round, from the warm start."""

    out_dir: str
    rounds: int = Field(ge=0, description="rounds; 0: the stage is skipped")
    feedback: bool = Field(description="false: the same rounds and real budget with nothing fed back (DreamGym-S2R)")
    synthetic_iterations: int = Field(gt=0, description="synthetic RL iterations per round")
    real_transitions: int = Field(gt=0, description="real transitions of sim-to-real RL on training tasks per round "
                                  "(the replay audit's real transitions are counted on top)")
    sim_to_real: Literal["every_round", "last_round"] = Field(description=(
        "which rounds run sim-to-real: last_round spends real_transitions once, after the last round's synthetic RL "
        "(DreamGym-S2R's shape), and the earlier rounds learn from the replay audit alone"))
    replay_transitions: int | None = Field(ge=0, description="real transitions the replay audit may spend per round, "
                                           "replaying synthetic wins first; null: every synthetic episode")
    training_steps: int = Field(gt=0, description="optimizer steps of the experience model's continued training per "
                                "round, on the seed and every on-policy transition so far (their share of the "
                                "examples: experience_model.policy_share)")
    heldout_games: int = Field(gt=0, description="held-out games per environment each round's policies play (the "
                               "first of the evaluation split); the last round's play all policy.eval_tasks")
    onboard_into_seed: bool = Field(description="the pipeline flow ends by onboarding the rounds' on-policy "
                                    "trajectories into data/: the next retraining run starts from them")


class StudyParams(Section):
    """The results study (flows/study.py, components/results/study.py)."""

    results_dir: str
    seeds: list[int] = Field(min_length=1)
    algorithms: list[Literal["grpo", "ppo"]] = Field(min_length=1)
    environments: list[str] = Field(min_length=1, description=(
        "each run trains its experience model and policy on one of these, with its folder under the environment's "
        "in results_dir"))
    real_budget: int = Field(gt=0, description="B: real transitions of the real-environment RL baseline")
    s2r_share: float = Field(ge=0, le=1, description="DreamGym-S2R's real budget as a share of B (paper: 0.1)")
    variants: list[str] = Field(description="the variants to run by name; empty: all")
    on_work_pool: bool = Field(description=(
        "each run a flow run of the study_row deployment on prefect.work_pool, in a workspace of its own: the "
        "pool's workers run as many at once as they take; false: one after another in this checkout"))
    parked_rows: str | None = Field(description=(
        "folder where each work-pool row's resume state (checkpoints, games played so far, its clock) is copied "
        "while it runs, to commit with the rows: a row whose workspace is gone (another machine) goes on from it; "
        "null: none"))


class PrefectParams(Section):
    """Deployments of the pipeline (flows/deployments.py). The server is PREFECT_API_URL, never a param."""

    work_pool: str = Field(description="process work pool whose worker runs the deployed pipeline")
    deployment: str = Field(description="name of the pipeline's deployment, shown as pipeline/NAME")
    retrain_cron: str | None = Field(description="cron schedule of retraining, e.g. '0 3 * * 0'; null: none")
    timezone: str = Field(description="IANA time zone the cron schedule is read in, e.g. UTC")
    retrain_on_onboard: bool = Field(description="`dreamgym data onboard` of new trajectories starts a run")

    @field_validator("retrain_cron")
    @classmethod
    def _five_cron_fields(cls, value: str | None) -> str | None:
        if value is not None and len(value.split()) != 5:
            raise ValueError("must be a cron expression of 5 fields: minute hour day-of-month month day-of-week")
        return value

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        try:
            zoneinfo.ZoneInfo(value)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError("must be an IANA time zone such as UTC or Europe/Berlin") from None
        return value


class Params(Section):
    seed: int
    data: DataParams
    models: ModelsParams
    storage: StorageParams
    environments: EnvironmentsParams
    collect_seed: CollectSeedParams
    evaluate: EvaluateParams
    buffer: BufferParams
    annotate: AnnotateParams
    experience_model: ExperienceModelParams
    policy: PolicyParams
    synthetic_rl: SyntheticRLParams
    sim_to_real: SimToRealParams
    correction: CorrectionParams
    study: StudyParams
    prefect: PrefectParams


def load_params(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None) -> Params:
    """Read params.yaml (plus dotted-key overrides such as {"data.max_text_length": 10}) into Params."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ParamsError(f"{path}: file not found; run from the repository root or pass --params PATH") from None
    except yaml.YAMLError as error:
        raise ParamsError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level")
    for dotted, value in (overrides or {}).items():
        set_dotted(raw, dotted, value)
    return parse_params(raw, source=str(path))


def overridden(params: Params, overrides: dict[str, Any]) -> Params:
    """`params` with dotted-key overrides ({"synthetic_rl.iterations": 2}), validated like params.yaml."""
    raw = params.model_dump()
    for dotted, value in overrides.items():
        set_dotted(raw, dotted, value)
    return parse_params(raw, source="overrides " + ", ".join(overrides))


def parse_params(raw: dict[str, Any], source: str = "params") -> Params:
    try:
        return Params.model_validate(raw)
    except ValidationError as error:
        problems = [_describe(err) for err in error.errors()]
        raise ParamsError(f"{source}: " + "; ".join(problems)) from None


def active_profile(params_path: str | Path = "params.yaml", profiles_dir: str | Path = "profiles") -> str:
    """The name of the profile whose every value params.yaml holds ("custom" when none does), for reports."""
    current = load_params(params_path).model_dump()
    for path in sorted(Path(profiles_dir).glob("*.yaml")):
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if isinstance(values, dict) and all(get_dotted(current, key) == value for key, value in values.items()):
            return path.stem
    return "custom"


def profile_values(profile: str | Path) -> dict[str, Any]:
    """A profile's dotted keys and values: profiles/NAME.yaml, or any path."""
    path = Path(profile) if Path(profile).suffix in (".yaml", ".yml") else Path("profiles") / f"{profile}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in Path("profiles").glob("*.yaml"))) or "none"
        raise ParamsError(f"profile {profile!r}: no file {path} (profiles here: {known})")
    values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(values, dict):
        raise ParamsError(f"{path}: expected a mapping of dotted keys to values")
    return values


def use_profile(profile: str | Path, params_path: str | Path = "params.yaml") -> dict[str, Any]:
    """Write a profile's values into params.yaml, keeping its comments and order; return what changed.

    A profile (profiles/NAME.yaml, or any path) maps dotted keys to values. The result is validated before anything
    is written, so a bad profile leaves params.yaml as it was. DVC then sees ordinary param changes.
    """
    return write_params(profile_values(profile), params_path)


def write_params(values: dict[str, Any], params_path: str | Path = "params.yaml") -> dict[str, Any]:
    """Write dotted keys' values into params.yaml, keeping its comments and order; return what changed. The result is
    validated before anything is written, so bad values leave params.yaml as it was."""
    from ruamel.yaml import YAML

    params_path = Path(params_path)
    current = load_params(params_path).model_dump()
    load_params(params_path, values)  # validates the result (ParamsError names the key)
    changed = {key: value for key, value in values.items() if get_dotted(current, key) != value}
    round_trip = YAML()  # keeps comments, order and quoting of everything it does not touch
    round_trip.width, round_trip.preserve_quotes = 118, True
    round_trip.representer.add_representer(  # `null`, as params.yaml writes it, not an empty value
        type(None), lambda representer, _: representer.represent_scalar("tag:yaml.org,2002:null", "null"))
    round_trip.representer.add_representer(float, _float_scalar)
    tree = round_trip.load(params_path.read_text(encoding="utf-8"))
    for key, value in changed.items():
        set_dotted(tree, key, _flow(value))
    text = io.StringIO()
    round_trip.dump(tree, text)
    # ruamel leaves a space at the end of each line where it wraps a long flow list
    params_path.write_text("".join(line.rstrip() + "\n" for line in text.getvalue().splitlines()), encoding="utf-8")
    return changed


def _float_scalar(representer: Any, value: float) -> Any:
    """A float as YAML 1.1 (PyYAML, which reads params.yaml) reads it back: 1.0e-05, not 1e-05 (a string there)."""
    text = repr(value)
    if not math.isfinite(value):
        text = ".nan" if math.isnan(value) else ("-.inf" if value < 0 else ".inf")
    elif "e" in text and "." not in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}.0e{exponent}"
    return representer.represent_scalar("tag:yaml.org,2002:float", text)


def _flow(value: Any) -> Any:
    """Lists in flow style, [0, 1, 2], as params.yaml writes them."""
    if not isinstance(value, list):
        return value
    from ruamel.yaml.comments import CommentedSeq

    seq = CommentedSeq(value)
    seq.fa.set_flow_style()
    return seq


def get_dotted(tree: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        tree = tree.get(key, {}) if isinstance(tree, dict) else {}
    return tree


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def _describe(err: dict[str, Any]) -> str:
    loc = [str(part) for part in err["loc"]]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        allowed = list(_model_at(loc[:-1]).model_fields)
        close = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"allowed keys: {', '.join(allowed)}"
        return f"unknown key '{key}' ({hint})"
    if err["type"] == "value_error" and isinstance(err.get("input"), dict):  # a check across a section's keys
        return f"'{key}': {err['msg'].removeprefix('Value error, ')}"
    expected = _expected_type(loc)
    if err["type"] == "missing":
        return f"missing key '{key}' (expected {expected})"
    got = err.get("input")
    return f"'{key}' expects {expected}, got {type(got).__name__} {got!r}: {err['msg']}"


def _model_at(loc: list[str]) -> type[BaseModel]:
    model: type[BaseModel] = Params
    for part in loc:
        annotation = model.model_fields[part].annotation
        # an optional section (`LoraParams | None`) is a Union: look inside it for the model
        for candidate in (annotation, *typing.get_args(annotation)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                model = candidate
                break
    return model


def _expected_type(loc: list[str]) -> str:
    model, name = _model_at(loc[:-1]), loc[-1]
    field = model.model_fields.get(name)
    if field is None:  # an index inside a list, e.g. data.reward_range.0
        return "a valid value"
    annotation = field.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a mapping"
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(choice) for choice in typing.get_args(annotation))
    return getattr(annotation, "__name__", None) if isinstance(annotation, type) else str(annotation)
