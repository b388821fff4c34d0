"""Does decoding several sequences at once pay in llama.cpp on this machine? Prefill and per-token decode cost of the
experience model's GGUF export, one sequence against B sequences sharing one llama.cpp batch.

    .venv/bin/python benchmarks/llamacpp_batching.py [--model DIR] [--weights q8_0] [--batches 1 8]
        [--prompt-tokens 800] [--new-tokens 64] [--threads 1]

`LlamaCppBackend` decodes one sequence at a time; this measures what the low-level multi-sequence API would buy
before anyone writes it. Each of B distinct prompts of the same length is prefilled into its own sequence of one
unified KV cache (llama.cpp batches of 512 tokens), then every sequence decodes greedily, one token per sequence per
llama_decode call. Prints tokens per second of prefill, and decode milliseconds per step and per token per sequence.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import table  # noqa: E402
from components.llm.gguf_export import export_gguf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/experience/model")
    parser.add_argument("--cache-dir", default=".cache/models")
    parser.add_argument("--weights", default="q8_0", choices=["f32", "f16", "q8_0"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=800)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import llama_cpp as lc
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    path = export_gguf(args.model, args.weights, args.cache_dir)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    vocabulary = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    text = "You are in a kitchen. There is a fridge, a knife and a red potato. " * (args.prompt_tokens // 10)
    print(f"{path.name}, {args.threads} thread(s), prompts of {args.prompt_tokens} tokens, {args.new_tokens} new "
          f"tokens per sequence, greedy", flush=True)
    rows = []
    for size in args.batches:
        params = lc.llama_context_default_params()
        params.n_ctx = (args.prompt_tokens + args.new_tokens + 64) * size
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max, params.kv_unified, params.flash_attn_type = size, True, 1
        params.n_threads = params.n_threads_batch = args.threads
        context = lc.llama_init_from_model(model, params)
        batch = lc.llama_batch_init(512, 0, size)

        def decode(entries: list[tuple[int, int, int, bool]]) -> dict[int, np.ndarray]:
            """Feed (token, position, sequence, want logits) entries; the logits of each sequence that wants them."""
            logits = {}
            for start in range(0, len(entries), 512):
                chunk = entries[start: start + 512]
                batch.n_tokens = len(chunk)
                for i, (token, position, sequence, wanted) in enumerate(chunk):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
                    batch.seq_id[i][0], batch.logits[i] = sequence, wanted
                if lc.llama_decode(context, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                for i, (_, _, sequence, wanted) in enumerate(chunk):
                    if wanted:
                        row = lc.llama_get_logits_ith(context, i)
                        logits[sequence] = np.ctypeslib.as_array(row, shape=(vocabulary,)).copy()
            return logits

        prompts = [tokenizer(f"Prompt {n}. {text}")["input_ids"][: args.prompt_tokens] for n in range(size)]
        started = time.perf_counter()
        logits = decode([(token, position, sequence, position == len(ids) - 1)
                         for sequence, ids in enumerate(prompts) for position, token in enumerate(ids)])
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        for step in range(args.new_tokens):
            logits = decode([(int(np.argmax(logits[sequence])), len(prompts[sequence]) + step, sequence, True)
                             for sequence in range(size)])
        decoding = time.perf_counter() - started
        rows.append([str(size), f"{size * args.prompt_tokens / prefill:.0f}",
                     f"{decoding / args.new_tokens * 1e3:.1f}", f"{decoding / args.new_tokens / size * 1e3:.1f}"])
        lc.llama_batch_free(batch)
        lc.llama_free(context)
    lc.llama_model_free(model)
    print(table(["sequences", "prefill tok/s", "decode ms per step", "decode ms per token per sequence"], rows))


if __name__ == "__main__":
    main()
