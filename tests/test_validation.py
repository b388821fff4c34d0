"""Every contract rule, each with a record that breaks only it, checked in one Great Expectations run."""
from __future__ import annotations

import copy
import json

import pytest

from components.data.validation import Limits, RawRecord, read_raw_records, validate_records
from tests.seed_factory import valid_record

LIMITS = Limits(max_text_length=100, reward_range=(-1.0, 1.0))


def _mutate(change):
    record = valid_record(0)
    change(record)
    return record


def _set(path, value):
    def change(record):
        target = record
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


def _delete(path):
    def change(record):
        target = record
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return change


# case id -> (mutation, expected rule, expected field)
CASES = {
    "missing trajectory_id": (_delete(["trajectory_id"]), "missing_field", "trajectory_id"),
    "null success": (_set(["success"], None), "missing_field", "success"),
    "missing task.instruction": (_delete(["task", "instruction"]), "missing_field", "task.instruction"),
    "missing step action": (_delete(["steps", 1, "action"]), "missing_field", "steps[1].action"),
    "return as string": (_set(["return"], "1.0"), "wrong_type", "return"),
    "success as int": (_set(["success"], 1), "wrong_type", "success"),
    "task as string": (_set(["task"], "cook"), "wrong_type", "task"),
    "steps as object": (_set(["steps"], {"0": {}}), "wrong_type", "steps"),
    "step as string": (_set(["steps", 2], "eat meal"), "wrong_type", "steps[2]"),
    "reward as bool": (_set(["steps", 0, "reward"], True), "wrong_type", "steps[0].reward"),
    "done as string": (_set(["steps", 0, "done"], "false"), "wrong_type", "steps[0].done"),
    "parameters as list": (_set(["task", "parameters"], [1]), "wrong_type", "task.parameters"),
    "info as string": (_set(["steps", 0, "info"], "x"), "wrong_type", "steps[0].info"),
    "unknown top-level field": (_set(["notes"], "hi"), "unknown_field", ""),
    "unknown task field": (_set(["task", "difficulty"], 3), "unknown_field", "task"),
    "unknown step field": (_set(["steps", 0, "obs"], "x"), "unknown_field", "steps[0]"),
    "empty steps": (_set(["steps"], []), "empty_steps", "steps"),
    "unknown source": (_set(["source"], "robot"), "unknown_source", "source"),
    "held-out game": (_set(["task"], {"task_id": "tw-s1000001", "environment": "textworld-cooking",
                                      "instruction": "Cook", "parameters": {"seed": 1_000_001}}),
                      "heldout_game", "task.parameters.seed"),
    "reward above range": (_set(["steps", 2, "reward"], 1.5), "reward_out_of_range", "steps[2].reward"),
    "reward below range": (_set(["steps", 0, "reward"], -3), "reward_out_of_range", "steps[0].reward"),
    "reward NaN": (_set(["steps", 0, "reward"], float("nan")), "reward_out_of_range", "steps[0].reward"),
    "reward infinite": (_set(["steps", 1, "reward"], float("inf")), "reward_out_of_range", "steps[1].reward"),
    "return infinite": (_set(["return"], float("-inf")), "non_finite", "return"),
    "done before last step": (_set(["steps", 0, "done"], True), "done_before_last_step", "steps[0].done"),
    "state chain broken": (_set(["steps", 2, "state"], "elsewhere"), "state_mismatch", "steps[2].state"),
    "state too long": (_set(["steps", 0, "state"], "s" * 101), "text_too_long", "steps[0].state"),
    "action too long": (_set(["steps", 1, "action"], "a" * 101), "text_too_long", "steps[1].action"),
    "next_state too long": (_set(["steps", 2, "next_state"], "n" * 101), "text_too_long", "steps[2].next_state"),
    "empty action": (_set(["steps", 0, "action"], ""), "empty_text", "steps[0].action"),
    "empty trajectory_id": (_set(["trajectory_id"], ""), "empty_text", "trajectory_id"),
    "empty environment": (_set(["task", "environment"], ""), "empty_text", "task.environment"),
    "lone surrogate in state": (_set(["steps", 0, "state"], "bad \ud800 text"), "invalid_utf8", "steps[0]"),
    "lone surrogate in instruction": (_set(["task", "instruction"], "\udc80"), "invalid_utf8", ""),
}


