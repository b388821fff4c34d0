"""correction_rounds: round after round, synthetic RL, then on-policy play in the real games on training tasks, then
the experience model corrected on the real transitions the policy met; the next round starts from the current policy.

Each round is the pipeline's own stages run in a round directory (`<out_dir>/rounds/round_N/`, their metrics and
reports under it): synthetic_rl (`correction.synthetic_iterations`) and sim_to_real (`correction.real_transitions`)
from the current policy, evaluate_policies of the sim-to-real policy (held-out success), the replay audit (synthetic
episodes replayed in the real games: how many synthetic wins they confirm; the replays are on-policy data too), then,
with `correction.feedback`, the round's on-policy trajectories onboarded beside the seed (validation and quarantine as
for a user's data), annotate, index_buffer and train_experience_model continued from the current experience model
(`correction.training_steps`), and evaluate_experience_model: fidelity on the current policy's own play of held-out
games. `feedback: false` spends the
same rounds and real budget with nothing fed back (DreamGym-S2R), for the comparison. `sim_to_real: last_round` runs
sim-to-real once, in the last round (DreamGym-S2R's shape at its budget): the earlier rounds' policy is their synthetic
RL policy and their on-policy data is the replay audit's alone.

A finished round is kept (its `round.json`) and a rerun goes on from the next; a round cut short resumes its
unfinished steps (each keeps its own checkpoints). Rounds made under other settings or inputs are discarded. On
another machine a round goes on from what `resume_state` parked: its finished steps' metrics and its checkpoints,
the models made again from those.

Under a launcher every process runs the rounds: the rank-aware steps (synthetic_rl, sim_to_real, evaluate_policies,
train_experience_model, evaluate_experience_model) on all of them, the others (the replay audit, onboarding, annotate,
index_buffer) and every write on the main process while the others wait; each step's metrics are read
back from its file, so every process computes the same rows.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from components import distributed
from components.builders import WRITER_DIR
from components.config import Params, get_dotted, overridden
from components.data.contract import ON_POLICY, TRAJECTORIES, is_heldout_game, read_trajectories, write_trajectories
from components.data.onboarding import onboard
from components.data.validation import Limits
from components.envs.registry import has_adapter
from components.files import directory_identity, discard_unless_stamped, fingerprint, sha256_file
from components.reports import GAMES_FILE, line_plot, markdown_table, metrics_path, write_csv, write_stage_outputs
from components.results.study import read_games, sign_test
from stages import (
    annotate,
    evaluate_experience_model,
    evaluate_policies,
    index_buffer,
    sim_to_real,
    synthetic_rl,
    train_experience_model,
)
from stages.common import RANK_AWARE_STAGES, StageError

log = logging.getLogger(__name__)
# what a round reads (the keys of `current`) and where a corrected round keeps its own, under its directory
READ_FROM = {"policy": "policy.sft.out_dir", "experience": "experience_model.out_dir", "data": "data.dir",
             "annotated": "annotate.out_dir", "buffer": "buffer.out_dir"}
CORRECTED = {"experience": "experience", "data": "data", "annotated": "annotated", "buffer": "buffer"}
ROUND_FILE = "round.json"  # a finished round's row: its presence marks the round done
SHOWN = ["round", "real_transitions", "real_transitions_total", "on_policy_transitions", "quarantined",
         "synthetic_wins", "confirmed_wins", "synthetic_fallback_rate", "on_policy_false_win_rate",
         "on_policy_false_wins", "on_policy_unrewarded", "on_policy_change_f1", "heldout_success", "minutes"]


def run(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Correction rounds from the warm start; the final policy, the corrected experience model and every round's
    on-policy trajectories are the outputs."""
    root, settings = Path(root).resolve(), params.correction
    out = root / settings.out_dir
    main = distributed.is_main_process()
    if settings.rounds == 0:
        return _skipped(params, root, "correction.rounds is 0") if main else {}
    if settings.real_transitions < (cost := sim_to_real.iteration_cost(params)):
        raise StageError(f"correction.real_transitions {settings.real_transitions} pays for no sim-to-real iteration "
                         f"(one costs up to {cost}: sim_to_real.tasks_per_iteration x "
                         "group_size x policy.max_turns), so the rounds would never leave the warm start: raise it, or "
                         "lower those")
    raw = params.model_dump()
    current = {key: root / get_dotted(raw, section) for key, section in READ_FROM.items()}
    stamp = _fingerprint(raw, current)
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for number in range(1, settings.rounds + 1):
        round_dir = round_path(params, root, number)
        with distributed.main_process_first():
            if main and discard_unless_stamped(round_dir, f"{stamp} round {number}", round_dir / "STAMP"):
                log.info("round %d: discarded work of other settings or inputs", number)
        finished, handed_on = round_dir / ROUND_FILE, after_round(current, round_dir, settings.feedback,
                                                                  round_policy(params, number))
        kept = json.loads(finished.read_text(encoding="utf-8")) if finished.is_file() else None
        if kept is not None and _models_here(handed_on):
            row = kept
            say(f"[correction_rounds] round {number}/{settings.rounds}: finished before, kept")
        else:
            if kept is not None:
                say(f"[correction_rounds] round {number}/{settings.rounds}: finished before (parked), its models made "
                    "again from its checkpoints and kept trainings")
            row = play_round(params, root, round_dir, number, current, rows)
            if kept is not None:
                row = kept  # the round as it was played, not the remaking of its models
            elif main:
                finished.write_text(json.dumps(row, indent=1), encoding="utf-8")
            distributed.wait_for_everyone()
        current = handed_on
        rows.append(row)
        elapsed = time.monotonic() - started
        say(f"[correction_rounds] round {number}/{settings.rounds} done: {row['real_transitions_total']} real "
            f"transitions so far, on-policy false wins {row['on_policy_false_wins']}/{row['on_policy_unrewarded']}"
            f", synthetic wins confirmed {row['confirmed_wins']}/{row['synthetic_wins']}, held-out success "
            f"{row['heldout_success']}; ETA {elapsed / number * (settings.rounds - number):.0f}s")

    if not main:  # the main process writes the outputs
        return {}

    _replace_dir(current["policy"] / "model", out / "model")
    _replace_dir(current["experience"] / "model", out / "experience_model")
    played = [t for number in range(1, settings.rounds + 1)
              for t in read_trajectories(round_path(params, root, number) / ON_POLICY)]
    write_trajectories(played, out / ON_POLICY)
    write_csv(rows, root / "metrics" / "correction_rounds.csv")
    line_plot(rows, "round", ["on_policy_false_win_rate", "confirmed_share", "heldout_success"],
              root / "reports" / "correction_rounds.png", "Correction rounds" + ("" if settings.feedback
                                                                                else " (no feedback)"))
    last = rows[-1]
    metrics = {"rounds": len(rows), "feedback": settings.feedback, "real_transitions": last["real_transitions_total"],
               "synthetic_transitions": sum(row["synthetic_transitions"] for row in rows),
               "on_policy_transitions": sum(len(t.steps) for t in played),
               "final": {key: last[key] for key in ("on_policy_false_win_rate", "confirmed_wins", "synthetic_wins",
                                                    "heldout_success")},
               "first": {key: rows[0][key] for key in ("on_policy_false_win_rate", "heldout_success")},
               "seconds": round(sum(row["minutes"] for row in rows) * 60, 1)}
    metrics["against_warm_start"] = against_warm_start(root / GAMES_FILE, round_path(params, root) / GAMES_FILE)
    write_stage_outputs("correction_rounds", metrics, report(params, rows, metrics["against_warm_start"]), root)
    return metrics


