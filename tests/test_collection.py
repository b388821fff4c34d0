"""components/data/collection.py: a crashed collection resumes its own finished episodes, never another's."""
from components.data.collection import _load_progress
from tests.seed_factory import valid_record, write_jsonl


def test_progress_is_resumed_only_by_the_same_collection(tmp_path):
    progress = write_jsonl([valid_record(0), valid_record(1)], tmp_path / "textworld.jsonl")
    (tmp_path / "textworld.fingerprint").write_text("params-and-code-a\n")

    assert sorted(_load_progress(progress, "params-and-code-a")) == ["demo-0000", "demo-0001"]
    # the params or the collection code changed since the crash: those episodes are not this collection's
    assert _load_progress(progress, "params-and-code-b") == {} and not progress.exists()
    assert (tmp_path / "textworld.fingerprint").read_text() == "params-and-code-b\n"


def test_skipping_expert_episodes_are_collected_as_source_policy(tmp_path):
    from components.config import load_params
    from components.data.collection import collect_environment
    from tests.conftest import REPO, SMALL_RUN

    mix = {"expert": 0, "noisy_expert": 0, "skipping_expert": 1, "random": 0}
    params = load_params(REPO / "params.yaml", {**SMALL_RUN, "collect_seed.train_tasks": 1,
                                                 "collect_seed.episodes": mix})
    lines = []
    collected = collect_environment(params, "textworld-cooking", tmp_path / "tw.jsonl", tmp_path / "progress.jsonl",
                                    log=lines.append).trajectories
    assert [(t.trajectory_id.rsplit("-", 2)[1:], t.source) for t in collected] == [(["skipping_expert", "0"],
                                                                                     "policy")]
    assert (tmp_path / "tw.jsonl").exists() and not (tmp_path / "progress.jsonl").exists()
    assert not any("no skipping expert" in line for line in lines)


def test_environment_failures_are_played_again_then_kept_aside_and_never_onboarded(tmp_path, monkeypatch):
    """Engines that do not start in time (a busy machine) fail every play of the first episode, then start again:
    that episode is left out of the collection (its plays kept aside with their reason), the next one collected."""
    import components.envs.textworld_cooking as tw
    from components.config import load_params
    from components.data.collection import ENV_FAILURE_ATTEMPTS, collect_environment, env_failures_path
    from components.data.contract import TRAJECTORIES, read_trajectories
    from components.envs.base import env_failure
    from components.envs.registry import real_environment
    from stages.outputs import onboard_collected
    from tests.conftest import REPO, SMALL_RUN

    mix = {"expert": 1, "noisy_expert": 0, "skipping_expert": 0, "random": 1}
    params = load_params(REPO / "params.yaml", {**SMALL_RUN, "collect_seed.train_tasks": 1,
                                                 "collect_seed.episodes": mix})
    task = real_environment("textworld-cooking").make_tasks(params.environments, "train", 1, params.seed)[0]
    expert, random_ = f"{task.task_id}-expert-0", f"{task.task_id}-random-0"
    monkeypatch.setattr(tw, "STARTUP_TIMEOUT_S", 0.01)  # far less than a child takes to import TextWorld
    lines = []

    def log(line: str) -> None:
        lines.append(line)
        if "left out" in line:
            monkeypatch.undo()  # the machine is less busy now: engines start again

    out = tmp_path / "seed" / "textworld-cooking.jsonl"
    collection = collect_environment(params, "textworld-cooking", out, tmp_path / "progress.jsonl", log=log)
    assert collection.left_out == [expert]
    assert [t.trajectory_id for t in collection.trajectories] == [random_]
    assert [t.trajectory_id for t in read_trajectories(out)] == [random_]
    assert sum("playing it again" in line for line in lines) == ENV_FAILURE_ATTEMPTS - 1
    kept = read_trajectories(env_failures_path(out))  # beside the collection, each play with its reason
    assert env_failures_path(out) == tmp_path / "seed" / "env_failures" / "textworld-cooking.jsonl"
    assert [t.trajectory_id for t in kept] == [expert] * ENV_FAILURE_ATTEMPTS == \
           [t.trajectory_id for t in collection.env_failures]
    assert all("at reset: TimeoutError: no answer" in env_failure(t) for t in kept)

    result = onboard_collected(params, tmp_path)  # what the pipeline onboards: <out_dir>/*.jsonl
    assert (result.read, result.added, result.rejected) == (1, 1, [])
    assert [t.trajectory_id for t in read_trajectories(tmp_path / "data" / TRAJECTORIES)] == [random_]
