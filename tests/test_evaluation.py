"""Evaluation harness on real held-out tasks: Wilson intervals, parallel evaluation, baselines, cleanup."""
from __future__ import annotations

import _thread
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from components.config import load_params
from components.envs.base import env_failure
from components.reports import write_csv
from components.results.evaluation import (
    ENV_FAILURES_COLUMN,
    EvaluationResult,
    evaluate_baselines,
    evaluate_policy,
    outcome_agreement,
    replay_in_real,
    results_table,
    seeded_random,
    wilson_interval,
)
from components.results.study import read_games, sign_test
from components.simulator.replay_buffer import Retrieved
from components.simulator.synthetic import episodes_from_buffer
from stages.evaluate_policies import wins_first_within

REPO = Path(__file__).resolve().parents[1]
# The repository's own game cache: games are deterministic in their parameters, so tests share them.
TW_CACHE = {"environments.textworld.cache_dir": str(REPO / ".cache" / "textworld")}


def engine_children() -> list[psutil.Process]:
    """Child processes of this test process that belong to an environment (TextWorld engine or browser)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            command = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if any(mark in command for mark in ("textworld_cooking", "chromedriver", "dreamgym-miniwob-", "chromium")):
            found.append(child)
    return found


def check_result(result: EvaluationResult, tasks: list) -> None:
    assert result.episodes == len(tasks) == len(result.trajectories)
    assert [t.task for t in result.trajectories] == tasks  # task order, whatever the worker timing
    assert result.successes == sum(t.success for t in result.trajectories)
    assert 0 <= result.success_ci_low <= result.success_rate <= result.success_ci_high <= 1
    metrics = result.metrics()
    assert "trajectories" not in metrics
    json.dumps(metrics)
    assert all(0 <= value <= 1 for key, value in metrics.items() if "success" in key and key != "successes")


# -- Wilson interval --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("successes", "n", "low", "high"), [
    (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0), (5, 10, 0.2366, 0.7634), (81, 263, 0.2553, 0.3662),
])
def test_wilson_interval_known_values(successes: int, n: int, low: float, high: float) -> None:
    assert wilson_interval(successes, n, 0.95) == pytest.approx((low, high), abs=1e-4)


def test_wilson_interval_edges() -> None:
    assert wilson_interval(0, 0, 0.95) == (0.0, 1.0)
    narrow, wide = wilson_interval(5, 10, 0.80), wilson_interval(5, 10, 0.99)
    assert wide[0] < narrow[0] < 0.5 < narrow[1] < wide[1]
    with pytest.raises(ValueError):
        wilson_interval(11, 10, 0.95)


# -- TextWorld --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def textworld():
    pytest.importorskip("textworld")
    from components.envs.registry import real_environment

    params = load_params(REPO / "params.yaml", TW_CACHE)
    kind = real_environment("textworld-cooking")
    tasks = kind.make_tasks(params.environments, "heldout", 4, params.seed)
    return kind, params, tasks


def test_textworld_expert_wins_every_task_in_parallel(textworld) -> None:
    kind, params, tasks = textworld
    lines: list[str] = []
    result = evaluate_policy(kind, params.environments, tasks, kind.expert, workers=2, confidence=0.95,
                             name="expert", progress=lines.append)
    check_result(result, tasks)
    assert result.success_rate == 1.0 and result.mean_return == 1.0
    assert result.success_ci_high == 1.0 and result.success_ci_low > 0.3
    assert all(t.source == "expert" for t in result.trajectories)
    assert len({t.trajectory_id for t in result.trajectories}) == len(tasks)
    assert lines and "4/4 episodes" in lines[-1] and "success 1.00" in lines[-1] and "ETA" in lines[-1]
    assert not engine_children()


def test_textworld_random_is_poor_and_reproducible(textworld) -> None:
    kind, params, tasks = textworld
    runs = [evaluate_policy(kind, params.environments, tasks, seeded_random(kind, params.seed), workers=workers,
                            confidence=0.95, name="random", progress=None) for workers in (2, 1)]
    for result in runs:
        check_result(result, tasks)
        assert result.success_rate <= 0.25
        assert result.mean_steps > 5
    # the same actions whichever worker played which task
    assert [[s.action for s in t.steps] for t in runs[0].trajectories] == \
           [[s.action for s in t.steps] for t in runs[1].trajectories]
    assert not engine_children()


def test_synthetic_episodes_replayed_in_the_real_game_confirm_or_refute_their_wins(textworld) -> None:
    kind, params, tasks = textworld
    expert = evaluate_policy(kind, params.environments, tasks[:2], kind.expert, workers=1, confidence=0.95,
                             name="expert", progress=None).trajectories

    def stored(trajectory_id: str, task_id: str, actions: list[str], wins: bool) -> list[Retrieved]:
        """An episode as synthetic RL leaves it in the buffer: the simulator's verdict on its last step."""
        return [Retrieved.from_columns("textworld-cooking", task_id, trajectory_id, index, f"state {index}", action,
                                       "next", float(wins and index == len(actions) - 1),
                                       wins and index == len(actions) - 1, "synthetic", "synthetic")
                for index, action in enumerate(actions)]

    walkthrough = [[step.action for step in t.steps] for t in expert]
    records = [*stored("syn-3", "generated-variation", walkthrough[0], True),  # no real game to replay it in
               *stored("syn-2", tasks[0].task_id, walkthrough[0], False),  # a real win the simulator missed
               *stored("syn-1", tasks[1].task_id, walkthrough[1][:-1], True),  # a win one move early: not real
               *stored("syn-0", tasks[0].task_id, walkthrough[0], True)][::-1]  # a real win; order does not matter
    synthetic, unreplayable = episodes_from_buffer(records, {task.task_id: task for task in tasks})
    assert unreplayable == 1 and [e.trajectory_id for e in synthetic] == ["syn-0", "syn-1", "syn-2"]
    assert [e.success for e in synthetic] == [True, True, False]
    assert [[s.action for s in e.steps] for e in synthetic] == [walkthrough[0], walkthrough[1][:-1], walkthrough[0]]

    real = replay_in_real(kind, params.environments, synthetic, progress=None)
    assert [[s.action for s in r.steps] for r in real] == [[s.action for s in e.steps] for e in synthetic]
    assert [r.success for r in real] == [True, False, True]
    assert outcome_agreement(synthetic, real) == {"episodes": 3, "env_failures": 0, "synthetic_successes": 2,
                                                  "real_successes": 2, "both": 1, "synthetic_only": 1, "real_only": 1}
    assert not engine_children()
    # a replay budget (the correction rounds'): synthetic wins first, each episode whole or not at all
    lengths = [len(e.steps) for e in synthetic]
    assert wins_first_within(synthetic[::-1], sum(lengths)) == synthetic[1::-1] + synthetic[2:]
    assert wins_first_within(synthetic, lengths[0] + lengths[1] - 1) == [synthetic[0]]
    assert wins_first_within(synthetic, lengths[0] - 1) == ([synthetic[1]] if lengths[1] < lengths[0] else [])


