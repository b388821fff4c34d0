"""evaluate_policies: the warm start, the synthetic-RL and the sim-to-real policies on held-out tasks."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from components import distributed
from components.builders import (
    fallback_budget,
    heldout_demonstrations,
    policy_format,
    policy_trajectories,
    saved_buffer,
    success_rewards,
    synthetic_environments,
)
from components.config import Params
from components.data.contract import TRAJECTORIES, Trajectory, read_trajectories, write_trajectories
from components.envs.registry import has_adapter, real_environment
from components.llm import sft
from components.llm.backends import HFGenerationBackend
from components.reports import GAMES_FILE, markdown_table, write_csv, write_stage_outputs
from components.results.evaluation import (
    ENV_FAILURES_COLUMN,
    ENV_FAILURES_NOTE,
    SIMULATED,
    evaluate_in_simulation,
    evaluate_policy,
    format_success,
    outcome_agreement,
    replay_in_real,
)
from components.rl import policy
from components.rl.loop import read_iteration_log
from components.rl.rollouts import SyntheticBatch
from components.simulator.synthetic import episodes_from_buffer, first_state_tasks

EPISODES_FILE = "reports/evaluate_policies_episodes.jsonl"  # every episode played, to replay failures
JOURNALS = ".cache/evaluate_policies"  # the games played so far, per policy and environment: a rerun resumes them


def run(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """The warm start, the synthetic-RL and the sim-to-real policies on held-out tasks: closed-loop success (with
    confidence intervals) in the real environment, or inside the experience model for a seed-only domain, and
    teacher-forced next-action accuracy on held-out seed episodes."""
    root, fmt = Path(root), policy_format(params)
    rl_label = f"synthetic {params.synthetic_rl.algorithm}"
    candidates = {"sft warm start": ("train_policy_sft", root / params.policy.sft.out_dir / "model"),
                  rl_label: ("synthetic_rl", root / params.synthetic_rl.out_dir / "model"),
                  "sim-to-real": ("sim_to_real", root / params.sim_to_real.out_dir / "model")}
    candidates = {label: path for label, (stage, path) in candidates.items()
                  if stage in params.evaluate.policies and sft.has_trained_model(path)}
    heldout = heldout_demonstrations(params, root)
    environments = [name for name in params.policy.environments if has_adapter(name)]
    skipped = [name for name in params.policy.environments if not has_adapter(name)]
    tasks = {name: real_environment(name).make_tasks(params.environments, "heldout", params.policy.eval_tasks,
                                                     params.seed) for name in environments}
    # A seed-only domain has no application to play: its held-out seed tasks are played in the experience model.
    heldout_tasks = first_state_tasks(policy_trajectories(params, root, heldout=True)) if skipped else []
    simulated = {name: [t for t in heldout_tasks if t.environment == name][: params.policy.eval_tasks]
                 for name in skipped}
    # Under a launcher the processes share each real environment's games (evaluate_policy); the main process alone
    # plays the seed-only domains' games in the experience model, scores next actions, audits and writes.
    main = distributed.is_main_process()
    simulators, simulator_stats = (synthetic_environments(params, root, saved_buffer(params, root), skipped)
                                   if skipped and main else ([], None))
    metrics: dict[str, Any] = {"skipped": skipped}
    rows, episodes, games = [], [], []
    for label, model_dir in candidates.items():
        key = label.replace(" ", "_")  # the policy's name in the metrics and the games file
        model, tokenizer = sft.load_trained_model(model_dir)
        identity = policy.factory_identity(model_dir, fmt, params.policy.max_action_tokens) if environments else ""
        entry: dict[str, Any] = {}
        if heldout and main:
            entry["next_action"] = policy.next_action_accuracy(HFGenerationBackend(model, tokenizer), heldout, fmt,
                                                               params.policy.max_action_tokens)
        for name in environments:
            result = evaluate_policy(real_environment(name), params.environments, tasks[name],
                                     policy.policy_factory(model, tokenizer, fmt, params.policy.max_action_tokens),
                                     workers=params.evaluate.workers, confidence=params.evaluate.confidence,
                                     name=label.replace(" ", "-"), max_steps=params.policy.max_turns,
                                     journal=root / JOURNALS / f"{key}-{name}.jsonl", policy_identity=identity)
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
                                            batched=params.policy.batched_rollouts,
                                            confidence=params.evaluate.confidence, name=label)
            entry[f"{env.name}{SIMULATED}"] = result.metrics()
            episodes += result.trajectories
            games += result.games(key, f"{env.name}{SIMULATED}")
            accuracy = entry.get("next_action", {}).get("accuracy")
            rows.append([f"{env.name} (in the experience model)", label, result.episodes, format_success(result),
                         f"{accuracy:.3f}" if accuracy is not None else "n/a", f"{result.mean_steps:.1f}",
                         f"{result.wall_s:.0f}", result.env_failures])
        metrics[key] = entry
    if not main:
        return {}
    if simulator_stats is not None:
        fallback_budget(params).check(simulator_stats, "evaluate_policies (held-out games of seed-only domains)",
                                      params.experience_model.inference.max_new_tokens)
        metrics["experience_model"] = simulator_stats.as_dict()
    replay_rows = []
    if rl_label in candidates and params.evaluate.replay_audit:
        metrics["synthetic_replay"], replays, replay_rows = replay_synthetic_episodes(params, root, environments)
        episodes += replays
    # What the RL policies saw, read from the iteration log saved with each model (a checkpoint's too), so it is
    # that model's history even when a study points the out_dirs at another run's.
    logs = {label: read_iteration_log(model_dir) for label, model_dir in candidates.items()}
    text = report(params, rows, len(heldout), skipped, provenance(logs, rl_label), replay_rows)
    write_trajectories(episodes, root / EPISODES_FILE)
    write_csv(games, root / GAMES_FILE)
    write_stage_outputs("evaluate_policies", metrics, text, root)
    shutil.rmtree(root / JOURNALS, ignore_errors=True)
    return metrics


def replay_synthetic_episodes(params: Params, root: Path, environments: list[str], max_transitions: int | None = None,
                              ) -> tuple[dict[str, Any], list[Trajectory], list[list]]:
    """Synthetic RL's episodes on real training tasks, replayed action by action in the real environment: how many
    synthetic wins the application confirms (metrics, the replays, a report row per environment). With
    `max_transitions`, the replays spend at most that many real transitions, synthetic wins first: they are what the
    audit asks about."""
    buffer_dir = Path(params.synthetic_rl.out_dir) / "replay_buffer"  # under root, as saved_buffer takes it
    if not (root / buffer_dir).is_dir():
        return {}, [], []
    buffer = saved_buffer(params, root, buffer_dir)
    records, _ = buffer.export(source="synthetic")
    buffer.close()
    tasks = {t.task.task_id: t.task for t in read_trajectories(root / params.data.dir / TRAJECTORIES)}
    metrics: dict[str, Any] = {}
    rows, replays = [], []
    for name in environments:
        synthetic, unreplayable = episodes_from_buffer([r for r in records if r.environment == name], tasks,
                                                       success_rewards(params, root).get(name))
        if max_transitions is not None:
            synthetic = wins_first_within(synthetic, max_transitions - sum(len(t.steps) for t in replays))
        real = replay_in_real(real_environment(name), params.environments, synthetic)
        metrics[name] = {**outcome_agreement(synthetic, real), "unreplayable": unreplayable}
        replays += real
        m = metrics[name]
        rows.append([name, m["episodes"], m["synthetic_successes"], m["both"], m["synthetic_only"], m["real_only"],
                     unreplayable])
    return metrics, replays, rows


def wins_first_within(episodes: list[Trajectory], budget: int) -> list[Trajectory]:
    """The episodes whose actions fit in `budget` steps together, wins first, otherwise in order."""
    chosen = []
    for episode in sorted(episodes, key=lambda t: not t.success):
        if len(episode.steps) <= budget:
            chosen.append(episode)
            budget -= len(episode.steps)
    return chosen


def provenance(logs: dict[str, list[dict[str, Any]]], rl_label: str) -> str:
    """What the RL policies' iteration logs say they were trained on, as sentences for the report."""
    text = ""
    if rl_log := logs.get(rl_label):
        text += (f" The synthetic RL policy ({len(rl_log)} iterations) saw "
                 f"{sum(row['synthetic_transitions'] for row in rl_log)} synthetic transitions and no real ones "
                 "beyond the seed.")
    if s2r_log := logs.get("sim-to-real"):
        text += f" Sim-to-real then used {sum(row['env_transitions'] for row in s2r_log)} real transitions."
    return text


