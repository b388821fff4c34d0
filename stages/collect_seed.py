"""collect_seed: the default seed set collected in the real environments (seed/<environment>.jsonl), to be onboarded."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from components.config import Params
from components.data.collection import ENV_FAILURE_ATTEMPTS, collect_environment, collectable, env_failures_path
from components.data.contract import Trajectory
from components.reports import write_stage_outputs
from stages.common import by_source, source_table


def run(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Collect the default seed set in the real environments (seed/<environment>.jsonl), to be onboarded."""
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
               for (_, source), group in by_source(trajectories).items()},
            "env_failures": len(result.env_failures),  # plays an environment failure ended, retried or not
            "env_failures_left_out": len(result.left_out),  # planned episodes no play of which was collected
        }
        kept = (f", kept in `{env_failures_path(out_path).relative_to(root)}`" if result.env_failures else "")
        failures.append(f"- {environment}: {len(result.env_failures)} play(s) ended by an environment failure, "
                        f"{len(result.left_out)} episode(s) left out{kept}")
    write_stage_outputs("collect_seed", metrics, report(params, collected, failures, seed_only), root)
    return metrics


def report(params: Params, collected: list[Trajectory], failures: list[str], seed_only: list[str]) -> str:
    settings = params.collect_seed
    return (f"# Seed collection\n\n{settings.train_tasks} training tasks per environment; per task "
            f"{settings.episodes.expert} expert, {settings.episodes.noisy_expert} noisy-expert "
            f"(epsilon {settings.noisy_epsilon}: a random command or, half the time in TextWorld, a mistake the game "
            f"refuses), {settings.episodes.skipping_expert} skipping-expert (one "
            f"walkthrough step left out; TextWorld only) and {settings.episodes.random} random episode(s); the noisy "
            f"and skipping experts' source is `policy`. "
            f"Onboard them with `dreamgym data onboard {settings.out_dir}/*.jsonl`.\n\n"
            + source_table(by_source(collected))
            + (f"\nEnvironment failures (a hung or crashed engine or browser, not the policy: never collected; the "
               f"episode is played again, up to {ENV_FAILURE_ATTEMPTS} times in all, then left out):\n\n"
               + "\n".join(failures) + "\n" if failures else "")
            + (f"\nSkipped (no real-environment adapter): {', '.join(seed_only)}\n" if seed_only else ""))