def test_an_engine_that_dies_mid_episode_is_counted_apart_not_as_a_loss(textworld, tmp_path) -> None:
    kind, params, tasks = textworld
    doomed = tasks[1].task_id

    def make_policy(env):
        expert = kind.expert(env)

        def act(task, observation, history):
            if task.task_id == doomed and len(history) == 2:
                os.kill(env._worker._process.pid, signal.SIGKILL)  # the engine crashes under the episode
            return expert(task, observation, history)
        return act

    result = evaluate_policy(kind, params.environments, tasks, make_policy, workers=2, confidence=0.95,
                             name="expert", progress=None)
    assert [env_failure(t) is not None for t in result.trajectories] == [False, True, False, False]
    assert len(result.trajectories[1].steps) == 3 and not result.trajectories[1].success
    # the expert won the three games it could play: 3 of 3, not 3 of 4
    assert (result.episodes, result.successes, result.env_failures) == (3, 3, 1)
    assert (result.success_rate, result.success_ci_low, result.success_ci_high) == (1.0, *wilson_interval(3, 3, 0.95))
    assert result.mean_return == 1.0 and result.metrics()["env_failures"] == 1
    table = results_table([result], 0.95)
    assert f"| {ENV_FAILURES_COLUMN} |" in table and table.rstrip().endswith("| 1 |")

    # the games file marks the game (no outcome, the reason), and the study's pairing leaves it out
    games = result.games("expert")
    assert [g["won"] for g in games] == [1, "", 1, 1] and "game engine failed" in games[1]["env_failure"]
    assert [g["env_failure"] for g in games[::2]] == ["", ""]
    write_csv(games, tmp_path / "evaluate_policies_games.csv")
    outcomes = read_games(tmp_path / "evaluate_policies_games.csv")[("expert", "textworld-cooking")]
    assert outcomes == {t.task_id: True for t in tasks if t.task_id != doomed}
    assert (len(outcomes), sum(outcomes.values())) == (result.episodes, result.successes)  # what paired_games checks

    # a replay an environment failure ended has no real outcome to agree or disagree with
    assert outcome_agreement(result.trajectories, result.trajectories) == {
        "episodes": 3, "env_failures": 1, "synthetic_successes": 3, "real_successes": 3, "both": 3,
        "synthetic_only": 0, "real_only": 0}
    assert not engine_children()


