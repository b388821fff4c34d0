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


def test_skipping_expert_episodes_are_collected_as_source_policy(tmp_path):
    from components.collection import collect_environment
    from components.config import load_params
    from tests.conftest import REPO, SMALL_RUN

    mix = {"expert": 0, "noisy_expert": 0, "skipping_expert": 1, "random": 0}
    params = load_params(REPO / "params.yaml", {**SMALL_RUN, "collect_seed.train_tasks": 1,
                                                 "collect_seed.episodes": mix})
    lines = []
    collected = collect_environment(params, "textworld-cooking", tmp_path / "tw.jsonl", tmp_path / "progress.jsonl",
                                    log=lines.append)
    assert [(t.trajectory_id.rsplit("-", 2)[1:], t.source) for t in collected] == [(["skipping_expert", "0"],
                                                                                     "policy")]
    assert (tmp_path / "tw.jsonl").exists() and not (tmp_path / "progress.jsonl").exists()
    assert not any("no skipping expert" in line for line in lines)
