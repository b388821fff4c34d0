"""What the RL algorithms share: settings, the per-iteration record, and checkpoint side-cars.

GRPO (components/rl/grpo.py) and PPO (components/rl/ppo.py) both train the warm-started policy on multi-turn episodes
from `play_iteration`: the curriculum's tasks for the iteration (`tasks_per_iteration` tasks x `group_size`
episodes), their trajectories appended to the replay buffer as synthetic experience, the curriculum's variance
bookkeeping and new task variations; then one policy update. Every `save_every` iterations a checkpoint holds the
policy adapter, the optimizer, the RNG states and, next to them, the replay buffer, the curriculum and the iteration
log, so a crashed run resumes from the last checkpoint without losing or repeating an iteration.

An episode an environment failure ended (a hung or dead engine or browser; in the synthetic environment, a step the
experience model could not predict) is not the policy's outcome: the iteration log counts it (`env_failures`) and
leaves it out of the outcome means, the update gives it no advantage (`training_returns` for GRPO's groups,
`trainable` for PPO), the curriculum does not see it and the replay buffer does not get it. An iteration every episode
of which failed stops the run with an error.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from components import distributed
from components.data.contract import Trajectory, append_records, read_records, write_records
from components.envs.base import check_not_all_failed
from components.files import (
    atomic_directory,
    atomic_write_text,
    checkpoint_number,
    directory_identity,
    discard_unless_stamped,
    fingerprint,
    numbered_checkpoints,
    write_made_from,
)
from components.llm.backends import stream_seed
from components.llm.sft import LoraSettings, save_for_inference
from components.rl.rollouts import Episode, EpisodeBatch, RolloutStats, rollout
from components.simulator.replay_buffer import FaissReplayBuffer, ReplayBuffer, WeaviateReplayBuffer
from components.simulator.synthetic import add_to_buffer

if TYPE_CHECKING:  # curriculum.py builds on this module
    from components.llm.backends import GenerationBackend
    from components.rl.curriculum import Curriculum
    from components.rl.policy import PolicyFormat

BUFFER_DIR, LOG_FILE, CURRICULUM_FILE = "replay_buffer", "iterations.jsonl", "curriculum.json"
# In checkpoints/: every episode the run played, with its iteration. A resume drops the iterations after its
# checkpoint (they are played again), so the file holds each iteration's episodes once: the real ones are the
# policy's own on-policy data (sim-to-real's), which the correction rounds onboard.
EPISODES_FILE = "episodes.jsonl"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PPOSettings:
    """PPO only (params synthetic_rl.ppo)."""

    epochs: int  # passes over each iteration's episodes
    gamma: float  # discount per turn
    gae_lambda: float
    value_coef: float
    value_learning_rate: float


@dataclass(frozen=True)
class RLSettings:
    """params synthetic_rl, with policy.max_turns, policy.max_action_tokens and the run seed: no defaults here, every
    value comes from params (the builders make it; sim_to_real replaces the schedule with its own)."""

    algorithm: Literal["grpo", "ppo"]
    iterations: int
    tasks_per_iteration: int
    group_size: int  # episodes per task (GRPO's group)
    learning_rate: float
    temperature: float  # sampling temperature of the policy in rollouts (and in the trainers' log-probs)
    beta: float  # KL penalty towards the warm-start policy
    clip_epsilon: float
    max_turns: int
    max_action_tokens: int
    batched_rollouts: bool  # rollouts.rollout's `batched`
    max_tokens: int  # an episode's whole token sequence
    micro_batch_size: int  # episodes per forward/backward pass (gradients accumulate over the iteration)
    save_every: int
    save_total_limit: int
    lora: LoraSettings | None
    ppo: PPOSettings
    seed: int
    transition_budget: int | None  # environment transitions the run may spend (sim-to-real's); None: no limit

    @property
    def episodes_per_iteration(self) -> int:
        return self.tasks_per_iteration * self.group_size

    @property
    def transitions_per_iteration(self) -> int:
        """The most environment transitions an iteration can take: every episode runs to the turn limit."""
        return self.episodes_per_iteration * self.max_turns


@dataclass(frozen=True)
class RLResult:
    model_dir: Path
    iterations: int
    resumed_from: str | None
    log: list[dict[str, Any]]
    seconds: float  # over every invocation: this one's, plus the logged time of the iterations it resumed after


TIME_SPLIT = ("policy_generation_s", "environment_s", "buffer_s", "curriculum_s", "optimisation_s")  # curve_s: apart


@dataclass(frozen=True)
class CurveProbe:
    """The learning curve's measure: every `every` iterations (and after the last), `measure(model, tokenizer)` plays
    the policy as it stands on a fixed set of held-out games and returns its success; it only measures (greedy play,
    nothing kept), so training goes on as it would without it."""

    every: int
    measure: Callable[[Any, Any], float]

    def point(self, model: Any, tokenizer: Any, iteration: int, last: bool) -> dict[str, Any]:
        """The iteration log's fields for 1-based `iteration` (`last`: the run's last): held-out success and its
        time, or none."""
        if iteration % self.every and not last:
            return {}
        started, training = time.monotonic(), model.training
        model.eval()
        try:
            with distributed.alone():  # the main process measures by itself (the RL loops call it there alone)
                success = self.measure(model, tokenizer)
        finally:
            model.train(training)
        return {"heldout_success": round(success, 4), "curve_s": round(time.monotonic() - started, 2)}


def logged_seconds(rows: list[dict[str, Any]]) -> float:
    """The time the iterations of an iteration log took (the sum of each row's time split): what a resumed run
    counts for the iterations an earlier, killed invocation trained."""
    return sum(float(row.get(field) or 0.0) for row in rows for field in TIME_SPLIT)


def iteration_record(iteration: int, episodes: list[Episode], stats: RolloutStats, buffer: ReplayBuffer | None,
                     **fields: Any) -> dict[str, Any]:
    """One row of the iteration log (DVC plots): rollout outcomes (over the episodes no environment failure ended),
    the time split, the curriculum's and the update's numbers."""
    n = len(episodes)
    counted = trainable(episodes)
    return {
        "iteration": iteration,
        "reward_mean": sum(e.return_ for e in counted) / len(counted),
        "success_rate": sum(e.success for e in counted) / len(counted),
        "ended_rate": sum(e.done for e in counted) / len(counted),  # the environment (not the turn limit) ended them
        "turns_mean": sum(len(e.actions) for e in counted) / len(counted),
        "env_failures": n - len(counted),  # episodes an environment failure ended, in none of the numbers above
        # steps where the experience model's reply was unparsable and the state stayed as it was
        "fallback_steps": sum(bool(step.info.get("fallback"))
                              for e in episodes if e.trajectory for step in e.trajectory.steps),
        "policy_tokens_mean": sum(sum(e.env_mask) for e in episodes) / n,
        "sequence_tokens_mean": sum(len(e.prompt_ids) + len(e.completion_ids) for e in episodes) / n,
        "buffer_size": len(buffer) if buffer is not None else None,
        "policy_generation_s": round(stats.policy_seconds, 2),
        "environment_s": round(stats.env_seconds, 2),
        **{key: (round(value, 6) if isinstance(value, float) else value) for key, value in fields.items()},
    }


def trainable(episodes: list[Episode]) -> list[Episode]:
    """The episodes whose outcome is the policy's: all but those an environment failure ended."""
    return [e for e in episodes if e.env_failure is None]


def training_returns(episodes: list[Episode], group_size: int) -> list[float]:
    """Each episode's return as GRPO's update sees it (groups: `group_size` episodes of a task in a row).

    An episode an environment failure ended takes the mean return of the rest of its group, so its group-relative
    advantage is 0 and the others' keep their signs and order (their spread is measured with it); in a group that
    failed whole, every episode gets 0: no advantage.
    """
    returns: list[float] = []
    for start in range(0, len(episodes), group_size):
        group = episodes[start:start + group_size]
        counted = [e.return_ for e in trainable(group)]
        stand_in = sum(counted) / len(counted) if counted else 0.0
        returns += [e.return_ if e.env_failure is None else stand_in for e in group]
    return returns


def another_iteration_fits(settings: RLSettings, iterations_done: int, transitions_spent: int) -> bool:
    """Whether the run plays another iteration after `iterations_done` that spent `transitions_spent`: at most
    `settings.iterations`, and under a transition budget only while the iteration's worst case (every episode to the
    turn limit) fits in what is left. So a run never exceeds its budget, yet spends what episodes shorter than the
    turn limit leave (an iteration count fixed in advance by the worst case would not); a resumed run, reading the
    spending from its log, plans the same."""
    return iterations_done < settings.iterations and (
        settings.transition_budget is None
        or settings.transition_budget - transitions_spent >= settings.transitions_per_iteration)


def iterations_allowed(settings: RLSettings, rows: list[dict[str, Any]]) -> int:
    """How many of the logged iterations `rows` this run's plan plays (`another_iteration_fits` before each): a
    checkpoint past it belongs to a longer run or a larger budget, and is not resumed."""
    done = spent = 0
    while done < len(rows) and another_iteration_fits(settings, done, spent):
        spent += rows[done]["env_transitions"]
        done += 1
    return done


def progress(settings: RLSettings, iteration: int, spent: int, seconds_per_iteration: float) -> tuple[str, str]:
    """For an iteration's log line: where the run stands after `iteration` (of its iterations, and of its transition
    budget) and its time per iteration with the ETA (under a budget, of the iterations the mean spending leaves)."""
    left = settings.iterations - iteration
    where = f"{iteration}/{settings.iterations}"
    if settings.transition_budget is not None:
        where += f" ({spent}/{settings.transition_budget} transitions)"
        # the next iteration, then more while a worst case fits in what is left, at the mean spending so far
        mean = max(spent / max(iteration, 1), 1)
        after = (settings.transition_budget - spent - settings.transitions_per_iteration) // mean
        left = min(left, int(after) + 1) if another_iteration_fits(settings, iteration, spent) else 0
    return where, f"{seconds_per_iteration:.0f}s/iteration, ETA {seconds_per_iteration * left:.0f}s"


def episode_seed(seed: int, iteration: int, index: int) -> int:
    """The policy's sampling seed for episode `index` of `iteration`: the same whichever process plays it."""
    return stream_seed(seed, iteration, index)


def play_iteration(model: Any, tokenizer: Any, make_batch: Callable[[], EpisodeBatch], curriculum: Curriculum,
                   generator: GenerationBackend | None, buffer: ReplayBuffer | None, fmt: PolicyFormat,
                   settings: RLSettings, iteration: int) -> tuple[list[Episode], RolloutStats, dict[str, Any]]:
    """One iteration's experience (0-based `iteration`): the curriculum's tasks, `group_size` episodes each, played
    in the synthetic environment and appended to the replay buffer; then the curriculum records each group's reward
    variance and asks `generator` (the experience model's backbone) for variations of the most uncertain tasks,
    which later iterations may play. Returns the episodes, the rollout's time split and the log fields.

    Under a launcher every process calls it: the main process picks the tasks, each process plays its share of the
    episodes (`make_batch()` of every process reaching the same environments: one shared simulator server, or real
    environments of its own), each episode from its own sampling seed, so the iteration is the one a single process
    plays; every process gets all the episodes back, and the main process alone feeds the buffer and the curriculum.
    """
    main = distributed.is_main_process()
    tasks = distributed.broadcast(curriculum.tasks_for_iteration(iteration, settings.tasks_per_iteration,
                                                                 settings.group_size, settings.seed)
                                  if main else None)
    share = distributed.share(len(tasks))
    stats = RolloutStats()
    played = rollout(model, tokenizer, make_batch(), [tasks[i] for i in share], fmt, max_turns=settings.max_turns,
                     batched=settings.batched_rollouts, max_action_tokens=settings.max_action_tokens,
                     max_tokens=settings.max_tokens, temperature=settings.temperature, stats=stats,
                     seeds=[episode_seed(settings.seed, iteration, i) for i in share])
    parts = distributed.all_gather((played, stats))
    episodes, stats = [e for part, _ in parts for e in part], RolloutStats.of_processes([s for _, s in parts])
    check_not_all_failed([e.trajectory for e in episodes], f"RL iteration {iteration + 1}")
    fields = None
    if main:
        started = time.monotonic()
        counted = trainable(episodes)
        added = add_to_buffer(buffer, [e.trajectory for e in counted]) if buffer is not None else 0
        buffer_seconds, started = time.monotonic() - started, time.monotonic()
        curriculum.observe([e.task for e in counted], [e.return_ for e in counted])
        curriculum.observe_failures([e.task for e in episodes if e.env_failure is not None])
        if generator is not None:
            curriculum.propose(generator, iteration + 1)
        fields = {"env_transitions": sum(len(e.trajectory.steps) for e in episodes), "synthetic_transitions": added,
                  "buffer_s": round(buffer_seconds, 2),  # embedding the new transitions into the replay buffer
                  "curriculum_s": round(time.monotonic() - started, 2),
                  "tasks": " ".join(t.task_id for t in tasks[::settings.group_size]),
                  "generated_tasks_played": sum("parent_task_id" in t.parameters for t in tasks[::settings.group_size]),
                  **curriculum.summary()}
    return episodes, stats, distributed.broadcast(fields)


def keep_episodes(checkpoints: Path, iteration: int, episodes: list[Episode]) -> None:
    """Append iteration `iteration`'s (1-based) episodes, as contract trajectories, to checkpoints/EPISODES_FILE."""
    append_records(({"iteration": iteration, "trajectory": episode.trajectory.to_dict()} for episode in episodes
                    if episode.trajectory is not None), checkpoints / EPISODES_FILE)


def kept_episodes(out_dir: str | Path) -> list[Trajectory]:
    """Every episode an RL run in `out_dir` played (`keep_episodes`), in order; [] before its first iteration."""
    path = Path(out_dir) / "checkpoints" / EPISODES_FILE
    return [Trajectory.from_dict(r["trajectory"]) for r in read_records(path)] if path.is_file() else []


def _forget_episodes_after(checkpoints: Path, iterations: int) -> None:
    """Drop the kept episodes of iterations after `iterations` (a resume plays them again)."""
    path = checkpoints / EPISODES_FILE
    if path.is_file():
        write_records([r for r in read_records(path) if r["iteration"] <= iterations], path)


def save_sidecars(checkpoint: Path, buffer: ReplayBuffer | None, log: list[dict[str, Any]],
                  curriculum: Curriculum) -> None:
    """Next to a checkpoint: the replay buffer, the curriculum and the iteration log as of that iteration. The log
    is written last and atomically: its presence marks the checkpoint complete. (A Weaviate buffer saves a
    reference with its content hash and synthetic keys; its server keeps what is added after the checkpoint until
    a resume restores it.)"""
    if buffer is not None:
        buffer.save(checkpoint / BUFFER_DIR)
    (checkpoint / CURRICULUM_FILE).write_text(json.dumps(curriculum.state_dict()), encoding="utf-8")
    write_iteration_log(checkpoint, log)


def write_iteration_log(directory: Path, log: list[dict[str, Any]]) -> None:
    """The iteration log (one JSON object per line) into `directory`, atomically: a present log is a whole one."""
    atomic_write_text(directory / LOG_FILE, "".join(json.dumps(row) + "\n" for row in log))


def read_iteration_log(model_dir: str | Path) -> list[dict[str, Any]] | None:
    """The iteration log saved with an RL policy (a checkpoint or the final model); None for a policy saved without
    one (a warm start, or a model trained before final models carried their log)."""
    path = Path(model_dir) / LOG_FILE
    if not path.is_file():
        return None
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def save_trained_policy(model: Any, tokenizer: Any, out_dir: Path, log: list[dict[str, Any]]) -> Path:
    """The trained policy (LoRA merged) at out_dir/model, replacing any earlier one atomically, with its iteration
    log beside it: whoever evaluates the model later can say what it was trained on, wherever it was moved."""
    model_dir, stamp = out_dir / "model", out_dir / "checkpoints" / "fingerprint.txt"  # the run's (`start_run`)
    with atomic_directory(model_dir, replace=True) as tmp:
        save_for_inference(model, tokenizer, tmp)
        write_iteration_log(tmp, log)
        if stamp.is_file():
            write_made_from(tmp, f"rl {stamp.read_text(encoding='utf-8').strip()} after {len(log)} iterations")
    return model_dir


def sidecars_complete(checkpoint: Path, with_buffer: bool) -> bool:
    return (checkpoint / LOG_FILE).is_file() and (not with_buffer or (checkpoint / BUFFER_DIR).is_dir())


def load_sidecars(checkpoint: Path, buffer: ReplayBuffer | None, curriculum: Curriculum) -> list[dict[str, Any]]:
    """Restore `buffer` in place and `curriculum` to their states at the checkpoint; return the iteration log.

    In place, because the synthetic environments retrieve from the very buffer object the caller passed: the run
    must continue with the synthetic transitions it had made. A fresh buffer (seed transitions only) gets the
    checkpoint's synthetic transitions added with their stored vectors; a server-side (Weaviate) buffer, the run's
    own copy, already holds them and drops the ones a killed run added after the checkpoint.
    """
    log = read_iteration_log(checkpoint) or []
    if isinstance(buffer, FaissReplayBuffer):
        saved = FaissReplayBuffer.load(checkpoint / BUFFER_DIR, buffer.encoder, buffer.index)
        records, vectors = saved.export(source="synthetic")
        buffer.add_vectors(records, vectors)
    elif isinstance(buffer, WeaviateReplayBuffer):
        buffer.restore(checkpoint / BUFFER_DIR)
    curriculum.load_state_dict(json.loads((checkpoint / CURRICULUM_FILE).read_text(encoding="utf-8")))
    return log


def prune_checkpoints(checkpoints: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints. Called after a checkpoint's side-cars are written: pruning before that
    (as Trainer's save_total_limit does) could leave no complete checkpoint if the run died mid-save."""
    for old in numbered_checkpoints(checkpoints)[:-keep] if keep > 0 else []:
        shutil.rmtree(old)


def last_complete_checkpoint(checkpoints: Path, with_buffer: bool, settings: RLSettings) -> Path | None:
    """The newest `checkpoint-N` whose side-cars were written and whose N iterations this run plays
    (`iterations_allowed`).

    Newer ones are removed: a crash mid-save left them, or they belong to a longer run than this one (a run cut to
    fewer iterations must not finish past its length, nor sim-to-real past its budget of real transitions).
    """
    found = numbered_checkpoints(checkpoints)
    while found:
        complete = sidecars_complete(found[-1], with_buffer)
        beyond = complete and checkpoint_number(found[-1]) > iterations_allowed(settings,
                                                                                read_iteration_log(found[-1]) or [])
        if complete and not beyond:
            return found[-1]
        log.warning("removing %s: %s", found[-1], "beyond this run's length or budget" if beyond
                    else "incomplete (a crash)")
        shutil.rmtree(found.pop())
    return None


def settings_fingerprint(settings: RLSettings, policy_model: str, curriculum: Curriculum, environment: str) -> str:
    """Checkpoints are only resumed by a run with the same settings, warm start, environment, tasks and curriculum.

    The warm start counts by content when it is a local directory (a policy retrained in place is another warm
    start); `environment` is the caller's identity of where episodes come from (the simulator's model, buffer and
    settings, or the real environments' settings). The run's length, budget and checkpointing are left out: an
    iteration does not depend on them (the learning rate is constant), so a run extended to more iterations or a
    larger budget resumes where it stopped, and one cut shorter resumes from its last checkpoint within the cut.
    """
    what_an_iteration_does = {key: value for key, value in asdict(settings).items()
                              if key not in ("iterations", "transition_budget", "save_every", "save_total_limit")}
    warm_start = directory_identity(policy_model) if Path(policy_model).is_dir() else policy_model
    return fingerprint([what_an_iteration_does, warm_start, environment, [t.task_id for t in curriculum.base_tasks],
                        asdict(curriculum.settings), curriculum.clusters])


def start_run(policy_model: str, curriculum: Curriculum, buffer: ReplayBuffer | None, settings: RLSettings,
              out_dir: Path, environment: str) -> tuple[Path, Path | None, list[dict[str, Any]]]:
    """Checkpoints dir, the checkpoint to resume from (or None) and the iteration log so far; on resume the buffer
    and the curriculum are restored in place. Checkpoints of other settings, warm start, environment, tasks or
    curriculum are cleared, never resumed."""
    tasks = curriculum.base_tasks
    if len(tasks) < settings.tasks_per_iteration:
        raise ValueError(f"{len(tasks)} tasks for tasks_per_iteration={settings.tasks_per_iteration}")
    if not another_iteration_fits(settings, 0, 0):
        raise ValueError(f"a transition budget of {settings.transition_budget} pays for no iteration (one may take "
                         f"{settings.transitions_per_iteration}: tasks_per_iteration x group_size x max_turns)")
    checkpoints = out_dir / "checkpoints"
    stamp = settings_fingerprint(settings, policy_model, curriculum, environment)
    if discard_unless_stamped(checkpoints, stamp, checkpoints / "fingerprint.txt"):
        log.info("checkpoints in %s were for another warm start, environment or settings: starting over", checkpoints)
    resume = last_complete_checkpoint(checkpoints, with_buffer=buffer is not None, settings=settings)
    rows: list[dict[str, Any]] = []
    if resume is not None:
        rows = load_sidecars(resume, buffer, curriculum)
        log.info("resuming from %s (%d iterations done)", resume, len(rows))
    elif isinstance(buffer, WeaviateReplayBuffer):
        buffer.restore(None)  # synthetic records of a run killed before its first checkpoint
    _forget_episodes_after(checkpoints, len(rows))
    return checkpoints, resume, rows