def test_a_stopped_evaluation_resumes_from_its_journal_playing_only_the_games_it_lacks(textworld, tmp_path) -> None:
    """A crash in the third game keeps the first two; the rerun plays the last two and returns what one unbroken
    run would. A journal of another policy (or settings) is discarded, never mixed in."""
    kind, params, tasks = textworld
    journal, played = tmp_path / "journals" / "expert.jsonl", []

    def make_policy(crash_on: str | None):
        def make(env):
            expert = kind.expert(env)

            def act(task, observation, history):
                if not history:
                    played.append(task.task_id)
                if task.task_id == crash_on:
                    raise RuntimeError("the machine went away")
                return expert(task, observation, history)
            return act
        return make

    def evaluate(crash_on: str | None = None, identity: str = "expert v1", progress=None) -> EvaluationResult:
        return evaluate_policy(kind, params.environments, tasks, make_policy(crash_on), workers=1, confidence=0.95,
                               name="expert", progress=progress, journal=journal, policy_identity=identity)

    with pytest.raises(RuntimeError, match="went away"):
        evaluate(crash_on=tasks[2].task_id)
    assert played == [t.task_id for t in tasks[:3]]
    assert [json.loads(line)["trajectory"]["task"]["task_id"] for line in journal.read_text().splitlines()] \
        == [t.task_id for t in tasks[:2]]

    played.clear()
    lines: list[str] = []
    resumed = evaluate(progress=lines.append)
    assert played == [t.task_id for t in tasks[2:]]
    assert "resuming: 2 of 4 games played before" in lines[0] and "4/4 episodes" in lines[-1]
    check_result(resumed, tasks)
    unbroken = evaluate_policy(kind, params.environments, tasks, kind.expert, workers=2, confidence=0.95,
                               name="expert", progress=None)
    assert resumed.games("expert") == unbroken.games("expert") and resumed.successes == 4
    assert resumed.wall_s >= max(json.loads(line)["wall_s"] for line in journal.read_text().splitlines())

    played.clear()
    evaluate(identity="expert v2")  # another policy: every game again
    assert played == [t.task_id for t in tasks]
    assert not engine_children()


def test_a_game_an_engine_failure_ended_is_not_journalled_so_the_rerun_plays_it_again(textworld, tmp_path) -> None:
    kind, params, tasks = textworld
    doomed, journal, played, crashed = tasks[1].task_id, tmp_path / "expert.jsonl", [], []

    def make_policy(env):
        expert = kind.expert(env)

        def act(task, observation, history):
            if not history:
                played.append(task.task_id)
            if task.task_id == doomed and len(history) == 2 and not crashed:
                crashed.append(task.task_id)
                os.kill(env._worker._process.pid, signal.SIGKILL)  # the engine crashes under the first play
            return expert(task, observation, history)
        return act

    def evaluate() -> EvaluationResult:
        return evaluate_policy(kind, params.environments, tasks, make_policy, workers=2, confidence=0.95,
                               name="expert", progress=None, journal=journal, policy_identity="expert")

    assert evaluate().env_failures == 1 and len(journal.read_text().splitlines()) == 3
    played.clear()
    again = evaluate()
    assert played == [doomed] and (again.episodes, again.successes, again.env_failures) == (4, 4, 0)
    assert not engine_children()


def test_a_journal_line_a_crash_cut_short_is_dropped_and_the_next_append_starts_clean(tmp_path) -> None:
    from components.data.contract import append_records, read_journal

    journal = tmp_path / "games.jsonl"
    assert read_journal(journal) == []
    append_records([{"game": 1}, {"game": 2}], journal)
    with journal.open("a") as out:
        out.write('{"game": 3, "steps": [')  # the crash
    assert read_journal(journal) == [{"game": 1}, {"game": 2}]
    append_records([{"game": 3}], journal)
    assert read_journal(journal) == [{"game": 1}, {"game": 2}, {"game": 3}]


def test_an_environment_that_fails_every_episode_stops_the_evaluation(textworld, monkeypatch) -> None:
    """Engines that never start in time: every reset fails. That is a broken environment, not a result of 0 of 0."""
    import components.envs.textworld_cooking as tw

    kind, params, tasks = textworld
    monkeypatch.setattr(tw, "STARTUP_TIMEOUT_S", 0.01)  # far less than a child takes to import TextWorld
    with pytest.raises(RuntimeError, match=r"failure ended every episode \(4\).*at reset: TimeoutError: no answer"):
        evaluate_policy(kind, params.environments, tasks, kind.expert, workers=2, confidence=0.95, name="expert",
                        progress=None)
    assert not engine_children()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failing_policy_propagates_and_closes_every_engine(textworld, error: type[BaseException]) -> None:
    kind, params, tasks = textworld

    def make_policy(env):
        def act(task, observation, history):
            if len(history) == 2:
                raise error("policy broke")
            return (observation.valid_actions or ("look",))[0]
        return act

    with pytest.raises(error, match="policy broke"):
        evaluate_policy(kind, params.environments, tasks, make_policy, workers=2, confidence=0.95, name="broken",
                        progress=None)
    assert not engine_children()


