"""Seed-data onboarding: validate user files, keep what passes, quarantine the rest with reasons, version it.

The data directory holds the canonical seed set:
  trajectories.jsonl  every accepted trajectory, sorted by id (deterministic bytes: same input, same DVC hash)
  tasks.jsonl         the distinct tasks of those trajectories
  quarantine.jsonl    every rejected record, as given, with the reasons and where it came from
  on_policy.jsonl     of those trajectories, the ones a trained policy played in the real environment and that were
                      fed back (`fed_back=True`): the experience model's training weighs them (policy_share)
Nothing the user gave is dropped, truncated or altered: a record is either stored whole or quarantined whole.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.data.contract import ON_POLICY, QUARANTINE, TASKS, TRAJECTORIES, read_records, write_records
from components.data.validation import Limits, Rejected, read_raw_records, validate_records
from components.files import atomic_write_text


@dataclass
class OnboardingResult:
    data_dir: Path
    files: list[str]
    read: int
    added: int  # new trajectories stored
    unchanged: int  # identical to a trajectory already stored
    replaced: int = 0  # stored trajectories overwritten (only with replace=True)
    removed: int = 0  # stored trajectories of an earlier collection that this one no longer holds (superseded)
    rejected: list[Rejected] = field(default_factory=list)
    version_note: str = ""

    @property
    def exit_code(self) -> int:
        return 1 if self.rejected else 0

    def summary(self, examples: int = 5) -> str:
        accepted = self.added + self.unchanged + self.replaced
        replaced = f", {self.replaced} replaced" if self.replaced else ""
        kept = f"  -> kept in {self.data_dir / QUARANTINE}" if self.rejected else ""
        lines = [
            f"Onboarded {self.read} record(s) from {len(self.files)} file(s) into {self.data_dir}/",
            f"  accepted  {accepted:>6}  ({self.added} new, {self.unchanged} already stored{replaced})",
            f"  rejected  {len(self.rejected):>6}{kept}",
        ]
        if self.removed:
            lines.append(f"  removed   {self.removed:>6}  (an earlier collection's, no longer collected)")
        if self.rejected:
            counts = Counter(reason.rule for rejected in self.rejected for reason in rejected.reasons)
            lines.append("Most common reasons:")
            lines += [f"  {count:>6}  {rule}" for rule, count in counts.most_common(5)]
            lines.append("Rejected records:")
            for rejected in self.rejected[:examples]:
                lines.append(f"  {rejected.record.where}")
                lines += [f"      {reason}" for reason in rejected.reasons]
            if len(self.rejected) > examples:
                lines.append(f"  ... and {len(self.rejected) - examples} more in {self.data_dir / QUARANTINE}")
            lines.append("Fix the records and onboard the corrected file again; accepted records are already stored.")
        if self.version_note:
            lines.append(self.version_note)
        return "\n".join(lines)


def onboard(paths: list[str | Path], data_dir: str | Path, limits: Limits, version: bool = True,
            replace: bool = False, supersedes: Collection[str] = (), fed_back: bool = False) -> OnboardingResult:
    """Validate `paths`, merge accepted trajectories into `data_dir`, quarantine the rest, `dvc add` the dir.

    A record whose id is already stored with other content is quarantined, unless `replace` (the pipeline's own
    re-collection of a task, which supersedes the earlier episode). `supersedes`: the ids of stored records the
    input replaces as a whole (the pipeline's earlier collection): those it no longer holds are removed, so data/
    follows the collection's params instead of keeping the union of every collection. `fed_back`: the input is a
    trained policy's real play (correction rounds), so its accepted trajectories are listed in on_policy.jsonl too,
    apart from any `source: policy` record of the seed. Raises `UnusableInput`
    before writing anything when a file is missing or not JSONL/Parquet.
    """
    data_dir = Path(data_dir)
    records = [record for path in paths for record in read_raw_records(path)]  # every file read before any write
    stored = {r["trajectory_id"]: r for r in _read_if_exists(data_dir / TRAJECTORIES)}
    report = validate_records(records, limits, known=None if replace else stored)

    added = replaced = 0
    for _, trajectory in report.accepted:
        record = trajectory.to_dict()
        if trajectory.trajectory_id not in stored:
            added += 1
        elif stored[trajectory.trajectory_id] != record:
            replaced += 1
        stored[trajectory.trajectory_id] = record
    # every id the input holds, rejected ones too: a record rejected now must not take its stored copy with it
    incoming = {r.value.get("trajectory_id") for r in records if isinstance(r.value, dict)}
    stale = [key for key in stored if key in supersedes and key not in incoming]
    for key in stale:
        del stored[key]
    ordered = [stored[key] for key in sorted(stored)]
    write_records(ordered, data_dir / TRAJECTORIES)
    write_records(_distinct_tasks(ordered), data_dir / TASKS)
    _append_quarantine(data_dir / QUARANTINE, report.rejected)
    if fed_back:
        kept = {r["trajectory_id"]: r for r in _read_if_exists(data_dir / ON_POLICY)}
        kept.update((t.trajectory_id, stored[t.trajectory_id]) for _, t in report.accepted)
        write_records([kept[key] for key in sorted(kept)], data_dir / ON_POLICY)

    result = OnboardingResult(data_dir, [str(p) for p in paths], len(records), added,
                              len(report.accepted) - added - replaced, replaced, len(stale), report.rejected)
    if version:
        result.version_note = version_with_dvc(data_dir)
    return result


def _read_if_exists(path: Path) -> list[dict[str, Any]]:
    return list(read_records(path)) if path.exists() else []


def _distinct_tasks(trajectories: list[dict[str, Any]]) -> list[dict[str, Any]]:
    tasks: dict[str, dict[str, Any]] = {}
    for trajectory in trajectories:
        tasks.setdefault(trajectory["task"]["task_id"], trajectory["task"])
    return [tasks[key] for key in sorted(tasks)]


def quarantine_entry(rejected: Rejected) -> dict[str, Any]:
    record = rejected.record
    return {
        "origin": record.origin,
        "line": record.line,
        "reasons": [{"rule": r.rule, "field": r.field, "message": r.message} for r in rejected.reasons],
        "record": record.value,  # the parsed record as given (None when it did not parse) ...
        "raw": record.text,  # ... or the original line when it did not
    }


def _append_quarantine(path: Path, rejected: list[Rejected]) -> None:
    """Keep earlier rejections, add new ones; the same record from the same place is kept once, newest reasons."""
    entries = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            entry = json.loads(line)
            entries[_identity(entry)] = entry
    for entry in map(quarantine_entry, rejected):
        entries[_identity(entry)] = entry
    # ensure_ascii keeps lone surrogates and odd bytes exactly, as escapes, instead of failing to write
    text = "".join(json.dumps(entry, ensure_ascii=True, sort_keys=True) + "\n" for entry in entries.values())
    atomic_write_text(path, text)


def _identity(entry: dict[str, Any]) -> str:
    return json.dumps([entry["origin"], entry["line"], entry["record"], entry["raw"]], sort_keys=True)


def version_with_dvc(data_dir: Path) -> str:
    """`dvc add` the data directory when it sits inside a DVC repository; say what happened either way."""
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo

    try:
        repo = Repo(str(data_dir.resolve().parent))
    except NotDvcRepoError:
        return f"Not versioned: {data_dir} is not inside a DVC repository (run `dvc init` to version seed data)."
    with repo:
        repo.add(str(data_dir.resolve()))
    dvc_file = data_dir.with_name(data_dir.name + ".dvc")
    return f"Versioned with DVC: {dvc_file} (commit it: git add {dvc_file} && git commit)."
