import math

import pytest

from components.data.contract import TaskRef, Trajectory, Transition, read_trajectories, transitions, write_trajectories
from tests.seed_factory import valid_record


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip(tmp_path, suffix):
    trajectories = [Trajectory.from_dict(valid_record(i)) for i in range(5)]
    trajectories[0].steps[0].info["note"] = {"nested": [1, "two"]}
    path = tmp_path / f"t{suffix}"
    write_trajectories(trajectories, path)
    assert read_trajectories(path) == trajectories
    assert not list(tmp_path.glob("*.partial"))


def test_dict_form_matches_the_documented_record():
    record = valid_record(2)
    assert Trajectory.from_dict(record).to_dict() == record


def test_transition_view_with_bounded_history():
    trajectory = Trajectory.from_dict(valid_record(0, n_steps=4))
    views = list(transitions(trajectory, history_length=2))
    assert [v.step_index for v in views] == [0, 1, 2, 3]
    assert views[0].history == ()
    assert views[3].history == tuple((s.state, s.action) for s in trajectory.steps[1:3])
    assert views[3].done and not views[2].done
    assert all(v.next_state == s.next_state and math.isclose(v.reward, s.reward)
               for v, s in zip(views, trajectory.steps))



def test_annotated_and_retrieved_records_are_the_contract_transition():
    from components.simulator.annotation import AnnotatedTransition, annotate
    from components.simulator.replay_buffer import Retrieved

    trajectory = Trajectory.from_dict(valid_record(0, n_steps=3))
    views = list(transitions(trajectory, history_length=0))
    annotated = annotate([trajectory])
    assert all(isinstance(a, Transition) and isinstance(a, AnnotatedTransition) for a in annotated)
    shared = ("trajectory_id", "step_index", "task", "state", "action", "next_state", "reward", "done", "source",
              "history", "info")
    assert [[getattr(a, name) for name in shared] for a in annotated] == \
        [[getattr(v, name) for name in shared] for v in views]
    # The annotated file's keys, in order: the transition's fields but history, then the trace.
    assert list(annotated[0].to_dict()) == ["trajectory_id", "step_index", "task", "state", "action", "next_state",
                                            "reward", "done", "source", "info", "reasoning", "annotator"]

    found = Retrieved.from_columns("demo-kitchen", "demo-cooking-0", "demo-0000", 1, "s", "a", "n", 0.0, False,
                                   "real", "expert", 0.5)
    assert isinstance(found.transition, Transition) and found.transition.source == found.origin == "expert"
    assert (found.environment, found.task_id, found.source, found.state, found.score) == (
        "demo-kitchen", "demo-cooking-0", "real", "s", 0.5)
    # The buffer keeps no instruction: a retrieved task is a TaskRef, and reading an instruction off it fails.
    assert found.transition.task == TaskRef("demo-cooking-0", "demo-kitchen")
    assert not hasattr(found.transition.task, "instruction")

def test_atomic_replace_restores_the_old_directory_when_the_swap_fails(tmp_path, monkeypatch):
    import os

    from components.files import atomic_directory

    target = tmp_path / "model"
    target.mkdir()
    (target / "weights").write_text("old")
    renames = []

    def failing_second_rename(src, dst):
        renames.append((src, dst))
        if len(renames) == 2:
            raise OSError("disk full")
        real_rename(src, dst)

    real_rename = os.rename
    monkeypatch.setattr(os, "rename", failing_second_rename)
    with pytest.raises(OSError, match="disk full"):
        with atomic_directory(target, replace=True) as tmp:
            (tmp / "weights").write_text("new")
    assert (target / "weights").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary or .old-* copy left


def test_a_whole_file_write_leaves_the_old_file_or_the_new_one_and_nothing_beside_it(tmp_path, monkeypatch):
    """Writers of the same file at once each leave it whole; a write that fails midway leaves the old file as it was
    and no temporary file beside it."""
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from components.files import atomic_write_bytes, atomic_write_text

    target = tmp_path / "log.jsonl"
    texts = [str(k) * 100_000 for k in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda text: atomic_write_text(target, text), texts))
    assert target.read_text() in texts
    assert [p.name for p in tmp_path.iterdir()] == ["log.jsonl"]

    def disk_full(self, data):
        with open(self, "wb") as handle:
            handle.write(data[:10])
        raise OSError("disk full")

    before = target.read_bytes()
    monkeypatch.setattr(Path, "write_bytes", disk_full)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["log.jsonl"]
