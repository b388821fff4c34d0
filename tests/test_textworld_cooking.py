"""TextWorld cooking adapter on a handful of real, small games (generating one costs a few seconds)."""
from __future__ import annotations

import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("textworld")

from components.data.contract import Trajectory  # noqa: E402
from components.envs.base import ENV_FAILURE, EnvironmentFailure, Observation, env_failure  # noqa: E402
from components.envs.episode import run_episode  # noqa: E402
from components.envs.textworld_cooking import (  # noqa: E402
    ENVIRONMENT,
    SEED_RANGES,
    TextWorldCooking,
    _cache_root,
    _generate_game,
    cached_game,
    expert_policy,
    make_task,
    make_tasks,
    malformed,
    misdirected,
    noisy_expert_policy,
    random_policy,
    skipping_expert_policy,
)

HELDOUT = 6


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tw-cache")


@pytest.fixture(scope="module")
def heldout(cache: Path) -> list:
    return make_tasks("heldout", HELDOUT, seed=0, cache_dir=cache, workers=2)


@pytest.fixture(scope="module")
def env(cache: Path):
    with TextWorldCooking(cache) as environment:
        yield environment


def check_contract(trajectory: Trajectory) -> None:
    steps = trajectory.steps
    assert steps
    for previous, step in zip(steps, steps[1:]):
        assert step.state == previous.next_state
    assert all(not step.done for step in steps[:-1])
    assert trajectory.return_ == sum(step.reward for step in steps)
    Trajectory.from_dict(trajectory.to_dict())  # round-trips through the record form


def test_make_tasks_deterministic_cached_and_disjoint(cache: Path, heldout: list) -> None:
    assert len(heldout) == HELDOUT
    assert len({task.task_id for task in heldout}) == HELDOUT
    for task in heldout:
        assert task.environment == ENVIRONMENT
        assert task.task_id == f"tw-cooking-r1-t1-g1-open-cook-cut-s{task.parameters['seed']}"
        assert cached_game(task.parameters, cache) is not None
    started = time.perf_counter()
    assert make_tasks("heldout", HELDOUT, seed=0, cache_dir=cache) == heldout  # all cache hits: no engine
    assert make_tasks("heldout", 3, seed=0, cache_dir=cache) == heldout[:3]
    assert time.perf_counter() - started < 2.0
    assert not [p for p in cache.rglob(".*")]  # no temporary leftovers

    train = make_tasks("train", 1, seed=0, cache_dir=cache)
    (train_low, train_high), (heldout_low, heldout_high) = SEED_RANGES["train"], SEED_RANGES["heldout"]
    assert train_high <= heldout_low or heldout_high <= train_low  # disjoint ranges, so disjoint seeds
    assert all(train_low <= task.parameters["seed"] < train_high for task in train)
    assert all(heldout_low <= task.parameters["seed"] < heldout_high for task in heldout)


