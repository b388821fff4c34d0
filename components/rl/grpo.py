"""GRPO for multi-turn agents, on TRL's GRPOTrainer with a `rollout_func`.

Why `rollout_func` and not `environment_factory`: the environment factory exposes an environment as tools and relies
on the tokenizer's tool-calling chat template, which small models such as SmolLM2 lack, and it plays one episode per
instance. A `rollout_func` lets us run our own multi-turn engine (`rollouts.rollout`: every episode's policy turn in
one batched generate, every environment turn in one experience-model call) and hand TRL one token sequence per
episode with an `env_mask`, so the loss covers the policy's tokens only.

One optimizer step is one RL iteration (up to `settings.iterations`, and under a transition budget while it pays for
another): TRL asks for `tasks_per_iteration` x `group_size` episodes; we play the curriculum's tasks for the
iteration in their place (`rl.play_iteration`; the tasks TRL sampled from its static dataset are ignored, since the
curriculum adds tasks while training runs), each task `group_size` times in a row, which is how TRL groups
completions. The reward of an episode is its return; TRL normalises the rewards within each task's group
(group-relative advantages over whole multi-turn trajectories) and takes a clipped policy-gradient step with a KL
penalty (`beta`) towards the warm start. Trajectories go into the replay buffer as synthetic
experience.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from components import distributed
from components.llm.backends import GenerationBackend
from components.llm.sft import load_trained_model, lora_config
from components.rl.curriculum import Curriculum
from components.rl.loop import (
    CurveProbe,
    RLResult,
    RLSettings,
    another_iteration_fits,
    iteration_record,
    keep_episodes,
    logged_seconds,
    play_iteration,
    progress,
    prune_checkpoints,
    save_sidecars,
    save_trained_policy,
    start_run,
    training_returns,
)
from components.rl.policy import PolicyFormat
from components.rl.rollouts import EpisodeBatch, RolloutStats
from components.simulator.replay_buffer import ReplayBuffer

log = logging.getLogger(__name__)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.x

# TRL's per-step numbers kept in the iteration log (names as TRL logs them -> ours)
_TRL_METRICS = {"loss": "loss", "kl": "kl", "entropy": "entropy", "grad_norm": "grad_norm",
                "reward_std": "reward_std", "clip_ratio/region_mean": "clip_ratio"}


def episode_return(completions: list[Any], episode_return: list[float], **kwargs: Any) -> list[float]:
    """The reward of a completion is its episode's return (forwarded by rollout_func)."""
    return list(episode_return)


