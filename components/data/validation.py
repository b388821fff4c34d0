"""Validation of untrusted trajectory records against the data contract, with Great Expectations.

Two passes. Parsing (bytes -> UTF-8 -> JSON -> an object) happens per record in Python, since no table exists
before it. Every record that parses is flattened into two tables, one row per trajectory and one per step, and
an expectation suite checks the contract on them: required fields and JSON types, reward range, non-empty
steps, `done` only on the last step, state continuity, unique ids, length limits, valid UTF-8. Each failed
expectation points at rows, and rows point back at records, so every rejected record carries all its reasons.
"""
from __future__ import annotations

import json
import logging
import math
import os
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from components.data.contract import HELDOUT_GAME_SEEDS, SOURCES, Trajectory, file_format, is_heldout_game

MISSING, NULL, NOT_APPLICABLE = "missing", "null", "n/a"  # pseudo JSON types in the *_type columns
TRAJECTORY_FIELDS = {"trajectory_id": "string", "task": "object", "steps": "array", "success": "boolean",
                     "return": "number", "source": "string"}
TASK_FIELDS = {"task_id": "string", "environment": "string", "instruction": "string"}
STEP_FIELDS = {"state": "string", "action": "string", "next_state": "string", "reward": "number",
               "done": "boolean"}
OPTIONAL_OBJECTS = {"task": "parameters", "step": "info"}
TEXT_LIMITED = ("state", "action", "next_state")  # the contract's length limit applies to these
MAX_DEPTH = 100  # levels of nested objects and lists in one record (a trajectory needs 4, its info a few more)


class UnusableInput(Exception):
    """The input as a whole cannot be read (missing file, unknown format, corrupt Parquet)."""


@dataclass(frozen=True)
class Limits:
    max_text_length: int
    reward_range: tuple[float, float]

    @classmethod
    def of(cls, data: Any) -> Limits:
        """From the `data` section of params."""
        return cls(data.max_text_length, (data.reward_range[0], data.reward_range[1]))


@dataclass(frozen=True)
class Reason:
    rule: str   # stable rule id, e.g. "reward_out_of_range"
    field: str  # where in the record, e.g. "steps[2].reward"
    message: str  # what is wrong and how to fix it

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


@dataclass
class RawRecord:
    origin: str  # the file it came from
    line: int    # 1-based line (JSONL) or row (Parquet)
    value: Any = None  # the parsed JSON value; None when it did not parse
    text: str | None = None  # the original text when it did not parse, kept for the quarantine
    problem: Reason | None = None  # set when parsing failed

    @property
    def where(self) -> str:
        unit = "row" if file_format(self.origin) == "parquet" else "line"
        trajectory_id = self.value.get("trajectory_id") if isinstance(self.value, dict) else None
        named = f" (trajectory_id {trajectory_id!r})" if isinstance(trajectory_id, str) else ""
        return f"{self.origin} {unit} {self.line}{named}"


@dataclass
class Rejected:
    record: RawRecord
    reasons: list[Reason]


@dataclass
class ValidationReport:
    accepted: list[tuple[RawRecord, Trajectory]] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------- reading
def read_raw_records(path: str | Path) -> list[RawRecord]:
    """Every record of a JSONL or Parquet file, parsed where possible; parse failures become reasons."""
    path = Path(path)
    if not path.is_file():
        raise UnusableInput(f"{path}: no such file; check the path (directories are not read, name the files)")
    kind = file_format(path)
    if kind is None:
        raise UnusableInput(f"{path}: unsupported file type {path.suffix!r}; give JSONL (.jsonl) or Parquet (.parquet)")
    records = _read_parquet(path) if kind == "parquet" else _read_jsonl(path)
    if not records:
        raise UnusableInput(f"{path}: contains no records")
    return records


