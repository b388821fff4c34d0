"""Embedded replay-buffer speed and recall: filtered top-k retrieval as the buffer grows, exact against approximate.

    .venv/bin/python benchmarks/buffer_retrieval.py --threads 1 [--sizes 10000 100000 1000000] [--queries 200] [--k 4]
        [--data random structured] [--noise 0.2] [--rerank 64 256] [--encoder-texts 512]

Two buffers grow side by side by online appends to each size in turn, holding the same records and vectors (384-d,
the dimension of all-MiniLM-L6-v2, split evenly over 2 environments, so every query searches half the buffer):
`exact`, one `IndexFlatIP` per environment at any size, and `approximate`, params.yaml's `buffer.index` (exact up to
`approximate_above` rows per environment, then a 4-bit PQ fast scan whose best `rerank` candidates are re-scored
exactly). Recall@k is the share of the exact top-k (by key) that the approximate buffer returns for the same queries.
Rows `rerank N` search the approximate buffer re-ranking N candidates instead of params' `rerank` (a search-time
setting), to show what recall and latency fewer candidates give.

Two sets of vectors, because no structure and real structure are the two ends for any approximate index:
- `random`: uniform random unit vectors, queries too. No neighbourhoods at all: the worst case for indexes
  that prune (graphs, inverted lists).
- `structured`: the real all-MiniLM-L6-v2 embeddings of the distinct seed transitions (data/trajectories.jsonl,
  rendered as the buffer renders them) with Gaussian noise of norm `--noise` added, as many copies as the size
  needs; queries are fresh noisy copies. At 0.2 a copy's cosine to its seed is ~0.98, about the seeds' own
  nearest-neighbour cosine (median 0.956): dense clusters of near-ties, as a buffer of many similar episodes holds.

Index timings use `search` on ready vectors, i.e. the index alone; the encoder rows time all-MiniLM-L6-v2 on rendered
transitions, so `retrieve()` end to end costs about one encoder call plus one search. Latencies are wall-clock per
call; "add /s" counts transitions per second of `add_vectors`, including the approximate index's (re)training.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import table  # noqa: E402
from components import builders  # noqa: E402
from components.config import load_params  # noqa: E402
from components.data.contract import read_trajectories, transitions  # noqa: E402
from components.simulator.replay_buffer import (  # noqa: E402
    FaissReplayBuffer,
    IndexSettings,
    Retrieved,
    SentenceEncoder,
    render,
)

DIM, ENVIRONMENTS, BATCH = 384, ("textworld-cooking", "miniwob"), 32


class VectorsOnly:
    """The buffer never calls it here: vectors are added and searched directly."""

    name = "benchmark-vectors"

    def encode(self, texts: list[str]) -> np.ndarray:
        raise NotImplementedError


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def random_vectors(rng: np.random.Generator) -> Callable[[int], np.ndarray]:
    return lambda n: unit(rng.standard_normal((n, DIM), dtype=np.float32))


def noisy_copies(rng: np.random.Generator, seeds: np.ndarray, noise: float) -> Callable[[int], np.ndarray]:
    """Seed embeddings picked uniformly, plus isotropic Gaussian noise of expected norm `noise`, renormalised."""
    return lambda n: unit(seeds[rng.integers(0, len(seeds), n)]
                          + rng.standard_normal((n, DIM), dtype=np.float32) * np.float32(noise / np.sqrt(DIM)))


def seed_embeddings(data: Path, encoder: SentenceEncoder) -> np.ndarray:
    texts = sorted({render(t.state, t.action) for trajectory in read_trajectories(data)
                    for t in transitions(trajectory)})
    print(f"  embedding {len(texts)} distinct seed transitions with {encoder.name}", file=sys.stderr, flush=True)
    return encoder.encode(texts)


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


def grow(buffers: dict[str, FaissReplayBuffer], make: Callable[[int], np.ndarray], target: int,
         seconds: dict[str, float], chunk: int = 10_000) -> None:
    """Append the same records and vectors to every buffer until `target` are stored; time each buffer's adds."""
    first = next(iter(buffers.values()))
    while len(first) < target:
        start = len(first)
        stop = min(target, start + chunk)
        batch, vectors = records(start, stop), make(stop - start)  # generated outside the timing, shared
        for name, buffer in buffers.items():
            began = time.perf_counter()
            buffer.add_vectors(batch, vectors)
            seconds[name] += time.perf_counter() - began


def keys(hits: list[Retrieved]) -> set[tuple[str, int]]:
    return {(r.trajectory_id, r.step_index) for r in hits}


