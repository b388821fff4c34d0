"""Synthetic-environment throughput: transitions/s of `SyntheticEnvironment.step_batch` next to raw `generate`.

    .venv/bin/python benchmarks/synthetic_throughput.py [--batch-sizes 1 8 32] [--max-new-tokens 128]
        [--model models/experience/model] [--buffer buffer] [--repeats 1] [--threads N]

For each batch size B, B real TextWorld (state, action) pairs from the seed trajectories (each with its own
trajectory's earlier steps as history, and its own trajectory excluded from retrieval, as in SFT) are stepped by
one `step_batch` call: retrieval from the saved replay buffer, prompt building, chat template and tokenisation,
one batched `generate` (HF backend, batch_size=B, greedy), decoding and parsing. Next to it, the same model's
`model.generate` runs on the very same tokenised, padded batch with the very same keyword arguments (captured from
the backend's own call), which is the speed of generation alone; synthetic / raw is the overhead of the pipeline.

Both paths are forced to generate exactly `--max-new-tokens` tokens per prompt (`min_new_tokens` is set on the
model's generation config, which the backend's `generate` call inherits), so neither stops early; the new-token
columns verify it. `--natural-stop` lets replies end at EOS instead (compare the tokens/s columns then). Retries
are off by default (`--retries`): an unparsable reply would be generated again, which measures the model's output
quality rather than the pipeline. One warm-up step at batch 1 (both paths) comes before every timing.

Columns: transitions/s of step_batch; generations/s of raw generate; overhead vs raw = step_batch time / raw
generate time (1.00 = no overhead; two separate runs, so noisy on a shared machine); overhead vs own generate =
step_batch time / the time of the `model.generate` call inside that same step_batch (one run, so robust to
background load; the raw replay checks it); new tokens per second and per item (both must equal max-new-tokens
when forced); mean prompt tokens; retrieval ms (encoder + faiss) and, as shares of step_batch, retrieval, the
backend's time outside `model.generate` (chat template, tokenise, pad, decode) and the rest of step_batch (prompt
building, parsing, bookkeeping); parse ms (parse_prediction over the replies, timed apart); parsable replies.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import load_model, print_machine, table  # noqa: E402
from components import builders  # noqa: E402
from components.config import load_params  # noqa: E402
from components.data.contract import Trajectory, read_trajectories  # noqa: E402
from components.llm.backends import HFGenerationBackend  # noqa: E402
from components.simulator.experience_model import PredictionStats, PromptFormat  # noqa: E402
from components.simulator.replay_buffer import SentenceEncoder, load_replay_buffer  # noqa: E402
from components.simulator.synthetic import SyntheticEnvironment, SyntheticEpisode  # noqa: E402

ENVIRONMENT = "textworld-cooking"


def seed_steps(trajectories: list[Trajectory], count: int) -> list[tuple[Trajectory, int]]:
    """`count` (trajectory, step index) pairs with distinct (state, action): step 0 of every trajectory, then step 1
    of every trajectory, and so on (repeated if the seed data has fewer)."""
    pool = [t for t in trajectories if t.task.environment == ENVIRONMENT and t.steps]
    if not pool:
        raise SystemExit(f"no {ENVIRONMENT} trajectories in the seed data")
    chosen, seen = [], set()
    for depth in range(max(len(t.steps) for t in pool)):
        for trajectory in pool:
            if depth < len(trajectory.steps) and len(chosen) < count:
                step = trajectory.steps[depth]
                if (step.state, step.action) not in seen:
                    seen.add((step.state, step.action))
                    chosen.append((trajectory, depth))
    while len(chosen) < count:
        chosen += chosen[: count - len(chosen)]
    return chosen


def episodes_at(env: SyntheticEnvironment, steps: list[tuple[Trajectory, int]]) -> tuple[list, list[str]]:
    """Fresh episodes standing at the chosen real states (earlier real steps as history), and their real actions."""
    episodes = []
    for trajectory, index in steps:
        episode = SyntheticEpisode(trajectory.task, trajectory.steps[index].state, trajectory.trajectory_id)
        episode.steps = list(trajectory.steps[:index])
        episodes.append(episode)
    return episodes, [trajectory.steps[index].action for trajectory, index in steps]


class Probe:
    """Wraps `model.generate`, the backend's `generate` and the buffer's retrieval on the instances (no file is
    changed) to time each and to capture the exact `model.generate` call for the raw replay."""

    def __init__(self, model: Any, backend: HFGenerationBackend, buffer: Any) -> None:
        self.calls: list[dict[str, Any]] = []
        self.seconds = {"model": 0.0, "backend": 0.0, "retrieval": 0.0}
        self.new_tokens: list[int] = []
        self.replies: list[str] = []
        generate, backend_generate = model.generate, backend.generate

        def model_generate(**kwargs: Any) -> Any:
            started = time.perf_counter()
            output = generate(**kwargs)
            self.seconds["model"] += time.perf_counter() - started
            self.calls.append(kwargs)
            self.new_tokens.append(output.numel() - kwargs["input_ids"].numel())  # rows x new positions
            return output

        def timed_backend(*args: Any, **kwargs: Any) -> list[str]:
            started = time.perf_counter()
            replies = backend_generate(*args, **kwargs)
            self.seconds["backend"] += time.perf_counter() - started
            self.replies += replies
            return replies

        model.generate, backend.generate = model_generate, timed_backend
        if buffer is not None:
            retrieve = buffer.retrieve_examples

            def timed_retrieve(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                found = retrieve(*args, **kwargs)
                self.seconds["retrieval"] += time.perf_counter() - started
                return found

            buffer.retrieve_examples = timed_retrieve
        self.raw_generate = generate

    def reset(self) -> None:
        self.calls, self.new_tokens, self.replies = [], [], []
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def time_synthetic(env: SyntheticEnvironment, probe: Probe, steps: list[tuple[Trajectory, int]]) -> dict[str, Any]:
    episodes, actions = episodes_at(env, steps)
    probe.reset()
    started = time.perf_counter()
    env.step_batch(episodes, actions)
    total = time.perf_counter() - started
    return {"seconds": total, **probe.seconds, "calls": list(probe.calls), "new_tokens": sum(probe.new_tokens),
            "replies": list(probe.replies)}


def time_raw(probe: Probe, calls: list[dict[str, Any]]) -> tuple[float, int]:
    """Replay the captured `model.generate` calls (same inputs, same kwargs) on the unwrapped method."""
    import torch

    started, tokens = time.perf_counter(), 0
    for kwargs in calls:
        with torch.inference_mode():
            output = probe.raw_generate(**kwargs)
        tokens += output.numel() - kwargs["input_ids"].numel()
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default="models/experience/model",
                        help="experience model directory, or a packaged alias such as smollm2-135m-instruct")
    parser.add_argument("--cache-dir", default=".cache/models")
    parser.add_argument("--buffer", default="buffer", help="saved replay buffer ('' for no retrieval)")
    parser.add_argument("--embedder", default="all-minilm-l6-v2", help="the encoder the buffer was built with")
    parser.add_argument("--data", default="data/trajectories.jsonl")
    parser.add_argument("--params", default="params.yaml", help="experience_model.prompt gives the prompt format")
    parser.add_argument("--retries", type=int, default=0, help="retries of unparsable replies inside step_batch")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per batch size (the best is kept)")
    parser.add_argument("--natural-stop", action="store_true", help="do not force max-new-tokens (EOS may stop)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = parser.parse_args()

    print_machine(args.threads)

    params = load_params(args.params)
    fmt = PromptFormat(**{**params.experience_model.prompt.model_dump(), **({} if args.buffer else
                                                                            {"use_retrieval": False})})
    buffer = load_replay_buffer(args.buffer, SentenceEncoder(args.embedder, args.cache_dir, 64)) \
        if args.buffer else None
    model, tokenizer, model_name = load_model(args.model, args.cache_dir)
    if not args.natural_stop:
        model.generation_config.min_new_tokens = args.max_new_tokens  # inherited by the backend's generate call
    trajectories = read_trajectories(args.data)
    print(f"experience model: {model_name}; buffer: {args.buffer or 'none'} "
          f"({len(buffer) if buffer is not None else 0} transitions); max_new_tokens {args.max_new_tokens} "
          f"({'EOS may stop early' if args.natural_stop else 'forced'}), greedy, retries {args.retries}; prompt "
          f"top_k {fmt.top_k}, history {fmt.history_length}, reasoning {fmt.use_reasoning}")

    def measure(batch_size: int, repeats: int) -> tuple[dict[str, Any], tuple[float, int]]:
        """The fastest of `repeats` (step_batch, raw replay) pairs on `batch_size` seed states."""
        backend = HFGenerationBackend(model, tokenizer, batch_size=batch_size)
        settings = dataclasses.replace(builders.inference_settings(params), retries=args.retries,
                                       max_new_tokens=args.max_new_tokens, temperature=0.0)  # greedy, as printed
        env = SyntheticEnvironment(ENVIRONMENT, backend, buffer, fmt, settings, stats=PredictionStats())
        probe = Probe(model, backend, buffer)
        steps = seed_steps(trajectories, batch_size)
        best: dict[str, Any] | None = None
        raw_best: tuple[float, int] | None = None
        try:
            for repeat in range(repeats):  # ABBA order over repeats, so drifting background load hits both alike
                if repeat % 2:
                    raw = time_raw(probe, best["calls"])
                    synthetic = time_synthetic(env, probe, steps)
                else:
                    synthetic = time_synthetic(env, probe, steps)
                    raw = time_raw(probe, synthetic["calls"])
                best = synthetic if best is None or synthetic["seconds"] < best["seconds"] else best
                raw_best = raw if raw_best is None or raw[0] < raw_best[0] else raw_best
        finally:  # unwrap the instances
            del model.generate
            if buffer is not None:
                del buffer.retrieve_examples
        assert best is not None and raw_best is not None
        return best, raw_best

    best, raw_best = measure(1, 1)
    print(f"warm-up at batch 1: step_batch {best['seconds']:.2f} s, raw generate {raw_best[0]:.2f} s",
          file=sys.stderr, flush=True)
    rows = []
    for batch_size in args.batch_sizes:
        best, raw_best = measure(batch_size, args.repeats)
        from components.simulator.experience_model import parse_prediction

        started = time.perf_counter()
        parsed = [parse_prediction(reply) for reply in best["replies"]]
        parse_s = time.perf_counter() - started
        total, raw_s, raw_tokens = best["seconds"], raw_best[0], raw_best[1]
        prompt_tokens = sum(int(c["attention_mask"].sum()) for c in best["calls"]) / batch_size
        rest = total - best["retrieval"] - best["backend"]
        rows.append([
            str(batch_size), f"{batch_size / total:.3f}", f"{batch_size / raw_s:.3f}", f"{total / raw_s:.2f}",
            f"{total / best['model']:.3f}",
            f"{best['new_tokens'] / total:.1f}", f"{raw_tokens / raw_s:.1f}",
            f"{best['new_tokens'] // batch_size}/{raw_tokens // batch_size}", f"{prompt_tokens:.0f}",
            f"{best['retrieval'] * 1e3:.0f}", f"{best['retrieval'] / total:.1%}",
            f"{(best['backend'] - best['model']) / total:.1%}", f"{rest / total:.1%}", f"{parse_s * 1e3:.2f}",
            f"{sum(p is not None for p in parsed)}/{batch_size}",
        ])
        print(f"  batch {batch_size} done: step_batch {total:.2f} s, raw generate {raw_s:.2f} s", file=sys.stderr,
              flush=True)

    header = ["batch", "synthetic transitions/s", "raw generations/s", "overhead vs raw", "overhead vs own generate",
              "synthetic new tok/s",
              "raw new tok/s", "new tok per item syn/raw", "prompt tok", "retrieval ms", "retrieval share",
              "tokenise+decode share", "prompt+parse+rest share", "parse ms", "parsable"]
    print(f"\nsynthetic step_batch vs raw model.generate ({model_name}, {args.max_new_tokens} new tokens, "
          f"best of {args.repeats})")
    print(table(header, rows))


if __name__ == "__main__":
    main()