@pytest.fixture
def ctrl_c_raises():
    """Python's own Ctrl-C handler: a test run launched in the background (nohup, `&`) starts with SIGINT ignored,
    and then interrupt_main does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_in_the_caller_stops_the_workers_and_closes_every_engine(textworld, ctrl_c_raises) -> None:
    kind, params, tasks = textworld

    def make_policy(env):
        def act(task, observation, history):
            time.sleep(0.05)  # slow enough that Ctrl-C lands while episodes are still running
            return (observation.valid_actions or ("look",))[0]
        return act

    def interrupt_after_first_episode(line: str) -> None:
        _thread.interrupt_main()  # what Ctrl-C does: KeyboardInterrupt in the calling thread

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        evaluate_policy(kind, params.environments, tasks * 3, make_policy, workers=2, confidence=0.95,
                        name="slow", progress=interrupt_after_first_episode)
    assert time.monotonic() - started < 30  # 12 episodes of 50 slow steps would take longer
    assert not engine_children()


def test_evaluate_baselines_metrics_and_report_with_a_skipped_domain() -> None:
    pytest.importorskip("textworld")
    params = load_params(REPO / "params.yaml", {**TW_CACHE, "evaluate.heldout_tasks": 2,
                                                "evaluate.environments": ["textworld-cooking", "webshop"]})
    messages: list[str] = []
    metrics, report = evaluate_baselines(params, progress=messages.append)
    assert metrics["skipped"] == ["webshop"]
    assert set(metrics) == {"textworld-cooking", "skipped"}
    expert, random_ = metrics["textworld-cooking"]["expert"], metrics["textworld-cooking"]["random"]
    assert expert["episodes"] == random_["episodes"] == 2
    assert expert["success_rate"] == 1.0 and random_["success_rate"] <= 0.5
    json.dumps(metrics)
    assert any("webshop" in message and "no real-environment adapter" in message for message in messages)
    assert "| textworld-cooking | expert | 2 | 1.00 [0.34, 1.00] |" in report
    assert "Wilson" in report and "95%" in report and "webshop" in report
    assert not engine_children()


# -- MiniWoB ----------------------------------------------------------------------------------------------------------

def test_miniwob_expert_and_random() -> None:
    pytest.importorskip("miniwob")
    from components.envs.registry import real_environment

    params = load_params(REPO / "params.yaml")
    kind = real_environment("miniwob")
    tasks = kind.make_tasks(params.environments, "heldout", 3, params.seed)
    expert = evaluate_policy(kind, params.environments, tasks, kind.expert, workers=2, confidence=0.95,
                             name="expert", progress=None)
    check_result(expert, tasks)
    assert expert.success_rate == 1.0
    random_ = evaluate_policy(kind, params.environments, tasks, seeded_random(kind, params.seed), workers=2,
                              confidence=0.95, name="random", progress=None)
    check_result(random_, tasks)
    assert random_.success_rate < 1.0
    assert all(t.source == "random" for t in random_.trajectories)
    assert not engine_children()


def test_the_final_policy_of_the_correction_rounds_is_paired_with_the_warm_start_game_by_game(tmp_path):
    """On the held-out games both played: the games only one won and the exact sign test; a game only one of them
    played, or one an environment failure ended, is left out."""
    from stages.correction_rounds import against_warm_start

    def games(policy: str, outcomes: dict[str, int | str]) -> list[dict]:
        return [{"policy": policy, "environment": "textworld-cooking", "task_id": task, "won": won, "steps": 3,
                 "actions": "[]", "env_failure": "engine hung" if won == "" else ""} for task, won in outcomes.items()]

    write_csv(games("sft_warm_start", {"a": 0, "b": 0, "c": 1, "d": 0, "e": 0, "f": 0}),
              tmp_path / "warm.csv")
    write_csv(games("sim-to-real", {"a": 1, "b": 1, "c": 0, "d": 1, "e": "", "x": 1}), tmp_path / "final.csv")
    paired = against_warm_start(tmp_path / "warm.csv", tmp_path / "final.csv")["textworld-cooking"]
    assert paired == {"games": 4, "final_wins": 3, "warm_start_wins": 1, "final_only": 3, "warm_start_only": 1,
                      "p_value": sign_test(3, 1)}
    assert against_warm_start(tmp_path / "missing.csv", tmp_path / "final.csv") == {}