@pytest.fixture(scope="module")
def outcome():
    records = [RawRecord("cases.jsonl", line, value=_mutate(change))
               for line, (change, _, _) in enumerate(CASES.values(), start=1)]
    for record, name in zip(records, CASES):  # unique ids, so no case trips the uniqueness rule by accident
        if record.value.get("trajectory_id"):
            record.value["trajectory_id"] = f"case-{name}"
    records.append(RawRecord("cases.jsonl", len(records) + 1, value=valid_record(1)))
    report = validate_records(records, LIMITS)
    return {rejected.record.line: rejected.reasons for rejected in report.rejected}, report


@pytest.mark.parametrize("case", list(CASES))
def test_rule(outcome, case):
    reasons_by_line, _ = outcome
    line = list(CASES).index(case) + 1
    _, rule, field = CASES[case]
    reasons = reasons_by_line.get(line, [])
    assert (rule, field) in [(r.rule, r.field) for r in reasons], reasons
    assert all(r.message for r in reasons)


def test_valid_record_is_accepted_alongside_broken_ones(outcome):
    _, report = outcome
    assert [t.trajectory_id for _, t in report.accepted] == ["demo-0001"]
    assert len(report.rejected) == len(CASES)


def test_messages_name_the_fix(outcome):
    reasons_by_line, _ = outcome
    reason = next(r for r in reasons_by_line[list(CASES).index("reward above range") + 1])
    assert "1.5" in reason.message and "reward_range" in reason.message


def test_duplicate_ids_keep_the_first():
    first, second = valid_record(3), valid_record(3)
    second["steps"][0]["info"] = {"copy": 2}
    report = validate_records([RawRecord("a.jsonl", 1, value=first), RawRecord("a.jsonl", 2, value=second)], LIMITS)
    assert [r.line for r, _ in report.accepted] == [1]
    assert [(x.record.line, x.reasons[0].rule) for x in report.rejected] == [(2, "duplicate_id")]


def test_known_ids_identical_accepted_different_rejected():
    stored = valid_record(4)
    changed = copy.deepcopy(stored)
    changed["success"] = not changed["success"]
    known = {stored["trajectory_id"]: stored}
    same = validate_records([RawRecord("a.jsonl", 1, value=copy.deepcopy(stored))], LIMITS, known=known)
    other = validate_records([RawRecord("a.jsonl", 1, value=changed)], LIMITS, known=known)
    assert len(same.accepted) == 1 and not same.rejected
    assert [r.rule for r in other.rejected[0].reasons] == ["already_onboarded"]


def test_parse_failures(tmp_path):
    path = tmp_path / "raw.jsonl"
    good = json.dumps(valid_record(5)).encode()
    path.write_bytes(b"\n".join([good, b"{not json", b"[1, 2]", b'{"x": "\xff\xfe"}', b""]))
    records = read_raw_records(path)
    assert [(r.line, r.problem.rule if r.problem else None) for r in records] == [
        (1, None), (2, "invalid_json"), (3, "not_an_object"), (4, "invalid_utf8")]
    report = validate_records(records, LIMITS)
    assert len(report.accepted) == 1
    assert {r.record.line: r.record.text is not None for r in report.rejected} == {2: True, 3: False, 4: True}


def test_lone_surrogates_in_info_and_parameters_are_quarantined_by_path(tmp_path):
    from components.data.contract import write_trajectories

    in_info, in_key, good = valid_record(6), valid_record(7), valid_record(8)
    in_info["steps"][1]["info"] = {"n": ["ok", "\ud800"]}
    in_key["task"]["parameters"] = {"deep": {"\udc80k": 1}}
    records = [RawRecord("a.jsonl", line, value=v) for line, v in enumerate([in_info, in_key, good], start=1)]
    report = validate_records(records, LIMITS)
    assert {x.record.line: [str(r) for r in x.reasons] for x in report.rejected} == {
        1: ["steps[1]: not valid UTF-8 text (lone surrogates) in info.n[1]; fix the text encoding"],
        2: ["not valid UTF-8 text (lone surrogates) in task.parameters.deep.\\udc80k (the key); "
            "fix the text encoding"]}
    write_trajectories([t for _, t in report.accepted], tmp_path / "t.jsonl")  # no UnicodeEncodeError


