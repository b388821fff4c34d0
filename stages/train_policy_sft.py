"""train_policy_sft: the policy (models.policy) warm-started by SFT on successful seed episodes of training tasks."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from components.builders import (
    demonstrations,
    heldout_demonstrations,
    kept_trainings,
    policy_format,
    policy_trajectories,
    training_settings,
)
from components.config import Params
from components.data.contract import Trajectory
from components.llm import sft
from components.llm.backends import HFGenerationBackend
from components.reports import markdown_table, write_stage_outputs
from components.rl import policy
from stages.common import StageError


def run(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Warm-start the policy (models.policy) by SFT on successful seed episodes of training tasks."""
    root, settings = Path(root), params.policy.sft
    demos = demonstrations(params, policy_trajectories(params, root, heldout=False))
    if not demos:
        raise StageError(f"no successful {settings.sources} seed episodes of training tasks in "
                         f"{params.policy.environments}: onboard some, or change policy.sft.sources")
    fmt = policy_format(params)
    result = sft.train_sft(policy.sft_examples(demos, fmt), params.models.policy, root / settings.out_dir,
                           training_settings(settings.training, params.seed), cache_dir=root / params.models.cache_dir,
                           kept=kept_trainings(params, root))
    heldout = heldout_demonstrations(params, root)
    accuracy = None
    if heldout:
        model, tokenizer = sft.load_trained_model(result.model_dir)
        accuracy = policy.next_action_accuracy(HFGenerationBackend(model, tokenizer), heldout, fmt,
                                               params.policy.max_action_tokens)
    metrics = {"demonstrations": len(demos), "examples": result.examples, "too_long": result.too_long,
               "global_step": result.global_step, "train_loss": result.train_loss, "final_loss": result.final_loss,
               "seconds": round(result.seconds, 1), "precision": result.precision, "hardware": result.hardware,
               "heldout_next_action": accuracy}
    write_stage_outputs("train_policy_sft", metrics, report(params, result, demos, heldout, accuracy), root)
    return metrics


def report(params: Params, result: sft.TrainingResult, demos: list[Trajectory], heldout: list[Trajectory],
           accuracy: dict[str, Any] | None) -> str:
    settings = params.policy.sft
    text = (f"# Policy warm start (SFT)\n\n`{params.models.policy}` fine-tuned on {result.examples} steps of "
            f"{len(demos)} successful {'/'.join(settings.sources)} seed episodes of training tasks "
            f"({result.too_long} steps left out as longer than {settings.training.max_seq_len} tokens): "
            f"{result.global_step} optimizer steps, {result.summary()}.\n\n")
    if accuracy:
        text += (f"Teacher-forced next-action accuracy on {len(heldout)} held-out seed episodes: "
                 f"**{accuracy['accuracy']:.3f}** ({accuracy['correct']}/{accuracy['steps']} steps). By step:\n\n"
                 + markdown_table(["step", "accuracy"], [[k, v] for k, v in accuracy["by_step"].items()]))
    return text