def index_gb(buffer: FaissReplayBuffer, settings: IndexSettings) -> float:
    """Vectors (float32) plus, past the threshold, the scan's 4-bit codes."""
    rows = len(buffer)
    approximate = sum(n for env in ENVIRONMENTS if settings.approximate_above is not None
                      and (n := buffer.count(environment=env)) > settings.approximate_above)
    return (rows * DIM * 4 + approximate * DIM // settings.subquantizer_dims // 2) / 1e9


def measure(data: str, make: Callable[[int], np.ndarray], sizes: list[int], queries: int, k: int,
            settings: dict[str, IndexSettings], reranks: list[int]) -> Iterator[list[str]]:
    """Rows per size: each buffer of `settings` (the exact one first), then the approximate one searched with each
    of `reranks` (a search-time setting) in place of its own."""
    buffers = {name: FaissReplayBuffer(VectorsOnly(), index) for name, index in settings.items()}
    seconds = dict.fromkeys(buffers, 0.0)
    probe = make(queries)
    batches = [make(BATCH) for _ in range(max(queries // BATCH, 10))]
    environment = ENVIRONMENTS[0]
    for size in sizes:
        grow(buffers, make, size, seconds)
        exact_hits: list[list[Retrieved]] = []
        runs = [(name, buffer, buffer.index) for name, buffer in buffers.items()]
        threshold = settings["approximate"].approximate_above
        if threshold is not None and buffers["approximate"].count(environment=environment) > threshold:
            runs += [(f"rerank {r}", buffers["approximate"], replace(settings["approximate"], rerank=r))
                     for r in reranks]
        for name, buffer, index in runs:
            buffer.index = index
            buffer.search(probe[:1], environment=environment, k=k)  # warm-up
            found: list[list[Retrieved]] = []
            single = timed_calls(lambda v: found.append(buffer.search(v[None], environment=environment, k=k)[0]),
                                 probe)
            batched = timed_calls(lambda v: buffer.search(v, environment=environment, k=k), batches)
            excluded = timed_calls(lambda v: buffer.search(v[None], environment=environment, k=k,
                                                           exclude_trajectories=["traj-0"]), probe[: queries // 2])
            exact_hits = exact_hits or found  # the exact buffer comes first
            recall = np.mean([len(keys(f) & keys(e)) / len(e) for f, e in zip(found, exact_hits)])
            s50, s99 = percentiles_ms(single)
            b50, b99 = percentiles_ms(batched)
            x50, _ = percentiles_ms(excluded)
            add_rate = f"{size / seconds[name]:,.0f}" if name in seconds else "-"
            yield [data, f"{size:,}", name, add_rate, f"{s50:.2f}", f"{s99:.2f}", f"{x50:.2f}", f"{b50 / BATCH:.3f}",
                   f"{b99 / BATCH:.3f}", f"{recall:.3f}", f"{index_gb(buffer, index):.2f}"]
        buffers["approximate"].index = settings["approximate"]
        rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"  {data} {size:,} done, peak RSS {rss_gb:.1f} GB", file=sys.stderr, flush=True)


def encoder_rows(encoder: SentenceEncoder, texts_count: int) -> list[list[str]]:
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
    return [["MiniLM encode", "-", "-", f"{throughput:,.0f}", f"{s50:.2f}", f"{s99:.2f}", "-", f"{b50 / BATCH:.3f}",
             f"{b99 / BATCH:.3f}", "-", "-"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--queries", type=int, default=200, help="single queries per size (batches: queries/32)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--data", nargs="+", choices=["random", "structured"], default=["random", "structured"])
    parser.add_argument("--rerank", type=int, nargs="*", default=[64, 256],
                        help="also search the approximate buffer re-ranking this many candidates (not params')")
    parser.add_argument("--noise", type=float, default=0.2, help="structured: norm of the noise added to a seed")
    parser.add_argument("--params", default="params.yaml", help="buffer.index, models.embedder and cache_dir")
    parser.add_argument("--trajectories", default="data/trajectories.jsonl", help="structured: the seed set")
    parser.add_argument("--encoder-texts", type=int, default=512, help="0 skips the encoder rows")
    parser.add_argument("--threads", type=int, default=0, help="faiss OpenMP threads (0: faiss's default)")
    args = parser.parse_args()
    import faiss

    if args.threads:
        faiss.omp_set_num_threads(args.threads)
    params = load_params(args.params)
    approximate = builders.buffer_index(params)
    settings = {"exact": IndexSettings(approximate_above=None, rerank=approximate.rerank,
                                       subquantizer_dims=approximate.subquantizer_dims),
                "approximate": approximate}
    encoder = SentenceEncoder(params.models.embedder, params.models.cache_dir, params.buffer.encode_batch_size)
    sets = {"random": lambda: random_vectors(np.random.default_rng(0)),
            "structured": lambda: noisy_copies(np.random.default_rng(0),
                                               seed_embeddings(Path(args.trajectories), encoder), args.noise)}

    rows = [row for data in args.data for row in measure(data, sets[data](), sorted(args.sizes), args.queries,
                                                         args.k, settings, args.rerank)]
    if args.encoder_texts:
        rows += encoder_rows(encoder, args.encoder_texts)
    header = ["vectors", "stored", "index", "add /s", "1 query p50 ms", "p99 ms", "1 query excl. p50",
              f"batch {BATCH} p50 ms/query", "p99 ms/query", f"recall@{args.k}", "index GB"]
    print(f"\nembedded buffer (faiss {faiss.__version__}, {DIM}-d, {len(ENVIRONMENTS)} environments, k={args.k}, "
          f"{faiss.omp_get_max_threads()} faiss threads); approximate: {approximate}; structured noise {args.noise}; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GB")
    print(table(header, rows))


if __name__ == "__main__":
    main()
