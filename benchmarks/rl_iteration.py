"""Seconds per RL iteration, split into policy generation, experience-model generation and optimisation, next to a
bare TRL GRPOTrainer step on the same batch (ours / bare is the overhead of multi-turn synthetic rollouts).

    .venv/bin/python benchmarks/rl_iteration.py [--iterations 2] [--tasks 4] [--group-size 2] [--max-turns 3]
        [--max-action-tokens 16] [--experience-max-new-tokens 128] [--policy smollm2-135m-instruct]
        [--experience-model models/experience/model] [--threads N]

Ours: `components.rl.grpo.train_grpo` for `--iterations` iterations: the policy (LoRA as in params.yaml) plays
tasks_per_iteration x group_size multi-turn episodes in the synthetic environment (experience model on the HF
backend, batch = every episode of the turn, grounded by the saved replay buffer), then one GRPO step. Tasks are
TextWorld seed tasks with `initial_state` set to their seed trajectories' first state. The split is the iteration
log's: policy_generation_s, environment_s (experience model, retrieval included) and optimisation_s (the rest of the
step: log-probabilities, loss, backward, optimizer).

Bare: a plain `trl.GRPOTrainer` (no rollout_func) with the same policy, LoRA, seed, batch sizes, group size,
temperature, beta and loss, on a dataset of the same tasks in the same order (so TRL's sampler picks the same tasks
per step) whose prompt is the rendered first turn (system + task + first state, as in our rollouts). It generates
single-turn completions of exactly round(mean policy tokens per episode of ours) tokens (`min_new_tokens` = max),
scored by a trivial length reward, for as many steps as ours ran. Its split: TRL's `_generate` (timed in a
subclass) and the rest of the step. Steps are timed from `on_step_begin` to the step's `on_log`, as
train_grpo's own iteration log does. Note what the ratio contains: ours trains on the whole multi-turn sequence
(the environment's states included, masked out of the loss but not out of the forward pass), bare on the first
prompt plus the policy's tokens only, so optimisation is compared on sequences of different length (both printed).

Everything is written to a temporary directory, removed at the end (--keep to keep it).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from benchmarks.common import load_model, print_machine, table  # noqa: E402
from components import builders  # noqa: E402
from components.config import Params, load_params  # noqa: E402
from components.data.contract import Task, read_trajectories  # noqa: E402
from components.envs.base import Observation  # noqa: E402
from components.llm.backends import HFGenerationBackend
from components.rl.loop import RLSettings  # noqa: E402
from components.rl.policy import SYSTEM, state_message  # noqa: E402
from components.rl.rollouts import SyntheticBatch  # noqa: E402
from components.simulator.experience_model import PredictionStats  # noqa: E402
from components.simulator.replay_buffer import SentenceEncoder, load_replay_buffer  # noqa: E402
from components.simulator.synthetic import SyntheticEnvironment  # noqa: E402

ENVIRONMENT = "textworld-cooking"


def seed_tasks(path: str, count: int) -> list[Task]:
    """The first `count` distinct TextWorld tasks of the seed data, each with its first seed state."""
    from components.simulator.synthetic import first_state_tasks

    tasks = first_state_tasks([t for t in read_trajectories(path) if t.task.environment == ENVIRONMENT])
    if len(tasks) < count:
        raise SystemExit(f"only {len(tasks)} {ENVIRONMENT} tasks in {path}, asked for {count}")
    return tasks[:count]


def run_ours(args: argparse.Namespace, params: Params, tasks: list[Task], settings: RLSettings,
             out_dir: Path) -> dict[str, Any]:
    from components.rl.curriculum import Curriculum, CurriculumSettings
    from components.rl.grpo import train_grpo

    fmt = builders.prompt_format(params)
    buffer = load_replay_buffer(args.buffer, SentenceEncoder(args.embedder, args.cache_dir, 64),
                                builders.buffer_index(params))
    model, tokenizer, name = load_model(args.experience_model, args.cache_dir)
    backend = HFGenerationBackend(model, tokenizer, batch_size=settings.episodes_per_iteration)
    stats = PredictionStats()
    played: list[list[str]] = []

    class RecordingBatch(SyntheticBatch):  # records which tasks each iteration played
        def start(self, batch_tasks: Any) -> list[Observation]:
            played.append([task.task_id for task in batch_tasks])
            return super().start(batch_tasks)

    def make_batch() -> SyntheticBatch:
        settings = dataclasses.replace(builders.inference_settings(params), retries=args.experience_retries,
                                       max_new_tokens=args.experience_max_new_tokens)
        return RecordingBatch(SyntheticEnvironment(ENVIRONMENT, backend, buffer, fmt, settings, stats=stats))

    print(f"experience model: {name}; buffer {args.buffer} ({len(buffer)} transitions)", flush=True)
    started = time.perf_counter()
    # the curriculum off: the overhead of the loop, not of new tasks
    curriculum = Curriculum(tasks, CurriculumSettings(**{**params.synthetic_rl.curriculum.model_dump(),
                                                         "enabled": False}))
    result = train_grpo(args.policy, curriculum, make_batch, buffer, builders.policy_format(params), settings,
                        out_dir / "ours", cache_dir=args.cache_dir)
    wall = time.perf_counter() - started
    return {"log": result.log, "played": played, "stats": stats.as_dict(), "wall": wall, "train_s": result.seconds}


def run_bare(args: argparse.Namespace, params: Params, tasks: list[Task], settings: RLSettings,
             completion_tokens: int, out_dir: Path) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from components.llm.models import load_causal_lm
    from components.llm.sft import lora_config
    from components.rl.grpo import grpo_config

    model, tokenizer = load_causal_lm(args.policy, cache_dir=args.cache_dir, dtype="float32")
    fmt = builders.policy_format(params)
    # The same tasks as train_grpo's; ours plays rl.task_schedule's picks, TRL's sampler picks here (both listed).
    rows = [{"prompt": [{"role": "system", "content": SYSTEM},
                        state_message(Observation(task.parameters["initial_state"]), fmt, task)],
             "task_id": task.task_id} for task in tasks]
    dataset = Dataset.from_list(rows)
    task_of = {row["prompt"][1]["content"]: row["task_id"] for row in rows}
    steps: list[dict[str, Any]] = []
    played: list[list[str]] = []

    def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [len(text) / 100 for text in texts]

    class TimedGRPOTrainer(GRPOTrainer):
        generation_seconds = 0.0

        def _generate(self, prompts: list[Any]) -> Any:
            played.append([task_of.get(p[1]["content"], "?") if isinstance(p, list) else "?" for p in prompts])
            started = time.perf_counter()
            output = super()._generate(prompts)
            type(self).generation_seconds += time.perf_counter() - started
            return output

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.started, TimedGRPOTrainer.generation_seconds = time.perf_counter(), 0.0

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **kwargs: Any) -> None:
            if logs and "loss" in logs:
                total = time.perf_counter() - self.started
                generation = TimedGRPOTrainer.generation_seconds
                steps.append({"step": state.global_step, "total_s": total, "generation_s": generation,
                              "rest_s": total - generation, "completion_length": logs.get("completions/mean_length")})

    peft_config = lora_config(model, settings.lora) if settings.lora is not None else None
    config = grpo_config(settings, out_dir / "bare", max_completion_length=completion_tokens,
                         generation_kwargs={"min_new_tokens": completion_tokens}, save_strategy="no")
    trainer = TimedGRPOTrainer(model=model, reward_funcs=[length_reward], args=config, train_dataset=dataset,
                               processing_class=tokenizer, peft_config=peft_config, callbacks=[StepTimes()])
    prompt_tokens = [len(tokenizer(tokenizer.apply_chat_template(row["prompt"], tokenize=False,
                                                                  add_generation_prompt=True),
                                   add_special_tokens=False)["input_ids"]) for row in rows]
    started = time.perf_counter()
    trainer.train()
    return {"steps": steps, "played": played, "wall": time.perf_counter() - started,
            "prompt_tokens": {row["task_id"]: n for row, n in zip(rows, prompt_tokens, strict=True)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=4, help="TextWorld seed tasks to draw from")
    parser.add_argument("--tasks-per-iteration", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-action-tokens", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--experience-max-new-tokens", type=int, default=128)
    parser.add_argument("--experience-retries", type=int, default=1, help="as params.yaml's inference.retries")
    parser.add_argument("--policy", default="smollm2-135m-instruct", help="packaged alias or model directory")
    parser.add_argument("--experience-model", default="models/experience/model",
                        help="experience model directory, or a packaged alias such as smollm2-135m-instruct")
    parser.add_argument("--buffer", default="buffer")
    parser.add_argument("--embedder", default="all-minilm-l6-v2", help="the encoder the buffer was built with")
    parser.add_argument("--data", default="data/trajectories.jsonl")
    parser.add_argument("--params", default="params.yaml",
                        help="the prompt formats, inference and the RL settings the options here leave")
    parser.add_argument("--cache-dir", default=".cache/models")
    parser.add_argument("--keep", action="store_true", help="keep the temporary output directory")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = parser.parse_args()

    print_machine(args.threads)

    params = load_params(args.params)  # synthetic_rl, less the sizes set here
    settings = dataclasses.replace(builders.rl_settings(params), iterations=args.iterations,
                                   tasks_per_iteration=args.tasks_per_iteration, group_size=args.group_size,
                                   max_turns=args.max_turns, max_action_tokens=args.max_action_tokens,
                                   micro_batch_size=args.micro_batch_size, save_every=max(args.iterations, 1),
                                   save_total_limit=1)
    tasks = seed_tasks(args.data, args.tasks)
    out_dir = Path(tempfile.mkdtemp(prefix="rl_iteration-"))
    print(f"policy {args.policy}; {len(tasks)} tasks; {settings.episodes_per_iteration} episodes/iteration "
          f"({settings.tasks_per_iteration} x group {settings.group_size}), max_turns {settings.max_turns}, "
          f"max_action_tokens {settings.max_action_tokens}, micro_batch {settings.micro_batch_size}, LoRA "
          f"{settings.lora}; experience max_new_tokens {args.experience_max_new_tokens}; output {out_dir}",
          flush=True)
    try:
        ours = run_ours(args, params, tasks, settings, out_dir)
        log = ours["log"]
        if not log:
            raise SystemExit("train_grpo logged no iteration")
        policy_tokens = max(1, round(sum(row["policy_tokens_mean"] for row in log) / len(log)))
        print(f"ours done in {ours['wall']:.1f} s (train {ours['train_s']:.1f} s); bare: {policy_tokens} completion "
              "tokens per episode", flush=True)
        bare = run_bare(args, params, tasks, settings, policy_tokens, out_dir)
    finally:
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)

    print(f"\nours: train_grpo iteration log (experience model calls: {ours['stats']})")
    rows = []
    for row, played in zip(log, ours["played"], strict=False):
        total = row["policy_generation_s"] + row["environment_s"] + row["optimisation_s"]
        rows.append([str(row["iteration"]), f"{total:.1f}", f"{row['policy_generation_s']:.1f}",
                     f"{row['environment_s']:.1f}", f"{row['optimisation_s']:.1f}", f"{row['turns_mean']:.1f}",
                     f"{row['policy_tokens_mean']:.1f}", f"{row['sequence_tokens_mean']:.0f}",
                     f"{row['reward_mean']:.2f}", ",".join(sorted(set(played)))])
    print(table(["iteration", "total s", "policy generation s", "environment s", "optimisation s", "turns",
                 "policy tokens", "sequence tokens", "reward", "tasks"], rows))

    print(f"\nbare TRL GRPOTrainer, single-turn, {policy_tokens} completion tokens")
    rows = []
    for step, played in zip(bare["steps"], bare["played"], strict=False):
        prompt = sum(bare["prompt_tokens"].get(t, 0) for t in played) / max(len(played), 1)
        rows.append([str(step["step"]), f"{step['total_s']:.1f}", f"{step['generation_s']:.1f}",
                     f"{step['rest_s']:.1f}", f"{step['completion_length'] or float('nan'):.1f}",
                     f"{prompt + policy_tokens:.0f}", ",".join(sorted(set(played)))])
    print(table(["step", "total s", "generation s", "optimisation s", "completion tokens", "sequence tokens",
                 "tasks"], rows))

    print("\nours / bare per iteration")
    rows = []
    for row, step in zip(log, bare["steps"], strict=False):
        total = row["policy_generation_s"] + row["environment_s"] + row["optimisation_s"]
        rows.append([str(row["iteration"]), f"{total / step['total_s']:.2f}",
                     f"{(row['policy_generation_s'] + row['environment_s']) / step['generation_s']:.2f}",
                     f"{row['policy_generation_s'] / step['generation_s']:.2f}",
                     f"{row['optimisation_s'] / step['rest_s']:.2f}"])
    print(table(["iteration", "total ratio", "rollout / bare generation", "policy generation / bare generation",
                 "optimisation / bare optimisation"], rows))


if __name__ == "__main__":
    main()
