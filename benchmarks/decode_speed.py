"""How fast Hugging Face `generate` writes the experience model's replies on this machine's device (a GPU when there
is one): one synthetic turn of B episodes is one `generate` call over B prompts; its seconds, prompt encoding and
per-token decoding, and the memory it takes, at each batch width B and dtype.

    .venv/bin/python benchmarks/decode_speed.py --save-prompts FILE [--params profiles/cpu.yaml] [--transitions 64]
    .venv/bin/python benchmarks/decode_speed.py [--model DIR] [--prompts FILE] [--random-weights]
        [--batches 1 8 32] [--dtypes float32 bfloat16] [--new-tokens 256] [--rounds 2] [--threads N]

The prompts are the experience model's own: those it gets for the held-out transitions `evaluate_experience_model`
scores, built as a synthetic step builds them (retrieval from the saved buffer, history, reasoning format).
`--save-prompts FILE` writes them and stops (it needs the pipeline's buffer and encoder); `--prompts FILE` reads
them, so the speed can be measured where neither is (a lent GPU machine); without it they are built on the spot.
B prompts are taken in file order (repeated when B is larger than the file). Every reply is exactly `--new-tokens`
long (min_new_tokens = max_new_tokens, greedy), so widths, dtypes and weights compare on the same work; a real
reply stops earlier, at the reply's end marker.

`--random-weights` builds the model from its config (`--model` needs only config.json and the tokenizer's files)
with random weights. What a token costs depends on the architecture and the shapes, not on the weights' values, and
the 135M model's weights are larger than what travels to a lent GPU (64 MiB); run here with and without it to see
that the two agree. Printed per dtype and width: seconds per turn, prompt encoding (the same prompts generated for
one token), milliseconds per decoding step, reply tokens per second, speed per reply against the first width
of the same dtype, and peak GPU memory.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import print_machine, table  # noqa: E402
from components.llm.backends import encode_prompt  # noqa: E402


def experience_prompts(params_path: str, transitions: int) -> list[Any]:
    """The prompts the experience model gets for the first `transitions` held-out transitions (outcomes first)."""
    from components import builders
    from components.config import load_params
    from components.simulator import fidelity
    from components.simulator.experience_model import PredictionStats

    class Recorder:
        """A backend that keeps each prompt and answers nothing (every step falls back: only prompts matter)."""

        def __init__(self) -> None:
            self.prompts: list[Any] = []

        def generate(self, prompts: list, max_new_tokens: int, temperature: float = 0.0) -> list[str]:
            self.prompts += prompts
            return [""] * len(prompts)

    params = load_params(params_path)
    heldout = fidelity.heldout_transitions(builders.experience_trajectories(params, Path(".")),
                                           params.data.heldout_task_fraction)
    heldout = fidelity.outcomes_first_sample(heldout, transitions)
    recorder = Recorder()
    fidelity.model_predictor(recorder, builders.prompt_format(params), builders.inference_settings(params),
                             builders.saved_buffer(params, Path(".")), PredictionStats())(heldout)
    return recorder.prompts[:len(heldout)]  # retries come after every first try; the first tries are enough


def load(model: str, dtype: str, random_weights: bool) -> tuple[Any, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from components import distributed

    if not random_weights:
        from benchmarks.common import load_model

        loaded, tokenizer, _ = load_model(model, ".cache/models")
        return loaded.to(getattr(torch, dtype)), tokenizer
    torch.manual_seed(0)
    built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return built.to(distributed.device()), tokenizer


def timed_generate(model: Any, inputs: dict, new_tokens: int, pad_token_id: int) -> float:
    import torch

    synchronize = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       temperature=None, top_p=None, top_k=None, pad_token_id=pad_token_id)
    synchronize()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml", help="where prompts are built: format, buffer, held-out")
    parser.add_argument("--transitions", type=int, default=64, help="held-out transitions whose prompts are used")
    parser.add_argument("--save-prompts", default=None, help="write the prompts to this JSONL file and stop")
    parser.add_argument("--prompts", default=None, help="read the prompts from this JSONL file")
    parser.add_argument("--model", default="models/experience/model")
    parser.add_argument("--random-weights", action="store_true", help="the model's architecture, random weights")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="timed calls per width (after one warm-up call)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    args = parser.parse_args()

    if args.save_prompts:
        prompts = experience_prompts(args.params, args.transitions)
        Path(args.save_prompts).write_text("".join(json.dumps(p) + "\n" for p in prompts))
        print(f"{len(prompts)} prompts written to {args.save_prompts}")
        return
    print_machine(args.threads)
    import torch

    prompts = ([json.loads(line) for line in Path(args.prompts).read_text().splitlines()] if args.prompts
               else experience_prompts(args.params, args.transitions))
    cuda = torch.cuda.is_available()
    weights = "random weights" if args.random_weights else "trained weights"
    print(f"model {args.model} ({weights}); {len(prompts)} prompts; replies of {args.new_tokens} tokens; "
          f"{args.rounds} timed rounds", flush=True)
    rows = []
    for dtype in args.dtypes:
        model, tokenizer = load(args.model, dtype, args.random_weights)
        model.eval()
        encoded = [encode_prompt(tokenizer, p) for p in prompts]
        per_reply_at_first = None
        for width in args.batches:
            batch = [encoded[i % len(encoded)] for i in range(width)]
            inputs = tokenizer.pad({"input_ids": batch}, padding_side="left", return_tensors="pt").to(model.device)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            timed_generate(model, inputs, args.new_tokens, tokenizer.pad_token_id)  # warm-up: first-call costs
            turn = sum(timed_generate(model, inputs, args.new_tokens, tokenizer.pad_token_id)
                       for _ in range(args.rounds)) / args.rounds
            prefill = sum(timed_generate(model, inputs, 1, tokenizer.pad_token_id)
                          for _ in range(args.rounds)) / args.rounds
            step_ms = (turn - prefill) / max(args.new_tokens - 1, 1) * 1e3
            per_reply = turn / width
            per_reply_at_first = per_reply_at_first or per_reply
            memory = f"{torch.cuda.max_memory_allocated() / 2**30:.1f}" if cuda else "-"
            rows.append([dtype, str(width), f"{sum(map(len, batch)) / width:.0f}", str(inputs['input_ids'].shape[1]),
                         f"{turn:.2f}", f"{prefill:.3f}", f"{step_ms:.1f}", f"{width * args.new_tokens / turn:.0f}",
                         f"{per_reply_at_first / per_reply:.1f}x", memory])
            print(f"{dtype}, B={width}: " + ", ".join(rows[-1][4:]), file=sys.stderr, flush=True)
        del model
    print()
    print(table(["dtype", "B", "prompt tok (mean)", "padded to", "s per turn", "prompt encoding s",
                 "ms per decoding step", "reply tok/s", "speed per reply vs first B", "peak GPU GiB"], rows))


if __name__ == "__main__":
    main()
