"""components/simulator/synthetic.py: the experience-model environment, batched stepping and write-back.

Most tests use `ScriptedBackend`, a test double for the *model* only: its reply is a fixed function of the prompt's
action (well-formed targets), and it records every prompt it receives. The environment, `predict`, the prompt
builder and the (faiss) replay buffer under test are the real ones. One test runs the real tiny HF model.
"""
from __future__ import annotations

import pytest

from components.data.contract import Step, Task, Trajectory, success_rewards, transitions
from components.envs.base import ENV_FAILURE, env_failure
from components.envs.episode import run_episode
from components.llm.backends import HFGenerationBackend
from components.llm.models import build_tiny_causal_lm
from components.simulator.experience_model import FALLBACK_NOTE, PredictionStats, format_target
from components.simulator.replay_buffer import open_replay_buffer
from components.simulator.synthetic import SyntheticEnvironment, add_to_buffer, record_trajectory
from tests.conftest import settings_from_params
from tests.hashing_encoder import HashingEncoder
from tests.scripted_backend import ScriptedBackend

ENV = "textworld-cooking"
KITCHEN = "You are in a kitchen. You see a closed fridge."
TASK = Task("tw-1", ENV, "Cook a meal, then eat it.", {"initial_state": KITCHEN})


def make_env(backend, buffer=None, prompt=None, inference=None, **keywords) -> SyntheticEnvironment:
    """params' experience model settings with two steps of history and no retries; `prompt` and `inference`
    override fields of those settings, `keywords` are SyntheticEnvironment's own."""
    fmt = settings_from_params("prompt", **{"history_length": 2, **(prompt or {})})
    settings = settings_from_params("inference", **{"retries": 0, **(inference or {})})
    return SyntheticEnvironment(ENV, backend, buffer, fmt, settings, **keywords)


def test_reset_step_done_success_and_info():
    env = make_env(ScriptedBackend())
    assert env.reset(TASK).state == KITCHEN

    first = env.step("open fridge")
    assert first.observation.state == "after open fridge" and first.observation.valid_actions is None
    assert (first.reward, first.done) == (0.0, False)
    assert first.info == {"synthetic": True, "fallback": False, "reasoning": "did open fridge", "truncated": False,
                          "retrieved": []}  # no buffer: no examples

    last = env.step("eat meal")
    assert (last.reward, last.done, last.info["success"]) == (1.0, True, True)
    with pytest.raises(RuntimeError):
        env.step("eat meal")  # the episode is over

    env.reset(TASK)
    assert env.step("give up").info["success"] is False


class HalfReward:
    """Ends every episode at once with reward 0.5: a reply the real game never gives."""

    def generate(self, prompts, max_new_tokens, temperature=0.0):
        return [format_target("The end.", 0.5, True, "it ends") for _ in prompts]


def test_a_win_needs_the_reward_that_wins_in_the_seed():
    won_in_seed = Trajectory("seed-1", TASK, [Step(KITCHEN, "eat meal", "You won.", 1.0, True, {})], True, 1.0,
                             "expert")
    lost_in_seed = Trajectory("seed-2", TASK, [Step(KITCHEN, "eat knife", "You lost.", 0.0, True, {})], False, 0.0,
                              "random")
    assert success_rewards([won_in_seed, lost_in_seed]) == {ENV: 1.0}

    env = make_env(HalfReward(), success_reward=1.0)
    env.reset(TASK)
    assert env.step("eat meal").info["success"] is False  # done with 0.5: not the game's win
    assert not record_trajectory(env.episode).success
    lenient = make_env(HalfReward())  # a domain whose seed has no success: any positive final reward
    lenient.reset(TASK)
    assert lenient.step("eat meal").info["success"] is True


def test_initial_state_comes_from_the_task_or_the_mapping_or_fails_clearly():
    bare = Task("tw-2", ENV, "Cook.")
    assert make_env(ScriptedBackend(), initial_states={"tw-2": "A pantry."}).reset(bare).state == "A pantry."
    with pytest.raises(ValueError, match="no initial state"):
        make_env(ScriptedBackend()).reset(bare)
    with pytest.raises(ValueError, match="imitates"):
        make_env(ScriptedBackend()).reset(Task("web-1", "miniwob", "Click.", {"initial_state": "page"}))


def test_history_in_the_prompt_is_bounded():
    backend = ScriptedBackend()
    env = make_env(backend, prompt={"history_length": 2})
    env.reset(TASK)
    for action in ("a1", "a2", "a3", "a4"):
        env.step(action)
    user = backend.calls[-1][0][-1]["content"]
    assert "Action: a2" in user and "Action: a3" in user  # the last two earlier steps
    assert "Action: a1" not in user and KITCHEN not in user
    assert "Current state:\nafter a3" in user and user.endswith("Action: a4")


