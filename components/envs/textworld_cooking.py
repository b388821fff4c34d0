"""TextWorld cooking games (the embodied-text regime, like the paper's ALFWorld) behind the Environment interface.

Games come from TextWorld's `tw-cooking` challenge with difficulty knobs (recipe size, ingredients to take,
rooms, open/cook/cut) and a seed; a Task's `parameters` name one game exactly. Compiled games are cached on disk
by their parameters, written to a temporary folder and renamed into place, so parallel or crashed generation
never leaves a broken entry.

The engine runs in a child process (`_Worker`): a per-step timeout can then kill a hung game (Jericho runs C code
that no signal or thread can interrupt) and the parent never imports TextWorld (import plus knowledge base: ~5 s
of CPU per process). Generation runs in the same kind of child.

Abstract state (compact text, the same layout every step):

    Recipe:            <- from the first state: the recipe is the goal's specification (see below)
    <ingredients and directions>
    Room:              <- only with `describe_room=True`
    <room description>
    Observation:
    <game text without the ASCII-art banner, the objective and the status line>
    Inventory: <inventory text>

The objective (the same in every game) is the task's instruction, which the policy's and the experience model's
prompts carry once; a Goal line in every state cost ~130 characters of each clipped state in those prompts (all
of a history state's 120).

The recipe is part of the task, as an ALFWorld goal ("put a clean apple in the fridge") is: every tw-cooking game
says only "check the cookbook", and a simulator cannot know the recipe of a game it never saw, so without it a
synthetic environment answers `examine cookbook` with nothing and the policy never learns what to cook. The
adapter reads it from the compiled game's metadata (game.json) and keeps it in every state; reading the cookbook
in the game still works and shows the same text.
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from components.data.contract import HELDOUT_GAME_SEEDS, Task
from components.envs.base import (
    ENV_FAILURE,
    Environment,
    EnvironmentFailure,
    Observation,
    Policy,
    Split,
    StepResult,
)
from components.files import atomic_write_text

ENVIRONMENT = "textworld-cooking"
OBJECTIVE = ("You are hungry! Let's cook a delicious meal. Check the cookbook in the kitchen for the recipe. "
             "Once done, enjoy your meal!")  # what every tw-cooking game says; the tasks' instruction
DEFAULT_DIFFICULTY: dict[str, Any] = {"recipe": 1, "take": 1, "go": 1, "open": True, "cook": True, "cut": True}
ROOM_COUNTS = (1, 6, 9, 12)  # the only map sizes tw-cooking knows
# Disjoint game-seed ranges, so no held-out game shares a seed with a training game.
SEED_RANGES: dict[str, tuple[int, int]] = {"train": (1, HELDOUT_GAME_SEEDS.start),
                                           "heldout": (HELDOUT_GAME_SEEDS.start, HELDOUT_GAME_SEEDS.stop)}
DEFAULT_CACHE_DIR = Path(os.environ.get("DREAMGYM_TEXTWORLD_CACHE",
                                        Path.home() / ".cache" / "dreamgym" / "textworld-cooking"))
GENERATION_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 120.0  # a child imports TextWorld before it answers; slow on a busy machine
# What a hung, dead or failing engine raises in the parent (_Worker): an environment failure, not the policy's (but
# at a step, a RuntimeError is the engine's answer to that action: a failure that counts)
ENGINE_ERRORS = (TimeoutError, EOFError, OSError, RuntimeError)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


# ---------------------------------------------------------------------------------------------- parameters

def game_parameters(seed: int, **difficulty: Any) -> dict[str, Any]:
    """Complete, validated game parameters: DEFAULT_DIFFICULTY overridden by `difficulty`, plus the seed."""
    unknown = set(difficulty) - set(DEFAULT_DIFFICULTY)
    if unknown:
        raise ValueError(f"unknown tw-cooking difficulty knobs {sorted(unknown)}; known: {sorted(DEFAULT_DIFFICULTY)}")
    params = {**DEFAULT_DIFFICULTY, **difficulty, "seed": seed}
    for key in ("recipe", "take", "go", "seed"):
        if isinstance(params[key], bool) or not isinstance(params[key], int):
            raise ValueError(f"tw-cooking parameter {key!r} must be an integer, got {params[key]!r}")
    for key in ("open", "cook", "cut"):
        if not isinstance(params[key], bool):
            raise ValueError(f"tw-cooking parameter {key!r} must be true or false, got {params[key]!r}")
    if not 1 <= params["recipe"] <= 5:
        raise ValueError(f"recipe must be 1..5, got {params['recipe']}")
    if not 0 <= params["take"] <= params["recipe"]:
        raise ValueError(f"take must be 0..recipe ({params['recipe']}), got {params['take']}")
    if params["go"] not in ROOM_COUNTS:
        raise ValueError(f"go (rooms) must be one of {ROOM_COUNTS}, got {params['go']}")
    if not 0 <= params["seed"] < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {params['seed']}")
    return params


def game_id(params: Mapping[str, Any]) -> str:
    """`tw-cooking-r1-t1-g1-open-cook-cut-s17`: the task id and the cache key."""
    flags = "".join(f"-{flag}" for flag in ("open", "cook", "cut") if params[flag])
    return f"tw-cooking-r{params['recipe']}-t{params['take']}-g{params['go']}{flags}-s{params['seed']}"


def make_task(seed: int, **difficulty: Any) -> Task:
    params = game_parameters(seed, **difficulty)
    return Task(game_id(params), ENVIRONMENT, OBJECTIVE, params)


# ---------------------------------------------------------------------------------------------- game cache

@functools.cache
def _textworld_version() -> str:
    return importlib.metadata.version("textworld")


def _cache_root(cache_dir: str | Path | None) -> Path:
    # A TextWorld upgrade may generate different games from the same parameters: keep caches apart.
    return Path(cache_dir or DEFAULT_CACHE_DIR) / f"textworld-{_textworld_version()}"


def cached_game(params: Mapping[str, Any], cache_dir: str | Path | None = None) -> Path | None:
    """The compiled game file for these parameters if it is in the cache, else None."""
    path = _cache_root(cache_dir) / game_id(params) / "game.z8"
    return path if path.is_file() else None


def _known_failure(params: Mapping[str, Any], cache_dir: str | Path | None) -> bool:
    return (_cache_root(cache_dir) / f"{game_id(params)}.failed").is_file()


def _generate(worker: _Worker, params: Mapping[str, Any], cache_dir: str | Path | None) -> Path | None:
    """Cached or freshly generated game file; None when these parameters do not generate a game."""
    if (path := cached_game(params, cache_dir)) is not None:
        return path
    if _known_failure(params, cache_dir):
        return None
    ok = worker.call("generate", (dict(params), str(_cache_root(cache_dir))), GENERATION_TIMEOUT_S)
    return cached_game(params, cache_dir) if ok else None


# ---------------------------------------------------------------------------------------------- tasks

def make_tasks(split: Split, count: int, *, seed: int, cache_dir: str | Path | None = None, workers: int = 1,
               **difficulty: Any) -> list[Task]:
    """`count` tasks of one difficulty whose games generate (and are now cached), deterministic in `seed`.

    Game seeds are drawn from the split's own range (SEED_RANGES), so train and held-out never share one;
    seeds that fail to generate are skipped (and remembered in the cache). The list for a larger `count` starts
    with the list for a smaller one. `workers` child processes generate in parallel.
    """
    if split not in SEED_RANGES:
        raise ValueError(f"split must be one of {sorted(SEED_RANGES)}, got {split!r}")
    game_parameters(0, **difficulty)  # fail on a typo before any work
    candidates = _candidate_seeds(split, seed)
    pool: list[_Worker] = []
    tasks: list[Task] = []
    try:
        while len(tasks) < count:
            batch = [game_parameters(next(candidates), **difficulty) for _ in range(max(1, workers))]
            for params, path in zip(batch, _generate_batch(batch, cache_dir, pool, workers)):
                if path is not None:
                    tasks.append(Task(game_id(params), ENVIRONMENT, OBJECTIVE, params))
    finally:
        for worker in pool:
            worker.close()
    return tasks[:count]


def _candidate_seeds(split: Split, seed: int) -> Iterator[int]:
    low, high = SEED_RANGES[split]
    rng = random.Random(f"{split}:{seed}")  # a string seed is hashed stably (not by PYTHONHASHSEED)
    seen: set[int] = set()
    for _ in range(high - low):
        candidate = rng.randrange(low, high)
        if candidate not in seen:
            seen.add(candidate)
            yield candidate
    raise RuntimeError(f"no more {split} seeds to try")


def _generate_batch(batch: list[dict[str, Any]], cache_dir: str | Path | None, pool: list[_Worker],
                    workers: int) -> list[Path | None]:
    """Generate the uncached games of `batch` in parallel, one per worker; results in batch order."""
    results: list[Path | None] = []
    pending: list[tuple[int, _Worker]] = []
    for index, params in enumerate(batch):
        results.append(cached_game(params, cache_dir))
        if results[-1] is not None or _known_failure(params, cache_dir):
            continue
        if len(pool) < workers:
            pool.append(_Worker())
        worker = pool[len(pending)]
        worker.send("generate", (params, str(_cache_root(cache_dir))))
        pending.append((index, worker))
    for index, worker in pending:
        if worker.receive(GENERATION_TIMEOUT_S):
            results[index] = cached_game(batch[index], cache_dir)
    return results


# ---------------------------------------------------------------------------------------------- environment

class TextWorldCooking(Environment):
    """One TextWorld engine (a child process) that plays the game named by each task's parameters.

    Reward is the outcome: 1.0 on the step that wins, else 0.0; losing (eating a needed ingredient) ends the
    episode with 0. `info` carries the game's intermediate `score`/`max_score`, `won`, `lost`, `valid_action`
    (the action was admissible; an inadmissible one is still played: the game answers it in text),
    `truncated`, and `success` on the final step. An engine that hangs longer than `step_timeout` or dies ends
    the episode with an environment failure (`truncated` true, `info[ENV_FAILURE]` says why); the next reset starts
    a new engine. At reset, the same raises `EnvironmentFailure`; parameters that do not generate a game, ValueError.
    An engine that answers an action with an error ends the episode as a failure that counts (`info["error"]`).
    Control characters in actions reach the engine as spaces (NUL and 0x10-0x14 kill it).
    A missing game is generated into `cache_dir` at reset (seconds); make_tasks generates them ahead.
    """

    name = ENVIRONMENT

    def __init__(self, cache_dir: str | Path | None = None, *, step_timeout: float = 10.0,
                 describe_room: bool = False) -> None:
        self.cache_dir = cache_dir
        self.step_timeout = step_timeout
        self.describe_room = describe_room  # adds the room description to every state (~100 tokens)
        self._worker: _Worker | None = None
        self._loaded: Path | None = None
        self._walkthrough: tuple[str, ...] = ()
        self._recipe = ""  # the loaded game's
        self._admissible: tuple[str, ...] = ()
        self._last: dict[str, Any] = {}
        self._done = True
        self._started = False

    @property
    def walkthrough(self) -> tuple[str, ...]:
        """The expert action sequence of the current game (it wins from the initial state)."""
        if not self._started:
            raise RuntimeError("reset() the environment first")
        return self._walkthrough

    def reset(self, task: Task) -> Observation:
        if task.environment != self.name:
            raise ValueError(f"task {task.task_id} is for {task.environment!r}, not {self.name!r}")
        if "seed" not in task.parameters:
            raise ValueError(f"task {task.task_id}: parameters need a 'seed' (see make_tasks)")
        params = game_parameters(**task.parameters)
        try:
            worker = self._ensure_worker()
            path = _generate(worker, params, self.cache_dir)
        except ENGINE_ERRORS as error:
            raise self._failed_reset(error) from error
        if path is None:
            raise ValueError(f"task {task.task_id}: these parameters do not generate a game (use make_tasks)")
        try:
            if path != self._loaded:
                worker.call("load", (str(path), self.describe_room), STARTUP_TIMEOUT_S)
                self._loaded, self._recipe = path, game_recipe(path)
            raw = worker.call("reset", None, max(self.step_timeout, 30.0))
        except ENGINE_ERRORS as error:
            raise self._failed_reset(error) from error
        self._walkthrough = tuple(raw["walkthrough"])
        self._done, self._started = False, True
        return self._observe(raw, _clean(raw["feedback"]))

    def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError("the episode is over (or never began): call reset() first")
        action = _CONTROL.sub(" ", action)  # the engine dies on some control characters (NUL, 0x10-0x14)
        valid = " ".join(action.lower().split()) in self._admissible
        try:
            assert self._worker is not None  # an episode in progress has its engine
            raw = self._worker.call("step", action, self.step_timeout)
        except RuntimeError as error:  # the engine answered with an error: this action's failure, not the engine's
            return self._fail(str(error), valid, environment=False)
        except ENGINE_ERRORS as error:  # it hung or died
            return self._fail(f"the game engine failed: {_describe(error)}", valid)
        won, lost = bool(raw["won"]), bool(raw["lost"])
        self._done = won or lost
        info: dict[str, Any] = {"score": raw["score"], "max_score": raw["max_score"], "won": won, "lost": lost,
                                "valid_action": valid, "truncated": False}
        if self._done:
            info["success"] = won
        return StepResult(self._observe(raw, _clean(raw["feedback"])), 1.0 if won else 0.0, self._done, info)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self._worker, self._loaded, self._done = None, None, True

    def _ensure_worker(self) -> _Worker:
        if self._worker is None or not self._worker.alive:  # first use, or the engine died or hung
            self._worker, self._loaded = _Worker(), None
        return self._worker

    def _observe(self, raw: dict[str, Any], text: str) -> Observation:
        self._admissible = tuple(sorted(raw["admissible_commands"] or ()))
        self._last = raw
        sections = [f"Recipe:\n{self._recipe}"]
        if self.describe_room and raw.get("description"):
            sections.append(f"Room:\n{_clean(raw['description'])}")
        sections.append(f"Observation:\n{text}")
        sections.append(f"Inventory: {_clean(raw['inventory'] or '')}")
        return Observation("\n".join(sections), self._admissible)

    def _failed_reset(self, error: BaseException) -> EnvironmentFailure:
        self.close()  # the next reset starts a new engine
        return EnvironmentFailure(f"the game engine failed at reset: {_describe(error)}")

    def _fail(self, why: str, valid: bool, environment: bool = True) -> StepResult:
        """End the episode as a failure and close the engine (the next reset starts a new one): an environment
        failure (`info[ENV_FAILURE]`) when it hung or died, else (it refused the action) a failure that counts."""
        self.close()
        info = {"score": self._last.get("score", 0), "max_score": self._last.get("max_score", 0), "won": False,
                "lost": False, "valid_action": valid, "truncated": True, ENV_FAILURE if environment else "error": why,
                "success": False}
        text = f"The game engine failed ({why}); the episode ends."
        return StepResult(self._observe({**self._last, "admissible_commands": []}, text), 0.0, True, info)


# ---------------------------------------------------------------------------------------------- policies

def game_reply(state: str) -> str:
    """The first line of a state's observation: the game's answer to the command before it (its wording, a refusal's
    included, is the game's own); empty for an empty state."""
    lines = state.split("Observation:")[-1].strip().splitlines()
    return lines[0].strip() if lines else ""


def expert_policy(env: TextWorldCooking) -> Policy:
    """Replays the current game's walkthrough (step i plays walkthrough[i]); "look" past its end."""
    def act(task: Task, observation: Observation, history: Sequence[tuple[str, str]]) -> str:
        walkthrough = env.walkthrough
        return walkthrough[len(history)] if len(history) < len(walkthrough) else "look"
    return act


def noisy_expert_policy(env: TextWorldCooking, epsilon: float, rng: random.Random,
                        mistake_share: float = 0.5) -> Policy:
    """With probability `epsilon` a detour, else the walkthrough's next step. A detour is a random admissible
    command or, with probability `mistake_share`, a mistake the game refuses: the walkthrough's next step
    `misdirected`, or its last step again once the game no longer allows it (`take red potato from counter` with
    the potato held). These are the mistakes a policy trained on walkthroughs makes, in the states it makes them.

    The walkthrough position advances only when its next step is played (by choice or by chance), so after a
    random detour the expert resumes where it left off. That often still wins (most detours, like `examine oven`,
    change nothing) but not always: a detour can eat an ingredient, drop the knife elsewhere or move rooms, and
    the replay does not re-plan. Past the end of the walkthrough the policy acts at random. One policy object
    plays one episode at a time (its position resets when the history is empty).
    """
    position = 0

    def act(task: Task, observation: Observation, history: Sequence[tuple[str, str]]) -> str:
        nonlocal position
        if not history:
            position = 0
        walkthrough = env.walkthrough
        following = position < len(walkthrough)
        commands = observation.valid_actions or ("look",)
        if following and rng.random() >= epsilon:
            action = walkthrough[position]
        else:
            action = rng.choice(commands)
            if following and rng.random() < mistake_share:
                repeated = walkthrough[position - 1] if position and walkthrough[position - 1] not in commands else None
                mistakes = [m for m in (misdirected(walkthrough[position], commands, rng), repeated) if m]
                action = rng.choice(mistakes) if mistakes else action
        if following and action == walkthrough[position]:
            position += 1
        return action
    return act


def skipping_expert_policy(env: TextWorldCooking, rng: random.Random) -> Policy:
    """The walkthrough with one step left out (chosen at random, never the last), then random admissible commands.

    Evidence against rewarding by length: it plays the commands of a winning episode at the same turns, but
    without the ingredient taken, cooked or cut, or the meal prepared, its final `eat meal` earns nothing; left
    without `inventory`, `examine cookbook` or `drop knife` it still wins, a turn earlier. An experience model seeded
    only with expert and noisy-expert episodes rewarded the 7th to 11th action whatever it was
    (reports/research/policy/session10/). One policy object plays one episode at a time.
    """
    plan: list[str] = []

    def act(task: Task, observation: Observation, history: Sequence[tuple[str, str]]) -> str:
        nonlocal plan
        if not history:
            plan = list(env.walkthrough)
            if len(plan) > 1:
                del plan[rng.randrange(len(plan) - 1)]
        if len(history) < len(plan):
            return plan[len(history)]
        return rng.choice(observation.valid_actions or ("look",))
    return act


# Commands that change the game for good: eating or drinking an ingredient (the game is lost when the recipe needs
# it), cooking or cutting it (lost when done wrong), preparing and eating the meal (the rewards).
CONSEQUENTIAL_VERBS = frozenset({"eat", "drink", "cook", "slice", "dice", "chop", "prepare"})


def random_policy(rng: random.Random, malformed_share: float = 0.25, consequential_weight: float = 4.0,
                  misdirected_share: float = 0.5) -> Policy:
    """A random admissible command, or with probability `malformed_share` one the game refuses: `misdirected`
    (well-formed, with probability `misdirected_share`) or `malformed`.

    Commands starting with a `CONSEQUENTIAL_VERBS` verb are `consequential_weight` times as likely as the others.
    Drawn uniformly they were rare (8 eats and 72 cooks in 1,633 seed steps, one or two among ~30 admissible
    commands), so the experience model saw too few of their outcomes and rewarded `cook tomato` or `eat tomato`
    in synthetic rollouts where the real game ends the episode lost.

    Malformed commands (a word of an admissible command with its letters shuffled, or two of its words swapped)
    put the game's answer to nonsense in the seed data: an RL policy sampling at temperature 1 writes such
    actions, and an experience model that never saw one may reward them (it did: `chowinethome` "won" a game).
    Misdirected commands put the game's answer to a sensible command the state does not allow in the seed data.
    """
    def act(task: Task, observation: Observation, history: Sequence[tuple[str, str]]) -> str:
        commands = observation.valid_actions or ("look",)
        weights = [consequential_weight if command.split()[0] in CONSEQUENTIAL_VERBS else 1.0 for command in commands]
        action = rng.choices(commands, weights)[0]
        if rng.random() >= malformed_share:
            return action
        return (rng.random() < misdirected_share and misdirected(action, commands, rng)) or malformed(action, rng)
    return act


# The words that join a command's object to its place or tool (`take X from Y`, `slice X with Y`).
_JOINS = re.compile(r" (from|into|on|with) ")
_PLACE_VERBS = frozenset({"open", "close"})  # their object is a place
_SIGHT_VERBS = frozenset({"examine"})  # anything in sight, portable or not: its things are no objects
_NO_THING_VERBS = frozenset({"go", "prepare", "look", "inventory"})  # a direction or nothing: no thing to swap


def _things(command: str) -> tuple[str, list[str], list[tuple[int, str]]]:
    """A command's verb, its rest split at the joining words ([thing, join, thing, ...]), and the (index in that
    list, role) of each thing it names: `object`, `place` (taken from, put on or into, opened) or `tool`."""
    verb, _, rest = command.partition(" ")
    if verb in _NO_THING_VERBS or not rest:
        return verb, [], []
    parts = _JOINS.split(rest)
    roles = [(0, "place" if verb in _PLACE_VERBS else "sight" if verb in _SIGHT_VERBS else "object")]
    roles += [(index, "tool" if parts[index - 1] == "with" else "place") for index in range(2, len(parts), 2)]
    return verb, parts, roles


def misdirected(action: str, commands: Sequence[str], rng: random.Random, tries: int = 10) -> str | None:
    """`action` with one thing it names replaced by another thing of the same role (object, place or tool) that the
    admissible `commands` name, such that the result is not admissible, so the game refuses it (`take red potato
    from counter` once the potato is held, `drop knife` with no knife); None when no such command comes of `tries`
    draws.

    Why: the experience model let such commands succeed (`You take the red potato from the counter.`), and each of
    the 34 synthetic wins of the CPU study's seed-0 DreamGym runs that the real game does not give went through one
    (reports/results_study/cpu/session27.md); the seed's refused commands were misspelt, hardly ever sensible.
    """
    verb, parts, roles = _things(action)
    things: dict[str, set[str]] = {}
    for command in commands:
        _, other_parts, other_roles = _things(command)
        for index, role in other_roles:
            things.setdefault(role, set()).add(other_parts[index])
    allowed = set(commands)
    for _ in range(tries if roles else 0):
        index, role = rng.choice(roles)
        others = sorted(things[role] - {parts[index]})
        if not others:
            continue
        changed = parts[:index] + [rng.choice(others)] + parts[index + 1:]
        candidate = f"{verb} " + "".join(f" {part} " if i % 2 else part for i, part in enumerate(changed))
        if candidate not in allowed:
            return candidate
    return None


def malformed(action: str, rng: random.Random) -> str:
    """`action` with two words swapped or, for a one-word command or by chance, one word's letters shuffled."""
    words = action.split()
    if len(words) > 1 and rng.random() < 0.5:
        i, j = rng.sample(range(len(words)), 2)
        words[i], words[j] = words[j], words[i]
    else:
        i = rng.randrange(len(words))
        letters = list(words[i])
        rng.shuffle(letters)
        words[i] = "".join(letters)
    return " ".join(words)


# ---------------------------------------------------------------------------------------------- text cleaning

_BANNER_LINE = re.compile(r"^[\s_$|\\/<>]*$")  # the ASCII-art title is drawn with these characters only
_PROMPT_LINE = re.compile(r"^\s*>")  # the input prompt, followed by the status bar (`-= Kitchen =-0/1`)
_RECIPE = re.compile(r"Ingredients:.*", re.DOTALL)
_ENDGAME = "Would you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command?"


def _clean(text: str) -> str:
    """Game text without the banner, the objective (the task's instruction), prompt and status bar."""
    text = text.replace(OBJECTIVE, "").replace(_ENDGAME, "")
    lines = [line.strip() for line in text.splitlines()]
    kept = [line for line in lines if not _PROMPT_LINE.match(line) and (not line or not _BANNER_LINE.match(line))]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()


def game_recipe(game_file: Path) -> str:
    """The recipe of a compiled game (its ingredients and directions), as reading its cookbook shows it."""
    metadata = json.loads(game_file.with_name("game.json").read_text(encoding="utf-8")).get("metadata", {})
    match = _RECIPE.search(_clean(metadata.get("recipe", "")))
    if not match:
        raise ValueError(f"{game_file}: no recipe in the game's metadata; delete this cache entry to regenerate it")
    return match.group(0).strip()


# ---------------------------------------------------------------------------------------------- child process

class _Worker:
    """A child Python process that owns TextWorld: generates games and plays one at a time.

    Requests and replies are pickled over a socket pair (`multiprocessing.connection`), which frames messages
    and lets the parent wait with a timeout. The child is started with `python -m` rather than
    `multiprocessing.Process`, so it neither forks the parent's threads nor re-runs the user's main script.
    """

    def __init__(self) -> None:
        parent, child = Pipe()
        root = str(Path(__file__).resolve().parents[2])  # the folder that holds `components`
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               "PYTHONHASHSEED": "0"}  # TextWorld iterates sets while generating; fix their order
        self._process = subprocess.Popen([sys.executable, "-m", __name__, str(child.fileno())],
                                         pass_fds=(child.fileno(),), env=env)
        child.close()
        self._conn = parent
        self._finalizer = weakref.finalize(self, _stop, self._process, parent)
        self.receive(STARTUP_TIMEOUT_S)  # the child says "ready" once TextWorld is imported

    def send(self, command: str, argument: Any) -> None:
        self._conn.send((command, argument))

    def receive(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            self._process.kill()  # hung: no point asking it to close
            self.close()
            raise TimeoutError(f"no answer from the TextWorld engine within {timeout:g} s")
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"TextWorld engine error: {value}")
        return value

    def call(self, command: str, argument: Any, timeout: float) -> Any:
        self.send(command, argument)
        return self.receive(timeout)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and self._process.poll() is None

    def close(self) -> None:
        self._finalizer()  # runs _stop once; later calls do nothing