def test_seeds_that_fail_to_generate_are_remembered_and_skipped(tmp_path: Path, cache: Path, heldout: list,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import textworld.challenges

    def fail(settings: dict, options: object) -> None:
        raise ValueError("high <= 0")  # what TextWorld raises for a seed with no valid layout

    monkeypatch.setitem(textworld.challenges.CHALLENGES, "tw-cooking", ("", fail, None))
    root = tmp_path / "cache"
    assert _generate_game(heldout[0].parameters, str(_cache_root(root))) is False
    assert not [p for p in root.rglob("*") if p.is_dir() and p.name.startswith("tw-")]  # no broken entry
    # make_tasks skips the remembered failure and takes the next seeds (copied here: nothing to generate).
    for task in heldout[1:]:
        shutil.copytree(cached_game(task.parameters, cache).parent, _cache_root(root) / task.task_id)
    assert make_tasks("heldout", HELDOUT - 1, seed=0, cache_dir=root) == heldout[1:]
    with pytest.raises(ValueError, match="do not generate"):
        TextWorldCooking(root).reset(heldout[0])


def test_unknown_or_bad_difficulty_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown"):
        make_tasks("train", 1, seed=0, recipes=2)
    with pytest.raises(ValueError, match="go"):
        make_task(1, go=2)


def test_same_parameters_same_game_in_another_cache(tmp_path: Path, env: TextWorldCooking, heldout: list) -> None:
    task = heldout[0]
    first = env.reset(task)
    walkthrough = env.walkthrough
    mtime = cached_game(task.parameters, env.cache_dir).stat().st_mtime_ns
    with TextWorldCooking(tmp_path) as fresh:  # regenerates the game from its parameters alone
        assert fresh.reset(task) == first
        assert fresh.walkthrough == walkthrough
    assert cached_game(task.parameters, env.cache_dir).stat().st_mtime_ns == mtime  # cache hit, not rewritten


def test_expert_wins_and_trajectories_pass_the_contract(env: TextWorldCooking, heldout: list) -> None:
    wins = 0
    for task in heldout:
        trajectory = run_episode(env, task, expert_policy(env), max_steps=60, trajectory_id=task.task_id,
                                 source="expert")
        check_contract(trajectory)
        wins += trajectory.success
        last = trajectory.steps[-1]
        assert last.done and last.reward == (1.0 if trajectory.success else 0.0)
        assert all(step.info["valid_action"] for step in trajectory.steps)
        assert last.info["score"] == last.info["max_score"] > 0
        # The recipe is in every state from the first, and it is what reading the cookbook shows; no banner.
        recipe = trajectory.steps[0].state.split("Recipe:\n")[1].split("\nObservation:")[0]
        assert recipe.startswith("Ingredients:") and "Directions:" in recipe
        assert all(f"Recipe:\n{recipe}\n" in step.state for step in trajectory.steps)
        read = next(step for step in trajectory.steps if step.action == "examine cookbook")
        assert recipe in read.next_state.split("Observation:")[1]
        assert all("$$" not in step.state for step in trajectory.steps)
    assert wins / len(heldout) >= 0.95


def test_random_policy_rarely_wins(env: TextWorldCooking, heldout: list) -> None:
    rng = random.Random(0)
    trajectories = [run_episode(env, task, random_policy(rng), max_steps=30, trajectory_id=f"r{i}",
                                source="random") for i, task in enumerate(heldout)]
    for trajectory in trajectories:
        check_contract(trajectory)
    assert sum(t.success for t in trajectories) <= 1
    # About a quarter of its commands are not admissible (malformed or misdirected): the real game's answer to them,
    # hardly ever an outcome (the parser can read a swapped pair: `cook potato red with oven` roasts the potato)
    steps = [step for trajectory in trajectories for step in trajectory.steps]
    refused = [step for step in steps if not step.info["valid_action"]]
    assert 0.1 < len(refused) / len(steps) < 0.4
    assert sum(step.reward != 0 or step.done for step in refused) <= 1


def test_random_policy_weights_consequential_commands_up() -> None:
    commands = ("eat red apple", "examine counter", "look", "inventory", "take knife", "open fridge",
                "go north", "examine oven", "drop knife", "close fridge", "take cookbook")
    observation = Observation("Recipe:\n...", commands)
    draws = 4000

    def eat_share(weight: float) -> float:
        policy = random_policy(random.Random(0), malformed_share=0.0, consequential_weight=weight)
        return sum(policy(None, observation, ()) == "eat red apple" for _ in range(draws)) / draws

    # 1 of 11 drawn uniformly; at weight 4, 4 of 14.
    assert eat_share(1.0) == pytest.approx(1 / 11, abs=0.02)
    assert eat_share(4.0) == pytest.approx(4 / 14, abs=0.03)


def test_malformed_commands_keep_the_words_and_letters() -> None:
    rng = random.Random(0)
    for action in ("take knife from counter", "inventory", "cook red apple with oven"):
        for _ in range(20):
            changed = malformed(action, rng)
            assert sorted(changed.replace(" ", "")) == sorted(action.replace(" ", ""))
            assert len(changed.split()) == len(action.split())


def test_misdirected_commands_swap_a_thing_of_the_same_role_and_are_not_admissible() -> None:
    commands = ("take red potato from counter", "take knife from counter", "open fridge", "drop yellow apple",
                "slice yellow apple with knife", "cook yellow apple with stove", "go north", "prepare meal")
    rng = random.Random(0)
    made = {misdirected(action, commands, rng) for action in commands for _ in range(10)}
    assert None in made  # `go north` and `prepare meal` name no thing to swap
    made.discard(None)
    assert made and not made & set(commands)
    assert "take red potato from fridge" in made and "drop red potato" in made  # a place, an object
    assert "slice yellow apple with stove" in made  # a tool
    assert not {command for command in made if "north" in command or "meal" in command}
    assert all(command.split()[0] in {c.split()[0] for c in commands} for command in made)


def test_the_game_refuses_misdirected_commands_and_the_walkthrough_still_wins(env: TextWorldCooking,
                                                                             heldout: list) -> None:
    """Each walkthrough step misdirected before it is played (as the noisy expert's mistakes are): the game refuses
    each (no reward, not over), and the walkthrough then wins: they are mistakes the seed can show anywhere."""
    rng, refused = random.Random(0), 0
    for task in heldout[:3]:
        observation = env.reset(task)
        for step in list(env.walkthrough):
            mistake = misdirected(step, observation.valid_actions, rng)
            if mistake is not None:
                result = env.step(mistake)
                assert not result.info["valid_action"] and result.reward == 0 and not result.done, mistake
                refused += 1
            result = env.step(step)
            observation = result.observation
        assert result.done and result.info["won"]
    assert refused >= 15


def test_noisy_expert_stays_on_the_walkthrough_without_noise(env: TextWorldCooking, heldout: list) -> None:
    task = heldout[1]
    trajectory = run_episode(env, task, noisy_expert_policy(env, 0.0, random.Random(0)), max_steps=60,
                             trajectory_id="n", source="expert")
    assert trajectory.success and [s.action for s in trajectory.steps] == list(env.walkthrough)
    noisy = run_episode(env, task, noisy_expert_policy(env, 0.5, random.Random(1)), max_steps=60,
                        trajectory_id="n2", source="expert")
    check_contract(noisy)


def test_skipping_expert_leaves_out_one_step_and_loses_without_a_needed_one(env: TextWorldCooking,
                                                                            heldout: list) -> None:
    task = heldout[1]
    env.reset(task)
    walkthrough = list(env.walkthrough)
    rng = random.Random(0)
    policy = skipping_expert_policy(env, rng)
    outcomes = {}
    for episode in range(12):  # one policy object, many episodes: each picks its own step to leave out
        trajectory = run_episode(env, task, policy, max_steps=30, trajectory_id=f"s{episode}", source="policy")
        check_contract(trajectory)
        actions = [step.action for step in trajectory.steps]
        played = actions[:len(walkthrough) - 1]
        left_out = [a for a in walkthrough if a not in played]
        assert len(left_out) == 1 and left_out[0] != walkthrough[-1]  # never the final `eat meal`
        assert played == [a for a in walkthrough if a != left_out[0]]
        outcomes[left_out[0]] = trajectory.success
    # leaving out the cooking itself loses; leaving out looking at the inventory still wins, a turn earlier
    cooking = [a for a in walkthrough if a.split()[0] in ("cook", "prepare")]
    assert any(action in outcomes for action in cooking), outcomes
    assert not any(outcomes[action] for action in cooking if action in outcomes)
    if "inventory" in outcomes:
        assert outcomes["inventory"]


def test_invalid_action_is_a_step(env: TextWorldCooking, heldout: list) -> None:
    observation = env.reset(heldout[2])
    result = env.step("fly to the moon")
    assert not result.done and result.reward == 0.0
    assert result.info["valid_action"] is False
    assert "Observation:" in result.observation.state
    assert result.observation.valid_actions == observation.valid_actions
    assert list(result.observation.valid_actions) == sorted(result.observation.valid_actions)
    # control characters the engine would die on (a policy can write them) reach it as spaces
    result = env.step("inventory\x00\x10")
    assert not result.done and result.info["valid_action"] and ENV_FAILURE not in result.info


def test_hung_engine_is_a_failed_final_step(cache: Path, heldout: list) -> None:
    with TextWorldCooking(cache, step_timeout=0.5) as env:
        env.reset(heldout[0])
        os.kill(env._worker._process.pid, signal.SIGSTOP)  # the engine hangs
        started = time.perf_counter()
        result = env.step("inventory")
        assert time.perf_counter() - started < 5.0
        assert result.done and result.reward == 0.0
        assert result.info["success"] is False and "no answer" in result.info[ENV_FAILURE]
        assert result.info["truncated"] and "The game engine failed" in result.observation.state
        with pytest.raises(RuntimeError):
            env.step("look")
        env.step_timeout = 10.0
        env.reset(heldout[0])  # a fresh engine
        assert not env.step("inventory").done
        os.kill(env._worker._process.pid, signal.SIGKILL)  # the engine crashes
        result = env.step("look")
        assert result.done and result.info["success"] is False and result.info[ENV_FAILURE]


def test_an_engine_that_fails_at_reset_is_an_environment_failure_of_that_episode(cache: Path, heldout: list,
                                                                                 monkeypatch) -> None:
    """An engine that does not start in time (a busy machine) fails the reset: EnvironmentFailure (a task that does
    not generate stays a ValueError, above), which run_episode records as a one-step episode marked env_failure."""
    import components.envs.textworld_cooking as tw

    with TextWorldCooking(cache) as env:
        monkeypatch.setattr(tw, "STARTUP_TIMEOUT_S", 0.01)  # far less than a child takes to import TextWorld
        with pytest.raises(EnvironmentFailure, match="at reset: TimeoutError: no answer"):
            env.reset(heldout[0])
        trajectory = run_episode(env, heldout[0], expert_policy(env), max_steps=5, trajectory_id="t",
                                 source="expert")
        assert [(s.action, s.done) for s in trajectory.steps] == [("", True)] and not trajectory.success
        assert "no answer from the TextWorld engine" in env_failure(trajectory)
        assert Trajectory.from_dict(trajectory.to_dict()) == trajectory
        monkeypatch.undo()
        env.reset(heldout[0])  # a new engine
        assert not env.step("inventory").done


def test_close_twice(cache: Path, heldout: list) -> None:
    env = TextWorldCooking(cache)
    env.reset(heldout[0])
    env.close()
    env.close()
    with pytest.raises(RuntimeError):
        env.step("look")


def test_describe_room_puts_what_is_where_in_every_state(cache: Path, heldout: list) -> None:
    """With environments.textworld.describe_room the state says what the room holds, which changes as things are
    taken: a simulator can then tell `take X from Y` with X elsewhere from one with X there."""
    from components.config import load_params
    from components.envs.registry import real_environment

    params = load_params(Path(__file__).parents[1] / "params.yaml", {
        "environments.textworld.describe_room": True, "environments.textworld.cache_dir": str(cache)})
    task = heldout[0]
    with real_environment(ENVIRONMENT).open(params.environments) as env:
        trajectory = run_episode(env, task, expert_policy(env), max_steps=60, trajectory_id=task.task_id,
                                 source="expert")
    check_contract(trajectory)
    assert trajectory.success
    assert all("\nRoom:\n-= " in step.state and step.state.index("Room:") < step.state.index("Observation:")
               for step in trajectory.steps)
    take = next(step for step in trajectory.steps if step.action.startswith("take ") and " from " in step.action)
    room_before, room_after = (state.split("Room:\n")[1].split("\nObservation:")[0]
                               for state in (take.state, take.next_state))
    thing = take.action.split(" from ")[0].removeprefix("take ")
    assert thing in room_before and thing not in room_after
