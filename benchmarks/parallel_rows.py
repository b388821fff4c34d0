"""Whether two study rows side by side, one core each, get more done than one row on every core: the policy's work
of a row (a greedy turn after a long conversation, a training step on an episode) done twice by one process on
`--cores` threads, against once by each of `--cores` processes pinned to a core of their own, at one thread each.

    .venv/bin/python benchmarks/parallel_rows.py [--model smollm2-135m-instruct] [--prompt-tokens 1000]
        [--new-tokens 16] [--train-tokens 1500] [--repeats 4] [--cores 2]

Run it on an idle machine: every figure is wall time. Printed per workload: seconds for the whole work each way and
the ratio (one process's seconds over the side-by-side seconds; above 1, side by side gets more done an hour).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import load_model, print_machine, table  # noqa: E402

WORKLOADS = ("greedy turn", "training step")


def _work(args: argparse.Namespace, threads: int, core: int | None, units: int, barrier, results) -> None:
    """Load the model, warm up, wait for the others, then time `units` of each workload."""
    import torch

    if core is not None:
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, _, _ = load_model(args.model, args.cache_dir)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_tokens))
    episode = torch.randint(0, vocab, (1, args.train_tokens))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def greedy_turn() -> None:
        with torch.no_grad():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                           min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    def training_step() -> None:
        model.train()
        loss = model(input_ids=episode, labels=episode).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()

    timed = {}
    for name, fn in zip(WORKLOADS, (greedy_turn, training_step)):
        fn()  # warm-up: allocator, kernels
        barrier.wait()
        start = time.perf_counter()
        for _ in range(units):
            fn()
        timed[name] = time.perf_counter() - start
        barrier.wait()  # the side-by-side workers start each workload together
    results.put(timed)


def run(args: argparse.Namespace, processes: int, threads: int, units: int) -> dict[str, float]:
    """Seconds per workload until the last of `processes` workers is done with its `units`."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    cores = sorted(os.sched_getaffinity(0))
    workers = [ctx.Process(target=_work, args=(args, threads, cores[i] if processes > 1 else None, units, barrier,
                                               results)) for i in range(processes)]
    for worker in workers:
        worker.start()
    timed = [results.get() for _ in workers]
    for worker in workers:
        worker.join()
    return {name: max(t[name] for t in timed) for name in WORKLOADS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--cache-dir", default=".cache/models")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--train-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=4, help="units of each workload per side-by-side process")
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < args.cores:
        parser.error(f"--cores {args.cores}: this process may run on {len(os.sched_getaffinity(0))} cores only")
    print_machine(0)
    print(f"{args.model}: prompt {args.prompt_tokens} tokens, {args.new_tokens} new, training sequence "
          f"{args.train_tokens}", flush=True)
    alone = run(args, processes=1, threads=args.cores, units=args.repeats * args.cores)
    side = run(args, processes=args.cores, threads=1, units=args.repeats)
    rows = [[name, f"{args.repeats * args.cores}", f"{alone[name]:.1f}", f"{side[name]:.1f}",
             f"{alone[name] / side[name]:.2f}x"] for name in WORKLOADS]
    print(table(["workload", "units", f"one process, {args.cores} threads (s)",
                 f"{args.cores} processes, 1 thread each (s)", "side by side vs one"], rows))


if __name__ == "__main__":
    main()
