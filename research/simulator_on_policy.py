"""Does the experience model predict what the real game does with the policy's own actions? Fidelity on real
transitions the policy produced (a study run's evaluation and replay-audit episodes), for chosen commands.

The seed's held-out transitions (evaluate_experience_model) hold few of the policy's mistakes; here they are the
point: `prepare meal` typed before the ingredients are cut and cooked, which the real game refuses. Each transition
keeps its whole episode as history (the model sees what its format allows, `experience_model.prompt.history_length`).
A real or predicted outcome is the first line of the next state's observation (the text after its last
"Observation:"), e.g. "You still miss something." or "Adding the meal to your inventory.".

    python research/simulator_on_policy.py EPISODES.jsonl [...] --action "prepare meal" --action "eat meal" \
        [--per-outcome 20] [--out results.json]

Uses params.yaml and the trained experience model and buffer in this checkout (models/experience, the saved
buffer). Prints, per command, how often the predicted outcome and reward match the real ones, and the confusion of
real against predicted outcomes. Cost: one prediction per transition (about 5 s each on 2 CPU cores with reasoning).
"""
import argparse
import json
import logging
import random
from collections import Counter, defaultdict
from pathlib import Path

from components.builders import experience_predictor, saved_buffer
from components.config import load_params
from components.data.contract import Trajectory, read_records, transitions
from components.envs.textworld_cooking import game_reply
from components.simulator import experience_model as em
from components.simulator.fidelity import reward_correct


def summarise(rows: list[dict], actions: list[str]) -> dict:
    """Per command: outcome and reward accuracy, and per real outcome the predicted outcomes and how often the
    predicted reward was right (a refused `eat meal` with reward 1 is a false win)."""
    summary = {}
    for action in actions:
        mine = [r for r in rows if r["action"] == action]
        if not mine:
            continue
        by_real = {real: [r for r in mine if r["real"] == real] for real in sorted({r["real"] for r in mine})}
        summary[action] = {
            "n": len(mine),
            "outcome_accuracy": sum(r["real"] == r["predicted"] for r in mine) / len(mine),
            "reward_accuracy": sum(reward_correct(r["predicted_reward"], r["real_reward"]) for r in mine) / len(mine),
            "by_real_outcome": {real: {"n": len(rs), "real_reward": sorted({r["real_reward"] for r in rs}),
                                       "reward_correct": sum(reward_correct(r["predicted_reward"], r["real_reward"])
                                                             for r in rs),
                                       "predicted": dict(Counter(r["predicted"] for r in rs).most_common())}
                                for real, rs in by_real.items()}}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("episodes", nargs="+", type=Path)
    parser.add_argument("--action", action="append", required=True, help="a command to test (repeatable)")
    parser.add_argument("--per-outcome", type=int, default=20, help="transitions sampled per (command, real outcome)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the figures and every prediction here (JSON)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")

    # the same episode kept by several runs (the warm start's greedy games) counts once
    episodes = {}
    for path in args.episodes:
        for record in read_records(path):
            trajectory = Trajectory.from_dict(record)
            episodes.setdefault((trajectory.task.task_id, tuple(s.action for s in trajectory.steps)), trajectory)
    groups = defaultdict(list)
    for trajectory in episodes.values():
        for t in transitions(trajectory):
            if t.action.strip() in args.action:
                groups[(t.action.strip(), game_reply(t.next_state))].append(t)
    rng = random.Random(args.seed)
    chosen = [t for key in sorted(groups) for t in rng.sample(groups[key], min(args.per_outcome, len(groups[key])))]
    print(f"{len(episodes)} distinct episodes; {len(chosen)} transitions chosen of "
          f"{sum(len(g) for g in groups.values())} with the commands")

    params = load_params("params.yaml")
    fmt = em.PromptFormat(**params.experience_model.prompt.model_dump())
    stats = em.PredictionStats()
    predictions = experience_predictor(params, Path("."), saved_buffer(params, Path(".")), stats)(chosen)

    rows = [{"action": t.action.strip(), "real": game_reply(t.next_state), "predicted": game_reply(p.next_state),
             "real_reward": t.reward, "predicted_reward": p.reward, "fallback": p.fallback,
             "trajectory_id": t.trajectory_id, "step_index": t.step_index}
            for t, p in zip(chosen, predictions, strict=True)]
    summary = {"history_length": fmt.history_length, "history_state_chars": fmt.history_state_chars,
               "use_reasoning": fmt.use_reasoning, "use_retrieval": fmt.use_retrieval,
               "prediction": stats.as_dict(), "actions": summarise(rows, args.action)}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({**summary, "rows": rows}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
