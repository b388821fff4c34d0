"""evaluate_experience_model: fidelity on held-out real transitions, the experience model against
copy-nearest-neighbour and no-change: on the seed's held-out tasks, and on the warm-start policy's own play of
held-out evaluation games (the states a policy reaches; they only measure). Under a launcher each process predicts
its share of the transitions and plays its share of the games; the main process scores them all and writes."""
from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

from components import distributed
from components.builders import (
    experience_predictor,
    experience_trajectories,
    fallback_budget,
    policy_format,
    saved_buffer,
)
from components.config import Params
from components.data.contract import Transition, transitions, write_records
from components.envs.registry import has_adapter, real_environment
from components.llm import sft
from components.reports import write_stage_outputs
from components.results.evaluation import evaluate_policy
from components.rl import policy
from components.simulator import experience_model as em
from components.simulator import fidelity

PREDICTIONS_FILE = "reports/evaluate_experience_model_predictions.jsonl"  # each prediction beside its gold transition
ON_POLICY_FILE = "reports/evaluate_experience_model_on_policy.jsonl"  # the same, on the warm start's held-out play
JOURNALS = ".cache/evaluate_experience_model"  # the warm start's games played so far: a rerun resumes them


def run(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Fidelity on held-out real transitions: the experience model against copy-nearest-neighbour and no-change."""
    root, settings, started = Path(root), params.experience_model, time.monotonic()
    heldout = fidelity.heldout_transitions(experience_trajectories(params, root), params.data.heldout_task_fraction)
    if settings.fidelity_max_transitions:
        heldout = fidelity.outcomes_first_sample(heldout, settings.fidelity_max_transitions)
    buffer = saved_buffer(params, root)
    stats = em.PredictionStats()
    results = score(params, root, buffer, heldout, stats, root / PREDICTIONS_FILE)
    metrics: dict[str, Any] = {"transitions": len(heldout), "prediction": stats.as_dict(), **results}
    played, games = on_policy_transitions(params, root)
    random.Random(params.seed).shuffle(played)  # the sample's ordinary steps spread over every game, not the first
    on_policy = fidelity.outcomes_first_sample(played, settings.fidelity_max_transitions) \
        if settings.fidelity_max_transitions else played
    on_policy_results = None
    if on_policy:
        on_policy_stats = em.PredictionStats()
        on_policy_results = score(params, root, buffer, on_policy, on_policy_stats, root / ON_POLICY_FILE)
        metrics["on_policy"] = {"games": games, "temperature": settings.on_policy_temperature,
                                "transitions_played": len(played), "transitions": len(on_policy),
                                "prediction": on_policy_stats.as_dict(), **on_policy_results}
        stats.add(on_policy_stats)
    elif distributed.is_main_process():  # a seed-only domain, or no warm start or games: nothing played, an empty
        write_records([], root / ON_POLICY_FILE)  # file for DVC's output
    if not distributed.is_main_process():
        return {}
    metrics["seconds"] = round(time.monotonic() - started, 1)
    fallback_budget(params).check(stats, f"evaluate_experience_model (predictions beside the gold transitions: "
                                         f"{PREDICTIONS_FILE}, {ON_POLICY_FILE})", settings.inference.max_new_tokens)
    write_stage_outputs("evaluate_experience_model", metrics,
                        report(params, metrics, results, on_policy_results, stats), root)
    shutil.rmtree(root / JOURNALS, ignore_errors=True)
    return metrics


def score(params: Params, root: Path, buffer: Any, heldout: list[Transition], stats: em.PredictionStats,
          predictions_file: Path) -> dict[str, Any]:
    """The fidelity table of the experience model and the two baselines on `heldout`; each prediction is written
    beside its gold transition to `predictions_file`, to read where the model goes wrong."""
    share = distributed.share(len(heldout))
    mine = experience_predictor(params, root, buffer, stats)(heldout[share.start:share.stop]) if share else []
    parts = distributed.all_gather((mine, stats))
    if not distributed.is_main_process():
        return {}
    predictions = [prediction for part, _ in parts for prediction in part]
    for _, theirs in parts[1:]:  # the budget holds for every process's predictions
        stats.add(theirs)
    predictors = {
        "experience model": lambda _: predictions,
        "copy nearest neighbour": fidelity.copy_nearest_neighbour(buffer),
        "state unchanged": fidelity.state_unchanged,
    }
    write_records(({"trajectory_id": t.trajectory_id, "step_index": t.step_index, "action": t.action,
                    "next_state": t.next_state, "reward": t.reward, "done": t.done, "info": t.info,
                    "predicted": {"next_state": p.next_state, "reward": p.reward, "done": p.done,
                                  "reasoning": p.reasoning, "fallback": p.fallback}}
                   for t, p in zip(heldout, predictions, strict=True)), predictions_file)
    return fidelity.evaluate(predictors, heldout, encoder=buffer.encoder)


def on_policy_transitions(params: Params, root: Path) -> tuple[list[Transition], int]:
    """The warm start's play (greedy, or sampled at `on_policy_temperature` from the run's seed) of the first
    `on_policy_games` held-out evaluation games of each environment the experience model simulates and an adapter
    plays: (every real transition, games played). These games are the evaluation's held-out split: they measure,
    and nothing here adds them to any training data or buffer."""
    games, temperature = params.experience_model.on_policy_games, params.experience_model.on_policy_temperature
    model_dir = root / params.policy.sft.out_dir / "model"
    names = [name for name in params.experience_model.environments if has_adapter(name)]
    if not games or not names or not sft.has_trained_model(model_dir):
        return [], 0
    model, tokenizer = sft.load_trained_model(model_dir)
    fmt = policy_format(params)
    identity = policy.factory_identity(model_dir, fmt, params.policy.max_action_tokens, temperature, params.seed)
    played, count = [], 0
    for name in names:
        kind = real_environment(name)
        tasks = kind.make_tasks(params.environments, "heldout", games, params.seed)
        result = evaluate_policy(kind, params.environments, tasks,
                                 policy.policy_factory(model, tokenizer, fmt, params.policy.max_action_tokens,
                                                       temperature, params.seed),
                                 workers=params.evaluate.workers, confidence=params.evaluate.confidence,
                                 name="policy", max_steps=params.policy.max_turns,
                                 journal=root / JOURNALS / f"{name}.jsonl", policy_identity=identity)
        played += [t for trajectory in result.trajectories for t in transitions(trajectory)]
        count += len(tasks)
    return played, count


def report(params: Params, metrics: dict[str, Any], results: dict[str, Any], on_policy_results: dict[str, Any] | None,
           stats: em.PredictionStats) -> str:
    fmt, inference = params.experience_model.prompt, params.experience_model.inference
    text = (fidelity.fidelity_report(results)
            + f"\n{metrics['transitions']} held-out seed transitions (tasks never seen in training or in the buffer). "
              f"Each prediction beside its gold transition: `{PREDICTIONS_FILE}`.\n")
    if on_policy_results is not None:
        on_policy = metrics["on_policy"]
        text += ("\n## On the warm start's own play of held-out games\n\n"
                 f"The warm-start policy played {on_policy['games']} held-out evaluation games "
                 + ("greedily " if not on_policy["temperature"] else
                    f"sampling at temperature {on_policy['temperature']:g}, each turn from a seed of its own under "
                    f"the run's seed {params.seed} ")
                 + f"({on_policy['transitions_played']} real transitions; they only measure, nothing trains on them); "
                 f"{on_policy['transitions']} of them scored, rewarded, look-alike and refused steps first. These "
                 "are the states a policy reaches, mistakes included, which the seed rarely shows: false wins here "
                 "are what synthetic RL would be paid for. Each prediction beside its gold transition: "
                 f"`{ON_POLICY_FILE}`.\n\n"
                 + fidelity.fidelity_report(on_policy_results, title=None))
    return text + (f"\nThe experience model ran with reasoning {fmt.use_reasoning}, retrieval {fmt.use_retrieval} and "
                   f"reply form {fmt.reply}; {stats.fallbacks} of {stats.requests} predictions fell back after "
                   f"{inference.retries} retry(ies) (an unparsable reply becomes 'state unchanged, reward 0').\n")
