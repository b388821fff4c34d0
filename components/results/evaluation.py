"""Evaluate any policy on held-out tasks of a real environment: success with a Wilson interval, return, steps.

Generic on purpose: the scripted baselines here and, later, trained LLM policies go through `evaluate_policy`.
Environments are stepped in parallel threads, one environment per thread; that is real parallelism because the
engines (TextWorld child processes, Chromium) do the work outside the interpreter. Episodes an environment failure
ended (a hung or dead engine or browser: `base.env_failure`) are not the policy's outcome: they are counted apart
(`env_failures`) and left out of every rate, mean and interval.
"""
from __future__ import annotations

import json
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components import distributed
from components.config import EnvironmentsParams, Params
from components.data.contract import SOURCES, Task, Trajectory, append_records, read_journal
from components.envs.base import Environment, Observation, Policy, check_not_all_failed, env_failure
from components.envs.episode import run_episode
from components.envs.registry import RealEnvironment, has_adapter, real_environment
from components.files import discard_unless_stamped, fingerprint
from components.reports import markdown_table
from components.stats import wilson_interval

SIMULATED = " (simulated)"  # after an environment's name: its held-out games played in the experience model
PROGRESS_EVERY_S = 5.0  # a progress line at most this often (plus the first and the last episode)
ENV_FAILURES_COLUMN = "environment failures (excluded)"  # the reports' column for `env_failures`
ENV_FAILURES_NOTE = ("Episodes an environment failure ended (a hung or crashed engine or browser: not the policy's "
                     "doing) are counted apart and left out of episodes, success, its interval and the means.")


@dataclass(frozen=True)
class EvaluationResult:
    environment: str
    policy: str
    episodes: int  # counted: every episode played but those an environment failure ended
    successes: int
    success_rate: float
    success_ci_low: float
    success_ci_high: float
    mean_return: float
    mean_steps: float
    wall_s: float
    env_failures: int = 0  # episodes an environment failure ended: in no number above
    trajectories: list[Trajectory] = field(default_factory=list, repr=False)  # in task order, all of them

    def metrics(self) -> dict[str, float | int]:
        """The numbers for DVC metrics (no trajectories, no names: those are the keys around it)."""
        return {"episodes": self.episodes, "successes": self.successes, "success_rate": self.success_rate,
                "success_ci_low": self.success_ci_low, "success_ci_high": self.success_ci_high,
                "mean_return": self.mean_return, "mean_steps": self.mean_steps, "env_failures": self.env_failures,
                "wall_s": round(self.wall_s, 2)}

    def games(self, policy: str, environment: str | None = None) -> list[dict[str, Any]]:
        """One row per game played, for pairing policies game by game (every policy plays the same held-out
        tasks, greedily): its outcome and its actions (JSON list), which show where two policies' play differs.
        A game an environment failure ended has no outcome (`won` empty) and says why in `env_failure`: a pairing
        leaves it out, as the metrics do."""
        rows = []
        for t in self.trajectories:
            failure = env_failure(t)
            rows.append({"policy": policy, "environment": environment or self.environment, "task_id": t.task.task_id,
                         "won": "" if failure else int(t.success), "steps": len(t.steps),
                         "actions": json.dumps([s.action for s in t.steps]), "env_failure": failure or ""})
        return rows


