"""`dreamgym data onboard` as a user runs it: exit codes, summary, quarantine, DVC versioning."""
import json

import pytest

from components.data.contract import read_records, write_records
from tests.conftest import REPO, run
from tests.seed_factory import BREAKAGES, mixed_records, valid_record, write_jsonl


def test_hundred_records_ten_broken_ten_ways(project):
    records, broken_at = mixed_records(100)
    seed = write_jsonl(records, project / "seed.jsonl")
    result = run("dreamgym", "data", "onboard", str(seed), cwd=project, check=False)
    assert result.returncode == 1, result.stderr
    assert "accepted      90" in result.stdout and "rejected      10" in result.stdout
    assert "Most common reasons:" in result.stdout and "quarantine.jsonl" in result.stdout

    stored = list(read_records(project / "data" / "trajectories.jsonl"))
    assert len(stored) == 90
    quarantine = [json.loads(line) for line in (project / "data" / "quarantine.jsonl").read_text().splitlines()]
    assert {entry["line"]: entry["reasons"][0]["rule"] for entry in quarantine} == broken_at
    assert sorted(broken_at.values()) == sorted(BREAKAGES)
    for entry in quarantine:  # nothing lost: the record as given, or its raw text when it did not parse
        assert entry["record"] is not None or entry["raw"]
        assert all(reason["message"] for reason in entry["reasons"])
    assert (project / "data.dvc").exists()
    assert "/data" in (project / ".gitignore").read_text()


def test_onboarding_again_is_idempotent(project):
    seed = write_jsonl(mixed_records(30)[0], project / "seed.jsonl")
    run("dreamgym", "data", "onboard", str(seed), cwd=project, check=False)
    stored = {name: (project / "data" / name).read_bytes() for name in ("trajectories.jsonl", "tasks.jsonl")}
    again = run("dreamgym", "data", "onboard", str(seed), cwd=project, check=False)
    assert again.returncode == 1 and "(0 new, 20 already stored)" in again.stdout
    assert {name: (project / "data" / name).read_bytes() for name in stored} == stored
    quarantine = [json.loads(line) for line in (project / "data" / "quarantine.jsonl").read_text().splitlines()]
    assert sorted(entry["line"] for entry in quarantine) == list(range(21, 31))  # each rejected record once


def test_all_accepted_exits_zero_and_merges(project):
    first = write_jsonl([valid_record(i) for i in range(3)], project / "a.jsonl")
    second = project / "b.parquet"
    write_records([valid_record(i) for i in range(3, 5)], second)
    assert run("dreamgym", "data", "onboard", str(first), cwd=project).returncode == 0
    result = run("dreamgym", "data", "onboard", str(second), "--data-dir", "data", cwd=project)
    assert "(2 new, 0 already stored)" in result.stdout
    ids = [r["trajectory_id"] for r in read_records(project / "data" / "trajectories.jsonl")]
    assert ids == [f"demo-{i:04d}" for i in range(5)]
    tasks = [t["task_id"] for t in read_records(project / "data" / "tasks.jsonl")]
    assert tasks == sorted(set(tasks)) and len(tasks) == 5


def test_unusable_input_exits_two_and_writes_nothing(project):
    missing = run("dreamgym", "data", "onboard", "nope.jsonl", cwd=project, check=False)
    assert missing.returncode == 2 and "no such file" in missing.stderr
    (project / "seed.csv").write_text("a,b\n")
    wrong = run("dreamgym", "data", "onboard", "seed.csv", cwd=project, check=False)
    assert wrong.returncode == 2 and "give JSONL (.jsonl) or Parquet (.parquet)" in wrong.stderr
    (project / "empty.jsonl").write_text("\n")
    empty = run("dreamgym", "data", "onboard", "empty.jsonl", cwd=project, check=False)
    assert empty.returncode == 2 and "contains no records" in empty.stderr
    (project / "corrupt.parquet").write_bytes(b"not parquet")
    corrupt = run("dreamgym", "data", "onboard", "corrupt.parquet", cwd=project, check=False)
    assert corrupt.returncode == 2 and "cannot be read as Parquet" in corrupt.stderr
    assert not (project / "data").exists()


