"""components/collection.py: a crashed collection resumes its own finished episodes, never another's."""
from components.collection import _load_progress
from tests.seed_factory import valid_record, write_jsonl


def test_progress_is_resumed_only_by_the_same_collection(tmp_path):
    progress = write_jsonl([valid_record(0), valid_record(1)], tmp_path / "textworld.jsonl")
    (tmp_path / "textworld.fingerprint").write_text("params-and-code-a\n")

    assert sorted(_load_progress(progress, "params-and-code-a")) == ["demo-0000", "demo-0001"]
    # the params or the collection code changed since the crash: those episodes are not this collection's
    assert _load_progress(progress, "params-and-code-b") == {} and not progress.exists()
    assert (tmp_path / "textworld.fingerprint").read_text() == "params-and-code-b\n"