def test_retrieved_examples_reach_the_prompt_filtered_by_environment():
    buffer = open_replay_buffer("embedded", HashingEncoder(), index=settings_from_params("buffer_index"))
    seed = Trajectory("seed-1", Task("tw-9", ENV, "Cook."), [
        Step(KITCHEN, "open fridge", "The fridge is open. A red potato.", 0.0, False)], False, 0.0, "expert")
    other = Trajectory("web-1", Task("web-9", "miniwob", "Click."), [
        Step(KITCHEN, "open fridge", "MINIWOB PAGE", 0.0, False)], False, 0.0, "expert")
    buffer.add([t for tr in (seed, other) for t in transitions(tr)], source="real")

    backend = ScriptedBackend()
    # whole example states (the short reply's trimmed context would cut this one-line state down to its change)
    env = make_env(backend, buffer, prompt={"use_retrieval": True, "top_k": 2, "reply": "next_state",
                                            "trim_context": False})
    env.reset(TASK)
    result = env.step("open fridge")
    user = backend.calls[0][0][-1]["content"]
    assert "Similar transitions:" in user and "Next state: The fridge is open. A red potato." in user
    assert "MINIWOB PAGE" not in user
    assert result.info["retrieved"] == ["seed-1/0"]  # the examples' ids, of this environment only
    assert "retrieved" not in env.episode.steps[0].info  # shown, not stored with the step


def test_garbage_output_falls_back_is_counted_and_ends_the_episode_as_an_environment_failure():
    """A step the model could not predict is no outcome of the policy's: the episode ends there, marked as a crashed
    real environment's would be, so RL, the buffer and evaluation leave it out (an episode that went on asked the
    model the same state every turn to its limit, 12 of 21 predictions in one MiniWoB iteration)."""
    stats = PredictionStats()
    env = make_env(ScriptedBackend(garbage=True), stats=stats, inference={"retries": 1})
    env.reset(TASK)
    result = env.step("open fridge")
    assert result.info["fallback"] is True and result.done and result.reward == 0.0
    assert result.info["truncated"] and "experience model fell back" in result.info[ENV_FAILURE]
    assert result.observation.state == f"{KITCHEN}\n{FALLBACK_NOTE}"
    assert (stats.requests, stats.generations, stats.fallbacks) == (1, 2, 1)
    trajectory = record_trajectory(env.episode)
    assert env_failure(trajectory) and not trajectory.success
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("look")

    # an agent loop that handles fallbacks itself can keep the episode going on the unchanged state
    going = make_env(ScriptedBackend(garbage=True), end_on_fallback=False)
    going.reset(TASK)
    result = going.step("open fridge")
    assert result.info["fallback"] and not result.done and ENV_FAILURE not in result.info


def test_batch_of_three_makes_one_backend_call_and_writes_back():
    backend = ScriptedBackend()
    buffer = open_replay_buffer("embedded", HashingEncoder(), index=settings_from_params("buffer_index"))
    env = make_env(backend, buffer)
    episodes = [env.new_episode(TASK, f"syn-{i}") for i in range(3)]
    results = env.step_batch(episodes, ["open fridge", "eat meal", "look"])
    assert len(backend.calls) == 1 and len(backend.calls[0]) == 3
    assert [r.observation.state for r in results] == ["after open fridge", "after eat meal", "after look"]
    assert [e.done for e in episodes] == [False, True, False]

    trajectory = record_trajectory(episodes[1])
    assert trajectory.source == "synthetic" and trajectory.success and trajectory.return_ == 1.0
    assert add_to_buffer(buffer, [trajectory]) == 1
    assert buffer.count(ENV, source="synthetic") == 1


def test_run_episode_works_unchanged():
    actions = iter(["open fridge", "take potato", "eat meal"])
    seen = []

    def policy(task, observation, history):
        seen.append(len(history))
        return next(actions)

    trajectory = run_episode(make_env(ScriptedBackend()), TASK, policy, max_steps=5, trajectory_id="t",
                             source="synthetic")
    assert seen == [0, 1, 2] and trajectory.success and trajectory.return_ == 1.0
    assert [s.next_state for s in trajectory.steps] == ["after open fridge", "after take potato", "after eat meal"]
    assert all(s.info["synthetic"] and "success" not in s.info for s in trajectory.steps)


def test_real_tiny_model_end_to_end():
    model, tokenizer = build_tiny_causal_lm([KITCHEN, format_target("after open fridge", 0.0, False, "why")])
    stats = PredictionStats()
    env = make_env(HFGenerationBackend(model, tokenizer), stats=stats, inference={"max_new_tokens": 8})
    env.reset(TASK)
    episodes = [env.episode, env.new_episode(TASK)]
    results = env.step_batch(episodes, ["open fridge", "look"])
    assert len(results) == 2 and all(isinstance(r.observation.state, str) for r in results)
    assert stats.requests == 2 and stats.fallbacks == sum(r.info["fallback"] for r in results)
    assert stats.fallbacks == 2  # a random model with 8 new tokens cannot write a full target
