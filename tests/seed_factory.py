"""Seed records for tests and the onboarding demo: valid ones, and the same broken in ten different ways.

Writes the two example files named in the README:
  python -m tests.seed_factory valid 24 examples/seed/demo-kitchen.jsonl
  python -m tests.seed_factory mixed 100 examples/seed/mixed-100.jsonl
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

ROOMS = ["kitchen", "pantry", "garden", "cellar"]
ITEMS = ["red potato", "carrot", "yellow pepper", "block of cheese", "red apple"]


def valid_record(index: int, n_steps: int = 3) -> dict[str, Any]:
    """A well-formed trajectory: a small cooking episode whose states chain step to step."""
    room, item = ROOMS[index % len(ROOMS)], ITEMS[index % len(ITEMS)]
    actions = ["open fridge", f"take {item} from fridge", "prepare meal", "eat meal"][:n_steps]
    states = [f"You are in the {room}. You see a closed fridge."]
    states += [f"You are in the {room}. Step {i + 1}: you did '{a}'." for i, a in enumerate(actions)]
    success = index % 3 == 0
    steps = [{"state": states[i], "action": a, "next_state": states[i + 1],
              "reward": 1.0 if (success and i == n_steps - 1) else 0.0, "done": i == n_steps - 1, "info": {}}
             for i, a in enumerate(actions)]
    return {"trajectory_id": f"demo-{index:04d}",
            "task": {"task_id": f"demo-cooking-{index % 7}", "environment": "demo-kitchen",
                     "instruction": f"Cook a meal with the {item}, then eat it.", "parameters": {"variant": index % 7}},
            "steps": steps, "success": success, "return": 1.0 if success else 0.0, "source": "expert"}


def _break(record: dict[str, Any], how: str) -> dict[str, Any] | str:
    broken = copy.deepcopy(record)
    steps = broken["steps"]
    if how == "invalid_json":
        return json.dumps(broken)[:-7]  # a line cut short
    if how == "missing_field":
        del broken["success"]
    elif how == "wrong_type":
        steps[0]["reward"] = "0.5"
    elif how == "reward_out_of_range":
        steps[-1]["reward"] = 5.0
    elif how == "empty_steps":
        broken["steps"] = []
    elif how == "done_before_last_step":
        steps[0]["done"] = True
    elif how == "state_mismatch":
        steps[1]["state"] = "You are somewhere else entirely."
    elif how == "duplicate_id":
        broken["trajectory_id"] = "demo-0000"
    elif how == "text_too_long":
        steps[0]["action"] = "open fridge " * 6000  # 72,000 characters, over the 65,536 default
    elif how == "unknown_source":
        broken["source"] = "robot"
    else:
        raise ValueError(how)
    return broken


BREAKAGES = ["invalid_json", "missing_field", "wrong_type", "reward_out_of_range", "empty_steps",
             "done_before_last_step", "state_mismatch", "duplicate_id", "text_too_long", "unknown_source"]


def mixed_records(total: int = 100) -> tuple[list[dict[str, Any] | str], dict[int, str]]:
    """`total` records, the last len(BREAKAGES) broken one way each; returns them and {line: breakage}."""
    records: list[dict[str, Any] | str] = [valid_record(i) for i in range(total)]
    broken_at = {}
    for offset, how in enumerate(BREAKAGES):
        index = total - len(BREAKAGES) + offset
        records[index] = _break(records[index], how)
        broken_at[index + 1] = how  # 1-based line numbers
    return records, broken_at


def write_jsonl(records: list[dict[str, Any] | str], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for record in records:
            out.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return path


if __name__ == "__main__":
    kind, count, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    write_jsonl([valid_record(i) for i in range(count)] if kind == "valid" else mixed_records(count)[0], out)
