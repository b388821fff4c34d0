"""components/rl/policy.py and components/rl/rollouts.py: the policy's conversation format and multi-turn rollouts.

The policy is a real (tiny, random) Llama; the synthetic environment is real with a scripted experience *model*
(tests/scripted_backend.py), so episode ends and rewards are known in advance.
"""
from __future__ import annotations

import pytest

from components.data.contract import Step, Task, Trajectory
from components.envs.base import Observation
from components.llm.backends import ConversationBackend, HFGenerationBackend
from components.llm.models import build_tiny_causal_lm
from components.rl.policy import (
    conversation,
    llm_policy,
    next_action_accuracy,
    parse_action,
    sft_examples,
)
from components.rl.rollouts import ChatSegments, RolloutStats, SyntheticBatch, rollout
from components.simulator.experience_model import format_target
from components.simulator.synthetic import SyntheticEnvironment
from tests.conftest import settings_from_params
from tests.scripted_backend import ScriptedBackend

ENV = "textworld-cooking"
TASK = Task("tw-1", ENV, "Cook a meal, then eat it.", {"initial_state": "You are in a kitchen."})
POLICY_FORMAT = settings_from_params("policy_prompt")


def _synthetic(backend) -> SyntheticEnvironment:
    """The experience model played by a scripted `backend`, no retrieval, no retries."""
    return SyntheticEnvironment(ENV, backend, None, settings_from_params("prompt", use_retrieval=False),
                                settings=settings_from_params("inference", retries=0))


@pytest.fixture(scope="module")
def tiny():
    texts = ["open fridge", "eat meal", "take potato", "State: You are in a kitchen.", "Task: Cook a meal"] * 20
    return build_tiny_causal_lm(texts, seed=1)


def _trajectory(trajectory_id="tw-1") -> Trajectory:
    steps = [Step("kitchen", "open fridge", "fridge open", 0.0, False, {}),
             Step("fridge open", "eat meal", "eaten", 1.0, True, {})]
    return Trajectory(trajectory_id, TASK, steps, True, 1.0, "expert")


def test_conversation_alternates_states_and_actions_and_clips_states():
    fmt = settings_from_params("policy_prompt", max_state_chars=60, show_valid_actions=True, max_valid_actions=2)
    messages = conversation(TASK, [Observation("kitchen " * 30, ("look", "open fridge", "eat meal")),
                                   Observation("fridge open")], ["open fridge"], fmt)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[1]["content"].startswith("Task: Cook a meal") and "chars cut" in messages[1]["content"]
    assert "Valid actions: look | open fridge" in messages[1]["content"] and "eat meal" not in messages[1]["content"]
    assert "Task:" not in messages[3]["content"]
    with pytest.raises(ValueError, match="actions"):
        conversation(TASK, [Observation("a")], ["x"], fmt)


@pytest.mark.parametrize("reply, action", [
    ("open fridge", "open fridge"), ("Action: `take potato`\nbecause", "take potato"),
    ("\n\n  eat meal  \n", "eat meal"), ("", ""), ('"go north"', "go north"), ('take knife"', "take knife"),
    # a web action's quoted text keeps both quotes: without the closing one the page refuses it
    ('type [2] "Bethel, AK"', 'type [2] "Bethel, AK"'), ('`select [3] "Blue"`', 'select [3] "Blue"'),
    ('"press "Enter""', 'press "Enter"'), ("take chef's knife", "take chef's knife")])
def test_parse_action(reply, action):
    assert parse_action(reply) == action


def test_sft_examples_one_per_step_with_the_conversation_so_far():
    dataset = sft_examples([_trajectory()], POLICY_FORMAT)
    assert len(dataset) == 2
    second = dataset[1]
    assert [m["role"] for m in second["prompt"]] == ["system", "user", "assistant", "user"]
    assert second["prompt"][2]["content"] == "open fridge" and second["completion"][0]["content"] == "eat meal"


def test_next_action_accuracy_counts_steps(tiny):
    model, tokenizer = tiny
    result = next_action_accuracy(HFGenerationBackend(model, tokenizer), [_trajectory()], POLICY_FORMAT, 4)
    assert result["steps"] == 2 and 0 <= result["correct"] <= 2 and set(result["by_step"]) == {"0", "1"}


def test_llm_policy_keeps_its_episode():
    class Echo:  # the policy's generation backend: echoes how many turns the conversation has
        def generate(self, prompts, max_new_tokens, temperature=0.0):
            return [f"turn {sum(m['role'] == 'user' for m in prompts[0])}"]

    act = llm_policy(Echo(), POLICY_FORMAT, max_action_tokens=24)
    assert act(TASK, Observation("a"), []) == "turn 1"
    assert act(TASK, Observation("b"), [("a", "turn 1")]) == "turn 2"
    assert act(TASK, Observation("c"), []) == "turn 1"  # a new episode starts over


