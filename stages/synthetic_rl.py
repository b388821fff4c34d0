"""synthetic_rl: RL of the warm-started policy inside the synthetic environment (experience model + replay buffer)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from components import distributed
from components.builders import (
    curriculum_and_writer,
    curve_probe,
    fallback_budget,
    policy_format,
    rl_settings,
    rl_tasks,
    run_identity,
    saved_buffer,
    synthetic_environments,
)
from components.config import Params
from components.envs.base import EveryEpisodeFailed
from components.reports import line_plot, markdown_table, write_csv, write_stage_outputs
from components.rl.loop import settings_fingerprint
from components.rl.rollouts import RemoteSyntheticBatch, SyntheticBatch
from components.simulator.experience_model import PredictionStats
from components.simulator.replay_buffer import run_collection_name
from components.simulator.server import shared_simulators
from stages.common import StageError

# the iteration log's columns in the report's table
SHOWN = ["iteration", "reward_mean", "success_rate", "heldout_success", "kl", "entropy", "turns_mean",
         "policy_tokens_mean", "synthetic_transitions", "generated_tasks_played", "generated_tasks",
         "policy_generation_s", "environment_s", "curriculum_s", "optimisation_s"]


def run(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """RL of the warm-started policy inside the synthetic environment (experience model + replay buffer)."""
    root, settings = Path(root), params.synthetic_rl
    tasks = rl_tasks(params, root)
    if len(tasks) < settings.tasks_per_iteration:
        raise StageError(f"{len(tasks)} training tasks in {params.policy.environments} with seed episodes; "
                         f"synthetic_rl.tasks_per_iteration is {settings.tasks_per_iteration}")
    buffer = saved_buffer(params, root)  # embedded: a copy in memory; weaviate: the seed collection, copied below
    # Under a launcher the main process alone loads the experience model and the task writer.
    main = distributed.is_main_process()
    curriculum, generator = curriculum_and_writer(params, root, tasks, buffer, with_writer=main)
    if settings.algorithm == "grpo":
        from components.rl.grpo import train_grpo as train
    else:
        from components.rl.ppo import train_ppo as train
    warm_start = str(root / params.policy.sft.out_dir / "model")
    experience = params.experience_model
    # a taught curriculum writer proposes other tasks than the backbone: its recipe is part of what a run resumes
    taught = [settings.curriculum] if settings.curriculum.writer_training else []
    simulator = run_identity(root / experience.out_dir / "model", root / params.buffer.out_dir, experience.prompt,
                             experience.inference, params.models.experience, *taught)
    if buffer.backend == "weaviate" and distributed.world_size() > 1:
        raise StageError("synthetic_rl on several processes needs the embedded buffer (buffer.backend: embedded): "
                         "each process would copy the Weaviate collection")
    if not distributed.on_one_machine():
        raise StageError("synthetic_rl on several machines: the processes play in one simulator server, which the "
                         "main process serves on 127.0.0.1; launch the processes on one machine")
    if buffer.backend == "weaviate":
        # Synthetic experience never alters index_buffer's collection: the run adds to its own copy, named by what
        # resumes its checkpoints (and its out_dir), so a resumed run finds it again and no other run shares it.
        fingerprint = settings_fingerprint(rl_settings(params), warm_start, curriculum, simulator)
        seed, buffer = buffer, buffer.copy(run_collection_name(buffer.collection_name,
                                                               f"{fingerprint}/{settings.out_dir}"))
        seed.close()
    envs, stats = synthetic_environments(params, root, buffer, params.policy.environments) if main else \
        ([], PredictionStats())
    budget = fallback_budget(params)
    # Under a launcher the main process serves its synthetic environments and every process plays its share there.
    with shared_simulators(envs, settings.tasks_per_iteration * settings.group_size) as urls:
        def next_batch() -> SyntheticBatch | RemoteSyntheticBatch:
            # the iterations so far: stop before paying for another on a simulator that does not answer
            budget.check(stats, "synthetic_rl", experience.inference.max_new_tokens)
            return SyntheticBatch(*envs) if urls is None else RemoteSyntheticBatch(urls)

        try:
            result = train(warm_start, curriculum, next_batch, buffer, policy_format(params),
                           rl_settings(params), root / settings.out_dir, cache_dir=root / params.models.cache_dir,
                           generator=generator, environment=simulator, curve=curve_probe(params))
        except EveryEpisodeFailed:  # every episode of an iteration ended on a fallback: say so by the budget, if over
            budget.check(stats, "synthetic_rl", experience.inference.max_new_tokens)
            raise
    if not main:  # the main process writes the outputs
        buffer.close()
        return {}
    budget.check(stats, "synthetic_rl", experience.inference.max_new_tokens)
    buffer.save(root / settings.out_dir / "replay_buffer")
    curriculum.write_tasks(root / settings.out_dir / "generated_tasks.jsonl")
    rows = result.log
    write_csv(rows, root / "metrics" / "synthetic_rl_iterations.csv")
    curves = ["reward_mean", "success_rate", "heldout_success", "kl", "entropy", "reward_variance_mean",
              "generated_tasks"]
    line_plot(rows, "iteration", curves, root / "reports" / "synthetic_rl.png",
              f"{settings.algorithm.upper()} in the synthetic environment")
    metrics = {"algorithm": settings.algorithm, "iterations": result.iterations, "tasks": len(tasks),
               "episodes": len(rows) * settings.tasks_per_iteration * settings.group_size,
               "synthetic_transitions": sum(row["synthetic_transitions"] for row in rows),
               "buffer_size": len(buffer), "experience_model": predictions_of_run(rows, stats),
               "curriculum": curriculum.summary(),
               "final": {key: rows[-1].get(key) for key in ("reward_mean", "success_rate", "kl")} if rows else {},
               "seconds": round(result.seconds, 1), "resumed": result.resumed_from is not None}
    text = report(params, metrics, rows, len(tasks), len(buffer), curriculum, result.seconds)
    write_stage_outputs("synthetic_rl", metrics, text, root)
    buffer.close()
    return metrics


def predictions_of_run(rows: list[dict[str, Any]], stats: Any) -> dict[str, Any]:
    """The experience model's predictions and fallbacks over the whole run, from the iteration log (one prediction
    per synthetic step): `stats` counts only this process's, which after a resume is the iterations since it."""
    requests = sum(row["env_transitions"] for row in rows)
    fallbacks = sum(row["fallback_steps"] for row in rows)
    return {"requests": requests, "fallbacks": fallbacks, "fallback_rate": fallbacks / requests if requests else 0.0,
            "this_process": stats.as_dict()}


