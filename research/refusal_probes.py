"""Does the experience model refuse what the real game refuses, on the states a policy reaches?

    python research/refusal_probes.py build EPISODES.jsonl... --out PROBES.jsonl   # replays, once
    python research/refusal_probes.py score PROBES.jsonl [--set KEY=VALUE]...       # this checkout's model
    python research/refusal_probes.py score PROBES.jsonl --controls                 # false refusals
    python research/refusal_probes.py explain PROBES.jsonl                          # what the state shows
    python research/refusal_probes.py recount SCORED.txt...                         # by command, from score's output

`build` replays synthetic RL's episodes (`{"trajectory": ...}` lines, as models/policy/rl/checkpoints/episodes.jsonl
and research/audit_synthetic_episodes.py read them) action by action in the real games of their training tasks and
keeps the replays. `score` asks the experience model of this checkout (params.yaml, its buffer) for the first step
of each replay that the game refused (up to it, the synthetic episode and the game agreed on what the policy did;
after it their states part), with the history the replay had, and prints how many it answers as the game did: the
same first line of the observation, or at least a refusal (a line the game answers refused commands with in the
replays, with no reward and the episode going on), and how many it rewards, ends or falls back on; each row keeps
the model's reasoning, and `fact_stated` says whether it holds the step's `annotation.grounding_sentence` (where the
state mentions the command's object: what a model trained with `annotate.ground_objects` writes first), and
`sections_right` whether it names the same object and sections, in any order. Many probes repeat one command in one
game (94 probes, 15 commands), so the summary counts commands too: how many the model refuses at least once, and how
many it answers both ways (`commands_split`: refusing some probes of a command and not others, the only sign that it
reads the state rather than the command; `recount` gives these for a kept `score` output). Cost: the real
game's steps (seconds) to build; one experience-model call per probe to score (94 in 8.6 min on one llama.cpp
thread, 5.7 min on two).

`score --controls` asks instead for the step before each probe, which the game accepted (same games, same
policies, one step earlier): a model that learned to refuse by rote refuses those too ("refused" there counts false
refusals). `explain` says, for each `take X from Y` probe, where the probe's state (with its history) shows X: held (the
inventory), in the room's description (a `Room:` section, `environments.textworld.describe_room`), in the last
observation, only in the history, or nowhere; beside the game's reply. A refusal the state cannot show (X nowhere
but in the recipe) no simulator can predict from it.

The probes are steps of training tasks, replayed: they only measure here, and nothing adds them to any data.
"""
import argparse
import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

from components.builders import experience_predictor, saved_buffer
from components.config import load_params
from components.data.contract import (
    TRAJECTORIES,
    Trajectory,
    Transition,
    is_refused,
    read_trajectories,
    transitions,
    write_trajectories,
)
from components.envs.registry import real_environment
from components.envs.textworld_cooking import game_reply as reply
from components.results.evaluation import replay_in_real
from components.simulator.annotation import grounding_sentence
from components.simulator.experience_model import PredictionStats
from components.simulator.state_changes import sections
from dreamgym.cli import set_overrides


def build(episode_files: list[str], out: str) -> None:
    params = load_params("params.yaml")
    tasks = {t.task.task_id: t.task for t in read_trajectories(f"{params.data.dir}/{TRAJECTORIES}")}
    episodes = [Trajectory.from_dict(json.loads(line)["trajectory"]) for name in episode_files
                for line in open(name, encoding="utf-8")]
    episodes = [replace(e, task=tasks[e.task.task_id]) for e in episodes if e.task.task_id in tasks]
    by_environment: dict[str, list[Trajectory]] = {}
    for episode in episodes:
        by_environment.setdefault(episode.task.environment, []).append(episode)
    replays = [replay for name, group in by_environment.items()
               for replay in replay_in_real(real_environment(name), params.environments, group, progress=None)]
    write_trajectories(replays, Path(out))
    refused = sum(is_refused(t) for replay in replays for t in transitions(replay))
    print(f"{out}: {len(replays)} replays, {refused} refused steps")


def first_refused_and_before(replay: Trajectory, history: int) -> tuple[Transition | None, Transition | None]:
    """The replay's first step the game refused, and the accepted step before it (None where there is none)."""
    steps = list(transitions(replay, history))
    index = next((i for i, t in enumerate(steps) if is_refused(t)), None)
    if index is None:
        return None, None
    return steps[index], steps[index - 1] if index > 0 else None