def test_a_conversation_encoded_once_plays_the_same_actions_as_one_encoded_every_turn(tiny):
    """Greedy play through ConversationBackend (the key/value cache carried from turn to turn) and through
    HFGenerationBackend (the whole conversation encoded every turn) gives the same replies, turn for turn, over
    several episodes in a row, while the cached one encodes only the new tokens of each turn."""
    model, tokenizer = tiny
    states = ["You are in a kitchen.", "The fridge is open. You see a potato.", "You take the potato.",
              "The potato is sliced.", "You eat the meal. It is delicious."]
    cached = ConversationBackend(model, tokenizer)
    for task in (TASK, Task("tw-2", ENV, "Slice a potato.", {}), TASK):
        fresh_policy = llm_policy(HFGenerationBackend(model, tokenizer, batch_size=1), POLICY_FORMAT, 6)
        cached_policy = llm_policy(cached, POLICY_FORMAT, 6)
        history: list[tuple[str, str]] = []
        for state in states:
            action = fresh_policy(task, Observation(state), history)
            assert cached_policy(task, Observation(state), history) == action
            history.append((state, action))
    assert cached.encoded_tokens < cached.prompt_tokens / 3  # three episodes of five turns: mostly from the cache
    with pytest.raises(ValueError, match="one conversation"):
        cached.generate(["a", "b"], max_new_tokens=1)


def test_a_sampled_policy_with_a_seed_plays_each_task_the_same_whatever_was_played_before(tiny):
    """The on-policy check samples the warm start's play (experience_model.on_policy_temperature) over evaluation
    workers: each turn draws from the seed, the task and the turn, so a game plays the same whichever worker plays
    it and after whichever games."""
    model, tokenizer = tiny
    states = ["You are in a kitchen.", "The fridge is open. You see a potato.", "You take the potato."]
    other = Task("tw-2", ENV, "Slice a potato.", {})

    def play(task, seed, before=()):
        backend = ConversationBackend(model, tokenizer)
        for earlier in before:  # other games first, on the same backend and torch stream
            llm_policy(backend, POLICY_FORMAT, 6, temperature=1.0, seed=seed)(earlier, Observation(states[0]), [])
        act, history = llm_policy(backend, POLICY_FORMAT, 6, temperature=1.0, seed=seed), []
        for state in states:
            history.append((state, act(task, Observation(state), history)))
        return [action for _, action in history]

    first = play(TASK, seed=3)
    assert play(TASK, seed=3, before=[other, other]) == first
    assert any(play(TASK, seed=seed) != first for seed in (4, 5, 6))  # another seed samples other actions


@pytest.mark.parametrize("batched", [True, False])
def test_rollout_tokens_masks_and_episode_ends(tiny, batched):
    model, tokenizer = tiny
    env = _synthetic(ScriptedBackend())
    stats = RolloutStats()
    episodes = rollout(model, tokenizer, SyntheticBatch(env), [TASK] * 3, POLICY_FORMAT, max_turns=3,
                       batched=batched, max_action_tokens=5, temperature=1.0, stats=stats)

    assert len(episodes) == 3 and stats.turns == sum(len(e.actions) for e in episodes) > 0
    segments = ChatSegments(tokenizer)
    for episode in episodes:
        assert len(episode.completion_ids) == len(episode.env_mask) == len(episode.logprobs)
        assert len(episode.actions) == len(episode.rewards) == len(episode.action_starts) <= 3
        assert episode.finished and episode.trajectory is not None
        assert [s.action for s in episode.trajectory.steps] == episode.actions
        assert episode.trajectory.source == "synthetic"
        # the policy's tokens are exactly the sampled ones, with finite log-probabilities; the rest is environment
        policy = [lp for lp, m in zip(episode.logprobs, episode.env_mask) if m == 1]
        assert policy and all(lp <= 0 for lp in policy)
        assert all(episode.env_mask[start] == 1 for start in episode.action_starts)
        if len(episode.actions) > 1:  # the next state reached the policy as a user turn
            text = tokenizer.decode(episode.completion_ids)
            assert segments.user_before.strip() in text and "after " in text
    # the environment's reply follows each action, never inside it
    assert sum(sum(e.env_mask) for e in episodes) == stats.policy_tokens