def evaluate_policy(kind: RealEnvironment, env_params: EnvironmentsParams, tasks: list[Task],
                    make_policy: Callable[[Environment], Policy], *, workers: int, confidence: float, name: str,
                    progress: Callable[[str], None] | None = print, max_steps: int | None = None,
                    journal: Path | None = None, policy_identity: str = "") -> EvaluationResult:
    """Play every task once with a fresh policy from `make_policy(env)`, `workers` environments in parallel.

    Each worker thread opens its own environment and takes the next unplayed task until none is left; results
    are stored by task index, so the output order never depends on timing. The first error (in a policy or an
    environment) stops the other workers and is raised; every environment is closed on every path. `max_steps`
    (default: the environment's own cap) bounds each episode. An episode an environment failure ended counts in
    `env_failures` only; when every episode did, the environment is broken, not flaky, and this raises.

    Under a launcher every process calls it and plays its share of the tasks (`workers` environments each); every
    process gets the whole result, the same as one process's (a policy that plays a task the same wherever it plays
    it, as greedy and task-seeded ones do). Only the main process reports progress, on its share.

    With `journal` (a JSONL file), each game played out is appended to it, and a later call with the same tasks,
    settings, code and `policy_identity` (what makes the policy play as it does: a model's content digest) plays
    only the games it lacks: a crash or a stop loses the games in flight, not the finished ones. A game an
    environment failure ended is not kept: the next call plays it again, on an environment that may work now. Wall
    time counts every call's. The journal of anything else is discarded; the caller deletes it once the result is
    safe.
    """
    max_steps = max_steps or kind.max_steps(env_params)
    source = name if name in SOURCES else "policy"
    share, total = distributed.share(len(tasks)), len(tasks)
    offset, tasks = share.start, tasks[share.start:share.stop]  # this process's share (one process: all)
    if not distributed.is_main_process():
        progress = None
    ids = [f"eval-{name}-{offset + index:05d}-{task.task_id}" for index, task in enumerate(tasks)]
    trajectories: list[Trajectory | None] = [None] * len(tasks)
    earlier_s = 0.0  # the wall time of the calls whose games the journal holds
    if journal is not None:
        if distributed.world_size() > 1:
            journal = journal.with_name(f"{journal.stem}.rank{distributed.rank()}{journal.suffix}")
        stamp = journal_fingerprint(kind, env_params, tasks, ids, max_steps, policy_identity)
        discard_unless_stamped(journal, stamp, journal.with_suffix(".fingerprint"))
        position = {trajectory_id: index for index, trajectory_id in enumerate(ids)}
        for record in read_journal(journal):
            trajectories[position[record["trajectory"]["trajectory_id"]]] = Trajectory.from_dict(record["trajectory"])
            earlier_s = max(earlier_s, record["wall_s"])
    todo = [index for index, trajectory in enumerate(trajectories) if trajectory is None]
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    environments: list[Environment] = []
    resumed = [t for t in trajectories if t is not None]
    state = {"next": 0, "done": len(resumed), "successes": sum(t.success for t in resumed),
             "env_failures": sum(env_failure(t) is not None for t in resumed), "printed": -math.inf}
    started = time.monotonic()
    if resumed and progress is not None:
        progress(f"[evaluate {kind.name} / {name}] resuming: {len(resumed)} of {len(tasks)} games played before "
                 f"(in {earlier_s:.0f} s), kept in {journal}")

    def report() -> None:  # called with the lock held
        done, now = state["done"], time.monotonic()
        if progress is None or not (done in (1, len(tasks)) or now - state["printed"] >= PROGRESS_EVERY_S):
            return
        state["printed"] = now
        elapsed = now - started
        eta = elapsed / (done - len(resumed)) * (len(tasks) - done)
        counted, failures = done - state["env_failures"], state["env_failures"]
        of = f" (this process's share of {total})" if len(tasks) < total else ""
        progress(f"[evaluate {kind.name} / {name}] {done}/{len(tasks)} episodes{of}, "
                 f"success {state['successes'] / counted if counted else 0.0:.2f}"
                 + (f" ({failures} environment failures excluded)" if failures else "")
                 + f", elapsed {earlier_s + elapsed:.0f} s, ETA {eta:.0f} s")

    def work() -> None:
        env: Environment | None = None
        try:
            env = kind.open(env_params)
            with lock:
                environments.append(env)
            while not stop.is_set():
                with lock:
                    next_todo = state["next"]
                    state["next"] += 1
                if next_todo >= len(todo):
                    return
                index = todo[next_todo]
                trajectory = run_episode(env, tasks[index], make_policy(env), max_steps=max_steps,
                                         trajectory_id=ids[index], source=source)
                if stop.is_set():  # a stop closed its environment under it: not a game the policy played out
                    return
                with lock:
                    trajectories[index] = trajectory
                    if journal is not None and env_failure(trajectory) is None:  # a failure is played again
                        append_records([{"trajectory": trajectory.to_dict(),
                                         "wall_s": earlier_s + time.monotonic() - started}], journal)
                    state["done"] += 1
                    state["successes"] += trajectory.success
                    state["env_failures"] += env_failure(trajectory) is not None
                    report()
        except BaseException as error:  # noqa: BLE001 - handed to the calling thread, which raises it
            with lock:
                errors.append(error)
            stop.set()
        finally:
            if env is not None:
                env.close()

    # daemon: a second Ctrl-C while we wait below must still let the interpreter exit (atexit closes engines)
    threads = [threading.Thread(target=work, name=f"evaluate-{index}", daemon=True)
               for index in range(max(0, min(workers, len(todo))))]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)  # short joins keep Ctrl-C responsive in the calling thread
    except BaseException:
        stop.set()
        with lock:
            opened = list(environments)
        for env in opened:  # cut running episodes short: their engines die, their steps fail, the workers stop
            env.close()
        for thread in threads:
            thread.join()
        raise
    if errors:
        raise errors[0]
    shares = distributed.all_gather(([t for t in trajectories if t is not None],
                                     earlier_s + time.monotonic() - started))
    result = summarize(kind.name, name, [t for played, _ in shares for t in played], confidence,
                       max(seconds for _, seconds in shares))
    check_not_all_failed(result.trajectories, f"evaluate {kind.name} / {name}")
    return result