def score(probes: str, overrides: dict, controls: bool = False) -> dict:
    params = load_params("params.yaml", overrides)
    history = params.experience_model.prompt.history_length
    replays = read_trajectories(Path(probes))
    steps = [step for replay in replays
             if (step := first_refused_and_before(replay, history)[1 if controls else 0]) is not None]
    # what the game answers a command it refuses, anywhere in the replays: a model's reply among them is a refusal
    refusals = {reply(t.next_state) for replay in replays for t in transitions(replay) if is_refused(t)}
    stats = PredictionStats()
    predictions = experience_predictor(params, Path("."), saved_buffer(params, Path(".")), stats)(steps)
    rows = [{"action": t.action, "game": reply(t.next_state), "model": reply(p.next_state),
             "same_reply": reply(p.next_state) == reply(t.next_state),
             "refused": not p.fallback and reply(p.next_state) in refusals and p.reward == 0 and not p.done,
             "rewarded": p.reward > 0, "ended": p.done, "fallback": p.fallback,
             # a model trained with annotate.ground_objects states this fact before its verdict: did it read it right?
             "fact_stated": bool(fact := grounding_sentence(t.action, t.state)) and fact in (p.reasoning or ""),
             "sections_right": bool(fact) and mentioned(fact) == mentioned(p.reasoning), "reasoning": p.reasoning}
            for t, p in zip(steps, predictions, strict=True)]
    summary = {"model": params.models.experience, "probes": "accepted step before" if controls else "first refused",
               "steps": len(rows),
               **{key: sum(row[key] for row in rows) for key in
                  ("same_reply", "refused", "rewarded", "ended", "fallback", "fact_stated", "sections_right")},
               "take_from": sum(row["action"].startswith("take ") and " from " in row["action"] for row in rows),
               "take_from_same_reply": sum(row["same_reply"] for row in rows
                                           if row["action"].startswith("take ") and " from " in row["action"])}
    summary |= by_command(rows)
    for row in rows:
        print(json.dumps(row))
    print(json.dumps(summary))
    return summary


def by_command(rows: list[dict]) -> dict:
    """The probes grouped by command: how many commands, how many refused at least once, answered both ways."""
    answers: dict[str, set[bool]] = {}
    for row in rows:
        answers.setdefault(row["action"], set()).add(row["refused"])
    return {"commands": len(answers), "commands_refused": sum(True in seen for seen in answers.values()),
            "commands_split": sum(len(seen) == 2 for seen in answers.values())}


def recount(scored: str) -> dict:
    """`by_command` of a kept `score` output (its rows are JSON lines with an action)."""
    rows = [json.loads(line) for line in Path(scored).read_text(encoding="utf-8").splitlines()
            if line.startswith("{") and '"action"' in line]
    counts = {"file": scored, "steps": len(rows), "refused": sum(row["refused"] for row in rows), **by_command(rows)}
    print(json.dumps(counts))
    return counts


def mentioned(trace: str | None) -> tuple[str, frozenset[str]] | None:
    """The object and the sections a grounding sentence says the state mentions it under (None: no such sentence),
    so that a model's stated fact compares with the true one whatever order it lists them in."""
    match = re.search(r"The state (?:mentions '([^']*)' under ([^.]*)\.|does not mention '([^']*)'\.)", trace or "")
    if match is None:
        return None
    return match[1] or match[3], frozenset(re.split(r", | and ", match[2])) if match[2] else frozenset()


# where a state can show the thing a command takes, in the order `explain` looks
PLACES = {"Inventory:": "held", "Room:": "in the room", "Observation:": "in the last observation"}


def explain(probes: str) -> Counter:
    history = load_params("params.yaml").experience_model.prompt.history_length
    places = Counter()
    for replay in read_trajectories(Path(probes)):
        step = first_refused_and_before(replay, history)[0]
        taken = re.fullmatch(r"take (.+?) from (.+)", step.action) if step is not None else None
        if taken is None:
            continue
        thing, section = taken.group(1), dict(sections(step.state))
        where = next((place for label, place in PLACES.items() if thing in section.get(label, "")), None)
        if where is None:
            where = "in the history" if any(thing in state for state, _ in step.history) else "nowhere"
        places[where, reply(step.next_state)] += 1
    for (where, game), count in places.most_common():
        print(f"{count:3d}  {where:24s}  {game}")
    return places


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("action", choices=["build", "score", "explain", "recount"])
parser.add_argument("files", nargs="+")
parser.add_argument("--out", default="probes.jsonl")
parser.add_argument("--controls", action="store_true", help="score the accepted step before each probe")
parser.add_argument("--set", action="append", default=[], help="a params override, as dreamgym --set takes")
args = parser.parse_args()
if args.action == "build":
    build(args.files, args.out)
elif args.action == "explain":
    explain(args.files[0])
elif args.action == "recount":
    for scored in args.files:
        recount(scored)
else:
    score(args.files[0], set_overrides(args.set), args.controls)