def round_path(params: Params, root: str | Path = ".", number: int | None = None) -> Path:
    """Round `number`'s directory; by default the last round's, whose policy is the result and plays every held-out
    game."""
    return Path(root) / params.correction.out_dir / "rounds" / f"round_{number or params.correction.rounds}"


def round_policy(params: Params, number: int) -> str:
    """The stage whose policy round `number` ends with: sim_to_real, or synthetic_rl in a round without sim-to-real."""
    settings = params.correction
    return "sim_to_real" if settings.sim_to_real == "every_round" or number == settings.rounds else "synthetic_rl"


def against_warm_start(warm_games: Path, final_games: Path) -> dict[str, dict[str, Any]]:
    """Per environment, the final policy against the warm start on the held-out games both played (evaluate_policies
    of the pipeline and of the last round draw the same games): wins, the games only one of them won, and the exact
    two-sided sign test on those."""
    warm = {env: games for (policy, env), games in read_games(warm_games).items() if policy == "sft_warm_start"}
    final = {env: games for (policy, env), games in read_games(final_games).items() if policy == "sim-to-real"}
    paired = {}
    for env in sorted(warm.keys() & final.keys()):
        both = warm[env].keys() & final[env].keys()
        final_only = sum(final[env][g] and not warm[env][g] for g in both)
        warm_only = sum(warm[env][g] and not final[env][g] for g in both)
        paired[env] = {"games": len(both), "final_wins": sum(final[env][g] for g in both),
                       "warm_start_wins": sum(warm[env][g] for g in both), "final_only": final_only,
                       "warm_start_only": warm_only, "p_value": sign_test(final_only, warm_only)}
    return paired


