"""Embedded replay-buffer speed: filtered top-k retrieval latency as the buffer grows, add and encoder throughput.

    .venv/bin/python benchmarks/buffer_retrieval.py [--sizes 10000 100000 1000000] [--queries 200] [--k 4]

One buffer grows by online appends to each size in turn (random unit 384-d vectors, the dimension of
all-MiniLM-L6-v2, split evenly over 2 environments), so every query scans half the buffer. Index timings use
`search` on ready vectors, i.e. the index alone; the encoder rows time all-MiniLM-L6-v2 on rendered transitions, so
`retrieve()` end to end costs about one encoder call plus one search. Latencies are wall-clock per call.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import table  # noqa: E402
from components.simulator.replay_buffer import FaissReplayBuffer, Retrieved, SentenceEncoder, render  # noqa: E402

DIM, ENVIRONMENTS, BATCH = 384, ("textworld-cooking", "miniwob"), 32


class VectorsOnly:
    """The buffer never calls it here: vectors are added and searched directly."""

    name = "random-unit-vectors"

    def encode(self, texts: list[str]) -> np.ndarray:
        raise NotImplementedError


def unit_vectors(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal((n, DIM), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def records(start: int, stop: int) -> list[Retrieved]:
    """Short synthetic metadata: 10-step trajectories alternating between the environments."""
    return [Retrieved.from_columns(ENVIRONMENTS[(i // 10) % 2], f"task-{i // 100}", f"traj-{i // 10}", i % 10,
                                   f"state {i}", f"action {i}", f"next state {i}", 0.0, i % 10 == 9, "real", "expert")
            for i in range(start, stop)]


def percentiles_ms(seconds: list[float]) -> tuple[float, float]:
    p50, p99 = np.percentile(np.array(seconds) * 1e3, [50, 99])
    return float(p50), float(p99)


def timed_calls(call, arguments) -> list[float]:
    times = []
    for argument in arguments:
        started = time.perf_counter()
        call(argument)
        times.append(time.perf_counter() - started)
    return times


def grow(buffer: FaissReplayBuffer, rng: np.random.Generator, target: int, chunk: int = 10_000) -> float:
    """Append until `target` transitions are stored; return transitions/s of `add_vectors` (metadata included)."""
    seconds, added = 0.0, 0
    while len(buffer) < target:
        start = len(buffer)
        stop = min(target, start + chunk)
        batch, vectors = records(start, stop), unit_vectors(rng, stop - start)  # generated outside the timing
        began = time.perf_counter()
        added += buffer.add_vectors(batch, vectors)
        seconds += time.perf_counter() - began
    return added / seconds if seconds else float("nan")


def index_rows(sizes: list[int], queries: int, k: int) -> list[list[str]]:
    rng = np.random.default_rng(0)
    buffer = FaissReplayBuffer(VectorsOnly())
    probe = unit_vectors(rng, queries)
    batches = [unit_vectors(rng, BATCH) for _ in range(max(queries // BATCH, 10))]
    rows = []
    for size in sizes:
        add_rate = grow(buffer, rng, size)
        environment = ENVIRONMENTS[0]
        buffer.search(probe[:1], environment=environment, k=k)  # warm-up
        single = timed_calls(lambda v: buffer.search(v[None], environment=environment, k=k), probe)
        batched = timed_calls(lambda v: buffer.search(v, environment=environment, k=k), batches)
        excluded = timed_calls(lambda v: buffer.search(v[None], environment=environment, k=k,
                                                       exclude_trajectories=["traj-0"]), probe[: queries // 2])
        s50, s99 = percentiles_ms(single)
        b50, b99 = percentiles_ms(batched)
        x50, _ = percentiles_ms(excluded)
        rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        rows.append([f"{size:,}", f"{add_rate:,.0f}", f"{s50:.2f}", f"{s99:.2f}", f"{x50:.2f}", f"{b50:.2f}",
                     f"{b99:.2f}", f"{b50 / BATCH:.3f}", f"{rss_gb:.2f}"])
        print(f"  {size:,} done", file=sys.stderr, flush=True)
    return rows


def encoder_rows(texts_count: int) -> list[list[str]]:
    import tempfile

    encoder = SentenceEncoder("all-minilm-l6-v2", tempfile.mkdtemp(), batch_size=64)
    # Realistic lengths: a TextWorld-like observation of ~60 words with a command.
    texts = [render(f"Kitchen {i}. You see a fridge, a counter with a knife, a stove and an oven. The fridge is "
                    f"closed. On the counter: a red potato, a yellow pepper and cookbook {i}. Exits: north, east.",
                    f"take red potato from counter {i}") for i in range(texts_count)]
    encoder.encode(texts[:8])  # load the model and warm up outside the timing
    started = time.perf_counter()
    encoder.encode(texts)
    throughput = texts_count / (time.perf_counter() - started)
    single = timed_calls(lambda t: encoder.encode([t]), texts[:50])
    batched = timed_calls(lambda i: encoder.encode(texts[i:i + BATCH]), range(0, min(texts_count, 10 * BATCH), BATCH))
    s50, s99 = percentiles_ms(single)
    b50, b99 = percentiles_ms(batched)
    return [["MiniLM encode", f"{throughput:,.0f}", f"{s50:.2f}", f"{s99:.2f}", "-", f"{b50:.2f}", f"{b99:.2f}",
             f"{b50 / BATCH:.3f}", "-"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--queries", type=int, default=200, help="single queries per size (batches: queries/32)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--encoder-texts", type=int, default=512, help="0 skips the encoder rows")
    parser.add_argument("--threads", type=int, default=0, help="faiss OpenMP threads (0: faiss's default)")
    args = parser.parse_args()
    if args.threads:
        import faiss

        faiss.omp_set_num_threads(args.threads)

    rows = index_rows(sorted(args.sizes), args.queries, args.k)
    if args.encoder_texts:
        rows += encoder_rows(args.encoder_texts)
    header = ["stored", "add or encode /s", "1 query p50 ms", "p99 ms", "1 query excl. p50", f"batch {BATCH} p50 ms",
              "p99 ms", "per query ms", "peak RSS GB"]
    import faiss

    print(f"\nembedded buffer (faiss {faiss.__version__} IndexFlatIP per environment, {DIM}-d, "
          f"{len(ENVIRONMENTS)} environments, k={args.k}, {faiss.omp_get_max_threads()} faiss threads)")
    print(table(header, rows))


if __name__ == "__main__":
    main()