def _read_jsonl(path: Path) -> list[RawRecord]:
    records = []
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                problem = Reason("invalid_utf8", "", f"line is not valid UTF-8 (byte {error.start}); "
                                                     "re-export the file as UTF-8")
                records.append(RawRecord(str(path), number, text=raw.decode("utf-8", "backslashreplace"),
                                         problem=problem))
                continue
            too_deep = f"objects or lists nested more than {MAX_DEPTH} levels deep; flatten the line's structure"
            try:
                value = json.loads(text)
                # deeper than MAX_DEPTH, writing or comparing the record would recurse out
                unreadable = too_deep if _depth(value) > MAX_DEPTH else None
            except json.JSONDecodeError as error:
                unreadable = f"not valid JSON ({error}); write one complete JSON object per line"
            except ValueError:  # an integer literal over Python's 4300-digit limit: not a JSONDecodeError
                unreadable = ("a number with over 4300 digits, more than a JSON reader takes; fix the value (keep "
                              "exact big numbers as strings in info)")
            except RecursionError:
                unreadable = too_deep
            if unreadable:
                records.append(RawRecord(str(path), number, text=text.rstrip("\n"),
                                         problem=Reason("invalid_json", "", unreadable)))
                continue
            problem = None if isinstance(value, dict) else Reason(
                "not_an_object", "", f"a JSON {_json_type(value)}, not an object; "
                                     "each line must be one trajectory object")
            records.append(RawRecord(str(path), number, value=value, problem=problem))
    return records