def test_greedy_rollouts_are_the_same_batched_or_one_episode_at_a_time_with_its_cache(tiny):
    """The per-episode path encodes only each new environment turn, yet the same tokens reach the model: greedy
    episodes match the batched path's token for token, and so do their log-probabilities."""
    model, tokenizer = tiny
    tasks = [TASK, Task("tw-2", ENV, "Slice a potato.", {"initial_state": "A potato lies here."}), TASK]
    played = {batched: rollout(model, tokenizer, SyntheticBatch(_synthetic(ScriptedBackend())), tasks, POLICY_FORMAT,
                               max_turns=3, batched=batched, max_action_tokens=5, temperature=0.0)
              for batched in (True, False)}
    for batched, cached in zip(played[True], played[False], strict=True):
        assert cached.completion_ids == batched.completion_ids and cached.actions == batched.actions
        assert cached.env_mask == batched.env_mask
        assert cached.logprobs == pytest.approx(batched.logprobs, abs=1e-4)


def test_seeded_episodes_are_the_same_in_process_or_split_over_a_simulator_server(tiny):
    """What lets every process of a launch play its share of an RL iteration: an episode sampled from its own seed
    comes out the same whether it is played with the others in process or, split in two, through the simulator
    server (components/simulator/server.py) that the main process serves; the server keeps the whole trajectory."""
    from components.rl.rollouts import RemoteSyntheticBatch
    from components.simulator.server import serving, simulator_app

    model, tokenizer = tiny
    tasks = [TASK, Task("tw-2", ENV, "Slice a potato.", {"initial_state": "A potato lies here."})] * 2
    seeds, settings = [11, 12, 13, 14], dict(max_turns=3, batched=False, max_action_tokens=5, temperature=1.0)
    together = rollout(model, tokenizer, SyntheticBatch(_synthetic(ScriptedBackend())), tasks, POLICY_FORMAT,
                       seeds=seeds, **settings)
    served = _synthetic(ScriptedBackend())
    with serving(simulator_app(served, lambda rng, task_id: TASK)) as url:
        apart = [episode for share in (slice(0, 1), slice(1, 4)) for episode in rollout(
            model, tokenizer, RemoteSyntheticBatch({ENV: url}), tasks[share], POLICY_FORMAT, seeds=seeds[share],
            **settings)]
        elsewhere = Task("a-1", "alfworld", "x", {"initial_state": "a room"})
        with pytest.raises(ValueError, match="no simulator server for .'alfworld'"):
            RemoteSyntheticBatch({ENV: url}).start([elsewhere])
        with pytest.raises(RuntimeError, match="this environment imitates 'textworld-cooking'"):
            RemoteSyntheticBatch({"alfworld": url}).start([elsewhere])  # the server says what it simulates

    assert len({tuple(e.actions) for e in together}) > 1  # the seeds differ, and so do the episodes
    for one, other in zip(together, apart, strict=True):
        assert (one.actions, one.completion_ids, one.env_mask) == (other.actions, other.completion_ids, other.env_mask)
        assert one.logprobs == pytest.approx(other.logprobs, abs=1e-5)
        assert (one.rewards, one.done, one.success) == (other.rewards, other.done, other.success)
        assert one.trajectory.steps == other.trajectory.steps and other.trajectory.source == "synthetic"
        assert other.trajectory.trajectory_id.startswith("synthetic-")
    assert served.stats.requests == sum(len(e.actions) for e in apart)  # the server's environment stepped them all


def test_a_step_the_simulator_cannot_predict_ends_the_episode_as_an_environment_failure_there_or_served(tiny):
    """In process or through the simulator server, an episode the experience model fell back on ends at that step,
    marked as an environment failure: GRPO gives it no advantage (`training_returns`) and it is no outcome."""
    from components.rl.loop import trainable, training_returns
    from components.rl.rollouts import RemoteSyntheticBatch
    from components.simulator.server import serving, simulator_app

    model, tokenizer = tiny
    settings = dict(max_turns=3, batched=True, max_action_tokens=3)
    local = rollout(model, tokenizer, SyntheticBatch(_synthetic(ScriptedBackend(garbage=True))), [TASK, TASK],
                    POLICY_FORMAT, **settings)
    with serving(simulator_app(_synthetic(ScriptedBackend(garbage=True)), lambda rng, task_id: TASK)) as url:
        served = rollout(model, tokenizer, RemoteSyntheticBatch({ENV: url}), [TASK], POLICY_FORMAT, **settings)
    for episode in [*local, *served]:
        assert episode.done and len(episode.actions) == 1 and "experience model fell back" in episode.env_failure
        assert not episode.success and episode.trajectory.steps[-1].info["fallback"]
    assert trainable(local) == [] and training_returns(local, 2) == [0.0, 0.0]