def report(params: Params, metrics: dict[str, Any], rows: list[dict[str, Any]], tasks: int, buffer_size: int,
           curriculum: Any, seconds: float) -> str:
    settings = params.synthetic_rl
    return (f"# Synthetic RL ({settings.algorithm.upper()})\n\nThe warm-started policy trained for "
            f"{metrics['iterations']} iterations inside the synthetic environment ({tasks} training tasks, "
            f"{settings.tasks_per_iteration} per iteration x {settings.group_size} episodes, at most "
            f"{params.policy.max_turns} turns). {metrics['synthetic_transitions']} synthetic transitions were "
            f"generated and appended to the replay buffer (now {buffer_size}); the experience model fell back on "
            f"{metrics['experience_model']['fallbacks']} of {metrics['experience_model']['requests']} predictions. "
            f"{curriculum_sentence(curriculum)} "
            f"Wall time {seconds:.0f} s.\n\n"
            "![learning curves](synthetic_rl.png)\n\n"
            + markdown_table(SHOWN, [[row.get(key) for key in SHOWN] for row in rows]))


def curriculum_sentence(curriculum: Any) -> str:
    if not curriculum.settings.enabled:
        return "Curriculum off (the ablation): base tasks only."
    summary = curriculum.summary()
    return (f"The curriculum proposed {summary['proposed']} task variations and accepted {summary['accepted']} "
            f"({summary['rejected']} rejected: " + ", ".join(
                f"{reason[9:]} {count}" for reason, count in summary.items()
                if reason.startswith("rejected_") and count) + "); generated tasks are in "
            "`generated_tasks.jsonl` next to the model.")