def journal_fingerprint(kind: RealEnvironment, env_params: EnvironmentsParams, tasks: list[Task], ids: list[str],
                        max_steps: int, policy_identity: str) -> str:
    """What decides how `evaluate_policy`'s games go: resumed games must come from the same ones. The code that
    plays them counts too (this module, the environment adapters, the policy)."""
    code = Path(__file__).parents[1]
    sources = [Path(__file__), *sorted((code / "envs").glob("*.py")), code / "rl" / "policy.py",
               code / "llm" / "backends.py"]
    return fingerprint([kind.name, env_params.model_dump(), [t.to_dict() for t in tasks], ids, max_steps,
                        policy_identity], sources)


def summarize(environment: str, policy: str, trajectories: list[Trajectory], confidence: float,
              wall_s: float) -> EvaluationResult:
    """The numbers of `trajectories` (kept whole in the result), over those no environment failure ended."""
    counted = [t for t in trajectories if env_failure(t) is None]
    n = len(counted)
    successes = sum(t.success for t in counted)
    low, high = wilson_interval(successes, n, confidence)
    return EvaluationResult(
        environment=environment, policy=policy, episodes=n, successes=successes,
        success_rate=successes / n if n else 0.0, success_ci_low=low, success_ci_high=high,
        mean_return=sum(t.return_ for t in counted) / n if n else 0.0,
        mean_steps=sum(len(t.steps) for t in counted) / n if n else 0.0,
        wall_s=wall_s, env_failures=len(trajectories) - n, trajectories=trajectories)


def evaluate_in_simulation(model: Any, tokenizer: Any, batch: Any, tasks: list[Task], fmt: Any, *, max_turns: int,
                           max_action_tokens: int, batched: bool, confidence: float, name: str) -> EvaluationResult:
    """A policy (greedy) on `tasks` inside a synthetic environment (`batch`: a rollouts.SyntheticBatch).

    The closed-loop measure a seed-only domain has: success is the experience model's verdict, so this scores the
    policy against the simulator, not the application (report it as such). All tasks play at once (`batched`: see
    rollouts.rollout). A game the model could not go on with (its fallback, where it ends the episode) counts apart,
    as a real environment's failure does; every game ending so raises.
    """
    from components.rl.rollouts import rollout

    started = time.monotonic()
    episodes = rollout(model, tokenizer, batch, tasks, fmt, max_turns=max_turns, batched=batched,
                       max_action_tokens=max_action_tokens, temperature=0.0)
    environment = ",".join(sorted({task.environment for task in tasks}))
    check_not_all_failed([e.trajectory for e in episodes], f"evaluate {environment} (simulated) / {name}")
    return summarize(environment, name, [e.trajectory for e in episodes], confidence, time.monotonic() - started)


def replay_in_real(kind: RealEnvironment, env_params: EnvironmentsParams, episodes: Sequence[Trajectory],
                   progress: Callable[[str], None] | None = print) -> list[Trajectory]:
    """Each episode's actions again, in order, in the real environment, until the game ends or they run out.

    Applied to episodes played inside the experience model, it tells which synthetic outcomes the application
    agrees with: a synthetic win the real game does not give is a simulator error the policy can learn to exploit.
    A replay an environment failure ended is kept, marked (`env_failure`); `outcome_agreement` leaves it out.
    """
    replays: list[Trajectory] = []
    env = kind.open(env_params)
    try:
        for index, episode in enumerate(episodes):
            actions = [step.action for step in episode.steps]
            replays.append(run_episode(env, episode.task, lambda task, observation, history: actions[len(history)],
                                       max_steps=len(actions), trajectory_id=f"replay-{episode.trajectory_id}",
                                       source="policy"))
            if progress is not None and (index + 1) % 20 == 0:
                progress(f"[replay {kind.name}] {index + 1}/{len(episodes)} episodes")
    finally:
        env.close()
    check_not_all_failed(replays, f"replay {kind.name}")
    return replays