def play_round(params: Params, root: Path, round_dir: Path, number: int, current: dict[str, Path],
               earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """One round in `round_dir`, from the `current` policy, experience model, data and buffer; its row."""
    settings, started = params.correction, time.monotonic()
    policy_stage = round_policy(params, number)
    # What the round reads, as absolute paths; what it writes, relative: under round_dir, the steps' root.
    reading = _reading(root, params, current)
    playing = overridden(params, {**reading, "synthetic_rl.out_dir": "synthetic_rl",
                                  "synthetic_rl.iterations": settings.synthetic_iterations,
                                  "sim_to_real.out_dir": "sim_to_real", "sim_to_real.start_from": "synthetic_rl",
                                  "sim_to_real.real_transitions": settings.real_transitions,
                                  "evaluate.policies": [policy_stage],
                                  "evaluate.replay_audit": False,  # the round's own, within replay_transitions
                                  # the last round's policy is the result: it plays every held-out game
                                  "policy.eval_tasks": params.policy.eval_tasks if number == settings.rounds
                                  else min(settings.heldout_games, params.policy.eval_tasks)})
    say(f"[correction_rounds] round {number}/{settings.rounds}: synthetic RL from {current['policy']} with the "
        f"experience model of {current['experience']}")
    synthetic = _step(round_dir, "synthetic_rl", lambda: synthetic_rl.run(playing, round_dir), everywhere=True,
                      output=round_dir / "synthetic_rl" / "model")
    real = (_step(round_dir, "sim_to_real", lambda: sim_to_real.run(playing, round_dir), everywhere=True,
                  output=round_dir / "sim_to_real" / "model")
            if policy_stage == "sim_to_real" else {"real_transitions_used": 0})
    evaluated = _step(round_dir, "evaluate_policies", lambda: evaluate_policies.run(playing, round_dir),
                      everywhere=True, output=round_dir / GAMES_FILE)
    audit, replays = replay_audit(playing, round_dir)

    # On-policy data: sim-to-real's episodes and the replays of synthetic episodes, all on training tasks
    on_policy = (read_trajectories(round_dir / "sim_to_real" / ON_POLICY) if policy_stage == "sim_to_real" else []) \
        + replays
    if distributed.is_main_process():
        write_trajectories(on_policy, round_dir / ON_POLICY)
    quarantined = 0
    if settings.feedback:
        quarantined = correct(params, root, round_dir, current)
    # the experience model the next round uses, on the current policy's own play of held-out games
    measuring = overridden(params, _reading(root, params, after_round(current, round_dir, settings.feedback,
                                                                       policy_stage)))
    fidelity = _step(round_dir, "evaluate_experience_model",
                     lambda: evaluate_experience_model.run(measuring, round_dir), everywhere=True)

    audit = audit.values()
    on_policy_model = fidelity.get("on_policy", {}).get("experience model", {}).get("overall", {})
    spent = real["real_transitions_used"] + sum(len(t.steps) for t in replays)
    evaluated_as = "sim-to-real" if policy_stage == "sim_to_real" else f"synthetic_{params.synthetic_rl.algorithm}"
    heldout = [entry["success_rate"] for key, entry in evaluated.get(evaluated_as, {}).items()
               if isinstance(entry, dict) and "success_rate" in entry]
    wins, confirmed = sum(a["synthetic_successes"] for a in audit), sum(a["both"] for a in audit)
    unrewarded = on_policy_model.get("unrewarded_n", 0)
    return {"round": number, "real_transitions": spent,
            "real_transitions_total": spent + (earlier[-1]["real_transitions_total"] if earlier else 0),
            "on_policy_transitions": sum(len(t.steps) for t in on_policy), "quarantined": quarantined,
            "synthetic_transitions": synthetic["synthetic_transitions"],
            "synthetic_fallback_rate": synthetic["experience_model"]["fallback_rate"],
            "synthetic_wins": wins, "confirmed_wins": confirmed, "confirmed_share": confirmed / wins if wins else None,
            "on_policy_false_wins": on_policy_model.get("false_wins"), "on_policy_unrewarded": unrewarded,
            "on_policy_false_win_rate": on_policy_model["false_wins"] / unrewarded if unrewarded else None,
            "on_policy_change_f1": on_policy_model.get("change_f1"),
            "heldout_success": sum(heldout) / len(heldout) if heldout else None,
            "minutes": round((time.monotonic() - started) / 60, 2)}


def replay_audit(params: Params, round_dir: Path) -> tuple[dict[str, Any], list]:
    """The round's synthetic episodes replayed in the real games (evaluate_policies' audit): per environment, how
    many synthetic wins the game confirms, and the replays (real transitions on training tasks). Kept in the round
    directory, so a resumed round does not play them again."""
    kept, replayed = round_dir / "replay_audit.json", round_dir / "replays.jsonl"
    with distributed.main_process_first():  # the main process replays them; the others read them back
        if distributed.is_main_process() and not kept.is_file():
            environments = [name for name in params.policy.environments if has_adapter(name)]
            with distributed.alone():
                audit, replays, _ = evaluate_policies.replay_synthetic_episodes(params, round_dir, environments,
                                                                                params.correction.replay_transitions)
            write_trajectories([t for t in replays if not is_heldout_game(t.task.environment, t.task.parameters)],
                               replayed)
            kept.write_text(json.dumps(audit, indent=1), encoding="utf-8")
    return json.loads(kept.read_text(encoding="utf-8")), read_trajectories(replayed)


def _models_here(handed_on: dict[str, Path]) -> bool:
    """Whether the policy and the experience model a round hands on are on this machine: a parked round (`resume_state`)
    brings their checkpoints and kept trainings, not the merged models."""
    return all((handed_on[key] / "model").is_dir() for key in ("policy", "experience"))


def resume_state(params: Params, root: str | Path = ".") -> list[Path]:
    """What the rounds under `root` keep that the row goes on from on another machine (`stages.outputs.resume_state`):
    each round's stamp, its row once finished, the replay audit and its replays (real games: never played twice), its
    steps' metrics (a finished step is not run again, but for one whose outputs are missing: that step resumes its
    checkpoints or restores its kept training), the held-out games it played, and its checkpoints and journals. Not
    the merged models (hundreds of MB a round), nor what onboarding and re-indexing make again in seconds."""
    trained = ["synthetic_rl", f"synthetic_rl/{WRITER_DIR}", "sim_to_real", CORRECTED["experience"]]
    kept = ["STAMP", ROUND_FILE, "replay_audit.json", "replays.jsonl", "metrics", GAMES_FILE]
    return [path for round_dir in sorted((Path(root) / params.correction.out_dir / "rounds").glob("round_*"))
            for path in [round_dir / name for name in kept] + [round_dir / out / "checkpoints" for out in trained]
            + [round_dir / stage.JOURNALS for stage in (evaluate_policies, evaluate_experience_model)]]


def after_round(current: dict[str, Path], round_dir: Path, feedback: bool, policy_stage: str) -> dict[str, Path]:
    """What the next round reads: this round's policy (of `policy_stage`), and with feedback its corrected data,
    buffer and model."""
    return {**current, "policy": round_dir / policy_stage,
            **({key: round_dir / name for key, name in CORRECTED.items()} if feedback else {})}


def correct(params: Params, root: Path, round_dir: Path, current: dict[str, Path]) -> int:
    """The round's on-policy trajectories onboarded beside the data so far, then the buffer re-indexed and the
    experience model trained on, from the current one; how many on-policy records onboarding quarantined."""
    data_dir, onboarded = round_dir / CORRECTED["data"], round_dir / "onboarding.json"
    with distributed.main_process_first():
        # not onboarded yet, or cut short while onboarding: from the data so far, again
        if distributed.is_main_process() and not onboarded.is_file():
            shutil.rmtree(data_dir, ignore_errors=True)
            data_dir.mkdir(parents=True)
            for name in (TRAJECTORIES, ON_POLICY):  # the seed, and the earlier rounds' feedback
                if (current["data"] / name).is_file():
                    shutil.copyfile(current["data"] / name, data_dir / name)
            with distributed.alone():
                result = onboard([round_dir / ON_POLICY], data_dir, Limits.of(params.data), version=False,
                                 fed_back=True)
            print(f"[correction_rounds] {result.summary()}")
            onboarded.write_text(json.dumps({"quarantined": len(result.rejected)}), encoding="utf-8")
    quarantined = json.loads(onboarded.read_text(encoding="utf-8"))["quarantined"]
    outputs = {key: round_dir / name for key, name in CORRECTED.items()}
    corrected = overridden(params, {
        **_reading(root, params, {**current, **outputs}), "models.experience": str(current["experience"] / "model"),
        "experience_model.training.max_steps": params.correction.training_steps})
    made = {annotate: outputs["annotated"], index_buffer: outputs["buffer"],
            train_experience_model: outputs["experience"] / "model"}
    for stage, output in made.items():
        name = stage.__name__.rsplit(".", 1)[-1]
        _step(round_dir, name, lambda stage=stage: stage.run(corrected, round_dir),
              everywhere=name in RANK_AWARE_STAGES, output=output)
    return quarantined


def _reading(root: Path, params: Params, paths: dict[str, Path]) -> dict[str, str]:
    """Overrides that make a stage read `paths` (absolute, whatever root it runs in) and the shared model cache."""
    return {"models.cache_dir": str(root / params.models.cache_dir),
            **{READ_FROM[key]: str(path) for key, path in paths.items()}}


def _step(round_dir: Path, stage: str, work, everywhere: bool, output: Path | None = None) -> dict[str, Any]:
    """A stage's metrics in the round, read back from its file: `work` runs it unless it finished before (a resumed
    round) and its `output` is here (a parked round on another machine has the metrics, not the models: the stage
    runs again, from its checkpoints or kept training). Under a launcher `work` runs on every process (`everywhere`:
    a rank-aware stage) or on the main one, and every process reads the metrics once all are done."""
    done = metrics_path(stage, round_dir)
    # the main process's answer: it may write the metrics before another asks
    if not distributed.broadcast(done.is_file() and (output is None or output.exists())):
        if everywhere:
            work()
        elif distributed.is_main_process():
            with distributed.alone():  # a stage that is not rank-aware runs as one process would
                work()
        distributed.wait_for_everyone()
    return json.loads(done.read_text(encoding="utf-8"))


def say(line: str) -> None:
    """A progress line, from the main process only."""
    if distributed.is_main_process():
        print(line, flush=True)


def _fingerprint(raw: dict[str, Any], inputs: dict[str, Path]) -> str:
    """What the rounds are made from: the settings they use (`raw`, the params as a dict) and their inputs' content."""
    sections = {name: raw[name] for name in (
        "seed", "data", "models", "environments", "evaluate", "buffer", "annotate", "experience_model", "policy",
        "synthetic_rl", "sim_to_real", "correction")}
    content = {key: directory_identity(path / "model") if (path / "model").is_dir() else
               sha256_file(path / TRAJECTORIES) if (path / TRAJECTORIES).is_file() else directory_identity(path)
               for key, path in inputs.items()}
    return fingerprint([sections, content])


def _replace_dir(source: Path, target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)


def _skipped(params: Params, root: Path, why: str) -> dict[str, Any]:
    out = root / params.correction.out_dir
    for name in ("model", "experience_model"):
        shutil.rmtree(out / name, ignore_errors=True)
        (out / name).mkdir(parents=True)
        (out / name / "SKIPPED.md").write_text(f"No correction rounds: {why}.\n", encoding="utf-8")
    write_trajectories([], out / ON_POLICY)
    write_csv([], root / "metrics" / "correction_rounds.csv")
    line_plot([], "round", [], root / "reports" / "correction_rounds.png", "Correction rounds (skipped)")
    metrics = {"rounds": 0, "reason": why}
    write_stage_outputs("correction_rounds", metrics, f"# Correction rounds\n\nSkipped: {why}.\n", root)
    return metrics


def report(params: Params, rows: list[dict[str, Any]], paired: dict[str, dict[str, Any]]) -> str:
    settings = params.correction
    return (f"# Correction rounds ({'with' if settings.feedback else 'without'} feedback)\n\n"
            f"{len(rows)} rounds from the warm start, each {settings.synthetic_iterations} synthetic RL iteration(s), "
            + (f"then sim-to-real on training tasks ({settings.real_transitions} real transitions) and "
               if settings.sim_to_real == "every_round" else
               f"then sim-to-real on training tasks in the last round only ({settings.real_transitions} real "
               "transitions; the earlier rounds' policy is their synthetic RL policy) and, every round, ")
            + "the replay audit (synthetic episodes replayed in the real games, their transitions counted on top), "
            "then "
            + (f"the round's on-policy trajectories onboarded beside the seed, the buffer re-indexed and the "
               f"experience model trained {settings.training_steps} more steps (on-policy data repeated to about "
               f"{params.experience_model.policy_share:.0%} of its examples). " if settings.feedback else
               "nothing fed back (`correction.feedback: false`: DreamGym-S2R at the same real budget). ")
            + "On-policy fidelity: the experience model the next round uses, on the current policy's play ("
              + ("greedy" if not params.experience_model.on_policy_temperature else
                 f"sampled at temperature {params.experience_model.on_policy_temperature:g}")
              + f") of {params.experience_model.on_policy_games} held-out games (they only measure); a false win is "
              "a reward predicted where the game gave none. Held-out success: the round's sim-to-real policy on "
              f"the first {settings.heldout_games} held-out games per environment (the last round's on all "
              f"{params.policy.eval_tasks}).\n\n![rounds](correction_rounds.png)\n\n"
            + markdown_table(SHOWN, [[row.get(key) for key in SHOWN] for row in rows])
            + ("\n## The final policy against the warm start\n\nOn the held-out games both played (the warm start in "
               "the pipeline's evaluate_policies): games only one of them won, and the exact sign test on those.\n\n"
               + markdown_table(["environment", "games", "final policy wins", "warm start wins", "only the final",
                                 "only the warm start", "p (two-sided)"],
                                [[env, p["games"], p["final_wins"], p["warm_start_wins"], p["final_only"],
                                  p["warm_start_only"], f"{p['p_value']:.3f}"] for env, p in paired.items()])
               if paired else "\nNo paired comparison with the warm start: the pipeline's evaluate_policies has not "
               "played it on the same held-out games (evaluate.policies lists train_policy_sft).\n")
            + f"\nEach round's stages wrote their own metrics and reports under `{settings.out_dir}/rounds/`; every "
              f"on-policy trajectory is in `{settings.out_dir}/{ON_POLICY}` (`dreamgym data onboard` takes it).\n")
