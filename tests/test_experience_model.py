"""components/simulator/annotation.py and components/simulator/experience_model.py: traces, prompt/target format,
parsing, retries and
fallback, the three inference backends' seams, and one real SFT step on the tiny model."""
from __future__ import annotations

import json
import shutil
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from components.data.contract import Step, Task, TaskRef, Trajectory, Transition, transitions
from components.llm.backends import (
    BackendError,
    HFGenerationBackend,
    LlamaCppBackend,
    OpenAICompatibleBackend,
    PromptTooLong,
    VLLMBackend,
)
from components.llm.gguf_export import export_gguf, gguf_path
from components.llm.models import build_tiny_causal_lm
from components.llm.sft import (
    TRAINING_STATE,
    Emphasis,
    _lora_targets,
    has_trained_model,
    load_trained_model,
    train_sft,
    weighted_trainer,
)
from components.simulator.annotation import (
    DETERMINISTIC,
    VERDICT_WORDS,
    HFTeacher,
    annotate,
    annotation_summary,
    deterministic_trace,
    read_annotated,
    write_annotated,
)
from components.simulator.experience_model import (
    FALLBACK_NOTE,
    REPLY_END,
    ExperienceModelFailure,
    ExperienceQuery,
    FallbackBudget,
    PredictionStats,
    build_messages,
    format_target,
    parse_prediction,
    policy_repeats,
    predict,
    sft_examples,
)
from components.simulator.replay_buffer import FaissReplayBuffer, Retrieved
from tests.conftest import settings_from_params
from tests.hashing_encoder import HashingEncoder

TASK = Task("tw-r1-s1", "textworld-cooking", "Cook a meal following the cookbook, then eat it.")
KITCHEN = "Observation:\nYou are in a kitchen. You see a closed fridge.\nInventory: You are carrying nothing."
OPEN = "Observation:\nYou open the fridge, revealing a red potato.\nInventory: You are carrying nothing."
TAKEN = "Observation:\nYou take the red potato from the fridge.\nInventory: You are carrying: a red potato."
EATEN = "Observation:\nYou eat the meal. Not bad.\n*** The End ***\nInventory: You are carrying nothing."


def fmt(**overrides):
    """The experience model's prompt format in params.yaml, with `overrides`."""
    return settings_from_params("prompt", **overrides)


def inference(**overrides):
    """predict's InferenceSettings from params.yaml (experience_model.inference, data.reward_range), with
    `overrides`."""
    return settings_from_params("inference", **overrides)


def _step(state: str, action: str, next_state: str, reward: float = 0.0, done: bool = False, **info) -> Step:
    return Step(state, action, next_state, reward, done, dict(info))


def _trajectory(trajectory_id: str = "tw-1", task: Task = TASK) -> Trajectory:
    steps = [
        _step(KITCHEN, "open fridge", OPEN, score=0, max_score=2, valid_action=True),
        _step(OPEN, "take red potato from fridge", TAKEN, score=1, max_score=2, valid_action=True),
        _step(TAKEN, "eat meal", EATEN, 1.0, True, score=2, max_score=2, valid_action=True, won=True),
    ]
    return Trajectory(trajectory_id, task, steps, success=True, return_=1.0, source="expert")


def _retrieved(trajectory_id: str, step_index: int = 0, action: str = "open fridge") -> Retrieved:
    return Retrieved.from_columns("textworld-cooking", "tw-r1-s2", trajectory_id, step_index, KITCHEN, action, OPEN,
                                  0.0, False, "real", "expert", 0.9)


# ---- deterministic traces -------------------------------------------------------------------------------------


def test_trace_names_action_changes_progress_and_reward():
    trace = deterministic_trace(_trajectory().steps[1], previous_info={"score": 0})

    assert "'take red potato from fridge'" in trace and "verb 'take'" in trace
    assert "accepted" in trace
    assert "Inventory went from 'You are carrying nothing.' to 'You are carrying: a red potato.'" in trace
    assert "New: 'You take the red potato from the fridge.'" in trace
    assert "Gone: 'You open the fridge, revealing a red potato.'" in trace
    assert "score rose from 0 to 1 of 2" in trace
    assert "Reward 0" in trace and "goes on" in trace
    # without the changes (a reply that states them itself), the rest is the same
    brief = deterministic_trace(_trajectory().steps[1], previous_info={"score": 0}, describe_changes=False)
    assert not any(word in brief for word in ("Changed:", "New:", "Gone:", "went from"))
    assert brief.split(" Progress")[0] in trace and brief.endswith(trace[trace.index("Progress"):])
    # without the action restated (it is in the prompt already), the trace starts at what the game did
    terse = deterministic_trace(_trajectory().steps[1], previous_info={"score": 0}, restate_action=False)
    assert terse.startswith("The environment accepted it.") and "verb" not in terse
    assert trace.endswith(terse)


def test_trace_explains_success_and_failure_endings():
    win = deterministic_trace(_trajectory().steps[2], previous_info={"score": 1})
    assert "Reward 1" in win and "ends in success" in win and "'*** The End ***'" in win

    lost = deterministic_trace(_step(TAKEN, "eat red potato", EATEN, 0.0, True, lost=True))
    assert "Reward 0" in lost and "the game is lost" in lost


def test_trace_for_an_invalid_action_and_a_web_element():
    state = 'Task: Click the OK button.\n[3] button "OK"\n[4] button "Cancel"'
    invalid = deterministic_trace(_step(state, "click [9]", state, valid_action=False))
    assert "rejected it as invalid, so nothing changed" in invalid
    assert "New:" not in invalid and "Gone:" not in invalid

    valid = deterministic_trace(_step(state, "click [3]", state + "\ntext \"Done\"", valid_action=True))
    assert "Element [3] is 'button \"OK\"'" in valid and "accepted" in valid


def test_grounded_trace_says_where_the_state_puts_the_object_before_the_verdict():
    def grounded(state: str, action: str, valid: bool) -> str:
        return deterministic_trace(_step(state, action, state, valid_action=valid), ground_objects=True)

    at_place = grounded(OPEN, "take red potato from fridge", True)
    assert ("The state mentions 'red potato' under Observation. 'red potato' and 'fridge' meet in "
            "'You open the fridge, revealing a red potato'.") in at_place
    assert at_place.index("meet in") < at_place.index("accepted")  # the fact comes before the verdict
    held = grounded(TAKEN, "take red potato from fridge", False)  # held: the last sentence naming both is the take
    assert "under Observation and Inventory" in held and held.index("Inventory") < held.index("rejected")
    elsewhere = grounded(OPEN, "take red potato from counter", False)
    assert "No sentence names 'red potato' with 'counter'." in elsewhere
    assert "The state does not mention 'yellow potato'." in grounded(OPEN, "eat yellow potato", False)
    # a word inside another is not a mention; a web action names its element by reference instead
    assert "does not mention 'potato'" not in grounded(OPEN, "take potato", False)
    assert "does not mention 'pot'" in grounded(OPEN, "take pot", False)
    assert "mention" not in grounded('[3] button "OK"', "click [3]", True)
    assert "mention" not in grounded('[3] input_text value="a"', 'press "Enter"', True)
    # off (the default), the trace is as before
    assert "mention" not in deterministic_trace(_step(OPEN, "take red potato from fridge", TAKEN, valid_action=True))


