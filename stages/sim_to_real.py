"""sim_to_real: RL goes on in the real environments from the synthetic-RL policy (or, for the real-RL baseline, from
the warm start), on a budget of real transitions that is counted exactly and never exceeded."""
from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

from components import distributed
from components.builders import (
    curriculum_settings,
    curve_probe,
    policy_format,
    policy_trajectories,
    rl_settings,
    run_identity,
)
from components.config import Params
from components.data.contract import ON_POLICY, write_trajectories
from components.envs.registry import has_adapter, real_environment
from components.reports import line_plot, markdown_table, write_csv, write_stage_outputs
from components.rl.curriculum import Curriculum
from components.rl.loop import RLSettings, kept_episodes
from components.rl.rollouts import RealBatch

log = logging.getLogger(__name__)
# the iteration log's columns in the report's table
SHOWN = ["iteration", "reward_mean", "success_rate", "heldout_success", "kl", "turns_mean", "env_transitions",
         "env_failures", "policy_generation_s", "environment_s", "optimisation_s"]


def real_rl_settings(params: Params) -> RLSettings:
    settings = params.sim_to_real
    return dataclasses.replace(rl_settings(params), iterations=settings.max_iterations,
                               tasks_per_iteration=settings.tasks_per_iteration, group_size=settings.group_size,
                               learning_rate=settings.learning_rate, transition_budget=settings.real_transitions)


def iteration_cost(params: Params) -> int:
    """The real transitions one sim-to-real iteration may spend (every episode to the turn limit): a budget below it
    pays for none."""
    return real_rl_settings(params).transitions_per_iteration


def run(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Sim-to-real: RL goes on in the real environments from the synthetic-RL policy (or, for the real-RL baseline,
    from the warm start), on a budget of real transitions that is counted exactly and never exceeded."""
    root, settings = Path(root), params.sim_to_real
    model_dir = root / settings.out_dir / "model"
    # the training tasks as their real environments reset them (no synthetic initial_state)
    tasks = sorted({t.task.task_id: t.task for t in policy_trajectories(params, root, heldout=False)
                    if has_adapter(t.task.environment)}.values(), key=lambda task: task.task_id)
    skipped = [name for name in params.policy.environments if not has_adapter(name)]
    rl = real_rl_settings(params)
    why_not = ("no environment of policy.environments has a real-environment adapter (a seed-only domain)"
               if not tasks else
               f"a budget of {settings.real_transitions} real transitions pays for no iteration (one costs up to "
               f"{rl.transitions_per_iteration}: tasks_per_iteration x group_size x policy.max_turns)"
               if rl.transitions_per_iteration > settings.real_transitions else None)
    main = distributed.is_main_process()
    if why_not is not None:
        log.warning("sim_to_real skipped: %s", why_not)
        if not main:
            return {}
        shutil.rmtree(model_dir, ignore_errors=True)
        model_dir.mkdir(parents=True)
        (model_dir / "SKIPPED.md").write_text(f"Sim-to-real was skipped: {why_not}.\n", encoding="utf-8")
        write_csv([], root / "metrics" / "sim_to_real_iterations.csv")  # no iterations (outputs DVC expects)
        write_trajectories([], root / settings.out_dir / ON_POLICY)
        line_plot([], "iteration", [], root / "reports" / "sim_to_real.png", "Sim-to-real (skipped)")
        metrics = {"skipped": skipped, "reason": why_not, "iterations": 0, "real_transitions_used": 0,
                   "real_transitions_budget": settings.real_transitions}
        write_stage_outputs("sim_to_real", metrics, skipped_report(why_not), root)
        return metrics

    start = {"synthetic_rl": params.synthetic_rl.out_dir, "sft": params.policy.sft.out_dir}[settings.start_from]
    if params.synthetic_rl.algorithm == "grpo":
        from components.rl.grpo import train_grpo as train
    else:
        from components.rl.ppo import train_ppo as train
    # Real tasks cannot be invented: the curriculum is off here, the tasks are the training tasks' real games. Under a
    # launcher each process plays its share of each iteration in real environments of its own.
    result = train(str(root / start / "model"), Curriculum(tasks, curriculum_settings(params, enabled=False)),
                   lambda: RealBatch(lambda task: real_environment(task.environment).open(params.environments)),
                   None, policy_format(params), rl, root / settings.out_dir, cache_dir=root / params.models.cache_dir,
                   environment=run_identity(params.environments), curve=curve_probe(params))
    if not main:  # the main process writes the outputs
        return {}
    rows = result.log
    used = sum(row["env_transitions"] for row in rows)
    if used > settings.real_transitions:  # cannot happen: an iteration starts only if its worst case fits
        raise RuntimeError(f"sim_to_real used {used} real transitions, over its budget {settings.real_transitions}")
    write_csv(rows, root / "metrics" / "sim_to_real_iterations.csv")
    played = kept_episodes(root / settings.out_dir)
    write_trajectories(played, root / settings.out_dir / ON_POLICY)
    line_plot(rows, "iteration", ["reward_mean", "success_rate", "heldout_success", "kl", "env_transitions"],
              root / "reports" / "sim_to_real.png", f"Sim-to-real {params.synthetic_rl.algorithm.upper()}")
    metrics = {"skipped": skipped, "start_from": settings.start_from, "algorithm": params.synthetic_rl.algorithm,
               "iterations": result.iterations, "real_transitions_budget": settings.real_transitions,
               "real_transitions_used": used, "episodes": len(rows) * rl.episodes_per_iteration,
               "on_policy_transitions_kept": sum(len(t.steps) for t in played),
               # episodes an environment failure ended: out of success_rate and reward_mean, given no advantage
               "env_failures": sum(row.get("env_failures", 0) for row in rows),
               "final": {key: rows[-1].get(key) for key in ("reward_mean", "success_rate", "kl")} if rows else {},
               "seconds": round(result.seconds, 1), "resumed": result.resumed_from is not None}
    write_stage_outputs("sim_to_real", metrics, report(params, metrics, rows, len(tasks), rl, result.seconds), root)
    return metrics


def skipped_report(why_not: str) -> str:
    return f"# Sim-to-real\n\nSkipped: {why_not}.\n"


def report(params: Params, metrics: dict[str, Any], rows: list[dict[str, Any]], tasks: int, rl: Any,
           seconds: float) -> str:
    settings, skipped = params.sim_to_real, metrics["skipped"]
    return (f"# Sim-to-real ({params.synthetic_rl.algorithm.upper()})\n\nFrom the {settings.start_from} policy, "
            f"{metrics['iterations']} iterations in the real environments ({tasks} training tasks, "
            f"{rl.tasks_per_iteration} per iteration x {rl.group_size} episodes, at most {rl.max_turns} turns) used "
            f"**{metrics['real_transitions_used']} real transitions** of a budget of {settings.real_transitions} "
            f"(another iteration starts while its worst case, {rl.transitions_per_iteration}, fits in what is left). "
            f"Wall time {seconds:.0f} s. {metrics['env_failures']} episode(s) ended by an environment failure (a hung "
            "or crashed engine or browser): counted in `env_failures`, left out of success and reward, given no "
            "advantage.\n\n![learning curves](sim_to_real.png)\n\n"
            + markdown_table(SHOWN, [[row.get(key) for key in SHOWN] for row in rows])
            + (f"\nSkipped (no real-environment adapter): {', '.join(skipped)}.\n" if skipped else ""))