def test_lone_surrogate_in_an_unknown_field_name_prints(tmp_path):
    from components.data.onboarding import OnboardingResult

    record = valid_record(9)
    record["\ud800x"] = 1
    report = validate_records([RawRecord("a.jsonl", 1, value=record)], LIMITS)
    assert [r.rule for r in report.rejected[0].reasons] == ["unknown_field"]
    summary = OnboardingResult(tmp_path, ["a.jsonl"], 1, 0, 0, rejected=report.rejected).summary()
    assert "\\ud800x" in summary.encode("utf-8").decode()  # encodes: print() does not raise


def test_numbers_too_large_are_rejected_not_crashing(tmp_path):
    record = valid_record(10)
    record["steps"][0]["reward"] = 10 ** 400
    report = validate_records([RawRecord("a.jsonl", 1, value=record)], LIMITS)
    assert [(r.rule, r.field) for r in report.rejected[0].reasons] == [("reward_out_of_range", "steps[0].reward")]
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps(valid_record(11)) + '\n{"return": ' + "1" * 4301 + "}\n"
                    + "".join('{"info": ' + "[" * depth + "]" * depth + "}\n" for depth in (500, 100_000)))
    records = read_raw_records(path)
    assert [(r.line, r.problem.rule if r.problem else None) for r in records] == [
        (1, None), (2, "invalid_json"), (3, "invalid_json"), (4, "invalid_json")]
    assert "4300 digits" in records[1].problem.message
    # 500 levels parse but would recurse out when written; 100,000 do not even parse
    assert all("nested more than 100 levels" in r.problem.message for r in records[2:])


def test_duplicate_ids_keep_the_first_valid_copy():
    broken, valid, later = valid_record(12), valid_record(12), valid_record(12)
    broken["success"] = "yes"
    later["steps"][0]["info"] = {"copy": 3}
    records = [RawRecord("a.jsonl", line, value=v) for line, v in enumerate([broken, valid, later], start=1)]
    report = validate_records(records, LIMITS)
    assert [r.line for r, _ in report.accepted] == [2]
    assert {x.record.line: sorted(r.rule for r in x.reasons) for x in report.rejected} == {
        1: ["duplicate_id", "wrong_type"], 3: ["duplicate_id"]}
    assert "first valid record" in report.rejected[1].reasons[0].message


def test_duplicate_of_an_identical_stored_record_is_kept_once():
    stored = valid_record(13)
    changed = copy.deepcopy(stored)
    changed["success"] = not changed["success"]
    records = [RawRecord("a.jsonl", 1, value=copy.deepcopy(stored)), RawRecord("a.jsonl", 2, value=changed)]
    report = validate_records(records, LIMITS, known={stored["trajectory_id"]: stored})
    assert [r.line for r, _ in report.accepted] == [1]
    assert sorted(r.rule for r in report.rejected[0].reasons) == ["already_onboarded", "duplicate_id"]


def test_null_info_and_parameters_are_empty(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from components.data.contract import PARQUET_SCHEMA

    record = valid_record(14)
    record["task"]["parameters"] = None
    for step in record["steps"]:
        step["info"] = None
    path = tmp_path / "nullable.parquet"  # a Parquet writer with nullable info/parameters columns
    pq.write_table(pa.Table.from_pylist([record], schema=PARQUET_SCHEMA), path)
    report = validate_records(read_raw_records(path), LIMITS)
    assert not report.rejected
    (_, trajectory), = report.accepted
    assert trajectory.task.parameters == {} and all(step.info == {} for step in trajectory.steps)
