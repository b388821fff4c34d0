"""The experience model's cost per synthetic transition, and where it goes, backend against backend, in one run.

    .venv/bin/python benchmarks/synthetic_throughput.py [--params profiles/cpu.yaml] [--model DIR]
        [--paths hf llamacpp:f32 llamacpp:q8_0:draft10 hf@../other-checkout] [--transitions N] [--rounds R]
        [--threads T]

Every path predicts the same held-out real transitions (the ones `evaluate_experience_model` scores: the params'
`fidelity_max_transitions`, outcomes and look-alikes first; `--transitions` overrides the count) through
`fidelity.model_predictor`: retrieval from the saved buffer, prompt building, generation, parsing, retries and
fallbacks: what a synthetic step does. A path is a backend: `hf` (Hugging Face `generate`, batched as params say) or
`llamacpp:<weights>[:draft<N>][:batch<B>]` (the model exported to GGUF and run by llama.cpp, with prompt-lookup
drafts of N tokens, B sequences decoded together; default: the params' batch size, `batch1` one at a time). By
default every path uses the same trained model, prompt format and inference settings (`--params`, `--model`);
`PATH@DIR` runs the backend on another checkout DIR instead: its params.yaml (prompt format, reply form, inference
settings), its trained experience model and its buffer, so a model trained with another format is compared on the
same transitions. Rounds alternate the order of the paths, so a machine that slows down does not favour one; times
are summed over rounds.

Printed per path: transitions per second and the ratio to the first path; per transition, prompt and reply tokens
and where the time went: retrieval (encoder and index), prompt encoding (the same prompts generated again for one
token, timed apart: prefill), decoding (generation minus prefill) and the rest (prompt building, chat template,
parsing), and the prompt's tokens part by part (system message, task, retrieved examples, history, current state,
action). Then the fidelity table of each path on the same transitions (with the state-unchanged floor), and how
many replies equal the first path's.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import print_machine, table  # noqa: E402
from components import builders  # noqa: E402
from components.config import load_params  # noqa: E402
from components.llm.backends import encode_prompt, make_backend  # noqa: E402
from components.simulator import fidelity  # noqa: E402
from components.simulator.experience_model import REPLY_END, PredictionStats  # noqa: E402


class Timed:
    """Wraps a backend: times its `generate` calls and keeps their prompts and replies."""

    def __init__(self, backend: Any) -> None:
        self.backend, self.seconds, self.prompts, self.replies = backend, 0.0, [], []

    def generate(self, prompts: list, max_new_tokens: int, temperature: float = 0.0) -> list[str]:
        started = time.perf_counter()
        replies = self.backend.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature)
        self.seconds += time.perf_counter() - started
        self.prompts += prompts
        self.replies += replies
        return replies


PARTS = (("Task (", "task"), ("\n\nSimilar transitions:", "retrieved examples"), ("\n\nRecent history", "history"),
         ("\n\nCurrent state:", "current state"), ("\n\nAction:", "action"))


def prompt_parts(prompts: list, tokenizer: Any) -> str:
    """Where a prompt's tokens go: the system message and each part `build_messages` joins into the user message
    (found by their headers, in order: states hold blank lines of their own)."""
    totals = {"system": 0, **{name: 0 for _, name in PARTS}}
    for messages in prompts:
        totals["system"] += len(tokenizer(messages[0]["content"], add_special_tokens=False)["input_ids"])
        user = messages[1]["content"]
        starts = [(user.rfind(header) if name == "action" else user.find(header), name) for header, name in PARTS]
        starts = sorted((start, name) for start, name in starts if start >= 0)
        for (start, name), (end, _) in zip(starts, starts[1:] + [(len(user), "")]):
            totals[name] += len(tokenizer(user[start:end], add_special_tokens=False)["input_ids"])
    return ", ".join(f"{name} {count / max(len(prompts), 1):.0f}" for name, count in totals.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml", help="a params file or profile (profiles/cpu.yaml)")
    parser.add_argument("--model", default=None, help="experience model directory (default: the params' trained one)")
    parser.add_argument("--paths", nargs="+", default=["hf", "llamacpp:f32"],
                        help="backends to compare, the first is the baseline: hf, llamacpp:f32|f16|q8_0")
    parser.add_argument("--transitions", type=int, default=0, help="held-out transitions (0: the params' count)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch and llama.cpp threads (0: their default)")
    args = parser.parse_args()
    print_machine(args.threads)

    root = Path(".")
    params = load_params(args.params)
    heldout = fidelity.heldout_transitions(builders.experience_trajectories(params, root),
                                           params.data.heldout_task_fraction)
    heldout = fidelity.outcomes_first_sample(heldout,
                                             args.transitions or params.experience_model.fidelity_max_transitions)
    first = heldout[0]
    retrieval = {"seconds": 0.0}
    setups: dict[str, dict[str, Any]] = {}  # per path: backend, format, inference settings, buffer
    for path in args.paths:
        backend_spec, _, checkout = path.partition("@")
        where = Path(checkout) if checkout else root
        path_params = load_params(where / "params.yaml") if checkout else params
        settings = path_params.experience_model
        model = str(where / settings.out_dir / "model") if checkout or not args.model else args.model
        buffer = builders.saved_buffer(path_params, where)
        retrieve = buffer.retrieve_examples
        retrieve([(first.task.environment, first.state, first.action, first.trajectory_id)], 1)  # loads the encoder

        def timed_retrieve(*a: Any, retrieve: Any = retrieve, **k: Any) -> Any:
            started = time.perf_counter()
            found = retrieve(*a, **k)
            retrieval["seconds"] += time.perf_counter() - started
            return found

        buffer.retrieve_examples = timed_retrieve
        kind, _, options = backend_spec.partition(":")
        weights, *extras = options.split(":")
        draft = next((int(e.removeprefix("draft")) for e in extras if e.startswith("draft")),
                     settings.inference.llamacpp.draft_tokens)
        batch = next((int(e.removeprefix("batch")) for e in extras if e.startswith("batch")),
                     settings.inference.batch_size)
        backend = Timed(make_backend(
            kind, model, batch_size=batch, base_url=settings.inference.base_url,
            weight_type=weights or settings.inference.llamacpp.weight_type, threads=args.threads,
            context=settings.inference.llamacpp.context, draft_tokens=draft,
            cache_dir=root / params.models.cache_dir, stop=(REPLY_END,)))
        backend.backend.generate([[{"role": "user", "content": "warm up"}]], 4)  # first-call costs stay out
        fmt, inference = builders.prompt_format(path_params), builders.inference_settings(path_params)
        setups[path] = {"backend": backend, "fmt": fmt, "inference": inference, "buffer": buffer}
        print(f"{path}: experience model {model}; reply {fmt.reply}, trimmed context {fmt.trim_context}, reasoning "
              f"{fmt.use_reasoning}, retrieval top {fmt.top_k}, history {fmt.history_length}; max_new_tokens "
              f"{inference.max_new_tokens}, temperature {inference.temperature}, retries {inference.retries}",
              flush=True)
    print(f"{len(heldout)} held-out transitions", flush=True)
    backends = {path: setup["backend"] for path, setup in setups.items()}

    measured = {path: {"seconds": 0.0, "retrieval": 0.0, "generation": 0.0, "stats": PredictionStats()}
                for path in args.paths}
    predictions: dict[str, list] = {}
    for round_ in range(args.rounds):
        for path in (args.paths if round_ % 2 == 0 else list(reversed(args.paths))):
            timed, row = backends[path], measured[path]
            timed.prompts, timed.replies, timed.seconds, retrieval["seconds"] = [], [], 0.0, 0.0
            started = time.perf_counter()
            setup = setups[path]
            predictions[path] = fidelity.model_predictor(timed, setup["fmt"], setup["inference"], setup["buffer"],
                                                         row["stats"])(heldout)
            row["seconds"] += time.perf_counter() - started
            row["retrieval"] += retrieval["seconds"]
            row["generation"] += timed.seconds
            print(f"round {round_ + 1}, {path}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)

    tokenizer = backends[args.paths[0]].backend.tokenizer
    for path in args.paths:  # prompt encoding: the same prompts, one new token each, once
        timed, row = backends[path], measured[path]
        started = time.perf_counter()
        timed.backend.generate(timed.prompts, max_new_tokens=1, temperature=0.0)
        row["prefill"] = (time.perf_counter() - started) * args.rounds
        row["prompt_tokens"] = sum(len(encode_prompt(tokenizer, p)) for p in timed.prompts)
        row["reply_tokens"] = sum(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in timed.replies)

    n = len(heldout) * args.rounds
    baseline = measured[args.paths[0]]["seconds"]
    rows = []
    for path in args.paths:
        row = measured[path]
        decode = row["generation"] - row["prefill"]
        rest = row["seconds"] - row["retrieval"] - row["generation"]
        generations = max(len(backends[path].prompts), 1)  # the last round's, whose prompts and replies are counted
        rows.append([path, f"{n / row['seconds']:.3f}", f"{row['seconds'] / n:.2f}",
                     f"{baseline / row['seconds']:.2f}x", f"{row['prompt_tokens'] / generations:.0f}",
                     f"{row['reply_tokens'] / generations:.0f}", f"{row['retrieval'] / n * 1e3:.0f}",
                     f"{row['prefill'] / n:.2f}", f"{decode / n:.2f}",
                     f"{decode / max(row['reply_tokens'] * args.rounds, 1) * 1e3:.1f}", f"{rest / n * 1e3:.0f}",
                     f"{row['stats'].fallbacks}/{row['stats'].requests}"])
    print()
    print(table(["path", "transitions/s", "s per transition", "speed vs first", "prompt tok", "reply tok",
                 "retrieval ms", "prompt encoding s", "decoding s", "ms per reply token", "rest ms",
                 "fell back"], rows))
    print("\nprompt tokens per part (mean per generation):")
    for path in args.paths:
        print(f"  {path}: " + prompt_parts(backends[path].prompts, tokenizer))
    same = {path: sum(a == b for a, b in zip(backends[path].replies, backends[args.paths[0]].replies))
            for path in args.paths}
    print("\nreplies identical to the first path's (last round): "
          + ", ".join(f"{path} {same[path]}/{len(heldout)}" for path in args.paths))
    scored = fidelity.evaluate({**{path: (lambda _, p=path: predictions[p]) for path in args.paths},
                                "state unchanged": fidelity.state_unchanged}, heldout)
    print()
    print(fidelity.fidelity_report(scored, title=None))


if __name__ == "__main__":
    main()