def report(params: Params, rows: list[list], heldout: int, skipped: list[str], trained_on: str,
           replay_rows: list[list]) -> str:
    confidence = params.evaluate.confidence
    return ("# Policies on held-out tasks\n\n"
            + markdown_table(["environment", "policy", "episodes", f"success [{confidence:.0%} CI]",
                              "next-action accuracy", "mean steps", "wall time (s)", ENV_FAILURES_COLUMN], rows)
            + f"\nClosed loop: each policy plays {params.policy.eval_tasks} held-out real tasks per environment once "
              f"(greedy, at most {params.policy.max_turns} turns); Wilson intervals. Next-action accuracy is "
              f"teacher-forced on {heldout} held-out seed episodes. {ENV_FAILURES_NOTE}{trained_on} Every "
              f"episode, step by step: `{EPISODES_FILE}`; each game's outcome: `{GAMES_FILE}` (`won` empty and "
              "`env_failure` saying why where an environment failure ended the game).\n"
            + (f"\nNo real-environment adapter (seed-only domains): {', '.join(skipped)}. Their held-out seed tasks "
               "are played inside the experience model instead: that success is the simulator's verdict, a check "
               "of the policy against the learned dynamics, not of the application.\n" if skipped else "")
            + replay_report(replay_rows))


def replay_report(rows: list[list]) -> str:
    """The replay audit's section: per environment, the synthetic wins the real game confirms."""
    if not rows:
        return ""
    return ("\n## Synthetic episodes replayed in the real environment\n\n"
            "Every episode synthetic RL played inside the experience model on a real training task, its actions "
            "replayed in order in the real environment (`replay-*` in the episodes file). A synthetic win the real "
            "game does not give is a simulator error the policy was rewarded for.\n\n"
            + markdown_table(["environment", "episodes", "synthetic wins", "of them real wins",
                              "synthetic wins not real", "real wins the simulator missed",
                              "not replayable (generated tasks)"], rows))