def test_bad_params_exit_two(project):
    params = project / "params.yaml"
    params.write_text(params.read_text().replace("max_text_length:", "max_text_lenght:"))
    result = run("dreamgym", "data", "onboard", "x.jsonl", cwd=project, check=False)
    assert result.returncode == 2 and "did you mean 'max_text_length'" in result.stderr


def test_replace_mode_supersedes_stored_records(tmp_path):
    """The pipeline's re-collection replaces its earlier episodes; a user's id clash is quarantined instead."""
    from components.data.onboarding import onboard
    from components.data.validation import Limits

    limits = Limits(65536, (-1.0, 1.0))
    first = write_jsonl([valid_record(i) for i in range(3)], tmp_path / "a.jsonl")
    onboard([first], tmp_path / "data", limits, version=False)
    changed = [valid_record(i) for i in range(4)]
    changed[0]["success"] = not changed[0]["success"]
    second = write_jsonl(changed, tmp_path / "b.jsonl")
    assert len(onboard([second], tmp_path / "data", limits, version=False).rejected) == 1
    result = onboard([second], tmp_path / "data", limits, version=False, replace=True)
    assert (result.added, result.unchanged, result.replaced, result.rejected) == (0, 3, 1, [])
    stored = list(read_records(tmp_path / "data" / "trajectories.jsonl"))
    assert stored[0]["success"] == changed[0]["success"] and len(stored) == 4


def test_a_new_collection_supersedes_the_earlier_one_and_keeps_user_data(tmp_path):
    """Collected with 3 tasks, then with 2: data/ holds the 2, not the union; the user's own records stay, even one
    whose id looks collected; with only seed-only environments left, the last collection leaves data/ too."""
    from components.config import load_params
    from components.data.onboarding import onboard
    from components.data.validation import Limits
    from stages.outputs import onboard_collected

    def collected(index: int) -> dict:
        record = valid_record(index)
        record["task"]["environment"] = "textworld-cooking"
        record["trajectory_id"] = f"tw-game-{index}-expert-0"
        return record

    def collect(indexes: range, environments: list[str]):
        for old in (tmp_path / "seed").glob("*.jsonl"):
            old.unlink()
        write_jsonl([collected(i) for i in indexes], tmp_path / "seed" / "textworld-cooking.jsonl")
        params = load_params(REPO / "params.yaml", {"collect_seed.environments": environments})
        return onboard_collected(params, root=tmp_path)

    mine = valid_record(9)
    mine["trajectory_id"], mine["task"]["environment"] = "mine-expert-0", "textworld-cooking"  # looks collected
    onboard([write_jsonl([mine], tmp_path / "mine.jsonl")], tmp_path / "data", Limits(65536, (-1.0, 1.0)),
            version=False)
    collect(range(3), ["textworld-cooking"])
    result = collect(range(2), ["textworld-cooking"])

    assert (result.unchanged, result.removed) == (2, 1) and "removed        1" in result.summary()
    stored = [r["trajectory_id"] for r in read_records(tmp_path / "data" / "trajectories.jsonl")]
    assert stored == ["mine-expert-0", "tw-game-0-expert-0", "tw-game-1-expert-0"]

    assert collect(range(0), ["demo-kitchen"]).removed == 2  # no real environment collected any more
    assert [r["trajectory_id"] for r in read_records(tmp_path / "data" / "trajectories.jsonl")] == ["mine-expert-0"]
    assert collect(range(0), ["demo-kitchen"]) is None  # and nothing left to supersede