def _stop(process: subprocess.Popen[bytes], conn: Connection) -> None:
    try:
        conn.send(("close", None))
        process.wait(timeout=2)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass  # already dead, or hung: killed below
    if process.poll() is None:
        process.kill()
        process.wait()
    conn.close()


def _serve(fd: int) -> None:
    """The child's loop: answer requests until "close" or until the parent goes away."""
    import textworld  # noqa: PLC0415 - only the child pays for TextWorld
    conn = Connection(fd)
    conn.send(("ok", "ready"))
    engine: Any = None
    describe_room = False
    while True:
        try:
            command, argument = conn.recv()
        except (EOFError, OSError):
            break
        if command == "close":
            break
        try:
            if command == "generate":
                reply: Any = _generate_game(*argument)
            elif command == "load":
                path, describe_room = argument
                if engine is not None:
                    engine.close()
                engine = textworld.start(path, request_infos=textworld.EnvInfos(
                    admissible_commands=True, inventory=True, description=describe_room, won=True, lost=True,
                    score=True, max_score=True, extras=["walkthrough"]))
                reply = None
            elif command == "reset":
                reply = _state(engine.reset(), with_walkthrough=True)
            elif command == "step":
                reply = _state(engine.step(argument)[0])
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", reply))
        except Exception as error:  # noqa: BLE001 - reported to the parent, which decides
            conn.send(("error", f"{type(error).__name__}: {error}"))
    if engine is not None:
        engine.close()


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _state(game_state: Any, with_walkthrough: bool = False) -> dict[str, Any]:
    keys = ("feedback", "inventory", "description", "admissible_commands", "won", "lost", "score", "max_score")
    state = {key: game_state.get(key) for key in keys}
    if with_walkthrough:
        state["walkthrough"] = list(game_state.get("extra.walkthrough") or [])
    return state


def _generate_game(params: dict[str, Any], cache_root: str) -> bool:
    """Generate and compile one game into the cache (temp folder, then rename); False if the seed fails."""
    import textworld  # noqa: PLC0415
    from textworld.challenges import CHALLENGES  # noqa: PLC0415

    root = Path(cache_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / game_id(params)
    if final.is_dir():
        return True  # another process finished it first
    options = textworld.GameOptions()
    options.seeds = params["seed"]
    settings = {key: params[key] for key in ("recipe", "take", "go", "open", "cook", "cut")}
    settings.update(drop=False, recipe_seed=0, split=None)
    try:
        game = CHALLENGES["tw-cooking"][1](settings=settings, options=options)
    except ValueError:  # e.g. "high <= 0": no valid layout for this seed; remember, so nobody retries it
        atomic_write_text(root / f"{game_id(params)}.failed", f"{settings} seed {params['seed']}\n")
        return False
    temporary = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        options.path = str(temporary / "game.z8")
        textworld.generator.compile_game(game, options)
        (temporary / "game.ni").unlink(missing_ok=True)  # the Inform 7 source: not needed to play
        temporary.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        os.rename(temporary, final)  # atomic; fails if `final` appeared meanwhile, which is just as good
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return True


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