def grpo_config(settings: RLSettings, output_dir: str | Path, **overrides: Any) -> Any:
    """TRL's GRPOConfig for `settings`: one optimizer step per iteration (the iteration's episodes accumulate in
    micro-batches); `overrides` set anything else (checkpointing, generation limits)."""
    import torch
    from trl import GRPOConfig

    return GRPOConfig(**{
        "output_dir": str(output_dir),
        "max_steps": settings.iterations,
        "per_device_train_batch_size": settings.micro_batch_size,
        # each of N processes trains 1/N of the iteration's micro-batches (TRL's generation batch spans them all)
        "gradient_accumulation_steps": distributed.per_process_accumulation(
            settings.episodes_per_iteration // settings.micro_batch_size),
        "num_generations": settings.group_size,
        "max_completion_length": settings.max_tokens,
        "temperature": settings.temperature,
        "learning_rate": settings.learning_rate,
        "lr_scheduler_type": "constant",
        "beta": settings.beta,
        "epsilon": settings.clip_epsilon,
        "loss_type": "dapo",  # token-level normalisation: long episodes are not down-weighted per token
        "scale_rewards": "group",
        "logging_steps": 1,
        "seed": settings.seed,
        "data_seed": settings.seed,
        "use_cpu": not torch.cuda.is_available(),
        "bf16": False,
        "report_to": "none",
        "disable_tqdm": True,
        **overrides,
    })


def train_grpo(policy_model: str, curriculum: Curriculum, make_batch: Callable[[], EpisodeBatch],
               buffer: ReplayBuffer | None, fmt: PolicyFormat, settings: RLSettings, out_dir: str | Path,
               cache_dir: str | Path = ".cache/models", generator: GenerationBackend | None = None,
               environment: str = "", curve: CurveProbe | None = None) -> RLResult:
    """Train `policy_model` (the warm start) with GRPO on episodes from `make_batch()` over the curriculum's tasks
    (`generator` writes the curriculum's task variations; None: no new tasks; `curve` adds held-out success to the
    iteration log).

    Layout: `out_dir/checkpoints/checkpoint-N` (adapter, optimizer, scheduler, RNG states, trainer state, plus the
    replay buffer and iteration log as of iteration N); `out_dir/model` is the final policy. A rerun with the same
    settings, warm start and `environment` (the caller's identity of where episodes come from) resumes from the last
    complete checkpoint; TRL's sampler skips the iterations already done.
    """
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from components.llm.models import load_causal_lm

    if settings.episodes_per_iteration % settings.micro_batch_size:
        raise ValueError(f"tasks_per_iteration x group_size ({settings.episodes_per_iteration}) must be a multiple "
                         f"of micro_batch_size ({settings.micro_batch_size})")
    out_dir = Path(out_dir)
    with distributed.main_process_first():  # the main process clears stale checkpoints; all resume from the same
        checkpoints, resume, rows = start_run(policy_model, curriculum, buffer, settings, out_dir, environment)
    earlier_seconds = logged_seconds(rows)  # iterations restored from the checkpoint
    main = distributed.is_main_process()
    spent = {"transitions": sum(row["env_transitions"] for row in rows)}  # every process: each iteration adds its own
    if resume is not None and not another_iteration_fits(settings, len(rows), spent["transitions"]):
        # Nothing left to train. Trainer.train would still take a step: resumed mid-epoch, it tests max_steps only
        # after one, and for sim-to-real that step spends real transitions beyond the budget.
        if main:
            trained, tokenizer = load_trained_model(resume)
            if settings.lora is not None:
                trained = trained.merge_and_unload()
            save_trained_policy(trained, tokenizer, out_dir, rows)
        distributed.wait_for_everyone()
        return RLResult(out_dir / "model", len(rows), str(resume), rows, earlier_seconds)

    model, tokenizer = load_causal_lm(policy_model, cache_dir=cache_dir, dtype="float32")
    # TRL needs a dataset to sample from; its rows only name base tasks, and rollout_func plays the curriculum's.
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": t.task_id}]} for t in curriculum.base_tasks])
    pending: dict[str, Any] = {}

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list]:
        # Under a launcher TRL hands each process its share of the iteration's prompts: each process plays its
        # share of the iteration (play_iteration), gets all of it back, and trains on TRL's share of the episodes,
        # in the order TRL gathers them back for the groups' advantages.
        episodes, stats, fields = play_iteration(trainer.model, tokenizer, make_batch, curriculum, generator, buffer,
                                                 fmt, settings, trainer.state.global_step)
        if len(episodes) != len(prompts) * distributed.world_size():
            raise RuntimeError(f"{len(episodes)} episodes for TRL's {len(prompts)} prompts per process: the "
                               "generation batch must be one iteration (tasks_per_iteration x group_size)")
        pending.update(episodes=episodes, stats=stats, fields=fields)
        spent["transitions"] += fields["env_transitions"]
        returns = training_returns(episodes, settings.group_size)  # env failures: no advantage
        mine = slice(distributed.rank() * len(prompts), (distributed.rank() + 1) * len(prompts))
        return {"prompt_ids": [e.prompt_ids for e in episodes[mine]],
                "completion_ids": [e.completion_ids for e in episodes[mine]],
                "logprobs": [e.logprobs for e in episodes[mine]],
                "env_mask": [e.env_mask for e in episodes[mine]],
                "episode_return": returns[mine]}

    class IterationLog(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.start, self.first = time.monotonic(), state.global_step

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.step_start = time.monotonic()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # every process stops at once: all of them count the same broadcast transitions; the last iteration is
            # saved, so a resume finds the run complete
            if not another_iteration_fits(settings, state.global_step, spent["transitions"]):
                control.should_training_stop = control.should_save = True

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **kwargs: Any) -> None:
            if not main or not logs or "loss" not in logs or "episodes" not in pending:
                return
            stats: RolloutStats = pending["stats"]
            step_seconds = time.monotonic() - self.step_start
            update = {ours: logs[theirs] for theirs, ours in _TRL_METRICS.items() if theirs in logs}
            fields = pending["fields"]
            optimisation_s = (step_seconds - stats.policy_seconds - stats.env_seconds - fields["buffer_s"]
                              - fields["curriculum_s"])
            episodes = pending.pop("episodes")
            rows.append(iteration_record(state.global_step, episodes, stats, buffer, **fields,
                                         optimisation_s=round(optimisation_s, 2), **update))
            keep_episodes(checkpoints, state.global_step, episodes)
            if curve is not None:
                last = not another_iteration_fits(settings, state.global_step, spent["transitions"])
                rows[-1].update(curve.point(trainer.model, tokenizer, state.global_step, last))
            row, done = rows[-1], state.global_step - self.first
            where, pace = progress(settings, state.global_step, spent["transitions"],
                                   (time.monotonic() - self.start) / done)
            log.info("iteration %s reward %.3f success %.2f kl %s held-out %s | %s", where, row["reward_mean"],
                     row["success_rate"], row.get("kl", "n/a"), row.get("heldout_success", "-"), pace)

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not main:  # Trainer saved the checkpoint in the main process
                return
            save_sidecars(checkpoints / f"checkpoint-{state.global_step}", buffer, rows, curriculum)
            prune_checkpoints(checkpoints, settings.save_total_limit)

    peft_config = lora_config(model, settings.lora) if settings.lora is not None else None
    # save_total_limit None: Trainer would prune before on_save writes the side-cars (see prune_checkpoints)
    args = grpo_config(settings, checkpoints, save_strategy="steps", save_steps=settings.save_every,
                       save_total_limit=None)
    trainer = GRPOTrainer(model=model, reward_funcs=[episode_return], args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, rollout_func=rollout_func,
                          callbacks=[IterationLog()])
    started = time.monotonic()
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)

    trained = trainer.model.merge_and_unload() if peft_config is not None else trainer.model
    model_dir = save_trained_policy(trained, tokenizer, out_dir, rows) if main else out_dir / "model"
    distributed.wait_for_everyone()
    return RLResult(model_dir, trainer.state.global_step, str(resume) if resume else None, rows,
                    earlier_seconds + time.monotonic() - started)