def _depth(value: Any) -> int:
    """How deeply objects and lists nest in `value` (a loop, not recursion: the input may nest arbitrarily)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _read_parquet(path: Path) -> list[RawRecord]:
    from components.data.contract import read_records  # the contract owns the Parquet encoding of objects

    try:
        rows = list(read_records(path))
    except Exception as error:  # pyarrow raises several types for corrupt or non-Parquet files
        raise UnusableInput(f"{path}: cannot be read as Parquet ({error}); re-export it or use JSONL") from None
    return [RawRecord(str(path), number, value=row) for number, row in enumerate(rows, start=1)]


# --------------------------------------------------------------------------------------------------- tables
def _json_type(value: Any) -> str:
    if value is None:
        return NULL
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", dict: "object", list: "array"}.get(type(value), type(value).__name__)


def _types(prefix: str, obj: Any, fields: Iterable[str]) -> dict[str, str]:
    if not isinstance(obj, dict):
        return {f"{prefix}{name}__type": NOT_APPLICABLE for name in fields}  # the parent's own rule reports it
    return {f"{prefix}{name}__type": _json_type(obj[name]) if name in obj else MISSING for name in fields}


def _finite_or_inf(value: Any) -> float | None:
    """Numbers as floats with NaN, infinities and integers too large for a float as +inf, so a range expectation
    flags them; others None."""
    if _json_type(value) != "number":
        return None
    try:
        return float(value) if math.isfinite(value) else math.inf
    except OverflowError:  # a huge JSON integer literal
        return math.inf


def _text(value: Any) -> str | None:
    """Strings for the table; lone surrogates escaped, since Arrow-backed pandas strings cannot hold them."""
    if not isinstance(value, str):
        return None
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def _not_utf8(obj: Any, names: Iterable[str], prefix: str = "") -> str | None:
    """Paths of the text in these fields, nested keys and values included, that is not valid UTF-8."""
    if not isinstance(obj, dict):
        return None
    bad = []
    # A queue, not recursion: user objects may nest as deep as the JSON parser allows.
    pending = deque((f"{prefix}{name}", obj[name]) for name in names if name in obj)
    while pending:
        path, value = pending.popleft()
        if isinstance(value, str) and _text(value) != value:
            bad.append(path)
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{_text(key) or key}"
                if isinstance(key, str) and _text(key) != key:
                    bad.append(f"{child} (the key)")
                pending.append((child, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{number}]", item) for number, item in enumerate(value))
    return ", ".join(bad) or None


def _unknown(obj: Any, known: Iterable[str]) -> str | None:
    if not isinstance(obj, dict):
        return None
    extra = sorted(set(obj) - set(known))
    return ", ".join(map(str, map(_text, extra))) or None  # escaped: a lone surrogate in a name breaks tables


def _tables(records: list[RawRecord]) -> tuple[pd.DataFrame, pd.DataFrame]:
    trajectory_rows, step_rows = [], []
    for index, record in enumerate(records):
        value = record.value
        task = value.get("task")
        steps = value.get("steps")
        row: dict[str, Any] = {"record": index}
        row |= _types("", value, TRAJECTORY_FIELDS)
        row |= _types("task.", task, [*TASK_FIELDS, "parameters"])
        row["trajectory_id"] = _text(value.get("trajectory_id"))
        row["task_id"] = _text(task.get("task_id")) if isinstance(task, dict) else None
        row["environment"] = _text(task.get("environment")) if isinstance(task, dict) else None
        row["instruction"] = _text(task.get("instruction")) if isinstance(task, dict) else None
        row["source"] = _text(value.get("source"))
        row["return_value"] = _finite_or_inf(value.get("return"))
        row["heldout_game"] = isinstance(task, dict) and is_heldout_game(task.get("environment"),
                                                                          task.get("parameters"))
        row["n_steps"] = len(steps) if isinstance(steps, list) else None
        row["unknown_fields"] = _unknown(value, TRAJECTORY_FIELDS)
        row["task.unknown_fields"] = _unknown(task, [*TASK_FIELDS, "parameters"])
        row["not_utf8"] = ", ".join(filter(None, [_not_utf8(value, ["trajectory_id", "source"]),
                                                  _not_utf8(task, [*TASK_FIELDS, "parameters"], "task.")])) or None
        trajectory_rows.append(row)
        if not isinstance(steps, list):
            continue
        for number, step in enumerate(steps):
            previous = steps[number - 1] if number else None
            srow: dict[str, Any] = {"record": index, "step": number, "is_last": number == len(steps) - 1,
                                    "step__type": _json_type(step)}
            srow |= _types("", step, [*STEP_FIELDS, "info"])
            srow["reward_value"] = _finite_or_inf(step.get("reward")) if isinstance(step, dict) else None
            srow["done"] = step.get("done") if isinstance(step, dict) and isinstance(step.get("done"), bool) else None
            for name in TEXT_LIMITED:
                text = step.get(name) if isinstance(step, dict) else None
                srow[f"{name}_length"] = len(text) if isinstance(text, str) else None
            srow["state"] = _text(step.get("state")) if isinstance(step, dict) else None
            srow["previous_next_state"] = _text(previous.get("next_state")) if isinstance(previous, dict) else None
            srow["unknown_fields"] = _unknown(step, [*STEP_FIELDS, "info"])
            srow["not_utf8"] = _not_utf8(step, [*TEXT_LIMITED, "info"])
            step_rows.append(srow)
    return _object_frame(trajectory_rows), _object_frame(step_rows)


def _object_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    frame = pd.DataFrame(rows)
    # Object dtype keeps JSON types as they came (no int -> float, no bool -> object surprises).
    return frame.astype(object) if len(frame) else frame


# --------------------------------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class Rule:
    name: str
    table: str  # "trajectories" or "steps"
    field: str  # the contract field; "{step}" is filled in for step rules
    expectation: Any  # a great_expectations Expectation
    explain: Callable[[pd.Series], str]  # the offending row -> what is wrong and the fix


def _type_rules(table: str, prefix: str, fields: dict[str, str], where: str) -> list[Rule]:
    import great_expectations as gx

    rules = []
    for name, expected in fields.items():
        column = f"{prefix}{name}__type"
        rules.append(Rule("missing_field", table, f"{where}{name}",
                          gx.expectations.ExpectColumnValuesToNotBeInSet(column=column, value_set=[MISSING, NULL]),
                          lambda row, n=name, t=expected: f"required {t} is missing or null; add '{n}'"))
        rules.append(Rule("wrong_type", table, f"{where}{name}",
                          gx.expectations.ExpectColumnValuesToBeInSet(
                              column=column, value_set=[expected, MISSING, NULL, NOT_APPLICABLE]),
                          lambda row, c=column, t=expected: f"expected a JSON {t}, got a {row[c]}"))
    return rules


def build_rules(limits: Limits, known_ids: Iterable[str] = ()) -> list[Rule]:
    import great_expectations as gx
    from great_expectations.expectations.row_conditions import Column

    E = gx.expectations
    low, high = limits.reward_range
    cap = limits.max_text_length
    rules = [
        *_type_rules("trajectories", "", TRAJECTORY_FIELDS, ""),
        *_type_rules("trajectories", "task.", TASK_FIELDS, "task."),
        Rule("wrong_type", "trajectories", "task.parameters",
             E.ExpectColumnValuesToBeInSet(column="task.parameters__type",
                                           value_set=["object", MISSING, NULL, NOT_APPLICABLE]),
             lambda row: f"optional parameters must be an object, got a {row['task.parameters__type']}"),
        Rule("unknown_field", "trajectories", "", E.ExpectColumnValuesToBeNull(column="unknown_fields"),
             lambda row: f"unknown field(s) {row['unknown_fields']}; the contract has {', '.join(TRAJECTORY_FIELDS)} "
                         "(put your own data in task.parameters or steps[].info)"),
        Rule("unknown_field", "trajectories", "task", E.ExpectColumnValuesToBeNull(column="task.unknown_fields"),
             lambda row: f"unknown field(s) {row['task.unknown_fields']}; a task has task_id, environment, "
                         "instruction, parameters (put your own data in parameters)"),
        Rule("heldout_game", "trajectories", "task.parameters.seed",
             E.ExpectColumnValuesToBeInSet(column="heldout_game", value_set=[False]),
             lambda row: f"{row['task_id']!r} is a held-out evaluation game of {row['environment']} (seed in "
                         f"[{HELDOUT_GAME_SEEDS.start}, {HELDOUT_GAME_SEEDS.stop})): its transitions only measure "
                         "and never train or ground anything; onboard games of the train split"),
        Rule("empty_steps", "trajectories", "steps", E.ExpectColumnValuesToBeBetween(column="n_steps", min_value=1),
             lambda row: "no steps; a trajectory needs at least one step"),
        Rule("unknown_source", "trajectories", "source",
             E.ExpectColumnValuesToBeInSet(column="source", value_set=list(SOURCES)),
             lambda row: f"{row['source']!r} is not a source; use one of {', '.join(SOURCES)}"),
        Rule("duplicate_id", "trajectories", "trajectory_id", E.ExpectColumnValuesToBeUnique(column="trajectory_id"),
             lambda row: f"{row['trajectory_id']!r} appears more than once in the input; ids must be unique "
                         "(only the first valid record with it is kept), give this one its own id"),
        Rule("non_finite", "trajectories", "return",
             E.ExpectColumnValuesToBeBetween(column="return_value", min_value=-1e308, max_value=1e308),
             lambda row: "return is NaN, infinite or too large; give the finite sum of rewards"),
        Rule("empty_text", "trajectories", "trajectory_id",
             E.ExpectColumnValueLengthsToBeBetween(column="trajectory_id", min_value=1),
             lambda row: "empty id; give each trajectory a non-empty unique id"),
        Rule("empty_text", "trajectories", "task.task_id",
             E.ExpectColumnValueLengthsToBeBetween(column="task_id", min_value=1),
             lambda row: "empty task id; name the task"),
        Rule("empty_text", "trajectories", "task.environment",
             E.ExpectColumnValueLengthsToBeBetween(column="environment", min_value=1),
             lambda row: "empty environment; name the application the trajectory comes from"),
        Rule("invalid_utf8", "trajectories", "", E.ExpectColumnValuesToBeNull(column="not_utf8"),
             lambda row: f"not valid UTF-8 text (lone surrogates) in {row['not_utf8']}; fix the text encoding"),
        Rule("wrong_type", "steps", "steps[{step}]",
             E.ExpectColumnValuesToBeInSet(column="step__type", value_set=["object"]),
             lambda row: f"a step must be an object, got a {row['step__type']}"),
        *_type_rules("steps", "", STEP_FIELDS, "steps[{step}]."),
        Rule("wrong_type", "steps", "steps[{step}].info",
             E.ExpectColumnValuesToBeInSet(column="info__type", value_set=["object", MISSING, NULL, NOT_APPLICABLE]),
             lambda row: f"optional info must be an object, got a {row['info__type']}"),
        Rule("unknown_field", "steps", "steps[{step}]", E.ExpectColumnValuesToBeNull(column="unknown_fields"),
             lambda row: f"unknown field(s) {row['unknown_fields']}; a step has {', '.join(STEP_FIELDS)}, info "
                         "(put your own data in info)"),
        Rule("reward_out_of_range", "steps", "steps[{step}].reward",
             E.ExpectColumnValuesToBeBetween(column="reward_value", min_value=low, max_value=high),
             lambda row: (f"{row['reward_value']} is outside [{low}, {high}]" if math.isfinite(row["reward_value"])
                          else "reward is NaN, infinite or too large")
             + "; rescale rewards or set data.reward_range in params.yaml"),
        Rule("done_before_last_step", "steps", "steps[{step}].done",
             E.ExpectColumnValuesToBeInSet(column="done", value_set=[False], row_condition=Column("is_last") == False),  # noqa: E712
             lambda row: "done is true before the last step; only the final step may end the episode "
                         "(split the trajectory there, or set done false)"),
        Rule("state_mismatch", "steps", "steps[{step}].state",
             E.ExpectColumnPairValuesToBeEqual(column_A="state", column_B="previous_next_state",
                                               ignore_row_if="either_value_is_missing",  # reported as missing
                                               row_condition=Column("step") > 0),
             lambda row: f"differs from steps[{row['step'] - 1}].next_state; each state must equal the previous "
                         "step's next_state (a missing step in between?)"),
        *[Rule("text_too_long", "steps", f"steps[{{step}}].{name}",
               E.ExpectColumnValuesToBeBetween(column=f"{name}_length", max_value=cap),
               lambda row, n=name: f"{int(row[f'{n}_length'])} characters, over the limit of {cap}; shorten the "
                                   "abstract state/action or raise data.max_text_length in params.yaml")
          for name in TEXT_LIMITED],
        Rule("empty_text", "steps", "steps[{step}].action",
             E.ExpectColumnValuesToBeBetween(column="action_length", min_value=1),
             lambda row: "empty action; record the action that was taken"),
        Rule("invalid_utf8", "steps", "steps[{step}]", E.ExpectColumnValuesToBeNull(column="not_utf8"),
             lambda row: f"not valid UTF-8 text (lone surrogates) in {row['not_utf8']}; fix the text encoding"),
    ]
    if known_ids:
        rules.append(Rule("already_onboarded", "trajectories", "trajectory_id",
                          E.ExpectColumnValuesToNotBeInSet(column="trajectory_id", value_set=sorted(known_ids)),
                          lambda row: f"{row['trajectory_id']!r} is already in the data directory with different "
                                      "content; give the new trajectory its own id"))
    return rules


# --------------------------------------------------------------------------------------------------- running
def _failing_rows(rules: list[Rule], frame: pd.DataFrame, name: str) -> dict[int, list[Rule]]:
    """Run the rules of one table as a Great Expectations suite; map row index -> the rules it broke."""
    import great_expectations as gx

    rules = [rule for rule in rules if rule.table == name]
    if frame.empty or not rules:
        return {}
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = {"globally": False}  # a CLI prints its own summary
    batch = context.data_sources.add_pandas(name).add_dataframe_asset(name).add_batch_definition_whole_dataframe(name)
    suite = context.suites.add(gx.ExpectationSuite(name=f"dreamgym-{name}"))
    for rule in rules:
        suite.add_expectation(rule.expectation)
    validation = context.validation_definitions.add(gx.ValidationDefinition(name=name, data=batch, suite=suite))
    result = validation.run(batch_parameters={"dataframe": frame}, result_format={"result_format": "COMPLETE"})
    failing: dict[int, list[Rule]] = {}
    by_id = {rule.expectation.id: rule for rule in rules}  # adding to the suite gave each expectation an id
    for outcome in result.results:
        if outcome.exception_info and outcome.exception_info.get("raised_exception"):
            raise RuntimeError(f"validation rule failed to run: {outcome.exception_info['exception_message']}")
        if outcome.success:
            continue
        rule = by_id[outcome.expectation_config.id]
        for index in outcome.result.get("unexpected_index_list") or []:
            failing.setdefault(int(index), []).append(rule)
    return failing


def validate_records(records: list[RawRecord], limits: Limits, known: dict[str, dict[str, Any]] | None = None,
                     ) -> ValidationReport:
    """Split records into accepted trajectories and rejected records with every reason each one broke.

    `known` maps trajectory ids already onboarded to their canonical records: an identical record is accepted
    (onboarding the same file twice is harmless); the same id with other content is rejected.
    """
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    import great_expectations  # noqa: F401  (importing it sets one of its loggers to INFO: a docs site per context)
    logging.getLogger("great_expectations.data_context.types.base").setLevel(logging.WARNING)
    known = known or {}
    report = ValidationReport()
    parsed = [r for r in records if r.problem is None]
    report.rejected += [Rejected(r, [r.problem]) for r in records if r.problem is not None]
    trajectories, steps = _tables(parsed)
    rules = build_rules(limits, known_ids=known)
    reasons: dict[int, list[Reason]] = {}
    for row, broken in _failing_rows(rules, trajectories, "trajectories").items():
        index = trajectories.at[row, "record"]
        reasons.setdefault(index, []).extend(Reason(r.name, r.field, r.explain(trajectories.loc[row])) for r in broken)
    for row, broken in _failing_rows(rules, steps, "steps").items():
        index, number = steps.at[row, "record"], steps.at[row, "step"]
        reasons.setdefault(index, []).extend(
            Reason(r.name, r.field.format(step=number), r.explain(steps.loc[row])) for r in broken)
    _accept_identical_known(parsed, reasons, known)  # first: an identical copy of a stored record is valid
    _keep_first_of_duplicates(parsed, reasons)
    for index, record in enumerate(parsed):
        if reasons.get(index):
            report.rejected.append(Rejected(record, reasons[index]))
        else:
            report.accepted.append((record, Trajectory.from_dict(record.value)))
    report.rejected.sort(key=lambda rejected: (rejected.record.origin, rejected.record.line))
    return report


def _keep_first_of_duplicates(parsed: list[RawRecord], reasons: dict[int, list[Reason]]) -> None:
    """The uniqueness expectation flags every copy of an id; the first copy that broke no other rule is kept."""
    kept: set[str] = set()
    for index, record in enumerate(parsed):
        own = reasons.get(index, [])
        if not own or any(reason.rule != "duplicate_id" for reason in own):
            continue
        trajectory_id = record.value.get("trajectory_id")
        if trajectory_id not in kept:
            kept.add(trajectory_id)
            reasons[index] = []


def _accept_identical_known(parsed: list[RawRecord], reasons: dict[int, list[Reason]],
                            known: dict[str, dict[str, Any]]) -> None:
    for index, record in enumerate(parsed):
        own = reasons.get(index, [])
        if {reason.rule for reason in own} - {"duplicate_id"} != {"already_onboarded"}:
            continue
        if Trajectory.from_dict(record.value).to_dict() == known[record.value["trajectory_id"]]:
            reasons[index] = [reason for reason in own if reason.rule != "already_onboarded"]