def test_annotate_is_deterministic_and_round_trips(tmp_path: Path):
    records = annotate([_trajectory("tw-1"), _trajectory("tw-2")])
    order = [(r.trajectory_id, r.step_index) for r in records]
    assert order[:4] == [("tw-1", 0), ("tw-1", 1), ("tw-1", 2), ("tw-2", 0)]
    assert all(r.annotator == DETERMINISTIC and r.reasoning for r in records)
    assert "score rose from 0 to 1" in records[1].reasoning  # previous step's info is used

    write_annotated(records, tmp_path / "a.jsonl")
    write_annotated(annotate([_trajectory("tw-1"), _trajectory("tw-2")]), tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert read_annotated(tmp_path / "a.jsonl") == records


def test_teacher_replies_are_used_and_unusable_ones_fall_back():
    class HalfTeacher:  # a test double: the unit under test is how annotate() uses replies
        name = "fake-teacher"

        def explain(self, transitions):
            return ["Opening <next_state>the fridge</next_state> reveals it." if t.step_index == 0 else None
                    for t in transitions]

    records = annotate([_trajectory()], teacher=HalfTeacher())
    assert records[0].annotator == "fake-teacher"
    assert "<next_state>" not in records[0].reasoning  # tags that would break the target format are removed
    assert records[1].annotator == DETERMINISTIC
    assert annotation_summary(records, "fake-teacher")["teacher_fallbacks"] == 2

    class DeadTeacher:
        name = "dead"

        def explain(self, transitions):
            raise ConnectionError("endpoint down")

    assert all(r.annotator == DETERMINISTIC for r in annotate([_trajectory()], teacher=DeadTeacher()))


def test_a_crashed_teacher_annotation_resumes_asking_only_unanswered_transitions(tmp_path: Path):
    class CountingTeacher:  # a test double: the unit under test is which transitions annotate() asks for
        name, max_new_tokens = "counting-teacher", 64

        def __init__(self, crash_after: int | None = None):
            self.asked: list[tuple[str, int]] = []
            self.crash_after = crash_after

        def explain(self, transitions):
            if self.crash_after is not None and len(self.asked) >= self.crash_after:
                raise KeyboardInterrupt  # the process dies: not a teacher failure annotate() may absorb
            self.asked += [(t.trajectory_id, t.step_index) for t in transitions]
            return [None if t.step_index == 2 else f"Because of {t.action}." for t in transitions]

    # 9 transitions, batches of 2; each game its own instruction (identical prompts would share one reply)
    trajectories = [_trajectory(f"tw-{i}", replace(TASK, instruction=f"{TASK.instruction} ({i})")) for i in range(3)]
    replies = tmp_path / "replies.jsonl"
    with pytest.raises(KeyboardInterrupt):
        annotate(trajectories, CountingTeacher(crash_after=4), batch_size=2, replies_path=replies)
    with open(replies, "a", encoding="utf-8") as torn:
        torn.write('{"key": "0')  # the line being written when the process died

    resumed = CountingTeacher()
    records = annotate(trajectories, resumed, batch_size=2, replies_path=replies)
    # The 4 asked before: 3 usable replies kept, the one unusable (step 2 of tw-0) asked again with the 5 never asked.
    assert resumed.asked == [("tw-0", 2), ("tw-1", 1), ("tw-1", 2), ("tw-2", 0), ("tw-2", 1), ("tw-2", 2)]
    assert records == annotate(trajectories, CountingTeacher(), batch_size=2)  # as if it had never crashed
    assert [r.annotator for r in records].count("counting-teacher") == 6

    other = CountingTeacher()
    other.name = "another-teacher"  # another teacher's replies are not this one's
    annotate(trajectories, other, batch_size=2, replies_path=replies)
    assert len(other.asked) == 9


# ---- prompt, target, parser -----------------------------------------------------------------------------------


def test_prompt_holds_task_bounded_history_and_examples_by_switch():
    history = [(f"state {i}", f"action {i}") for i in range(6)]
    query = ExperienceQuery(TASK, KITCHEN, "open fridge", history, (_retrieved("tw-9"), _retrieved("tw-8")))
    system, user = build_messages(query, fmt(use_reasoning=True, use_retrieval=True, history_length=2, top_k=1))

    assert system["role"] == "system" and "<reasoning>" in system["content"]
    assert TASK.instruction in user["content"] and "textworld-cooking" in user["content"]
    assert "action 5" in user["content"] and "action 4" in user["content"] and "action 3" not in user["content"]
    assert user["content"].count("Example ") == 1  # top_k
    assert user["content"].rstrip().endswith("Action: open fridge")

    _, no_retrieval = build_messages(query, fmt(use_retrieval=False, use_reasoning=False))
    assert "Similar transitions" not in no_retrieval["content"]
    first = build_messages(ExperienceQuery(TASK, KITCHEN, "open fridge"), fmt())[1]["content"]
    assert "first step" in first

    long_state = "Goal: cook.\n" + "x" * 5000 + "\nInventory: a knife."
    clipped = build_messages(ExperienceQuery(TASK, long_state, "look"), fmt(max_state_chars=300))[1]
    assert "chars cut" in clipped["content"] and "Goal: cook." in clipped["content"]
    assert "Inventory: a knife." in clipped["content"]


@pytest.mark.parametrize("reasoning", ["Opening the fridge shows what is inside.", None])
def test_target_round_trips_through_the_parser(reasoning):
    state = "  Line one\n\nLine with <b>markup</b> and trailing space  \n"
    parsed = parse_prediction(format_target(state, 0.5, True, reasoning))

    assert parsed is not None
    assert (parsed.next_state, parsed.reward, parsed.done, parsed.reasoning) == (state, 0.5, True, reasoning)
    # What a model tends to add around an answer: a trailing end-of-turn or extra text after </done>.
    assert parse_prediction(format_target(state, -1.0, False, reasoning) + "<|im_end|>\nmore") is not None


def test_changes_target_round_trips_through_the_parser_with_the_state():
    target = format_target(TAKEN, 0.0, False, "Taking it.", changes_from=OPEN)
    assert "<changes>" in target and "Observation:" in target and "fridge, revealing" not in target
    parsed = parse_prediction(target, OPEN)
    assert (parsed.next_state, parsed.reward, parsed.done, parsed.reasoning) == (TAKEN, 0.0, False, "Taking it.")
    assert parse_prediction(target) is None  # changes apply to a state
    unchanged = parse_prediction("<changes>\n\n</changes>\n<reward>0</reward>\n<done>false</done>", OPEN)
    assert unchanged.next_state == OPEN
    # a next state the changed sections cannot rebuild (a new section before the others) is written in full
    odd = "Goal:\nx\n" + OPEN
    assert "<next_state>" in format_target(odd, 0.0, False, changes_from=OPEN)
    assert parse_prediction(format_target(odd, 0.0, False, changes_from=OPEN), OPEN).next_state == odd


def test_changes_format_prompts_show_examples_and_history_by_what_changed():
    recipe = "Recipe:\nIngredients:\nred potato\n"
    example = Retrieved(Transition("tw-9-expert", 0, TaskRef("tw-9", "textworld-cooking"), recipe + KITCHEN,
                                   "open fridge", recipe + OPEN, 0.0, False, "expert"), "real", 0.9)
    query = ExperienceQuery(TASK, recipe + OPEN, "take red potato from fridge", ((recipe + KITCHEN, "open fridge"),),
                            (example,))
    user = build_messages(query, fmt(reply="changes", trim_context=True, history_length=1, top_k=1))[1]["content"]
    examples, rest = user.split("Recent history")
    assert "Changes: Observation:\nYou open the fridge" in examples and "Next state" not in examples
    assert examples.count("red potato\n") == 0 and "State: Observation:\nYou are in a kitchen" in examples
    assert "State: Observation:\nYou are in a kitchen" in rest.split("Current state")[0]
    system = build_messages(query, fmt(reply="changes"))[0]["content"]
    assert "<changes>" in system and "<next_state>" not in system


@pytest.mark.parametrize("reply", [
    "",
    "The fridge opens.",
    "<next_state>\nX\n</next_state>\n<reward>0</reward>",  # no done
    "<next_state>\nX\n<reward>0</reward>\n<done>false</done>",  # next_state not closed
    "<reward>0</reward>\n<done>false</done>",  # no next_state
    "<next_state>\nX\n</next_state>\n<reward>zero</reward>\n<done>false</done>",
    "<next_state>\nX\n</next_state>\n<reward>nan</reward>\n<done>false</done>",
    "<next_state>\nX\n</next_state>\n<reward>0</reward>\n<done>maybe</done>",
    "<next_state>\n \n</next_state>\n<reward>0</reward>\n<done>false</done>",  # empty state
    "Sure! <next_state>\nX\n</next_state>\n<reward>0</reward>\n<done>false</done>",  # preamble
    "<reasoning>why</reasoning><done>false</done><next_state>\nX\n</next_state><reward>0</reward>",  # order
])
def test_parser_rejects_malformed_replies(reply):
    assert parse_prediction(reply) is None


# ---- predict: retries and fallback ----------------------------------------------------------------------------


class ScriptedBackend:
    """A backend test double: the unit under test is predict()'s parsing, retry and fallback logic."""

    def __init__(self, *rounds):
        self.rounds, self.calls = list(rounds), []

    def generate(self, prompts, max_new_tokens, temperature):
        self.calls.append((len(prompts), temperature))
        reply = self.rounds.pop(0) if self.rounds else "garbage"
        if isinstance(reply, Exception):
            raise reply
        return [reply] * len(prompts)


def test_predict_retries_unparsable_output_with_sampling():
    valid = format_target(OPEN, 0.0, False, "The fridge opens.")
    backend = ScriptedBackend("garbage", valid)
    stats = PredictionStats()
    [prediction] = predict(backend, [ExperienceQuery(TASK, KITCHEN, "open fridge")], fmt(), stats=stats,
                           settings=inference(retries=1, temperature=0.0, retry_temperature=0.7))

    assert (prediction.next_state, prediction.attempts, prediction.fallback) == (OPEN, 2, False)
    assert backend.calls == [(1, 0.0), (1, 0.7)]  # greedy first, sampled retry
    assert (stats.generations, stats.retries, stats.fallbacks) == (2, 1, 0)


def test_predict_falls_back_and_counts_without_raising():
    queries = [ExperienceQuery(TASK, KITCHEN, "open fridge"), ExperienceQuery(TASK, OPEN, "take potato")]
    stats = PredictionStats()
    predictions = predict(ScriptedBackend(BackendError("down"), "garbage"), queries, fmt(), stats=stats,
                          settings=inference(retries=1))
    predictions += predict(ScriptedBackend(), queries[:1], fmt(), stats=stats, settings=inference(retries=0))

    assert [p.fallback for p in predictions] == [True, True, True]
    assert predictions[1].next_state == f"{OPEN}\n{FALLBACK_NOTE}"
    assert (predictions[1].reward, predictions[1].done) == (0.0, False)
    assert stats.as_dict() == {"requests": 3, "generations": 5, "retries": 2, "fallbacks": 3,
                               "reward_out_of_range": 0, "backend_calls": 3, "backend_errors": 1,
                               "fallback_rate": 1.0, "backend_error_rate": 1 / 3}
    assert stats.failed_replies == ["garbage", "garbage", "garbage"]  # kept for the budget's message


def test_a_reward_outside_the_range_is_unparsable_and_counted():
    out_of_range = format_target(OPEN, 5.0, True, "The fridge explodes.")
    stats = PredictionStats()
    [prediction] = predict(ScriptedBackend(out_of_range), [ExperienceQuery(TASK, KITCHEN, "open fridge")],
                           fmt(), stats=stats, settings=inference(retries=0, reward_range=(-1.0, 1.0)))
    assert prediction.fallback and (prediction.reward, prediction.done) == (0.0, False)
    assert (stats.fallbacks, stats.reward_out_of_range) == (1, 1)
    # without a range (None) the same reply is taken as it is (the stages always pass data.reward_range)
    [taken] = predict(ScriptedBackend(out_of_range), [ExperienceQuery(TASK, KITCHEN, "open fridge")], fmt(),
                      settings=inference(retries=0, reward_range=None))
    assert (taken.reward, taken.fallback) == (5.0, False)


def test_the_fallback_budget_stops_a_run_with_the_rate_the_replies_and_what_to_do():
    budget = FallbackBudget(max_fallback_rate=0.5, max_backend_error_rate=0.0)
    stats = PredictionStats()
    queries = [ExperienceQuery(TASK, KITCHEN, "open fridge")] * 4
    predict(ScriptedBackend("<next_state>\nYou open"), queries, fmt(), stats=stats, settings=inference(retries=0))
    with pytest.raises(ExperienceModelFailure) as failure:
        budget.check(stats, "synthetic_rl", max_new_tokens=64)
    message = str(failure.value)
    assert message.startswith("synthetic_rl: ")
    assert "4 of 4 predictions (100%, above experience_model.max_fallback_rate of 50% at 95% confidence)" in message
    assert "'<next_state>\\nYou open'" in message  # the first failed replies, as they came
    assert "never reach </done>" in message and "max_new_tokens (64)" in message
    assert "train it longer" in message and "experience_model.training" in message

    # half of them parse: at the budget, not over it
    valid = format_target(OPEN, 0.0, False, "The fridge opens.")
    predict(ScriptedBackend(valid), queries, fmt(), stats=stats, settings=inference(retries=0))
    budget.check(stats, "synthetic_rl")

    # a backend that raises is its own budget, with its own advice
    predict(ScriptedBackend(BackendError("HTTP 404: no such model"), valid), queries[:1], fmt(), stats=stats,
            settings=inference(retries=1))
    with pytest.raises(ExperienceModelFailure, match=r"backend failed on 1 of 4 calls .*HTTP 404.*base_url"):
        budget.check(stats, "evaluate_experience_model")

    # a stage stops when its failures show the rate over budget, not on one early failure: 1 of 8 over a 10%
    # budget goes on; 12 of 21 (one episode asking a state the model could not move, every turn) stops
    ten = FallbackBudget(max_fallback_rate=0.1, max_backend_error_rate=0.0)
    ten.check(PredictionStats(requests=8, fallbacks=1), "synthetic_rl")
    ten.check(PredictionStats(requests=200, fallbacks=24), "synthetic_rl")  # 12%: not shown above 10%
    with pytest.raises(ExperienceModelFailure, match=r"12 of 21 predictions \(57%, above"):
        ten.check(PredictionStats(requests=21, fallbacks=12), "synthetic_rl")
    with pytest.raises(ExperienceModelFailure, match=r"60 of 400 predictions"):
        ten.check(PredictionStats(requests=400, fallbacks=60), "synthetic_rl")  # 15%, and enough to show it


# ---- SFT data -------------------------------------------------------------------------------------------------


def test_sft_examples_rebuild_history_and_drop_own_trajectory_from_retrieval():
    records = annotate([_trajectory("tw-1"), _trajectory("tw-2")])
    buffer = FaissReplayBuffer(HashingEncoder(), settings_from_params("buffer_index"))
    buffer.add([t for tid in ("tw-1", "tw-2", "tw-3") for t in transitions(_trajectory(tid))], source="real")

    dataset = sft_examples(records, buffer, fmt(use_reasoning=True, use_retrieval=True, history_length=1, top_k=4,
                                                reply="next_state", trim_context=False),
                           outcome_repeats=1, lookalike_repeats=1)
    row = dataset[2]  # tw-1, step 2
    user = row["prompt"][1]["content"]
    examples, rest = user.split("Recent history")
    history, current = rest.split("Current state")
    assert "Action: take red potato from fridge" in history and "open fridge" not in history  # history_length 1
    assert "Action: eat meal" in current
    # tw-2 and tw-3 hold the same three transitions: repeats are dropped, so three of top 4 are left
    assert "Example 3" in examples and "Example 4" not in examples and examples.count("Action: eat meal") == 1
    assert buffer.retrieve_examples([("textworld-cooking", EATEN, "eat meal", "tw-1")], 2)[0][0].trajectory_id != "tw-1"
    parsed = parse_prediction(row["completion"][0]["content"])
    assert parsed is not None and parsed.done and parsed.reward == 1.0 and "success" in parsed.reasoning

    plain = sft_examples(records, buffer, fmt(use_retrieval=False, use_reasoning=False, reply="next_state"),
                         outcome_repeats=1, lookalike_repeats=1)
    assert "Similar transitions" not in plain[0]["prompt"][1]["content"]
    assert parse_prediction(plain[0]["completion"][0]["content"]).reasoning is None


def test_sft_examples_repeat_rewarded_and_terminal_transitions():
    records = annotate([_trajectory("tw-1")])
    dataset = sft_examples(records, None, fmt(use_retrieval=False), outcome_repeats=3, lookalike_repeats=1)
    assert [row["step_index"] for row in dataset] == [0, 1, 2, 2, 2]  # only "eat meal" is rewarded and terminal
    on_policy = annotate([replace(_trajectory("tw-2"), source="policy")])
    unweighted = sft_examples(records + on_policy, None, fmt(use_retrieval=False), outcome_repeats=3,
                              lookalike_repeats=1)
    assert [(row["trajectory_id"], row["step_index"]) for row in unweighted][5:] == \
        [("tw-2", 0), ("tw-2", 1)] + [("tw-2", 2)] * 3
    # 5 fed-back examples beside 5 of the seed: a share of 2/3 repeats each twice (10 of 15)
    weighted = sft_examples(records + on_policy, None, fmt(use_retrieval=False), outcome_repeats=3,
                            lookalike_repeats=1, policy_share=2 / 3, fed_back=["tw-2"])
    assert [(row["trajectory_id"], row["step_index"]) for row in weighted][5:] == \
        [("tw-2", 0)] * 2 + [("tw-2", 1)] * 2 + [("tw-2", 2)] * 6
    # the seed's own `source: policy` play (collect_seed's scripted player) is a seed step: weighing it put the cpu
    # correction row's share out of reach, so its feedback was repeated once (session 57)
    seed_play = sft_examples(records + on_policy, None, fmt(use_retrieval=False), outcome_repeats=3,
                             lookalike_repeats=1, policy_share=2 / 3)
    assert list(seed_play["trajectory_id"]) == list(unweighted["trajectory_id"])
    assert "eat meal" not in dataset[4]["prompt"][1]["content"].split("Current state")[0]  # history not repeated
    with pytest.raises(ValueError, match="outcome_repeats"):
        sft_examples(records, None, fmt(use_retrieval=False), outcome_repeats=0, lookalike_repeats=1)


def test_policy_repeats_bring_on_policy_examples_near_their_share():
    # the cpu correction row's first round: 18 on-policy examples beside 2,353 of the seed
    repeats = policy_repeats(18, 2353, 0.25)
    assert repeats == 44 and abs(18 * repeats / (18 * repeats + 2353) - 0.25) < 0.01
    assert policy_repeats(0, 2353, 0.25) == policy_repeats(18, 2353, 0.0) == 1  # none to repeat, or no share
    assert policy_repeats(900, 100, 0.25) == 1  # already past the share: never fewer than once


def test_sft_examples_repeat_lookalikes_of_a_rewarded_command():
    no_meal = Trajectory("tw-2", TASK, [_step(KITCHEN, "eat meal", "You can't see any such thing.", score=0,
                                              max_score=2, valid_action=False)], success=False, return_=0.0,
                         source="skipping_expert")
    records = annotate([_trajectory("tw-1"), no_meal])
    dataset = sft_examples(records, None, fmt(use_retrieval=False), outcome_repeats=3, lookalike_repeats=2)
    rows = [(row["trajectory_id"], row["step_index"]) for row in dataset]
    # the rewarded "eat meal" 3 times, the refused one (same command, no meal) twice, the rest once
    assert rows == [("tw-1", 0), ("tw-1", 1)] + [("tw-1", 2)] * 3 + [("tw-2", 0)] * 2
    with pytest.raises(ValueError, match="lookalike_repeats"):
        sft_examples(records, None, fmt(use_retrieval=False), outcome_repeats=1, lookalike_repeats=0)


def test_sft_examples_repeat_commands_the_game_refused():
    """A sensible command the state does not allow (the knife is already held) is what a policy's play is full of:
    it appears refusal_repeats times; a refused look-alike keeps its own weight."""
    held = Trajectory("tw-2", TASK, [
        _step(KITCHEN, "take knife from counter", "You can't see any such thing.", score=0, max_score=2,
              valid_action=False),
        _step(KITCHEN, "eat meal", "You can't see any such thing.", score=0, max_score=2, valid_action=False)],
        success=False, return_=0.0, source="noisy_expert")
    records = annotate([_trajectory("tw-1"), held])
    dataset = sft_examples(records, None, fmt(use_retrieval=False), outcome_repeats=3, lookalike_repeats=2,
                           refusal_repeats=4)
    rows = [(row["trajectory_id"], row["step_index"]) for row in dataset]
    assert rows == [("tw-1", 0), ("tw-1", 1)] + [("tw-1", 2)] * 3 + [("tw-2", 0)] * 4 + [("tw-2", 1)] * 2
    with pytest.raises(ValueError, match="refusal_repeats"):
        sft_examples(records, None, fmt(use_retrieval=False), outcome_repeats=1, lookalike_repeats=1,
                     refusal_repeats=0)


# ---- backends -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    records = annotate([_trajectory()])
    texts = [json.dumps(r.to_dict()) for r in records] + [format_target(KITCHEN, 0.0, False, "why")] * 3
    path = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny_causal_lm(texts, save_dir=path)
    return path


def test_hf_backend_generates_in_batches_like_one_by_one(tiny: Path):
    model, tokenizer = load_trained_model(tiny)
    prompts = [build_messages(ExperienceQuery(TASK, s, a), fmt()) for s, a in
               [(KITCHEN, "open fridge"), (OPEN * 3, "take red potato from fridge"), (TAKEN, "eat meal")]]
    prompts.append("A raw prompt string")

    batched = HFGenerationBackend(model, tokenizer, batch_size=3).generate(prompts, max_new_tokens=6)
    single = HFGenerationBackend(model, tokenizer, batch_size=1).generate(prompts, max_new_tokens=6)
    sampled = HFGenerationBackend(model, tokenizer, batch_size=4).generate(prompts, 6, temperature=1.0)

    assert len(batched) == 4 and all(isinstance(r, str) and r for r in batched)
    assert batched == single  # left padding leaves every prompt's greedy reply unchanged
    assert len(sampled) == 4


def test_hf_teacher_annotates_with_real_generation(tiny: Path):
    teacher = HFTeacher(str(tiny), cache_dir=tiny.parent, max_new_tokens=5)
    records = annotate([_trajectory()], teacher=teacher)
    assert teacher.name == f"hf:{tiny}"
    assert all(r.annotator in (teacher.name, DETERMINISTIC) and r.reasoning for r in records)


@pytest.mark.parametrize("weight_type, tolerance", [("f32", 0.0), ("f16", 1e-2), ("q8_0", 5e-2)])
def test_gguf_export_is_the_same_model_read_back(tiny: Path, tmp_path: Path, weight_type: str, tolerance: float):
    """transformers reads GGUF (and undoes the rotary permutation): the export must give back the model's logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = export_gguf(tiny, weight_type, tmp_path)
    assert exported == gguf_path(tiny, weight_type, tmp_path) and export_gguf(tiny, weight_type, tmp_path) == exported
    model, tokenizer = load_trained_model(tiny)
    back = AutoModelForCausalLM.from_pretrained(exported.parent, gguf_file=exported.name, dtype="float32")
    ids = tokenizer(KITCHEN + " open fridge", return_tensors="pt")["input_ids"]
    assert AutoTokenizer.from_pretrained(exported.parent, gguf_file=exported.name)(
        KITCHEN + " open fridge", return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    with torch.no_grad():
        gap = (model(ids).logits - back(ids).logits).abs().max().item()
    assert gap <= tolerance, f"{weight_type}: logits differ by {gap}"


def test_a_reseeded_hf_backend_samples_again_alike_on_its_own_random_stream(tiny: Path):
    """What the Gymnasium env relies on for seeded resets, without touching the agent's torch RNG beside it."""
    import torch

    model, tokenizer = load_trained_model(tiny)
    backend = HFGenerationBackend(model, tokenizer, batch_size=2)
    prompts = [build_messages(ExperienceQuery(TASK, KITCHEN, "open fridge"), fmt())] * 2

    def sample() -> list[str]:
        return backend.generate(prompts, max_new_tokens=12, temperature=1.0)

    backend.reseed(7)
    first = sample() + sample()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    backend.reseed(7)
    assert sample() + sample() == first  # the same stream after the same seed
    assert torch.equal(torch.rand(3), expected)  # the process's stream neither reset nor advanced
    assert len(set(first)) > 1  # it does sample


def test_llamacpp_backend_replies_like_the_hf_backend(tiny: Path, tmp_path: Path):
    model, tokenizer = load_trained_model(tiny)
    prompts = [build_messages(ExperienceQuery(TASK, s, a), fmt()) for s, a in
               [(KITCHEN, "open fridge"), (OPEN * 3, "take red potato from fridge"), (TAKEN, "eat meal")]]
    hf = HFGenerationBackend(model, tokenizer, batch_size=1).generate(prompts, max_new_tokens=10)
    llama = LlamaCppBackend(tiny, tmp_path, "f32", threads=1, context=1024)
    assert llama.generate(prompts, max_new_tokens=10) == hf  # same token ids in, greedy, f32 weights
    drafted = LlamaCppBackend(tiny, tmp_path, "f32", threads=1, context=1024, draft_tokens=8)
    assert drafted.generate(prompts, max_new_tokens=10) == hf  # prompt-lookup drafts keep greedy replies
    stop = next(text for text in tokenizer.batch_decode(tokenizer(hf[0])["input_ids"][:3]) if text.strip())
    [stopped] = LlamaCppBackend(tiny, tmp_path, "f32", threads=1, context=1024, stop=[stop]).generate(prompts[:1], 10)
    assert stopped.endswith(stop) and hf[0].startswith(stopped) and len(stopped) < len(hf[0])
    assert len(llama.generate(prompts, max_new_tokens=10, temperature=1.0)) == 3
    # several sequences decoded together (batches of 2: one of two prompts, one of one): the same greedy replies
    together = LlamaCppBackend(tiny, tmp_path, "f32", threads=1, context=1024, batch_size=2)
    assert together.generate(prompts, max_new_tokens=10) == hf
    [cut] = LlamaCppBackend(tiny, tmp_path, "f32", threads=1, context=1024, stop=[stop], batch_size=2).generate(
        prompts[:1] * 2, 10)[:1]
    assert cut == stopped
    together.reseed(3)
    sampled = together.generate(prompts, max_new_tokens=10, temperature=1.0)
    together.reseed(3)
    assert together.generate(prompts, max_new_tokens=10, temperature=1.0) == sampled != hf
    # the prefix all prompts share is encoded once and copied to each sequence; a later call keeps what it can of it
    assert together.generate(prompts[::-1], max_new_tokens=10) == hf[::-1]
    assert together.generate([prompts[0], "Hello"], max_new_tokens=10)[0] == hf[0]  # nothing shared
    with pytest.raises(PromptTooLong, match="1 of 2 prompts .* exceed the llama.cpp context") as refused:
        llama.generate([prompts[0], "word " * 3000], max_new_tokens=10)
    assert refused.value.indices == (1,)
    # in a batch of predictions the prompt that cannot fit falls back alone: the other one is still generated
    stats = PredictionStats()
    queries = [ExperienceQuery(TASK, KITCHEN, "open fridge"), ExperienceQuery(TASK, "word " * 3000, "open fridge")]
    predictions = predict(llama, queries, fmt(), stats=stats, settings=inference(retries=0, max_new_tokens=10))
    assert [p.fallback for p in predictions] == [True, True]  # a random tiny model writes nothing parsable
    assert len(stats.failed_replies) == 1  # the short prompt's reply: it was generated
    assert (stats.generations, stats.backend_calls, stats.backend_errors) == (1, 2, 1)
    assert "PromptTooLong" in stats.last_backend_error


class _ChatServer:
    """A real HTTP server on 127.0.0.1 that answers like an OpenAI-compatible endpoint after its first `failures`
    requests, which get HTTP 503."""

    def __init__(self, reply: str, failures: int = 1):
        self.requests: list[tuple[str, dict, str | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body, self.headers.get("Authorization")))
                if len(outer.requests) <= failures:
                    self.send_error(503, "warming up")
                    return
                choice = {"index": 0, "finish_reason": "stop"}
                choice |= {"text": reply} if "prompt" in body else {"message": {"role": "assistant", "content": reply}}
                payload = json.dumps({"id": "x", "object": "chat.completion", "choices": [choice]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_replies_stop_at_the_stop_string_on_every_backend(tiny: Path):
    model, tokenizer = load_trained_model(tiny)
    prompt = build_messages(ExperienceQuery(TASK, KITCHEN, "open fridge"), fmt())
    [free] = HFGenerationBackend(model, tokenizer).generate([prompt], max_new_tokens=12)
    stop = next(text for text in tokenizer.batch_decode(tokenizer(free)["input_ids"][:3]) if text.strip())
    [stopped] = HFGenerationBackend(model, tokenizer, stop=[stop]).generate([prompt], max_new_tokens=12)
    assert stopped.endswith(stop) and free.startswith(stopped) and len(stopped) < len(free)

    # OpenAI-style servers drop the stop string: the backend puts it back, so the reply still parses
    server = _ChatServer(format_target(OPEN, 0.0, False, "The fridge opens.").removesuffix(REPLY_END))
    try:
        backend = OpenAICompatibleBackend(server.url, "exp-model", backoff_s=0.01, concurrency=1, stop=[REPLY_END])
        [prediction] = predict(backend, [ExperienceQuery(TASK, KITCHEN, "open fridge")], fmt(), settings=inference())
    finally:
        server.close()
    assert (prediction.next_state, prediction.fallback) == (OPEN, False)
    assert server.requests[-1][1]["stop"] == [REPLY_END]


def test_openai_compatible_backend_over_real_http():
    server = _ChatServer(format_target(OPEN, 0.0, False, "The fridge opens."))
    try:
        backend = OpenAICompatibleBackend(server.url, "exp-model", api_key="sk-test", backoff_s=0.01, concurrency=1)
        [prediction] = predict(backend, [ExperienceQuery(TASK, KITCHEN, "open fridge")], fmt(), settings=inference())
        [text] = backend.generate(["plain prompt"], max_new_tokens=7, temperature=0.0)
    finally:
        server.close()

    assert (prediction.next_state, prediction.fallback) == (OPEN, False)
    assert parse_prediction(text) is not None
    path, body, auth = server.requests[1]  # [0] got the 503 and was retried
    assert path == "/v1/chat/completions" and auth == "Bearer sk-test"
    assert body["model"] == "exp-model" and body["messages"][0]["role"] == "system"
    assert server.requests[2][0] == "/v1/completions" and server.requests[2][1]["max_tokens"] == 7


def test_an_endpoint_that_is_down_costs_one_requests_retries_not_every_ones():
    """A teacher or simulator endpoint that answers 503 to everything: the call fails after one request has spent its
    retries; the other prompts are not each retried (64 prompts at 4 attempts each took 70 s in the suite)."""
    server = _ChatServer("unused", failures=10**6)
    try:
        backend = OpenAICompatibleBackend(server.url, "teacher", backoff_s=0.05, max_retries=3, concurrency=2)
        with pytest.raises(BackendError, match="HTTP 503"):
            backend.generate([f"prompt {i}" for i in range(16)], max_new_tokens=4)
    finally:
        server.close()
    assert 4 <= len(server.requests) <= 2 * 4  # two at a time, each at most its 4 attempts (16 before)


def test_vllm_backend_without_vllm_says_how_to_get_it():
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install vllm"):
            VLLMBackend("some/model")
    else:
        pytest.skip("vllm is installed here")


# ---- training -------------------------------------------------------------------------------------------------


def test_lora_sft_writes_a_model_that_reloads_and_a_rerun_reports_the_same_run(tiny: Path, tmp_path: Path):
    dataset = sft_examples(annotate([_trajectory("tw-1"), _trajectory("tw-2")]), None, fmt(), outcome_repeats=1,
                           lookalike_repeats=1)
    lora = settings_from_params("lora", r=4, alpha=8, top_layers=1)
    settings = settings_from_params("training", epochs=1.0, max_steps=2, learning_rate=2e-4, batch_size=2,
                                    gradient_accumulation_steps=1, max_seq_len=1536, lora=lora, precision="fp32",
                                    save_steps=1, save_total_limit=2, logging_steps=1)

    result = train_sft(dataset, str(tiny), tmp_path / "exp", settings, cache_dir=tmp_path)
    assert result.global_step == 2 and result.final_loss is not None and result.train_loss is not None
    assert (result.examples, result.too_long) == (6, 0)
    assert result.precision == "fp32" and f"s in fp32 on {result.hardware}" in result.summary()
    assert (tmp_path / "exp" / "checkpoints" / "checkpoint-1").is_dir()
    model, tokenizer = load_trained_model(result.model_dir)
    assert not (result.model_dir / "adapter_config.json").exists()  # merged into a plain model
    [reply] = HFGenerationBackend(model, tokenizer).generate([dataset[0]["prompt"]], max_new_tokens=4)
    assert isinstance(reply, str)
    checkpoint = tmp_path / "exp" / "checkpoints" / "checkpoint-2"  # a LoRA adapter: loads and evaluates too
    assert has_trained_model(checkpoint) and has_trained_model(result.model_dir) and not has_trained_model(tmp_path)
    load_trained_model(checkpoint)

    # Same data and settings: resumes from checkpoint-2 (already at max_steps, so no further step).
    # (Resumed mid-epoch, Trainer.train would take one more: a finished 6-step run once came back with 7.)
    saved = {path.name: path.read_bytes() for path in result.model_dir.iterdir()}
    again = train_sft(dataset, str(tiny), tmp_path / "exp", settings, cache_dir=tmp_path)
    # the same model, byte for byte (a trained save had the KV cache off in config.json, a resumed one on)
    assert {path.name: path.read_bytes() for path in again.model_dir.iterdir()} == saved
    assert again.resumed_from is not None and again.resumed_from.endswith("checkpoint-2")
    assert again.global_step == 2 and not (tmp_path / "exp" / "checkpoints" / "checkpoint-3").exists()
    assert (again.train_loss, again.final_loss) == (result.train_loss, result.final_loss)  # the same run's losses
    # and its training time, read from the checkpoint (this invocation trained nothing)
    assert 0 < again.seconds == float((checkpoint / "training_seconds.txt").read_text()) <= result.seconds
    load_trained_model(again.model_dir)


def test_a_kept_training_is_restored_elsewhere_instead_of_trained_again(tiny: Path, tmp_path: Path, caplog):
    """models.kept_trainings: a finished LoRA training is kept as its adapter (no optimizer state, no machine's
    path); a run with the same data and settings in another checkout restores it as the same model, byte for byte,
    with the first run's losses and time, and trains nothing; other settings train and are kept beside it."""
    dataset = sft_examples(annotate([_trajectory("tw-1"), _trajectory("tw-2")]), None, fmt(), outcome_repeats=1,
                           lookalike_repeats=1)
    settings = settings_from_params("training", epochs=1.0, max_steps=2, learning_rate=2e-4, batch_size=2,
                                    gradient_accumulation_steps=1, max_seq_len=1536, precision="fp32", save_steps=1,
                                    lora=settings_from_params("lora", r=4, alpha=8, top_layers=1))
    first = train_sft(dataset, str(tiny), tmp_path / "a" / "exp", settings, cache_dir=tmp_path / "a",
                      kept=tmp_path / "a" / "kept")
    [folder] = (tmp_path / "a" / "kept").iterdir()
    kept_files = {path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()}
    assert {"fingerprint.txt", "checkpoint-2/adapter_model.safetensors", "checkpoint-2/trainer_state.json",
            "checkpoint-2/training_seconds.txt"} <= kept_files
    assert not [name for name in kept_files if Path(name).name.startswith(TRAINING_STATE)]
    assert "checkpoint-2/tokenizer.json" not in kept_files  # the base model's, byte for byte: restored from there
    config = json.loads((folder / "checkpoint-2" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny)  # as params name it

    elsewhere = shutil.copytree(tmp_path / "a" / "kept", tmp_path / "b" / "kept")  # what a clone of the repo has
    trained_on = elsewhere / folder.name / "checkpoint-2" / "trained_on.json"
    assert json.loads(trained_on.read_text()) == {"precision": "fp32", "hardware": first.hardware}
    trained_on.write_text(json.dumps({"precision": "bf16", "hardware": "cpu: the machine that trained it"}))
    with caplog.at_level("INFO", logger="components.llm.sft"):
        again = train_sft(dataset, str(tiny), tmp_path / "b" / "exp", settings, cache_dir=tmp_path / "b",
                          kept=elsewhere)
    assert "restored the finished training kept in" in caplog.text
    assert again.resumed_from is not None and again.resumed_from.endswith("checkpoint-2")
    assert not (tmp_path / "b" / "exp" / "checkpoints" / "checkpoint-1").exists()  # nothing trained
    assert (again.global_step, again.train_loss, again.final_loss) == (first.global_step, first.train_loss,
                                                                       first.final_loss)
    assert 0 < again.seconds <= first.seconds
    assert (again.precision, again.hardware) == ("bf16", "cpu: the machine that trained it")  # not this one's
    assert {path.name: path.read_bytes() for path in again.model_dir.iterdir()} == \
        {path.name: path.read_bytes() for path in first.model_dir.iterdir()}
    # the model says which training made it: on a machine that merges it with other rounding, it is the same model
    assert (again.model_dir / "made_from.txt").read_text() == \
        f"sft {(tmp_path / 'a' / 'exp' / 'checkpoints' / 'fingerprint.txt').read_text().strip()}\n"

    other = train_sft(dataset, str(tiny), tmp_path / "b" / "exp", replace(settings, learning_rate=1e-4),
                      cache_dir=tmp_path / "b", kept=elsewhere)
    assert other.resumed_from is None and len(list(elsewhere.iterdir())) == 2
    full = train_sft(dataset, str(tiny), tmp_path / "b" / "full", replace(settings, lora=None, max_steps=1),
                     cache_dir=tmp_path / "b", kept=elsewhere)
    assert full.global_step == 1 and len(list(elsewhere.iterdir())) == 2  # a whole model is not kept


def test_the_same_seed_trains_the_same_model_byte_for_byte_and_another_seed_another(tiny: Path, tmp_path: Path):
    """A study's rows of one seed share its warm start only where DVC restores it: one trained again must be the same
    model, or rows of one seed compare policies from different starts."""
    dataset = sft_examples(annotate([_trajectory("tw-1"), _trajectory("tw-2")]), None, fmt(), outcome_repeats=1,
                           lookalike_repeats=1)
    settings = settings_from_params("training", epochs=1.0, max_steps=2, learning_rate=2e-4, batch_size=2,
                                    gradient_accumulation_steps=1, max_seq_len=1536, precision="fp32", seed=3,
                                    lora=settings_from_params("lora", r=4, alpha=8, top_layers=1))

    def weights(name: str, seed: int) -> dict[str, bytes]:
        trained = train_sft(dataset, str(tiny), tmp_path / name, replace(settings, seed=seed), cache_dir=tmp_path)
        return {path.name: path.read_bytes() for path in trained.model_dir.iterdir() if path.suffix == ".safetensors"}

    first = weights("first", 3)
    assert first and weights("again", 3) == first
    assert weights("other", 4) != first


def test_the_verdict_token_weighs_more_in_the_loss_and_a_changed_weight_starts_training_over(tiny: Path,
                                                                                            tmp_path: Path, caplog):
    """weighted_trainer's loss at weight 1 is TRL's own; at weight w a verdict token of the target counts w times.
    Training with it runs, and a run with another weight is another recipe: it does not resume the first."""
    import torch
    from trl import SFTConfig, SFTTrainer

    from components.llm.models import CHATML_TEMPLATE

    dataset = sft_examples(annotate([_trajectory("tw-1")]), None, fmt(), outcome_repeats=1, lookalike_repeats=1)
    assert any(f"The environment {VERDICT_WORDS[0]} it" in row["completion"][0]["content"] for row in dataset)
    model, tokenizer = load_trained_model(tiny)
    tokenizer.chat_template = tokenizer.chat_template or CHATML_TEMPLATE
    args = SFTConfig(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=3, completion_only_loss=True,
                     use_cpu=True, report_to="none", max_length=1536)
    examples = dataset.select_columns(["prompt", "completion"])
    plain = SFTTrainer(model=model, args=args, train_dataset=examples, processing_class=tokenizer)
    batch = next(iter(plain.get_train_dataloader()))
    # the test's tokenizer learnt ' accepted' whole but splits ' rejected': weighing ' re' would weigh 'red' too
    with pytest.raises(ValueError, match=r"' rejected' is 4 tokens .* set experience_model.verdict_weight to 1"):
        Emphasis(VERDICT_WORDS, 5.0).token_ids(tokenizer)
    verdicts = Emphasis(VERDICT_WORDS[:1], 5.0).token_ids(tokenizer)
    emphasized = torch.isin(batch["labels"][:, 1:], torch.tensor(verdicts))
    assert emphasized.any()

    def loss(trainer):
        with torch.no_grad():
            return trainer.compute_loss(model, dict(batch), return_outputs=True)
    same = weighted_trainer(verdicts, 1.0)(model=model, args=args, train_dataset=examples, processing_class=tokenizer)
    assert torch.allclose(loss(same)[0], loss(plain)[0])
    weighted, outputs = loss(weighted_trainer(verdicts, 5.0)(model=model, args=args, train_dataset=examples,
                                                             processing_class=tokenizer))
    assert torch.allclose(weighted, (-outputs.log_probs * (1 + 4 * emphasized)).sum() / outputs.label_mask.sum())
    assert weighted > loss(plain)[0]

    settings = settings_from_params("training", epochs=1.0, max_steps=1, learning_rate=2e-4, batch_size=1,
                                    gradient_accumulation_steps=1, max_seq_len=1536, precision="fp32", save_steps=1,
                                    lora=settings_from_params("lora", r=4, alpha=8, top_layers=1))
    with caplog.at_level("INFO", logger="components.llm.sft"):
        trained = train_sft(dataset, str(tiny), tmp_path / "exp", settings, cache_dir=tmp_path,
                            emphasis=Emphasis(VERDICT_WORDS[:1], 20.0))
    assert trained.global_step == 1 and trained.final_loss is not None
    counted = int(emphasized.sum())  # the batch above is the whole dataset: every verdict, once
    assert f"{counted} target tokens of 3 examples are accepted, weighing 20 times the others" in caplog.text
    assert train_sft(dataset, str(tiny), tmp_path / "exp", settings, cache_dir=tmp_path).resumed_from is None
    # weight 1 is plain SFT, the recipe of no emphasis: it resumes the plain run
    assert train_sft(dataset, str(tiny), tmp_path / "exp", settings, cache_dir=tmp_path,
                     emphasis=Emphasis(VERDICT_WORDS[:1], 1.0)).resumed_from is not None


def test_lora_top_layers_targets_only_the_top_layers(tiny: Path):
    model, _ = load_trained_model(tiny)
    targets = _lora_targets(model, settings_from_params("lora", top_layers=1))
    assert targets and all(".layers.1." in name for name in targets)
    assert {name.rsplit(".", 1)[1] for name in targets} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"}
    assert _lora_targets(model, settings_from_params("lora", target_modules="all-linear", top_layers=None)) == \
        "all-linear"


def test_full_fine_tuning_and_the_sequence_bound(tiny: Path, tmp_path: Path):
    dataset = sft_examples(annotate([_trajectory()]), None, fmt(), outcome_repeats=1, lookalike_repeats=1)
    settings = settings_from_params("training", epochs=1.0, max_steps=1, learning_rate=2e-4, batch_size=1,
                                    gradient_accumulation_steps=1, lora=None, precision="fp32", max_seq_len=500)

    result = train_sft(dataset, str(tiny), tmp_path / "full", settings, cache_dir=tmp_path)
    assert (result.examples, result.too_long) == (1, 2)  # left out, never cut
    load_trained_model(result.model_dir)
    with pytest.raises(ValueError, match="max_seq_len"):
        train_sft(dataset, str(tiny), tmp_path / "none", replace(settings, max_seq_len=10),
                               cache_dir=tmp_path)


def test_prediction_stats_add_counts_another_runs_predictions():
    seed, on_policy = PredictionStats(requests=8, generations=9, fallbacks=1), PredictionStats(
        requests=8, generations=8, fallbacks=8, backend_calls=2, backend_errors=1)
    seed.keep_failed("first")
    on_policy.keep_failed("second")
    on_policy.last_backend_error = "TimeoutError: slow"
    seed.add(on_policy)
    counts = (seed.requests, seed.generations, seed.fallbacks, seed.backend_calls, seed.backend_errors)
    assert counts == (16, 17, 9, 2, 1)
    assert seed.failed_replies == ["first", "second"] and seed.last_backend_error == "TimeoutError: slow"
    assert seed.fallback_rate == 9 / 16