def test_batched_rollouts_draw_from_their_episodes_seeds(tiny):
    """Batched, a turn is one draw for all episodes: from their seeds together, so the same episodes repeat and
    other episodes (another process's share of a group, whose contexts are the same) do not copy them."""
    model, tokenizer = tiny
    settings = dict(max_turns=2, batched=True, max_action_tokens=5, temperature=1.0)

    def played(seeds):
        return [e.actions for e in rollout(model, tokenizer, SyntheticBatch(_synthetic(ScriptedBackend())),
                                           [TASK, TASK], POLICY_FORMAT, seeds=seeds, **settings)]

    assert played([1, 2]) == played([1, 2]) != played([3, 4])


def test_rollout_ends_on_done_with_success_and_truncates_at_the_turn_limit(tiny):
    model, tokenizer = tiny

    class WinsAtOnce:  # the experience model says every action finishes the task
        def generate(self, prompts, max_new_tokens, temperature=0.0):
            return [format_target("done", 1.0, True, "finished") for _ in prompts]

    won = rollout(model, tokenizer, SyntheticBatch(_synthetic(WinsAtOnce())), [TASK], POLICY_FORMAT, max_turns=5,
                  batched=True, max_action_tokens=3)[0]
    assert (won.done, won.success, won.truncated, won.rewards) == (True, True, False, [1.0])
    assert won.env_mask == [1] * len(won.completion_ids)  # nothing follows the last action
    assert won.trajectory.success

    env = _synthetic(ScriptedBackend())
    cut = rollout(model, tokenizer, SyntheticBatch(env), [TASK], POLICY_FORMAT, max_turns=2, batched=False,
                  max_action_tokens=3, temperature=0.0)[0]
    assert cut.truncated and not cut.done and len(cut.actions) == 2


def test_an_environment_failure_in_real_rl_is_counted_apart_and_given_no_advantage(tiny, monkeypatch):
    """Two episodes of a real TextWorld game in a RealBatch; the second one's engine does not start in time (a busy
    machine). That episode ends at its first turn, marked; the iteration log counts it apart from the outcomes, GRPO
    gets its group's mean return for it (a group-relative advantage of 0) and PPO leaves it out."""
    pytest.importorskip("textworld")
    import components.envs.textworld_cooking as tw
    from components.envs.base import env_failure, failed_reset
    from components.rl.loop import iteration_record, trainable, training_returns
    from components.rl.rollouts import RealBatch
    from tests.conftest import REPO

    cache = REPO / ".cache" / "textworld"
    task = tw.make_tasks("train", 1, seed=0, cache_dir=cache)[0]
    running = tw.TextWorldCooking(cache)
    running.reset(task)  # the first episode's engine is already up: its reset starts none
    engines = iter([running, tw.TextWorldCooking(cache)])
    monkeypatch.setattr(tw, "STARTUP_TIMEOUT_S", 0.01)  # far less than a child takes to import TextWorld
    batch = RealBatch(lambda _: next(engines))
    model, tokenizer = tiny
    try:
        episodes = rollout(model, tokenizer, batch, [task, task], POLICY_FORMAT, max_turns=2, batched=True,
                           max_action_tokens=4, max_tokens=2000)
    finally:
        batch.close()
    played, failed = episodes
    assert played.env_failure is None and env_failure(played.trajectory) is None and len(played.actions) == 2
    assert "at reset: TimeoutError: no answer" in failed.env_failure == env_failure(failed.trajectory)
    assert failed.done and len(failed.actions) == 1 and failed.trajectory.steps == [failed_reset(failed.env_failure)]

    row = iteration_record(1, episodes, RolloutStats(), None)
    assert row["env_failures"] == 1
    assert (row["success_rate"], row["reward_mean"], row["turns_mean"]) == (float(played.success), played.return_, 2)
    assert training_returns(episodes, group_size=2) == [played.return_, played.return_]
    assert trainable(episodes) == [played]


def test_training_returns_give_a_failed_episode_its_groups_mean():
    from components.rl.loop import training_returns
    from components.rl.rollouts import Episode

    def episode(reward: float, failure: str | None = None) -> Episode:
        return Episode(TASK, [0], rewards=[reward], done=True, env_failure=failure)

    returns = training_returns([episode(1.0), episode(0.0), episode(0.0, "engine died"), episode(0.5),
                                episode(0.0, "browser crashed"), episode(0.0, "browser crashed")], group_size=4)
    assert returns[:4] == [1.0, 0.0, 0.5, 0.5] and returns[2] == sum(returns[:4]) / 4  # no advantage in its group
    assert returns[4:] == [0.0, 0.0]  # a group (here the last, of 2) that failed whole: no advantage at all