def test_a_heldout_games_transitions_never_reach_the_training_data_or_the_buffer(tmp_path):
    """Held-out evaluation games only measure: onboarding quarantines them (kept whole, with the reason) and the
    replay buffer refuses them, whatever source they claim; the same game from the train split goes through."""
    from components.data.contract import HELDOUT_GAME_SEEDS, Trajectory, transitions
    from components.data.onboarding import onboard
    from components.data.validation import Limits
    from components.simulator.replay_buffer import FaissReplayBuffer
    from tests.conftest import settings_from_params
    from tests.hashing_encoder import HashingEncoder

    def game(index: int, seed: int, source: str) -> dict:
        record = valid_record(index)
        record["task"] |= {"task_id": f"tw-cooking-s{seed}", "environment": "textworld-cooking",
                           "parameters": {"recipe": 1, "seed": seed}}
        return record | {"source": source}

    heldout = [game(0, HELDOUT_GAME_SEEDS.start, "policy"), game(1, HELDOUT_GAME_SEEDS.stop - 1, "expert")]
    train = game(2, HELDOUT_GAME_SEEDS.start - 1, "policy")
    result = onboard([write_jsonl([*heldout, train], tmp_path / "played.jsonl")], tmp_path / "data",
                     Limits(65536, (-1.0, 1.0)), version=False)
    assert result.added == 1
    stored = list(read_records(tmp_path / "data" / "trajectories.jsonl"))
    assert [r["trajectory_id"] for r in stored] == [train["trajectory_id"]]
    quarantined = list(read_records(tmp_path / "data" / "quarantine.jsonl"))
    assert [q["record"] for q in quarantined] == heldout  # kept whole
    assert all("held-out evaluation game" in json.dumps(q["reasons"]) for q in quarantined)

    buffer = FaissReplayBuffer(HashingEncoder(), settings_from_params("buffer_index"))
    for record in heldout:
        with pytest.raises(ValueError, match="held-out evaluation game"):
            buffer.add(list(transitions(Trajectory.from_dict(record))), source="real")
    assert buffer.add(list(transitions(Trajectory.from_dict(train))), source="real") == 3


def test_the_correction_rounds_on_policy_data_is_onboarded_beside_the_seed_for_the_next_retraining(tmp_path):
    """correction.onboard_into_seed: the pipeline flow's last task onboards the rounds' on-policy trajectories into
    data/ through the user's path (a held-out game's record quarantined, not stored); nothing kept: nothing done."""
    from components.config import load_params
    from components.data.contract import HELDOUT_GAME_SEEDS
    from stages.outputs import onboard_on_policy

    def played(index: int, seed: int) -> dict:
        record = valid_record(index)
        record["task"] |= {"task_id": f"tw-cooking-s{seed}", "environment": "textworld-cooking",
                           "parameters": {"recipe": 1, "seed": seed}}
        return record | {"source": "policy", "trajectory_id": f"s2r-{index}"}

    params = load_params(REPO / "params.yaml")
    assert onboard_on_policy(params, root=tmp_path) is None  # no rounds ran
    mine = valid_record(9)
    write_jsonl([mine], tmp_path / "mine.jsonl")
    run("dreamgym", "data", "onboard", str(tmp_path / "mine.jsonl"), "--data-dir", str(tmp_path / "data"),
        "--no-version", cwd=REPO)
    write_jsonl([played(0, 7), played(1, HELDOUT_GAME_SEEDS.start)],
                tmp_path / params.correction.out_dir / "on_policy.jsonl")
    result = onboard_on_policy(params, root=tmp_path)
    assert (result.added, len(result.rejected)) == (1, 1)
    stored = {r["trajectory_id"]: r["source"] for r in read_records(tmp_path / "data" / "trajectories.jsonl")}
    assert stored == {mine["trajectory_id"]: mine["source"], "s2r-0": "policy"}
    assert [q["record"]["trajectory_id"] for q in read_records(tmp_path / "data" / "quarantine.jsonl")] == ["s2r-1"]
    # only the accepted feedback is listed as the policy's play, which the experience model's training weighs
    # (experience_model.policy_share); the user's own records stay seed steps whatever their source
    assert [r["trajectory_id"] for r in read_records(tmp_path / "data" / "on_policy.jsonl")] == ["s2r-0"]
    write_jsonl([played(2, 8)], tmp_path / params.correction.out_dir / "on_policy.jsonl")
    onboard_on_policy(params, root=tmp_path)
    assert [r["trajectory_id"] for r in read_records(tmp_path / "data" / "on_policy.jsonl")] == ["s2r-0", "s2r-2"]
