"""evaluate_experience_model: fidelity on held-out real transitions, the experience model against
copy-nearest-neighbour and no-change."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from components.builders import experience_predictor, experience_trajectories, fallback_budget, saved_buffer
from components.config import Params
from components.data.contract import write_records
from components.reports import write_stage_outputs
from components.simulator import experience_model as em
from components.simulator import fidelity

PREDICTIONS_FILE = "reports/evaluate_experience_model_predictions.jsonl"  # each prediction beside its gold transition


def run(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Fidelity on held-out real transitions: the experience model against copy-nearest-neighbour and no-change."""
    root, settings = Path(root), params.experience_model
    heldout = fidelity.heldout_transitions(experience_trajectories(params, root), params.data.heldout_task_fraction)
    if settings.fidelity_max_transitions:
        heldout = fidelity.outcomes_first_sample(heldout, settings.fidelity_max_transitions)
    buffer = saved_buffer(params, root)
    stats = em.PredictionStats()
    predictions = experience_predictor(params, root, buffer, stats)(heldout)
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
    fallback_budget(params).check(stats, f"evaluate_experience_model (predictions beside the gold transitions: "
                                         f"{PREDICTIONS_FILE})", settings.inference.max_new_tokens)
    metrics = {"transitions": len(heldout), "prediction": stats.as_dict(), **results}
    write_stage_outputs("evaluate_experience_model", metrics, report(params, results, len(heldout), stats), root)
    return metrics


def report(params: Params, results: dict[str, Any], transitions: int, stats: em.PredictionStats) -> str:
    fmt, inference = params.experience_model.prompt, params.experience_model.inference
    return (fidelity.fidelity_report(results)
            + f"\n{transitions} held-out transitions (tasks never seen in training or in the buffer). The experience "
              f"model ran with reasoning {fmt.use_reasoning} and retrieval {fmt.use_retrieval}; "
              f"{stats.fallbacks} of {stats.requests} predictions fell back after {inference.retries} retry(ies) "
              f"(an unparsable reply becomes 'state unchanged, reward 0'). Each prediction beside its gold "
              f"transition: `{PREDICTIONS_FILE}`.\n")
