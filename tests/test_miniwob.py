"""MiniWoB++ in headless Chromium: expert and random success, invalid actions, step timeout, browser cleanup.

Needs the `miniwob` package and Debian `chromium` + `chromium-driver`; skipped without them. ~1 minute, at most two
browsers at a time.
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("miniwob")
psutil = pytest.importorskip("psutil")
if not (Path("/usr/bin/chromium").exists() and Path("/usr/bin/chromedriver").exists()):
    pytest.skip("needs Debian chromium and chromium-driver", allow_module_level=True)

from components.data.contract import Task  # noqa: E402
from components.envs.base import ENV_FAILURE, env_failure  # noqa: E402
from components.envs.episode import run_episode  # noqa: E402
from components.envs.miniwob import (  # noqa: E402
    SEED_RANGES,
    TASKS,
    MiniWoB,
    expert_policy,
    make_tasks,
    parse_state,
    random_policy,
    render_state,
)
from components.rl.policy import parse_action  # noqa: E402


@pytest.fixture(scope="module")
def env():
    with MiniWoB() as environment:
        yield environment


def _task(name: str, seed: int) -> Task:
    return Task(f"miniwob-{name}-s{seed}", "miniwob", "", {"task": name, "seed": seed})


def _browser_pids() -> set[int]:
    """Chromium and chromedriver processes under this pytest process."""
    return {p.pid for p in psutil.Process().children(recursive=True) if p.name().startswith("chrom")}


def _running(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_expert_wins_heldout_tasks(env):
    tasks = make_tasks("heldout", 2 * len(TASKS), seed=7, env=env)
    assert {t.parameters["task"] for t in tasks} == set(TASKS)
    trajectories = [run_episode(env, t, expert_policy(), max_steps=20, trajectory_id=t.task_id, source="expert")
                    for t in tasks]
    wins = [t.success for t in trajectories]
    assert sum(wins) / len(wins) >= 0.95, [t.task.task_id for t in trajectories if not t.success]
    multi_step = [t for t in trajectories if len(t.steps) >= 3]
    assert len({t.task.parameters["task"] for t in multi_step}) >= 5
    for trajectory in trajectories:
        last = trajectory.steps[-1]
        assert last.done and all(not s.done for s in trajectory.steps[:-1])
        assert trajectory.return_ == (1.0 if trajectory.success else 0.0)
        assert all(a.next_state == b.state for a, b in zip(trajectory.steps, trajectory.steps[1:]))
        assert trajectory.steps[0].state.startswith(f"Task: {trajectory.task.instruction}\n")
    # a policy that replies exactly the expert's action plays exactly it: quoted text keeps its quotes
    assert [s.action for t in trajectories for s in t.steps] == [parse_action(s.action) for t in trajectories
                                                                 for s in t.steps]


def test_the_pipelines_episode_outlives_the_pages_own_clock():
    """MiniWoB's page fails an episode after 10 s (click-button), a person's pace: an LLM policy on CPU lost games to
    it, more of them the busier the machine. The environment as the pipeline opens it sets the page's clock from
    params (environments.miniwob.episode_time_limit_s)."""
    from components.config import load_params
    from components.envs.registry import real_environment

    params = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
    task = _task("click-button", 1003)
    with real_environment("miniwob").open(params.environments) as env:
        observation = env.reset(task)
        time.sleep(11)
        result = env.step(expert_policy()(task, observation, []))
    assert result.done and result.reward == 1.0, result.info


def test_random_policy_rarely_wins(env):
    tasks = make_tasks("heldout", len(TASKS), seed=8, env=env)
    policy = random_policy(random.Random(0))
    wins = {t.parameters["task"]: run_episode(env, t, policy, max_steps=8, trajectory_id=t.task_id,
                                              source="random").success for t in tasks}
    # A lucky first click can win click-button, click-link, or click-checkboxes when nothing is to be checked;
    # tasks that need the right text typed are out of reach.
    assert sum(wins.values()) <= 3, wins
    typing = ("enter-text", "enter-password", "login-user", "use-autocomplete-nodelay", "search-engine",
              "book-flight-nodelay")
    assert not any(wins[name] for name in typing), wins


def test_state_is_compact_text_that_round_trips(env):
    state = env.reset(_task("login-user", 5)).state
    assert "<" not in state and state.startswith("Task: Enter the username")
    utterance, elements = parse_state(state)
    assert render_state(utterance, elements) == state
    assert any(e.tag == "input_password" and e.value == "" for e in elements)


def test_a_list_shows_its_options_and_select_chooses_one(env):
    state = env.reset(_task("choose-list", 1001)).state
    utterance, elements = parse_state(state)
    assert render_state(utterance, elements) == state
    options = next(e for e in elements if e.tag == "select")
    button = next(e for e in elements if e.tag == "button")
    assert len(options.options) >= 3 and options.value in options.options
    for action in (f'select [{options.ref}] "no such option"', f'select [{button.ref}] "Submit"',
                   f"select [{options.ref}]"):
        result = env.step(action)
        assert result.info["valid_action"] is False and not result.done, action
    assert "its options: " in env.step(f'select [{options.ref}] "nope"').info["error"]
    wanted = next(option for option in options.options if option != options.value)
    after = parse_state(env.step(f'select [{options.ref}] "{wanted}"').observation.state)[1]
    assert next(e for e in after if e.tag == "select").value == wanted
    tasks = make_tasks("heldout", 3, seed=3, task_names=["choose-list"], env=env)
    assert all(run_episode(env, t, expert_policy(), max_steps=4, trajectory_id=t.task_id, source="expert").success
               for t in tasks)


def test_coloured_blocks_and_svg_shapes_show_their_colour_and_size(env):
    state = env.reset(_task("click-shades", 1003)).state
    utterance, elements = parse_state(state)
    assert render_state(utterance, elements) == state
    blocks = [e for e in elements if e.tag == "span"]
    assert len(blocks) >= 6 and all(re.fullmatch(r"#[0-9a-f]{6} \((red|green|blue)\)", e.color) for e in blocks)
    wanted = re.search(r"shades of (\w+)", utterance)[1]
    for block in [e for e in blocks if e.color.endswith(f"({wanted})")]:
        env.step(f"click [{block.ref}]")
    assert env.step(f"click [{next(e.ref for e in elements if e.tag == 'button')}]").info["success"]

    shapes = parse_state(env.reset(_task("click-shape", 1003)).state)[1]
    assert all(e.color and re.fullmatch(r"\d+x\d+", e.size) for e in shapes if e.tag in ("circle", "rect", "text"))
    assert any(e.size for e in shapes)


def test_coverage_counts_what_the_state_shows_keeps_rows_and_goes_on(env, tmp_path, monkeypatch):
    from components.envs import miniwob as miniwob_module
    from components.envs.miniwob_coverage import coverage_markdown, read_rows, run_coverage

    env.reset(_task("choose-list", 1002))
    assert env.interactive_coverage() == (2, [])  # the list and the button
    shown = miniwob_module._elements_from_dom  # as before lists were read: the state had no line for the list
    monkeypatch.setattr(miniwob_module, "_elements_from_dom",
                        lambda *args: [element for element in shown(*args) if element.tag != "select"])
    env.reset(_task("choose-list", 1002))
    assert env.interactive_coverage() == (1, ["select"])
    monkeypatch.undo()

    rows_file = tmp_path / "coverage.jsonl"
    first = run_coverage(rows_file, ["choose-list", "click-button"], episodes=1, max_steps=5, step_timeout_s=10,
                         episode_time_limit_s=300)
    assert [(r.task, r.reset_error, r.shown == r.interactive > 0, r.policy, r.wins) for r in first] == [
        ("choose-list", "", True, "expert", 1), ("click-button", "", True, "expert", 1)]
    kept = rows_file.read_text()
    rows = run_coverage(rows_file, ["choose-list", "click-button", "drag-box"], episodes=1, max_steps=5,
                        step_timeout_s=10, episode_time_limit_s=300)
    assert rows_file.read_text().startswith(kept) and len(read_rows(rows_file)) == 3
    assert rows[2].task == "drag-box" and rows[2].policy == "random" and rows[2].episodes == 1
    table = coverage_markdown(rows, episodes=1, max_steps=5)
    assert table.startswith("3 tasks: 3 reset") and "| choose-list | ok | 2/2 |  | expert | 1/1 |" in table


def test_invalid_actions_fail_softly(env):
    state = env.reset(_task("enter-text", 3)).state
    _, elements = parse_state(state)
    button = next(e for e in elements if e.tag == "button")
    bad = ["", "jump", "click", "click [99999]", f'type [{button.ref}] "x"', 'press "NoSuchKey"', "wait [2]",
           'type [3 "unclosed']
    for action in bad:
        result = env.step(action)
        assert result.info["valid_action"] is False and result.info["error"], action
        assert result.reward == 0.0 and not result.done, action
        assert result.observation.state.startswith(state + "\nError: "), action
    # The episode goes on: the expert still wins it.
    task = _task("enter-text", 3)
    observation, history = env.reset(task), []
    for _ in range(5):
        action = expert_policy()(task, observation, history)
        result = env.step(action)
        history.append((observation.state, action))
        observation = result.observation
        if result.done:
            break
    assert result.done and result.info["success"] and result.reward == 1.0
    after = env.step("click [1]")  # stepping a finished episode is a failure observation too
    assert after.done and after.info["valid_action"] is False


def test_make_tasks_is_deterministic_with_disjoint_splits(env):
    first = make_tasks("train", 3, seed=1, task_names=["click-button"], env=env)
    assert first == make_tasks("train", 3, seed=1, task_names=["click-button"], env=env)
    heldout = make_tasks("heldout", 3, seed=1, task_names=["click-button"], env=env)
    low, high = SEED_RANGES["train"]
    assert all(low <= t.parameters["seed"] < high for t in first)
    low, high = SEED_RANGES["heldout"]
    assert all(low <= t.parameters["seed"] < high for t in heldout)
    assert all(t.instruction.startswith("Click on the") and t.environment == "miniwob" for t in first + heldout)


def test_hung_browser_step_times_out_and_env_recovers():
    before = _browser_pids()  # the module's browser, when it runs
    with MiniWoB(step_timeout_s=2.0) as env:
        task = _task("click-button", 11)
        state = env.reset(task).state
        pids = _browser_pids() - before
        # Wedge the page's renderer in an endless loop: a truly hung browser, not a mocked one. The loop starts a
        # moment later so that this call itself returns.
        env._gym.instance.driver.execute_script("setTimeout(() => { for (;;) {} }, 300);")
        time.sleep(0.5)
        ref = next(e.ref for e in parse_state(state)[1] if e.ref is not None)
        start = time.monotonic()
        result = env.step(f"click [{ref}]")
        assert time.monotonic() - start < 10
        assert result.done and result.reward == 0.0 and result.info["timeout"] and not result.info["success"]
        assert "step timed out" in result.info[ENV_FAILURE] and result.info["truncated"]
        assert "Episode over: failure" in result.observation.state
        time.sleep(0.5)
        assert not _running(pids), "the hung browser was not killed"
        trajectory = run_episode(env, task, expert_policy(), max_steps=3, trajectory_id="t", source="expert")
        assert trajectory.success  # the next reset started a fresh browser


def test_a_browser_gone_mid_episode_or_at_reset_is_an_environment_failure(monkeypatch):
    import components.envs.miniwob as mw

    task = _task("enter-text", 12)
    with MiniWoB() as env:
        state = env.reset(task).state
        field = next(e.ref for e in parse_state(state)[1] if e.tag == "input_text")
        refused = env.step(f'type [{field}] "\\ud800"')  # WebDriver cannot type a lone surrogate; the browser works
        assert refused.done and "InvalidArgument" in refused.info["error"] and ENV_FAILURE not in refused.info
        env.reset(task)
        env._gym.instance.driver.quit()  # the browser goes away under the episode
        result = env.step("wait")
        assert result.done and not result.info["success"] and result.info["truncated"]
        assert result.info[ENV_FAILURE].startswith("browser error:") and "Error: browser error" in \
            result.observation.state
        # a page that never loads: both tries of the reset time out (a tiny timeout alone raced a fast page on CI)
        monkeypatch.setattr(mw, "RESET_TIMEOUT_S", 0.5)
        monkeypatch.setattr(mw.MiniWoB, "_start_episode", lambda self, gym, seed: time.sleep(30))
        failed = run_episode(env, task, expert_policy(), max_steps=3, trajectory_id="t", source="expert")
        assert "the browser failed at reset: StepTimeout" in env_failure(failed) and len(failed.steps) == 1
        monkeypatch.undo()
        assert run_episode(env, task, expert_policy(), max_steps=3, trajectory_id="t", source="expert").success
    with pytest.raises(ValueError, match="unknown or unsupported"):  # a bad task is no environment failure
        MiniWoB().reset(_task("no-such-task", 1))


def test_browser_is_gone_after_an_exception_mid_episode():
    before = _browser_pids()
    with pytest.raises(RuntimeError, match="boom"):
        with MiniWoB() as env:
            env.reset(_task("login-user", 2))
            env.step('type [7] "someone"')
            ours = _browser_pids() - before
            assert ours, "no browser processes found"
            raise RuntimeError("boom")
    assert not _running(ours)
    env.close()  # safe twice
    # Without close(): dropping the last reference quits the browser too.
    leaked = MiniWoB()
    leaked.reset(_task("click-button", 2))
    ours = _browser_pids() - before
    del leaked
    assert not _running(ours)


def test_a_killed_dreamgym_command_closes_its_browser(tmp_path):
    """`kill` (SIGTERM) of a `dreamgym` command exits through atexit, which closes the browser it started."""
    repo = Path(__file__).resolve().parents[1]
    command = subprocess.Popen([sys.executable, "-m", "dreamgym.cli", "--params", str(repo / "params.yaml"),
                                "coverage", "miniwob", "click-button", "choose-list", "enter-text", "login-user"],
                               cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(repo)})
    deadline, ours = time.monotonic() + 60, set()
    while not ours and time.monotonic() < deadline and command.poll() is None:
        time.sleep(0.5)
        ours = {p.pid for p in psutil.Process(command.pid).children(recursive=True) if p.name().startswith("chrom")}
    assert ours, "the command started no browser"
    command.send_signal(signal.SIGTERM)
    assert command.wait(60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while _running(ours) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(ours)
