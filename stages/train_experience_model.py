"""train_experience_model: the experience model (models.experience) fine-tuned on annotated training-task
transitions, trace then outcome."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from components.builders import experience_sft_data, kept_trainings, prompt_format, training_settings
from components.config import Params
from components.llm import sft
from components.reports import write_stage_outputs
from components.simulator import experience_model as em
from components.simulator.annotation import VERDICT_WORDS
from stages.common import StageError


def run(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """SFT the experience model (models.experience) on annotated training-task transitions: trace, then outcome."""
    root, settings = Path(root), params.experience_model
    annotated, dataset = experience_sft_data(params, root)
    if not annotated:
        raise StageError(f"no annotated training transitions for {settings.environments}; run annotate first")
    result = sft.train_sft(dataset, params.models.experience, root / settings.out_dir,
                           training_settings(settings.training, params.seed), cache_dir=root / params.models.cache_dir,
                           emphasis=sft.Emphasis(VERDICT_WORDS, settings.verdict_weight),
                           kept=kept_trainings(params, root))
    metrics = {"examples": result.examples, "too_long": result.too_long, "global_step": result.global_step,
               "train_loss": result.train_loss, "final_loss": result.final_loss, "seconds": round(result.seconds, 1),
               "resumed": result.resumed_from is not None, "precision": result.precision, "hardware": result.hardware}
    write_stage_outputs("train_experience_model", metrics, report(params, result, prompt_format(params)), root)
    return metrics


def report(params: Params, result: sft.TrainingResult, fmt: em.PromptFormat) -> str:
    settings = params.experience_model
    return (f"# Experience model training\n\n`{params.models.experience}` fine-tuned on {result.examples} examples of "
            f"annotated training-task transitions in {', '.join(settings.environments)}, rewarded or terminal ones "
            f"repeated {settings.outcome_repeats} times, look-alikes {settings.lookalike_repeats} times, refused "
            f"commands {settings.refusal_repeats} times, a policy's own real transitions repeated to about "
            f"{settings.policy_share:.0%} of the examples, the verdict token weighing "
            f"{settings.verdict_weight:g} times the other target tokens (the losses below are so weighted) "
            f"({result.too_long} left out as "
            f"longer than {settings.training.max_seq_len} tokens): {result.global_step} optimizer steps, "
            f"{result.summary()}. Reasoning in the target: {fmt.use_reasoning}; retrieved examples in the "
            f"prompt: {fmt.use_retrieval} (top {fmt.top_k}). Model: `{result.model_dir}`.\n")
