"""Shadow mode: a share of the episodes a served simulator plays is replayed in the real environment, and how far
the two agree is kept up to date: the on-policy fidelity measure (`fidelity.score_predictions`) on the episodes the
served policies actually play.

A shadowed episode's actions are replayed in order in the real game (`evaluation.replay_in_real`) on a background
thread, so serving never waits for the real environment. Step i of the served episode is scored against step i of
its replay: reward, end, and what the game did with a command it refused; the episode's outcome against the replay's
(`evaluation.outcome_agreement`). Once the two diverge they no longer share a state, so later steps measure the
episode as a whole rather than one prediction.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
from dataclasses import replace
from typing import Any

from components.data.contract import Trajectory, transitions
from components.envs.base import env_failure
from components.simulator import fidelity

log = logging.getLogger(__name__)

# what a live summary shows of the fidelity metrics (all of them are in `fidelity`'s module docstring)
SHOWN = ("n", "reward_accuracy", "done_accuracy", "change_f1", "positive_n", "positive_reward_accuracy",
         "unrewarded_n", "false_wins", "missed_wins", "refused_n", "refusal_change_f1", "refusal_false_wins")


class Shadow:
    """Replays `share` of the submitted episodes in `kind` (a real-environment adapter, opened with `env_params`)."""

    def __init__(self, kind: Any, env_params: Any, share: float) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"shadow share {share}: a fraction in (0, 1]")
        self.kind, self.env_params, self.share = kind, env_params, share
        self.episodes_served = 0
        self.synthetic: list[Trajectory] = []
        self.real: list[Trajectory] = []
        self.failed_replays = 0  # replays the real environment could not run at all (logged)
        self._queue: queue.Queue[Trajectory | None] = queue.Queue()
        self._lock = threading.Lock()
        self._worker = threading.Thread(target=self._replay_forever, name="shadow", daemon=True)
        self._worker.start()

    def wants_next(self) -> bool:
        """Whether the next played episode is shadowed: exactly `share` of them, evenly spread, the first included."""
        self.episodes_served += 1
        n = self.episodes_served
        return math.ceil(n * self.share) > math.ceil((n - 1) * self.share)

    def submit(self, episode: Trajectory) -> None:
        """A finished (or abandoned) served episode to replay, in the task as the real environment takes it: without
        the first state the bundle gave it."""
        task = episode.task
        self._queue.put(replace(episode, task=replace(task, parameters={
            k: v for k, v in task.parameters.items() if k != "initial_state"})))

    @property
    def pending(self) -> int:
        """Episodes submitted and not yet replayed."""
        return self._queue.qsize()

    def close(self, timeout_s: float = 60) -> None:
        """Stop after the replays already queued (waiting at most `timeout_s`)."""
        self._queue.put(None)
        self._worker.join(timeout_s)

    def _replay_forever(self) -> None:
        from components.results.evaluation import replay_in_real

        while True:
            batch = [self._queue.get()]
            while not self._queue.empty():  # whatever queued meanwhile replays in one opening of the environment
                batch.append(self._queue.get_nowait())
            episodes = [e for e in batch if e is not None]
            if episodes:
                try:
                    replays = replay_in_real(self.kind, self.env_params, episodes, progress=None)
                except Exception:  # the real environment is broken; serving goes on, the summary says so
                    log.exception("shadow: replaying %d episode(s) in %s failed", len(episodes), self.kind.name)
                    with self._lock:
                        self.failed_replays += len(episodes)
                else:
                    with self._lock:
                        self.synthetic += episodes
                        self.real += replays
                    log.info(self.headline())
            if None in batch:
                return

    def summary(self) -> dict[str, Any]:
        """The agreement so far: outcomes of whole episodes and the fidelity metrics of their paired steps."""
        from components.results.evaluation import outcome_agreement

        with self._lock:
            synthetic, real, failed = list(self.synthetic), list(self.real), self.failed_replays
        pairs = [(s, r) for s, r in zip(synthetic, real, strict=True) if env_failure(r) is None]
        real_steps, served_steps = [], []
        for served, replay in pairs:
            replayed = list(transitions(replay))
            real_steps += replayed
            served_steps += served.steps[:len(replayed)]
        steps = fidelity.score_predictions(real_steps, served_steps)[fidelity.OVERALL] if real_steps else {"n": 0}
        return {"share": self.share, "episodes_served": self.episodes_served, "pending": self.pending,
                "failed_replays": failed, "outcomes": outcome_agreement(synthetic, real),
                "steps": {k: v for k, v in steps.items() if k in SHOWN}}

    def headline(self) -> str:
        """One line of `summary()` for the log."""
        s = self.summary()
        o, steps = s["outcomes"], s["steps"]

        def rate(key: str) -> str:
            return "n/a" if steps.get(key) is None else f"{steps[key]:.2f}"

        return (f"{o['episodes']} episodes replayed ({o['env_failures']} ended by environment failures); "
                f"synthetic wins confirmed {o['both']} of {o['synthetic_successes']}, real wins missed "
                f"{o['real_only']}; over {steps['n']} steps reward agreement {rate('reward_accuracy')}, end "
                f"agreement {rate('done_accuracy')}, false wins {steps.get('false_wins', 0)}, refused commands "
                f"{steps.get('refused_n', 0)} (false wins on them {steps.get('refusal_false_wins', 0)})")