def outcome_agreement(synthetic: Sequence[Trajectory], real: Sequence[Trajectory]) -> dict[str, int]:
    """How the synthetic outcomes of episodes compare with their replays in the real environment (paired in order);
    a pair with an episode an environment failure ended (the replay's, or the synthetic one's where the model fell
    back) lacks an outcome: counted in `env_failures` only."""
    all_pairs = list(zip(synthetic, real, strict=True))
    pairs = [(s, r) for s, r in all_pairs if env_failure(s) is None and env_failure(r) is None]
    return {"episodes": len(pairs), "env_failures": len(all_pairs) - len(pairs),
            "synthetic_successes": sum(s.success for s, _ in pairs),
            "real_successes": sum(r.success for _, r in pairs),
            "both": sum(s.success and r.success for s, r in pairs),
            "synthetic_only": sum(s.success and not r.success for s, r in pairs),
            "real_only": sum(r.success and not s.success for s, r in pairs)}


def seeded_random(kind: RealEnvironment, seed: int) -> Callable[[Environment], Policy]:
    """The random baseline, its generator seeded by (seed, task id) at the episode's first step.

    Seeding per task rather than per worker makes every random episode reproducible whichever worker plays it.
    """
    def make(env: Environment) -> Policy:
        inner: Policy | None = None

        def act(task: Task, observation: Observation, history) -> str:
            nonlocal inner
            if inner is None:
                inner = kind.random(env, random.Random(f"{seed}:{task.task_id}"))
            return inner(task, observation, history)
        return act
    return make


def evaluate_baselines(params: Params, progress: Callable[[str], None] | None = print,
                       journals: Path | None = None) -> tuple[dict[str, Any], str]:
    """Expert and random policies on the held-out tasks of every configured environment that has an adapter; with
    `journals` (a folder), the games played so far are kept there and a rerun resumes them (`evaluate_policy`).

    Returns the metrics `{environment: {policy: metrics}, "skipped": [names]}` and a markdown report.
    """
    settings = params.evaluate
    metrics: dict[str, Any] = {}
    results: list[EvaluationResult] = []
    skipped = [name for name in settings.environments if not has_adapter(name)]
    for name in skipped:
        if progress is not None:
            progress(f"[evaluate] skipping {name}: no real-environment adapter (a seed-only domain)")
    for name in (n for n in settings.environments if has_adapter(n)):
        kind = real_environment(name)
        tasks = kind.make_tasks(params.environments, "heldout", settings.heldout_tasks, params.seed)
        for policy, make_policy in (("expert", kind.expert), ("random", seeded_random(kind, params.seed))):
            result = evaluate_policy(kind, params.environments, tasks, make_policy, workers=settings.workers,
                                     confidence=settings.confidence, name=policy, progress=progress,
                                     journal=journals / f"{policy}-{name}.jsonl" if journals else None,
                                     policy_identity=f"seed {params.seed}")
            results.append(result)
            metrics.setdefault(name, {})[policy] = result.metrics()
    metrics["skipped"] = skipped
    return metrics, baseline_report(results, skipped, settings.confidence, settings.heldout_tasks)


def format_success(result: EvaluationResult) -> str:
    """`0.95 [0.86, 0.99]`: the success rate and its confidence interval."""
    return f"{result.success_rate:.2f} [{result.success_ci_low:.2f}, {result.success_ci_high:.2f}]"


def results_table(results: list[EvaluationResult], confidence: float) -> str:
    header = ["environment", "policy", "episodes", f"success [{confidence:.0%} CI]", "mean return", "mean steps",
              "wall time (s)", ENV_FAILURES_COLUMN]
    rows = [[r.environment, r.policy, r.episodes, format_success(r), f"{r.mean_return:.3f}", f"{r.mean_steps:.1f}",
             f"{r.wall_s:.1f}", r.env_failures] for r in results]
    return markdown_table(header, rows)


def baseline_report(results: list[EvaluationResult], skipped: list[str], confidence: float,
                    heldout_tasks: int) -> str:
    lines = ["# Evaluation: baselines on held-out tasks", "", results_table(results, confidence),
             f"Methods: each policy plays every held-out task once ({heldout_tasks} tasks per environment, drawn "
             "from a seed range disjoint from the training tasks). Success is the environment's own outcome "
             "(game won, web task completed); the interval is the Wilson score interval at "
             f"{confidence:.0%} confidence. Return is the sum of step rewards (1.0 on success, else 0); steps "
             "count actions up to success, failure or the step cap. The expert replays a walkthrough (TextWorld) "
             "or a scripted solver (MiniWoB); the random policy is the seed collection's: an admissible command "
             "(TextWorld; eat, drink, cook, cut and prepare weighted 4x; a quarter of them made into one the game "
             "refuses, misdirected or malformed) or a page "
             f"element (MiniWoB), seeded by the run seed and the task id. {ENV_FAILURES_NOTE}", ""]
    if skipped:
        lines += [f"Skipped (no real-environment adapter; seed-only domains): {', '.join(skipped)}.", ""]
    return "\n".join(lines)
