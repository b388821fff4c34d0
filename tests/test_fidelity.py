"""Fidelity metrics, the held-out split, and the two baselines on handcrafted transitions.

The nearest-neighbour baseline runs on a real FaissReplayBuffer with a bag-of-words hashing encoder (a copy of the
test double in test_replay_buffer.py), so which neighbour wins is computable by hand.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from components.data.contract import Step, Task, Trajectory, Transition, is_heldout_task, transitions
from components.simulator.experience_model import Prediction
from components.simulator.fidelity import (
    OVERALL,
    Guess,
    changed_text,
    copy_nearest_neighbour,
    evaluate,
    exact_match,
    fidelity_report,
    heldout_transitions,
    is_lookalike,
    outcomes_first_sample,
    reward_correct,
    rewarded_commands,
    score_predictions,
    state_unchanged,
    token_f1,
)
from components.simulator.replay_buffer import FaissReplayBuffer
from tests.conftest import settings_from_params
from tests.hashing_encoder import HashingEncoder


def transition(state: str, action: str, next_state: str, reward: float = 0.0, done: bool = False,
               environment: str = "textworld-cooking", trajectory_id: str = "q", step_index: int = 0) -> Transition:
    task = Task(f"{environment}-task", environment, "cook a meal")
    return Transition(trajectory_id, step_index, task, state, action, next_state, reward, done, "expert")


def trajectory(trajectory_id: str, task_id: str, environment: str, steps: list[Step]) -> Trajectory:
    return Trajectory(trajectory_id, Task(task_id, environment, "do it"), steps, steps[-1].reward > 0,
                      sum(s.reward for s in steps), "expert")


# ------------------------------------------------------------------------------------------------------ metrics
@pytest.mark.parametrize("pred, gold, expected", [
    ("the cat sat", "the cat sat", 1.0),
    ("The cat, sat!", "the cat sat", 1.0),  # case and punctuation do not count
    ("cat", "the cat sat", 2 * (1 / 1) * (1 / 3) / (1 / 1 + 1 / 3)),  # P=1, R=1/3 -> 0.5
    ("a b c d", "a b x y", 0.5),  # P=R=1/2
    ("dog", "the cat sat", 0.0),
    ("a a a", "a", 2 * (1 / 3) * 1 / (1 / 3 + 1)),  # multiset: one 'a' overlaps -> 0.5
    ("", "", 1.0),
    ("", "x", 0.0),
    ("x", "", 0.0),
])
def test_token_f1_known_values(pred, gold, expected):
    assert token_f1(pred, gold) == pytest.approx(expected)


def test_exact_match_and_reward_rule():
    assert exact_match("You see  a\nkitchen. ", "You see a kitchen.")
    assert not exact_match("you see a kitchen.", "You see a kitchen.")
    assert reward_correct(0.7, 1.0) and reward_correct(0.0, 0.0) and reward_correct(0.49, 0.0)
    assert not reward_correct(0.5, 0.0) and not reward_correct(0.0, 1.0)
    assert reward_correct(0.25, 0.2, tolerance=0.1) and not reward_correct(0.25, 0.0, tolerance=0.1)


def test_score_predictions_per_environment_and_overall():
    gold = [
        transition("s1", "a", "kitchen", 0.0, False),
        transition("s2", "b", "you eat the meal", 1.0, True),
        transition("s3", "c", "fridge open", 0.0, False),
        transition("p1", "click", "page 2", 0.0, False, environment="miniwob"),
    ]
    predictions = [
        Guess("kitchen", 0.0, False),  # all right
        Guess("you eat", 0.0, False),  # F1 = 2*1*0.5/1.5 = 2/3; reward and done wrong
        Prediction("fridge closed", 0.2, True),  # F1 1/2; reward right (|0.2| < 0.5); done wrong
        Guess("page 2", 1.0, False),  # exact; reward wrong
    ]
    scores = score_predictions(gold, predictions)
    assert set(scores) == {"textworld-cooking", "miniwob", OVERALL}
    tw = scores["textworld-cooking"]
    assert tw["n"] == 3
    assert tw["exact_match"] == pytest.approx(1 / 3)
    assert tw["token_f1"] == pytest.approx((1 + 2 / 3 + 0.5) / 3)
    assert tw["reward_accuracy"] == pytest.approx(2 / 3)
    assert tw["positive_n"] == 1 and tw["positive_reward_accuracy"] == 0.0
    assert tw["done_accuracy"] == pytest.approx(1 / 3)
    assert tw["terminal_n"] == 1 and tw["terminal_done_accuracy"] == 0.0
    web = scores["miniwob"]
    assert web["exact_match"] == 1.0 and web["reward_accuracy"] == 0.0
    assert web["positive_n"] == 0 and web["positive_reward_accuracy"] is None  # empty subset: no made-up rate
    overall = scores[OVERALL]
    assert overall["n"] == 4 and overall["exact_match"] == 0.5 and overall["reward_accuracy"] == 0.5
    counts = {"n", "false_wins", "missed_wins", "refusal_false_wins"}
    for metrics in scores.values():
        for key, value in metrics.items():
            if not key.endswith("_n") and key not in counts and value is not None:
                assert 0.0 <= value <= 1.0, key
    json.dumps(scores)  # the metrics file is plain JSON

    with pytest.raises(ValueError, match="3 predictions for 4 transitions"):
        score_predictions(gold, predictions[:3])


def test_what_changed_false_wins_and_refusals_are_scored_apart():
    kitchen = "Recipe:\nfry the apple\nObservation:\nYou are in a kitchen.\nInventory: nothing."
    took = "Recipe:\nfry the apple\nObservation:\nYou take the apple.\nInventory: an apple."
    refused = "Recipe:\nfry the apple\nObservation:\nYou can't see any such thing.\nInventory: nothing."
    gold = [transition(kitchen, "take apple", took),
            transition(kitchen, "eat meal", refused),
            transition(kitchen, "eat meal", "You eat the meal.", 1.0, True)]
    gold[1] = replace(gold[1], info={"valid_action": False})
    assert changed_text(kitchen, took) == "You take the apple.\nInventory: an apple."
    assert changed_text(kitchen, kitchen) == ""

    unchanged = score_predictions(gold, state_unchanged(gold))[OVERALL]
    assert unchanged["change_f1"] == 0.0  # every step changed something; copying the state says nothing of it
    assert unchanged["false_wins"] == 0 and unchanged["missed_wins"] == 1 and unchanged["unrewarded_n"] == 2
    assert unchanged["refused_n"] == 1 and unchanged["refusal_change_f1"] == 0.0

    # right about the take, a refused `eat meal` rewarded (a false win), the real win missed
    guesses = [Guess(took, 0.0, False), Guess("Meal eaten.", 1.0, True), Guess(kitchen, 0.0, False)]
    scores = score_predictions(gold, guesses)[OVERALL]
    assert scores["false_wins"] == 1 and scores["refusal_false_wins"] == 1 and scores["missed_wins"] == 1
    assert scores["change_f1"] == pytest.approx((1.0 + 0.0 + 0.0) / 3)
    assert scores["refusal_change_f1"] == 0.0
    report = fidelity_report({"model": {OVERALL: scores}})
    assert "1 of 2" in report and "0.000 (n=1)" in report  # false wins of the unrewarded; refusals' change F1

    no_info = score_predictions(gold[:1], guesses[:1])[OVERALL]
    assert no_info["refused_n"] == 0 and no_info["refusal_change_f1"] is None  # seed data without the info


def test_embedding_similarity_with_an_encoder():
    gold = [transition("s", "a", "red apple"), transition("s", "b", "green pear")]
    scores = score_predictions(gold, [Guess("red apple", 0, False), Guess("blue sky", 0, False)],
                               encoder=HashingEncoder())
    assert scores[OVERALL]["embedding_similarity"] == pytest.approx(0.5, abs=1e-6)  # 1 and 0 (disjoint words)


def test_heldout_transitions_takes_only_heldout_tasks():
    task_ids = [f"task-{i}" for i in range(40)]
    trajectories = [trajectory(f"traj-{tid}", tid, "textworld-cooking",
                               [Step("s0", "go", "s1", 0.0, False), Step("s1", "eat", "s2", 1.0, True)])
                    for tid in task_ids]
    held = heldout_transitions(trajectories, 0.2)
    expected = {tid for tid in task_ids if is_heldout_task(tid, 0.2)}
    assert expected and len(expected) < len(task_ids)  # the split is not degenerate on this sample
    assert {t.task.task_id for t in held} == expected
    assert len(held) == 2 * len(expected)
    assert heldout_transitions(trajectories, 0.0) == []


def test_outcomes_first_sample_keeps_rare_outcomes_and_caps_each_environment():
    ordinary = [transition("s", f"look {i}", "s", step_index=i) for i in range(10)]
    outcomes = [transition("s", "eat meal", "won", 1.0, True, step_index=20),
                transition("s", "eat knife", "dead", 0.0, True, step_index=21)]
    web = [transition("p", f"click {i}", "p", environment="miniwob", step_index=i) for i in range(3)]
    sample = outcomes_first_sample(ordinary + outcomes + web, 4)
    tw = [t for t in sample if t.task.environment == "textworld-cooking"]
    assert [t.action for t in tw] == ["eat meal", "eat knife", "look 0", "look 1"]  # outcomes first, half the cap
    assert [t.action for t in sample if t.task.environment == "miniwob"] == ["click 0", "click 1", "click 2"]
    assert [t.action for t in outcomes_first_sample(ordinary + outcomes, 2)] == ["eat meal", "look 0"]


def test_lookalikes_are_unrewarded_steps_of_a_rewarded_command_and_get_a_quarter_of_the_sample():
    won = transition("s", "eat meal", "won", 1.0, True, step_index=8)
    no_meal = transition("s", "eat meal", "You can't see any such thing.", step_index=7)  # the meal never made
    other_env = transition("p", "eat meal", "p", environment="miniwob", step_index=1)  # not rewarded over there
    ordinary = [transition("s", f"look {i}", "s", step_index=i) for i in range(10)]
    steps = ordinary + [won, no_meal, other_env]
    assert [t for t in steps if is_lookalike(t, rewarded_commands(steps))] == [no_meal]

    sample = outcomes_first_sample(ordinary + [no_meal, won], 8)
    assert [t.action for t in sample] == ["eat meal", "eat meal", "look 0", "look 1", "look 2", "look 3", "look 4",
                                          "look 5"]  # the outcome, the look-alike (at most 8 // 4), then ordinary
    scores = score_predictions([won, no_meal], [Guess("won", 1.0, True), Guess("won", 1.0, True)])
    assert scores[OVERALL]["lookalike_n"] == 1 and scores[OVERALL]["lookalike_reward_accuracy"] == 0.0
    assert scores[OVERALL]["positive_reward_accuracy"] == 1.0


def test_refused_commands_get_a_quarter_of_the_sample_after_outcomes_and_lookalikes():
    """A model that lets a refused command succeed hands the policy a state the game never reaches (session 26: 4 of
    5 on sampled play): the sample keeps such steps beside the outcomes and look-alikes."""
    ordinary = [transition("s", f"look {i}", "s", step_index=i) for i in range(10)]
    refused = [replace(transition("s", f"drop knife {i}", "You haven't got that.", step_index=30 + i),
                       info={"valid_action": False}) for i in range(3)]
    won = transition("s", "eat meal", "won", 1.0, True, step_index=20)

    sample = outcomes_first_sample(ordinary + refused + [won], 8)
    assert [t.action for t in sample] == ["eat meal", "drop knife 0", "drop knife 1", "look 0", "look 1", "look 2",
                                          "look 3", "look 4"]  # at most 8 // 4 refusals
    assert score_predictions(refused[:1], [Guess("You drop the knife.", 0.0, False)])[OVERALL]["refused_n"] == 1
    # a policy whose every command was refused still gets its steps scored: the caps order the sample, never empty it
    assert [t.action for t in outcomes_first_sample(refused, 2)] == ["drop knife 0", "drop knife 1"]


# ---------------------------------------------------------------------------------------------------- baselines
@pytest.fixture
def buffer():
    """Training transitions of two environments; outcomes distinguishable by their next states."""
    buf = FaissReplayBuffer(HashingEncoder(), settings_from_params("buffer_index"))
    kitchen = trajectory("train-kitchen", "t-k", "textworld-cooking", [
        Step("you are in the kitchen there is a fridge", "open fridge", "you open the fridge", 0.0, False),
        Step("the fridge is open it contains a carrot", "take carrot", "you take the carrot", 1.0, False),
        Step("you hold a carrot and a knife", "eat meal", "you eat the meal. you win", 1.0, True),
    ])
    garden = trajectory("train-garden", "t-g", "textworld-cooking", [
        Step("you are in the garden there is a shed", "go north", "you are in the shed", 0.0, False),
    ])
    web = trajectory("train-web", "t-w", "miniwob", [
        Step("page with a submit button", "click submit", "form submitted", 1.0, True),
    ])
    for t in (kitchen, garden, web):
        buf.add(list(transitions(t)), "real")
    return buf


def test_state_unchanged():
    gold = [transition("the room", "look", "the room", 0.0, False),
            transition("the room", "eat", "you win", 1.0, True)]
    guesses = state_unchanged(gold)
    assert [(g.next_state, g.reward, g.done) for g in guesses] == [("the room", 0.0, False), ("the room", 0.0, False)]
    scores = score_predictions(gold, guesses)[OVERALL]
    assert scores["exact_match"] == 0.5 and scores["reward_accuracy"] == 0.5 and scores["done_accuracy"] == 0.5
    assert scores["positive_reward_accuracy"] == 0.0


def test_copy_nearest_neighbour_picks_the_right_neighbour(buffer):
    queries = [
        transition("in the kitchen a fridge", "open the fridge", "the fridge is open", 0.0, False),
        transition("a carrot in the open fridge", "take the carrot", "taken", 1.0, False),
        transition("in the garden a shed", "go north", "you are in the shed", 0.0, False),
        transition("you hold a knife and a carrot", "eat the meal", "you win", 1.0, True),
        # same words as the kitchen steps, but miniwob: only miniwob's transition may answer
        transition("you are in the kitchen there is a fridge", "open fridge", "x", 0.0, False, environment="miniwob"),
    ]
    guesses = copy_nearest_neighbour(buffer)(queries)
    assert [(g.next_state, g.reward, g.done) for g in guesses] == [
        ("you open the fridge", 0.0, False),
        ("you take the carrot", 1.0, False),
        ("you are in the shed", 0.0, False),
        ("you eat the meal. you win", 1.0, True),
        ("form submitted", 1.0, True),
    ]


def test_copy_nearest_neighbour_excludes_own_trajectory_and_falls_back(buffer):
    # A query that *is* a stored transition must not copy itself.
    own = transition("in the garden there is a shed", "go north", "you are in the shed", trajectory_id="train-garden")
    assert copy_nearest_neighbour(buffer)([own])[0].next_state != "you are in the shed"
    assert copy_nearest_neighbour(buffer, exclude_own_trajectory=False)([own])[0].next_state == "you are in the shed"
    # An environment the buffer has never seen: state unchanged.
    alien = transition("a blank screen", "press key", "text appears", environment="alfworld")
    assert copy_nearest_neighbour(buffer)([alien])[0] == Guess("a blank screen", 0.0, False)
    assert copy_nearest_neighbour(buffer)([]) == []
    with pytest.raises(ValueError):
        copy_nearest_neighbour(buffer, k=0)


def test_copy_nearest_neighbour_k_votes_reward_and_done(buffer):
    query = transition("the fridge is open it contains a carrot", "take carrot", "taken", 1.0, False)
    top1 = copy_nearest_neighbour(buffer, k=1)([query])[0]
    top4 = copy_nearest_neighbour(buffer, k=4)([query])[0]
    assert top1.next_state == top4.next_state == "you take the carrot"
    # 4 textworld neighbours: rewards 1, 1, 0, 0 in some order with the carrot step first -> tie goes to rank 1.
    assert top4.reward == 1.0


def test_evaluate_and_report(buffer):
    gold = [transition("in the kitchen a fridge", "open the fridge", "you open the fridge", 0.0, False),
            transition("page with a submit button", "click submit", "form submitted", 1.0, True,
                       environment="miniwob")]
    results = evaluate({"state-unchanged": state_unchanged, "copy-nn": copy_nearest_neighbour(buffer)}, gold)
    assert results["copy-nn"][OVERALL]["exact_match"] == 1.0
    assert results["state-unchanged"][OVERALL]["exact_match"] == 0.0
    report = fidelity_report(results)
    lines = [line for line in report.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + 2 * 3  # header + (2 environments + overall) per predictor
    assert "| copy-nn | overall | 2 | 1.000 |" in report
    assert "reward acc. (r>0)" in report and "1.000 (n=1)" in report
    assert "embedding sim." not in report  # no encoder, no column
