"""The experience replay buffer: transitions with metadata, embedded, retrieved top-k by cosine similarity.

DreamGym's experience model conditions each prediction on the k past transitions most similar to the current
(state, action). The buffer is seeded with offline real trajectories and grows online with synthetic ones.

Two backends behind one interface (`ReplayBuffer`), picked by `open_replay_buffer(backend, ...)`:

- `embedded` (`FaissReplayBuffer`, the default): faiss in-process, no server; exact search, approximate (with exact
  re-ranking) in an environment past `buffer.index.approximate_above` rows. Saved to and loaded from a
  directory (`metadata.parquet`, one faiss index file per environment, `buffer.json`), which the artifact store
  keeps as the run's `buffer` artifact.
- `weaviate` (`WeaviateReplayBuffer`): a Weaviate server (weaviate-client 4.x) for buffers shared by many
  rollout workers or too big for one machine. One collection per seed buffer identity (`seed_collection_name`),
  a per-run copy for synthetic RL (`copy`, `run_collection_name`); saved as a reference with a content hash.

What gets embedded: `render(state, action)`, i.e. the text "action: {action}\\nstate: {state}". The action
comes first on purpose: encoders truncate (all-MiniLM-L6-v2 at 256 word pieces) and states run to thousands of
characters, so a state-first rendering would silently drop the action from long-state embeddings. Queries are
rendered the same way, so a query and a stored transition are compared like for like.

A transition is identified by (trajectory_id, step_index). Adding one that is already stored is a no-op (a retried
task can re-add a trajectory safely); `add` returns how many were new.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol
from urllib.parse import urlparse

import numpy as np

from components.data.contract import TaskRef, Transition, is_heldout_game
from components.files import atomic_directory, fingerprint, write_made_from

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

Source = Literal["real", "synthetic"]
BUFFER_SOURCES: tuple[Source, ...] = ("real", "synthetic")
FORMAT_VERSION = 1
_ENCODE_CHUNK = 1024  # transitions embedded per encoder call in `add`: bounds memory, not a tuning knob


def render(state: str, action: str) -> str:
    """The text embedded for a (state, action) pair; action first so truncation never cuts it (module docstring)."""
    return f"action: {action}\nstate: {state}"


# (environment, state, action, trajectory to exclude or None): one request for grounding examples
ExampleQuery = tuple[str, str, str, "str | None"]


def distinct(examples: Sequence[Retrieved]) -> list[Retrieved]:
    """`examples` in order without repeats of the same (state, action, next_state, reward, done)."""
    seen, kept = set(), []
    for ex in examples:
        key = (ex.state, ex.action, ex.next_state, ex.reward, ex.done)
        if key not in seen:
            seen.add(key)
            kept.append(ex)
    return kept


# ----------------------------------------------------------------------------------------------------- encoders
class Encoder(Protocol):
    """Texts -> float32 array of shape (len(texts), dim) with L2-normalised rows."""

    name: str  # saved with a buffer: vectors from a different encoder are meaningless to it

    def encode(self, texts: list[str]) -> np.ndarray: ...


class SentenceEncoder:
    """A sentence-transformers model (packaged alias, Hugging Face id or local path), loaded on first use."""

    def __init__(self, model_name_or_path: str, cache_dir: str | Path, batch_size: int = 64):
        self.name = model_name_or_path
        self.cache_dir = cache_dir
        self.batch_size = batch_size
        self._model: SentenceTransformer | None = None  # lazy: loading a buffer to count it needs no torch

    @property
    def model(self) -> SentenceTransformer:
        if self._model is None:
            from components.llm.models import load_sentence_embedder

            self._model = load_sentence_embedder(self.name, self.cache_dir)
        return self._model

    def encode(self, texts: list[str]) -> np.ndarray:
        vectors = self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                    convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(texts), -1)


def _normalised(vectors: np.ndarray) -> np.ndarray:
    """float32, C-contiguous, unit rows: inner product then *is* cosine, whatever an encoder hands us."""
    vectors = np.array(vectors, dtype=np.float32, order="C", ndmin=2)  # a copy: callers' arrays stay untouched
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    np.divide(vectors, norms, out=vectors, where=norms > 0)
    return vectors


# ------------------------------------------------------------------------------------------------- the records
def _transition_field(name: str) -> property:
    return property(lambda record: getattr(record.transition, name), doc=f"the transition's {name}")


@dataclass(frozen=True, slots=True)
class Retrieved:
    """A stored transition as the experience model sees it: the contract `Transition`, where the buffer got it
    (`source`: real or synthetic), and its cosine similarity to the query.

    The buffer stores a task's id and environment, not its instruction, so `transition.task` is a `TaskRef`: no
    reader of a retrieved record needs the instruction (prompts show examples' states, actions and outcomes), and one
    that needs the task looks it up by `task_id` (as `synthetic.episodes_from_buffer` does).
    """

    transition: Transition  # history and info are not stored: always empty here
    source: Source  # real or synthetic: where the buffer got it
    score: float = float("nan")  # cosine similarity; NaN on a stored record that no query produced

    # The stored columns read through to the transition (`origin` is its contract source: expert, random, ...).
    trajectory_id = _transition_field("trajectory_id")
    step_index = _transition_field("step_index")
    state = _transition_field("state")
    action = _transition_field("action")
    next_state = _transition_field("next_state")
    reward = _transition_field("reward")
    done = _transition_field("done")
    origin = _transition_field("source")

    @property
    def environment(self) -> str:
        return self.transition.task.environment

    @property
    def task_id(self) -> str:
        return self.transition.task.task_id

    @classmethod
    def from_columns(cls, environment: str, task_id: str, trajectory_id: str, step_index: int, state: str,
                     action: str, next_state: str, reward: float, done: bool, source: Source, origin: str,
                     score: float = float("nan")) -> Retrieved:
        """A record from its stored columns (`COLUMNS`, in that order), and its score when a query found it."""
        return cls(Transition(trajectory_id, step_index, TaskRef(task_id, environment), state, action, next_state,
                              reward, done, origin), source, score)


# The stored columns (metadata.parquet's, a Weaviate collection's properties), in stored order: attributes of
# Retrieved, and `Retrieved.from_columns`'s arguments. Changing them changes every saved buffer.
COLUMNS = ("environment", "task_id", "trajectory_id", "step_index", "state", "action", "next_state", "reward", "done",
           "source", "origin")


def _record(transition: Transition, source: Source) -> Retrieved:
    if source not in BUFFER_SOURCES:
        raise ValueError(f"source {source!r}: expected one of {BUFFER_SOURCES}")
    task = transition.task
    if is_heldout_game(task.environment, getattr(task, "parameters", None)):
        raise ValueError(f"transition {transition.trajectory_id}/{transition.step_index} is from {task.task_id}, a "
                         "held-out evaluation game: its transitions only measure and never ground the experience model")
    if source == "real" and transition.source == "synthetic":
        raise ValueError(f"transition {transition.trajectory_id}/{transition.step_index} comes from a synthetic "
                         "trajectory and cannot be added as real")
    return Retrieved.from_columns(transition.task.environment, transition.task.task_id, transition.trajectory_id,
                                  transition.step_index, transition.state, transition.action, transition.next_state,
                                  float(transition.reward), bool(transition.done), source, transition.source)


# ----------------------------------------------------------------------------------------------- the interface
class ReplayBuffer(ABC):
    """Embeds on the way in, retrieves by cosine similarity within one environment.

    Text rendering, encoding and de-duplication live here, once; backends implement storage (`_stored`,
    `_add_fresh`), `search`, `count` and `save`. The vector-level methods (`add_vectors`, `search`) are public so
    callers that already hold embeddings (benchmarks, a rebuilt index) skip the encoder.
    """

    backend: str

    def __init__(self, encoder: Encoder):
        self.encoder = encoder

    # -- text level --
    def add(self, transitions: Sequence[Transition], source: Source) -> int:
        """Embed and store transitions (skipping ones already stored); return how many were new."""
        added = 0
        for start in range(0, len(transitions), _ENCODE_CHUNK):
            chunk = transitions[start:start + _ENCODE_CHUNK]
            records = [_record(t, source) for t in chunk]  # validate before paying for the encoder
            fresh = [records[i] for i in self._fresh_positions(records)]  # never embed what is stored already
            if fresh:
                vectors = _normalised(self.encoder.encode([render(r.state, r.action) for r in fresh]))
                if len(vectors) != len(fresh):
                    raise ValueError(f"encoder {self.encoder.name!r}: {len(vectors)} rows for {len(fresh)} texts")
                added += self._add_fresh(fresh, vectors)
        return added

    def retrieve(self, state: str, action: str, *, environment: str, k: int,
                 exclude_trajectory: str | None = None) -> list[Retrieved]:
        """The k stored transitions of `environment` most similar to (state, action), best first.

        `exclude_trajectory` leaves out one trajectory's transitions: a transition must not retrieve itself or its
        own trajectory's future when the experience model is trained on the buffer's own contents.
        """
        return self.retrieve_batch([(state, action)], environment=environment, k=k,
                                   exclude_trajectories=[exclude_trajectory])[0]

    def retrieve_batch(self, queries: Sequence[tuple[str, str]], *, environment: str, k: int,
                       exclude_trajectories: Sequence[str | None] | None = None) -> list[list[Retrieved]]:
        """`retrieve` for many (state, action) queries at once: one encoder call, one index search."""
        if not queries:
            return []
        vectors = self.encoder.encode([render(state, action) for state, action in queries])
        return self.search(vectors, environment=environment, k=k, exclude_trajectories=exclude_trajectories)

    def retrieve_examples(self, queries: Sequence[ExampleQuery], k: int) -> list[list[Retrieved]]:
        """Grounding examples for the experience model: per (environment, state, action, own trajectory) query,
        the k most similar distinct transitions of that environment, never from the query's own trajectory.

        The one retrieval path of training, fidelity evaluation and synthetic rollouts, so the model sees examples
        picked the same way everywhere. One search per environment. Repeats are dropped (seed sets hold the same
        transition many times, and three copies of one example cost three times the tokens for the information of
        one), so 3k are fetched to leave k. Near-ties are ordered by (trajectory, step): BLAS sums in a
        thread-count-dependent order, and without this the examples (and every fingerprint of data built from
        them) would change with the number of threads.
        """
        found: list[list[Retrieved]] = [[] for _ in queries]
        if k <= 0:
            return found
        by_environment: dict[str, list[int]] = {}
        for i, query in enumerate(queries):
            by_environment.setdefault(query[0], []).append(i)
        for environment, members in by_environment.items():
            hits = self.retrieve_batch([(queries[i][1], queries[i][2]) for i in members], environment=environment,
                                       k=3 * k, exclude_trajectories=[queries[i][3] for i in members])
            for i, hit in zip(members, hits, strict=True):
                hit = sorted(hit, key=lambda r: (-round(r.score, 4), r.trajectory_id, r.step_index))
                found[i] = distinct(hit)[:k]
        return found

    # -- vector level --
    def add_vectors(self, records: Sequence[Retrieved], vectors: np.ndarray) -> int:
        """Store records with their embeddings (rows of `vectors`); skip stored keys; return how many were new."""
        vectors = _normalised(vectors)
        if len(vectors) != len(records):
            raise ValueError(f"{len(vectors)} vectors for {len(records)} records")
        positions = self._fresh_positions(records)
        return self._add_fresh([records[i] for i in positions], vectors[positions]) if positions else 0

    def _fresh_positions(self, records: Sequence[Retrieved]) -> list[int]:
        """Positions of the records to store: first occurrences of keys the buffer does not hold yet."""
        stored = self._stored({(r.trajectory_id, r.step_index) for r in records})
        seen, positions = set(stored), []
        for i, record in enumerate(records):
            key = (record.trajectory_id, record.step_index)
            if key not in seen:
                seen.add(key)
                positions.append(i)
        return positions

    @abstractmethod
    def _stored(self, keys: set[tuple[str, int]]) -> set[tuple[str, int]]:
        """Which of these (trajectory_id, step_index) keys the buffer already holds."""

    @abstractmethod
    def _add_fresh(self, records: list[Retrieved], vectors: np.ndarray) -> int:
        """Store records with unit vectors; the caller has dropped stored and repeated keys."""

    @abstractmethod
    def search(self, vectors: np.ndarray, *, environment: str, k: int,
               exclude_trajectories: Sequence[str | None] | None = None) -> list[list[Retrieved]]:
        """Top-k by cosine among `environment`'s transitions, one result list per query row, best first."""

    @abstractmethod
    def count(self, environment: str | None = None, source: Source | None = None) -> int: ...

    @abstractmethod
    def export(self, source: Source | None = None) -> tuple[list[Retrieved], np.ndarray]:
        """The stored records (of one source, or all) with their vectors, e.g. to merge into another buffer."""

    @abstractmethod
    def save(self, directory: str | Path) -> Path:
        """Write the buffer (or, for a server backend, a reference to it) to `directory`, atomically."""

    def __len__(self) -> int:
        return self.count()

    def close(self) -> None:
        """Release connections; the embedded backend holds none."""

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_query(k: int, vectors: np.ndarray, exclude: Sequence[str | None] | None) -> list[str | None]:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if exclude is None:
        return [None] * len(vectors)
    if len(exclude) != len(vectors):
        raise ValueError(f"{len(exclude)} exclude_trajectories for {len(vectors)} queries")
    return list(exclude)


def _write_manifest(directory: Path, backend: str, **fields_: Any) -> None:
    (directory / "buffer.json").write_text(json.dumps({"format": FORMAT_VERSION, "backend": backend, **fields_},
                                                      indent=1, sort_keys=True))


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = Path(directory) / "buffer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a saved replay buffer (no buffer.json)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: buffer format {manifest.get('format')!r}, this code reads {FORMAT_VERSION}")
    return manifest


def _check_encoder(saved: str, encoder: Encoder, where: Path) -> None:
    if saved != encoder.name:
        raise ValueError(f"{where} was embedded with encoder {saved!r}, not {encoder.name!r}: its vectors are not "
                         "comparable; load it with the same encoder or rebuild the buffer")


# ------------------------------------------------------------------------------------------- embedded (faiss)
_BLAS_MIN_QUERIES = 8


def _faiss() -> Any:
    """faiss, with batched flat search routed to BLAS from 8 queries of 384-d on.

    faiss 1.15 scans the whole index once *per query* unless queries x dimension >= distance_compute_blas_threshold
    (default 128,000, i.e. 334 queries at 384-d). A rollout batch of 32 queries then reads the vectors 32 times:
    measured at 500,000 x 384 on a shared 2-core box (one thread), 2.2 s per batch of 32 against 0.36 s through
    sgemm, while a single query stays faster on the per-query path (66 ms against ~200 ms). The setting is
    process-wide; the buffer is the project's only faiss user.
    """
    import faiss

    faiss.cvar.distance_compute_blas_threshold = _BLAS_MIN_QUERIES * 384
    return faiss


@dataclass(frozen=True)
class IndexSettings:
    """Mirrors config.BufferIndexParams: when an environment's exact index of the embedded buffer becomes
    approximate, and how that one scans and re-ranks (`FaissReplayBuffer`)."""

    approximate_above: int | None  # rows of one environment past which its index is approximate; None: never
    rerank: int  # candidates of the quantized scan re-scored exactly per query (at least k + the over-fetch)
    subquantizer_dims: int  # dimensions per 4-bit code of the quantized scan; must divide the embedding dimension


_TRAIN_ROWS = 16 * 256  # what faiss's k-means samples anyway for 16 centroids (4 bits): more would only be copied
_RETRAIN_GROWTH = 4  # retrain an environment's quantizer when it has grown 4x since: codes follow the data's drift
_CHUNK_ROWS = 65_536  # vectors re-encoded per step when (re)building: bounds the copy, not a tuning knob


class FaissReplayBuffer(ReplayBuffer):
    """In-process buffer: one faiss index per environment, exact (`IndexFlatIP`) until the environment holds more
    than `IndexSettings.approximate_above` rows, then a quantized scan with exact re-ranking.

    Why one index per environment rather than one index plus a filter: the environment filter is then structural,
    so a query can never see another environment's transitions and top-k is exact within its environment even when
    k exceeds that environment's size (a global index with post-filtering would need k' >> k to fill k slots; an
    IDSelector would rebuild an id set per query). Search cost also scales with the environment, not the buffer.
    Flat (brute-force) search over unit vectors is exact cosine; the default pipeline's buffers and the tests' stay
    below the threshold, so exact.

    The approximate index (`faiss.IndexRefine`): a 4-bit product-quantization fast scan (`IndexPQFastScan`, one
    code per `subquantizer_dims` dimensions: 192 codes, 96 bytes per 384-d vector) ranks every row of the
    environment, and its best `rerank` candidates (at least k plus the over-fetch) are re-scored exactly on the
    stored float vectors, which stay as the refine index: returned scores are exact cosines, `export` returns the
    stored vectors, and memory grows by the codes only (6%). A full scan of small codes rather than a graph (HNSW)
    because a graph prunes by neighbourhoods, which embeddings without structure do not have: on random vectors HNSW
    (M=32, efSearch 512) found 62% of the exact top-4 at 10^5 rows, where this scan finds all of them.
    `python benchmarks/buffer_retrieval.py --threads 1` measured at 10^6 stored (5 x 10^5 per environment) on a
    shared 2-core CPU, k=4, rerank 1024: single query p50 2.7 ms, p99 7.9 ms, recall@4 1.000 on random unit vectors;
    p50 2.6 ms, p99 3.1 ms, recall@4 0.998 on noisy copies of real MiniLM seed embeddings; the exact index in the
    same run: p50 28 ms, p99 38-40 ms. The quantizer is trained when the environment crosses the threshold (on
    `_TRAIN_ROWS` of its vectors, evenly spaced) and retrained each time the environment has grown by the factor
    `_RETRAIN_GROWTH` since, re-encoding every row inside that `add` (growing to 10^6 took 27 s of adds, retraining
    included, against 7 s exact). A saved buffer keeps each environment's index kind; a loaded one follows the
    settings from its next `add` on (an approximate index never turns exact again).

    Rows are numbered in insertion order (global ids, stable across save/load); per environment we keep the global
    id of each index row, and per (environment, trajectory) a count so `exclude_trajectory` over-fetches exactly
    enough to still return k.
    """

    backend = "embedded"

    def __init__(self, encoder: Encoder, index: IndexSettings):
        super().__init__(encoder)
        self.index = index
        self._records: list[Retrieved] = []
        self._keys: set[tuple[str, int]] = set()
        self._indexes: dict[str, Any] = {}  # environment -> faiss.IndexFlatIP, or faiss.IndexRefine past the threshold
        self._trained: dict[str, int] = {}  # environment -> rows its approximate index's quantizer was trained at
        self._rows: dict[str, list[int]] = {}  # environment -> global id of each index row
        self._per_trajectory: Counter[tuple[str, str]] = Counter()  # (environment, trajectory_id) -> transitions
        self._sources: Counter[tuple[str, str]] = Counter()  # (environment, source) -> transitions
        self._dimension: int | None = None
        self._lock = threading.RLock()  # rollout threads may search while another thread appends

    def _stored(self, keys: set[tuple[str, int]]) -> set[tuple[str, int]]:
        with self._lock:
            return keys & self._keys

    def _add_fresh(self, records: list[Retrieved], vectors: np.ndarray) -> int:
        faiss = _faiss()
        with self._lock:
            # Re-check under the lock: another thread may have added the same keys since the caller filtered.
            keep = [i for i, r in enumerate(records) if (r.trajectory_id, r.step_index) not in self._keys]
            records, vectors = [records[i] for i in keep], vectors[keep]
            if self._dimension is None:
                width = self.index.subquantizer_dims
                if self.index.approximate_above is not None and vectors.shape[1] % width:
                    raise ValueError(f"buffer.index.subquantizer_dims {width} does not divide the embedding "
                                     f"dimension {vectors.shape[1]}: pick a divisor of it (e.g. 2)")
                self._dimension = vectors.shape[1]
            if vectors.shape[1] != self._dimension:
                raise ValueError(f"vectors have dimension {vectors.shape[1]}, this buffer holds {self._dimension}")
            by_environment: dict[str, list[int]] = {}
            for offset, record in enumerate(records):
                by_environment.setdefault(record.environment, []).append(offset)
            base = len(self._records)
            for environment, offsets in by_environment.items():
                if environment not in self._indexes:
                    self._indexes[environment] = faiss.IndexFlatIP(self._dimension)
                    self._rows[environment] = []
                self._indexes[environment].add(vectors[offsets])
                self._rows[environment].extend(base + o for o in offsets)
            for record in records:
                self._records.append(record)
                self._keys.add((record.trajectory_id, record.step_index))
                self._per_trajectory[(record.environment, record.trajectory_id)] += 1
                self._sources[(record.environment, record.source)] += 1
            for environment in by_environment:
                self._fit_index(environment)
            return len(records)

    def _fit_index(self, environment: str) -> None:
        """Make `environment`'s index approximate past the threshold, retraining its quantizer on growth."""
        index, threshold = self._indexes[environment], self.index.approximate_above
        rows = index.ntotal
        if threshold is None or rows <= threshold:
            return
        trained = self._trained.get(environment)
        if trained is not None and rows < _RETRAIN_GROWTH * trained:
            return
        faiss, width = _faiss(), self.index.subquantizer_dims
        if self._dimension % width:  # a loaded buffer of another dimension (a new one is checked at its first add)
            raise ValueError(f"buffer.index.subquantizer_dims {width} does not divide the embedding dimension "
                             f"{self._dimension}: pick a divisor of it (e.g. 2)")
        retraining = isinstance(index, faiss.IndexRefine)
        exact = faiss.downcast_index(index.refine_index) if retraining else index  # the stored float vectors
        scan = faiss.IndexPQFastScan(self._dimension, self._dimension // width, 4, faiss.METRIC_INNER_PRODUCT)
        sample = np.unique(np.linspace(0, rows - 1, min(rows, _TRAIN_ROWS)).astype(np.int64))
        scan.train(exact.reconstruct_batch(sample))
        for start in range(0, rows, _CHUNK_ROWS):
            scan.add(exact.reconstruct_n(start, min(_CHUNK_ROWS, rows - start)))
        # The new index owns the scan and the stored vectors (as a loaded one does); the old one lets them go.
        if retraining:
            index.own_refine_index = False
        else:
            exact.this.disown()
        scan.this.disown()
        approximate = faiss.IndexRefine(scan, exact)  # the exact vectors are the refine index: scores are exact
        approximate.own_fields = approximate.own_refine_index = True
        self._indexes[environment] = approximate
        self._trained[environment] = rows

    def search(self, vectors: np.ndarray, *, environment: str, k: int,
               exclude_trajectories: Sequence[str | None] | None = None) -> list[list[Retrieved]]:
        vectors = _normalised(vectors)
        exclude = _check_query(k, vectors, exclude_trajectories)
        with self._lock:
            index = self._indexes.get(environment)
            if index is None or index.ntotal == 0:
                return [[] for _ in exclude]
            # Over-fetch by the largest excluded trajectory: after dropping its rows, k (or all that remain) are left.
            extra = max((self._per_trajectory[(environment, t)] for t in exclude if t is not None), default=0)
            wanted = min(k + extra, index.ntotal)
            if environment in self._trained:  # re-score the scan's best `rerank` (at least `wanted`) exactly
                candidates = min(max(self.index.rerank, wanted), index.ntotal)
                scores, rows = index.search(vectors, wanted,
                                            params=_faiss().IndexRefineSearchParameters(k_factor=candidates / wanted))
            else:
                scores, rows = index.search(vectors, wanted)
            ids = self._rows[environment]
            results = []
            for query_scores, query_rows, excluded in zip(scores, rows, exclude):
                hits = []
                for score, row in zip(query_scores, query_rows):
                    if row < 0:  # faiss pads with -1 when fewer than the requested rows exist
                        break
                    record = self._records[ids[row]]
                    if record.trajectory_id == excluded:
                        continue
                    hits.append(_with_score(record, float(score)))
                    if len(hits) == k:
                        break
                results.append(hits)
            return results

    def export(self, source: Source | None = None) -> tuple[list[Retrieved], np.ndarray]:
        """The stored records (of one source, or all) with their vectors, e.g. to merge into another buffer."""
        with self._lock:
            records: list[Retrieved] = []
            vectors: list[np.ndarray] = []
            for environment, index in sorted(self._indexes.items()):
                rows = self._rows[environment]
                stored = index.reconstruct_n(0, index.ntotal)
                keep = [i for i, row in enumerate(rows) if source in (None, self._records[row].source)]
                records += [self._records[rows[i]] for i in keep]
                vectors.append(stored[keep])
            width = self._dimension or 0
            return records, (np.concatenate(vectors) if vectors else np.zeros((0, width), dtype=np.float32))

    def count(self, environment: str | None = None, source: Source | None = None) -> int:
        with self._lock:
            return sum(n for (env, src), n in self._sources.items()
                       if environment in (None, env) and source in (None, src))

    def environments(self) -> list[str]:
        with self._lock:
            return sorted(self._indexes)

    # -- persistence --
    def save(self, directory: str | Path) -> Path:
        """metadata.parquet (rows in id order) + index-<n>.faiss per environment + buffer.json, atomically."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        target = Path(directory)
        with self._lock, atomic_directory(target, replace=True) as tmp:
            types = {"step_index": pa.int64(), "reward": pa.float64(), "done": pa.bool_()}
            table = pa.table({name: pa.array([getattr(r, name) for r in self._records],
                                             type=types.get(name, pa.string())) for name in COLUMNS})
            pq.write_table(table, tmp / "metadata.parquet")
            files = {}
            for number, (environment, index) in enumerate(sorted(self._indexes.items())):
                files[environment] = f"index-{number}.faiss"  # numbered: environment names need not be file-safe
                _faiss().write_index(index, str(tmp / files[environment]))
            # approximate: environment -> rows its quantizer was trained at. Written only when there is one, so an
            # all-exact buffer saves the same bytes as before approximate indexes existed (and DVC sees no change).
            approximate = {"approximate": dict(sorted(self._trained.items()))} if self._trained else {}
            _write_manifest(tmp, self.backend, encoder=self.encoder.name, dimension=self._dimension,
                            count=len(self._records), indexes=files, **approximate)
            # the vectors are the encoder's of the records' texts: the records and the manifest are what it holds
            write_made_from(tmp, fingerprint("embedded buffer", [tmp / "metadata.parquet", tmp / "buffer.json"]))
        return target

    @classmethod
    def load(cls, directory: str | Path, encoder: Encoder, index: IndexSettings) -> FaissReplayBuffer:
        """The saved buffer, each environment's index of the kind it was saved with; `index` rules its next adds."""
        import pyarrow.parquet as pq

        faiss = _faiss()
        directory = Path(directory)
        manifest = _read_manifest(directory)
        if manifest["backend"] != cls.backend:
            raise ValueError(f"{directory} holds a {manifest['backend']!r} buffer, not an embedded one")
        _check_encoder(manifest["encoder"], encoder, directory)
        buffer = cls(encoder, index)
        buffer._dimension = manifest["dimension"]
        table = pq.read_table(directory / "metadata.parquet")
        columns = (table.column(c).to_pylist() for c in COLUMNS)
        buffer._records = [Retrieved.from_columns(*row) for row in zip(*columns)]
        for global_id, record in enumerate(buffer._records):
            buffer._rows.setdefault(record.environment, []).append(global_id)  # id order = index row order
            buffer._keys.add((record.trajectory_id, record.step_index))
            buffer._per_trajectory[(record.environment, record.trajectory_id)] += 1
            buffer._sources[(record.environment, record.source)] += 1
        approximate = manifest.get("approximate", {})
        for environment, name in manifest["indexes"].items():
            buffer._indexes[environment] = faiss.read_index(str(directory / name))
            if isinstance(buffer._indexes[environment], faiss.IndexRefine) != (environment in approximate):
                raise ValueError(f"{directory}: {name} does not hold the index kind buffer.json records for "
                                 f"environment {environment!r}; the buffer is corrupt, rebuild it")
        buffer._trained = dict(approximate)
        for environment, rows in buffer._rows.items():
            stored = buffer._indexes[environment].ntotal if environment in buffer._indexes else 0
            if stored != len(rows):
                raise ValueError(f"{directory}: environment {environment!r} has {len(rows)} metadata rows but "
                                 f"{stored} vectors; the buffer is corrupt, rebuild it")
        return buffer


def _with_score(record: Retrieved, score: float) -> Retrieved:
    return replace(record, score=score)


# ------------------------------------------------------------------------------------------------------ weaviate
SCHEMA_VERSION = 1  # of a Weaviate collection (properties, named vector, distance, `render`): part of its identity
SYNTHETIC_KEYS = "synthetic_keys.jsonl"  # beside a saved Weaviate buffer's buffer.json: the synthetic records it held
_COLLECTION_NAME = re.compile(r"[A-Z][_0-9A-Za-z]*")  # what Weaviate accepts as a collection name
_CANONICAL = {"step_index": int, "reward": float, "done": bool}  # the server may hand numbers back as other types
_MODULUS = 2 ** 256


def record_digest(record: Retrieved) -> int:
    """sha256 of a record's stored fields (not its score), as an int."""
    values = [_CANONICAL.get(name, str)(getattr(record, name)) for name in COLUMNS]
    return int.from_bytes(hashlib.sha256(json.dumps(values, ensure_ascii=False).encode()).digest(), "big")


class ContentIndex:
    """What a Weaviate collection holds: per (trajectory_id, step_index) key, the record's source and digest.

    The content hash is the sum of the records' digests modulo 2^256 (hex): independent of order and updated one
    record at a time, so the buffer keeps it current as it adds and deletes instead of rereading the server.
    """

    def __init__(self, records: Iterable[Retrieved] = ()):
        self.entries: dict[tuple[str, int], tuple[str, int]] = {}
        for record in records:
            self.add(record)

    def add(self, record: Retrieved) -> None:
        self.entries[(record.trajectory_id, int(record.step_index))] = (record.source, record_digest(record))

    def remove(self, keys: Iterable[tuple[str, int]]) -> None:
        for key in keys:
            self.entries.pop(key, None)

    def content_hash(self) -> str:
        return f"{sum(digest for _, digest in self.entries.values()) % _MODULUS:064x}"

    def keys(self, source: Source) -> list[tuple[str, int]]:
        return sorted(key for key, (src, _) in self.entries.items() if src == source)

    def manifest(self) -> dict[str, Any]:
        """The content fields of a saved buffer's manifest."""
        sources = Counter(src for src, _ in self.entries.values())
        return {"count": len(self.entries), "sources": {src: sources[src] for src in BUFFER_SOURCES},
                "content_hash": self.content_hash()}


def unique_records(transitions: Sequence[Transition], source: Source) -> list[Retrieved]:
    """The records `add` stores from `transitions` into an empty buffer: the first of each key."""
    records: dict[tuple[str, int], Retrieved] = {}
    for transition in transitions:
        records.setdefault((transition.trajectory_id, transition.step_index), _record(transition, source))
    return list(records.values())


def _short_hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def seed_collection_name(prefix: str, records: Sequence[Retrieved], encoder_name: str) -> str:
    """`prefix`_<hash of the records' content, the encoder and the schema>: one collection per buffer identity, so
    buffers of other data or embeddings never share one, and the same inputs find theirs again."""
    if not _COLLECTION_NAME.fullmatch(prefix):
        raise ValueError(f"Weaviate collection prefix {prefix!r}: expected an upper-case letter, then letters, "
                         "digits or _")
    identity = {"content": ContentIndex(records).content_hash(), "encoder": encoder_name, "schema": SCHEMA_VERSION}
    return f"{prefix}_{_short_hash(identity)}"


def run_collection_name(seed_collection: str, run: str) -> str:
    """The collection of one run's copy of `seed_collection`; `run` identifies the run (its checkpoints'
    fingerprint), so a resumed run finds its copy and no other run shares it."""
    return f"{seed_collection}_run_{_short_hash(run)}"


class WeaviateReplayBuffer(ReplayBuffer):
    """The buffer in a Weaviate collection: our own vectors (no vectorizer), cosine HNSW, filtered near_vector.

    Object UUIDs are uuid5(trajectory_id/step_index), so ids are stable and a re-import overwrites, never
    duplicates. Filter properties use `field` tokenization: with the default `word` tokenization an equality
    filter on "textworld-cooking" would also match any environment containing the words "textworld" and
    "cooking". Weaviate searches a filtered set smaller than the index's flat-search cutoff (40,000 objects by
    default) by brute force, i.e. exactly; beyond that HNSW is approximate, like any Weaviate query.
    The API key, if any, comes from the `WEAVIATE_API_KEY` environment variable, never from params.

    Connecting reads every object's fields once (not the vectors) into a `ContentIndex`; adds and deletes through
    this object keep it current, so `save` can write the content hash without reading the collection again.
    """

    backend = "weaviate"
    VECTOR = "state_action"  # the collection's one named vector: embedding of render(state, action)

    def __init__(self, encoder: Encoder, *, url: str | None, collection: str, grpc_port: int,
                 import_batch_size: int = 200, create: bool = True):
        super().__init__(encoder)
        import weaviate
        from weaviate.classes.init import Auth

        url = url or os.environ.get("WEAVIATE_URL")
        if not url:
            raise ValueError("the weaviate buffer backend needs a server: set buffer.weaviate.url in params.yaml "
                             "or WEAVIATE_URL in the environment")
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"WEAVIATE_URL {url!r}: expected http(s)://host[:port]")
        secure = parsed.scheme == "https"
        api_key = os.environ.get("WEAVIATE_API_KEY")
        # Kept (and saved by `save`) without any user:password part: credentials come from the environment only.
        port = f":{parsed.port}" if parsed.port else ""
        self.url = f"{parsed.scheme}://{parsed.hostname}{port}"
        self.collection_name, self.grpc_port = collection, grpc_port
        self.import_batch_size = import_batch_size
        self._lock = threading.Lock()  # rollout threads may add while another saves
        self.client = weaviate.connect_to_custom(
            http_host=parsed.hostname, http_port=parsed.port or (443 if secure else 80), http_secure=secure,
            grpc_host=parsed.hostname, grpc_port=grpc_port, grpc_secure=secure,
            auth_credentials=Auth.api_key(api_key) if api_key else None,
        )
        try:
            self.collection = self._ensure_collection(create)
            self._index = ContentIndex(record for record, _ in self._objects(include_vector=False))
        except BaseException:
            self.client.close()
            raise

    def _ensure_collection(self, create: bool) -> Any:
        from weaviate.classes.config import Configure, DataType, Property, Tokenization, VectorDistances

        if self.client.collections.exists(self.collection_name):
            return self.client.collections.get(self.collection_name)
        if not create:
            raise ValueError(f"Weaviate collection {self.collection_name!r} does not exist on {self.url}: rerun the "
                             "stage that built it (index_buffer for the seed buffer, synthetic_rl for its copy)")

        def key(name: str) -> Property:  # filterable, matched whole
            return Property(name=name, data_type=DataType.TEXT, tokenization=Tokenization.FIELD,
                            index_searchable=False)

        def payload(name: str) -> Property:  # long text we only return: no inverted index to build
            return Property(name=name, data_type=DataType.TEXT, index_filterable=False, index_searchable=False)

        return self.client.collections.create(
            self.collection_name,
            description="DreamGym replay buffer: transitions embedded as render(state, action)",
            properties=[
                key("environment"), key("task_id"), key("trajectory_id"), key("source"), key("origin"),
                Property(name="step_index", data_type=DataType.INT),
                payload("state"), payload("action"), payload("next_state"),
                Property(name="reward", data_type=DataType.NUMBER),
                Property(name="done", data_type=DataType.BOOL),
            ],
            vector_config=Configure.Vectors.self_provided(
                name=self.VECTOR,
                vector_index_config=Configure.VectorIndex.hnsw(distance_metric=VectorDistances.COSINE),
            ),
        )

    @staticmethod
    def _uuid(trajectory_id: str, step_index: int) -> str:
        from weaviate.util import generate_uuid5

        return generate_uuid5(f"{trajectory_id}/{step_index}")

    def _objects(self, include_vector: bool) -> Iterator[tuple[Retrieved, list[float] | None]]:
        """Every stored record (with its vector when asked), in the server's order."""
        for obj in self.collection.iterator(include_vector=include_vector, return_properties=list(COLUMNS),
                                            cache_size=self.import_batch_size):
            properties = obj.properties
            record = Retrieved.from_columns(**{name: _CANONICAL.get(name, str)(
                "" if properties.get(name) is None else properties[name]) for name in COLUMNS})
            yield record, (obj.vector[self.VECTOR] if include_vector else None)

    def _stored(self, keys: set[tuple[str, int]]) -> set[tuple[str, int]]:
        from weaviate.classes.query import Filter

        by_uuid = {self._uuid(*key): key for key in keys}
        ids, stored = list(by_uuid), set()
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            found = self.collection.query.fetch_objects(filters=Filter.by_id().contains_any(chunk),
                                                        limit=len(chunk), return_properties=[])
            stored.update(by_uuid[str(obj.uuid)] for obj in found.objects)
        return stored

    def _add_fresh(self, records: list[Retrieved], vectors: np.ndarray) -> int:
        with self.collection.batch.fixed_size(batch_size=self.import_batch_size) as batch:
            for record, vector in zip(records, vectors):
                batch.add_object(properties={name: getattr(record, name) for name in COLUMNS},
                                 vector={self.VECTOR: vector.tolist()},
                                 uuid=self._uuid(record.trajectory_id, record.step_index))
        failed = self.collection.batch.failed_objects
        if failed:
            raise RuntimeError(f"Weaviate rejected {len(failed)} of {len(records)} transitions; first: "
                               f"{failed[0].message}")
        with self._lock:
            for record in records:
                self._index.add(record)
        return len(records)

    def _delete(self, keys: Sequence[tuple[str, int]]) -> None:
        from weaviate.classes.query import Filter

        for start in range(0, len(keys), 500):  # bounded filters; the server caps a delete at 10,000 by default
            chunk = keys[start:start + 500]
            result = self.collection.data.delete_many(
                where=Filter.by_id().contains_any([self._uuid(*key) for key in chunk]))
            if result.failed:
                raise RuntimeError(f"Weaviate failed to delete {result.failed} of {len(chunk)} transitions from "
                                   f"{self.collection_name!r}")
            with self._lock:
                self._index.remove(chunk)

    def search(self, vectors: np.ndarray, *, environment: str, k: int,
               exclude_trajectories: Sequence[str | None] | None = None) -> list[list[Retrieved]]:
        from weaviate.classes.query import Filter, MetadataQuery

        vectors = _normalised(vectors)
        exclude = _check_query(k, vectors, exclude_trajectories)
        results = []
        for vector, excluded in zip(vectors, exclude):  # gRPC round trips; a server-side batch API has no filters
            where = Filter.by_property("environment").equal(environment)
            if excluded is not None:
                where = where & Filter.by_property("trajectory_id").not_equal(excluded)
            response = self.collection.query.near_vector(
                near_vector=vector.tolist(), target_vector=self.VECTOR, limit=k, filters=where,
                return_metadata=MetadataQuery(distance=True), return_properties=list(COLUMNS),
            )
            # cosine distance = 1 - cosine similarity
            hits = [Retrieved.from_columns(**{name: obj.properties[name] for name in COLUMNS},
                                           score=1.0 - float(obj.metadata.distance))
                    for obj in response.objects]
            results.append(sorted(hits, key=lambda r: -r.score))
        return results

    def count(self, environment: str | None = None, source: Source | None = None) -> int:
        from weaviate.classes.query import Filter

        conditions = [Filter.by_property(name).equal(value)
                      for name, value in (("environment", environment), ("source", source)) if value is not None]
        where = None
        for condition in conditions:
            where = condition if where is None else where & condition
        return self.collection.aggregate.over_all(filters=where, total_count=True).total_count or 0

    def content_hash(self) -> str:
        """The content hash of what the collection holds (`ContentIndex`)."""
        with self._lock:
            return self._index.content_hash()

    def export(self, source: Source | None = None) -> tuple[list[Retrieved], np.ndarray]:
        """The stored records (of one source, or all) with their vectors, by (environment, trajectory, step)."""
        found = sorted(((record, vector) for record, vector in self._objects(include_vector=True)
                        if source in (None, record.source)),
                       key=lambda pair: (pair[0].environment, pair[0].trajectory_id, pair[0].step_index))
        vectors = np.array([vector for _, vector in found], dtype=np.float32)
        return [record for record, _ in found], vectors if found else np.zeros((0, 0), dtype=np.float32)

    def copy(self, collection: str) -> WeaviateReplayBuffer:
        """A buffer on `collection` holding this one's records with their vectors; this one is only read.

        An existing `collection` is completed, not emptied: a crash may have cut the copy short, and a resumed run's
        own records (other keys) stay for `restore` to keep or drop.
        """
        if collection == self.collection_name:
            raise ValueError(f"cannot copy Weaviate collection {collection!r} onto itself")
        target = WeaviateReplayBuffer(self.encoder, url=self.url, collection=collection, grpc_port=self.grpc_port,
                                      import_batch_size=self.import_batch_size)
        try:
            with self._lock:
                wanted = {key for key, entry in self._index.entries.items()
                          if target._index.entries.get(key) != entry}
            if wanted:
                pairs = [(record, vector) for record, vector in self._objects(include_vector=True)
                         if (record.trajectory_id, record.step_index) in wanted]
                target._add_fresh([record for record, _ in pairs],  # same uuid5: a differing record is replaced
                                  np.array([vector for _, vector in pairs], dtype=np.float32))
        except BaseException:
            target.close()
            raise
        return target

    def restore(self, directory: str | Path | None) -> None:
        """Bring the collection back to what `save` wrote to `directory` by deleting the synthetic records added
        since (`None`: every synthetic record); fails if records of that save are gone from the server."""
        keep: set[tuple[str, int]] = set()
        if directory is not None:
            lines = (Path(directory) / SYNTHETIC_KEYS).read_text(encoding="utf-8").splitlines()
            keep = {(trajectory_id, step_index) for trajectory_id, step_index in map(json.loads, filter(None, lines))}
        with self._lock:
            extra = [key for key, (source, _) in self._index.entries.items()
                     if source == "synthetic" and key not in keep]
        self._delete(extra)
        if directory is None:
            return
        expected, found = _read_manifest(Path(directory))["content_hash"], self.content_hash()
        if found != expected:
            with self._lock:
                gone = len(keep - set(self._index.entries))
            raise ValueError(f"{directory}: cannot restore Weaviate collection {self.collection_name!r} to this save: "
                             f"content hash {found}, the save's {expected} ({gone} of its {len(keep)} synthetic "
                             "records are no longer on the server); delete the checkpoints to start the run afresh")

    def save(self, directory: str | Path) -> Path:
        """The data stays in the server: save a reference (URL without credentials, collection) with the content's
        count and hash, and the synthetic records' keys for `restore`."""
        target = Path(directory)
        if self.count() != len(self._index.entries):  # another client wrote to the collection: hash what it holds
            index = ContentIndex(record for record, _ in self._objects(include_vector=False))
            with self._lock:
                self._index = index
        with self._lock:
            content, synthetic = self._index.manifest(), self._index.keys("synthetic")
        with atomic_directory(target, replace=True) as tmp:
            _write_manifest(tmp, self.backend, encoder=self.encoder.name, url=self.url, grpc_port=self.grpc_port,
                            collection=self.collection_name, schema=SCHEMA_VERSION, **content)
            (tmp / SYNTHETIC_KEYS).write_text("".join(json.dumps(list(key)) + "\n" for key in synthetic),
                                              encoding="utf-8")
        return target

    @classmethod
    def load(cls, directory: str | Path, encoder: Encoder) -> WeaviateReplayBuffer:
        """Connect to the saved collection; fails unless it still holds exactly the saved content."""
        directory = Path(directory)
        manifest = _read_manifest(directory)
        if manifest["backend"] != cls.backend:
            raise ValueError(f"{directory} holds a {manifest['backend']!r} buffer, not a weaviate one")
        _check_encoder(manifest["encoder"], encoder, directory)
        fix = "rerun index_buffer (for a synthetic_rl replay_buffer: synthetic_rl), e.g. `dvc repro -f index_buffer`"
        if manifest.get("schema") != SCHEMA_VERSION or "content_hash" not in manifest:
            raise ValueError(f"{directory}: saved with Weaviate schema {manifest.get('schema')!r} and no content "
                             f"hash, this code reads schema {SCHEMA_VERSION}; {fix}")
        buffer = cls(encoder, url=manifest["url"], collection=manifest["collection"], grpc_port=manifest["grpc_port"],
                     create=False)
        count, found = buffer.count(), buffer.content_hash()
        if (count, found) != (manifest["count"], manifest["content_hash"]):
            buffer.close()
            raise ValueError(f"{directory}: Weaviate collection {manifest['collection']!r} at {manifest['url']} "
                             f"changed since it was saved: expected {manifest['count']} records with content hash "
                             f"{manifest['content_hash']}, found {count} with {found}; {fix}")
        return buffer

    def drop(self) -> None:
        """Delete the collection and everything in it (tests, rebuilds)."""
        self.client.collections.delete(self.collection_name)
        with self._lock:
            self._index = ContentIndex()

    def close(self) -> None:
        self.client.close()


def open_seed_buffer(encoder: Encoder, transitions: Sequence[Transition], *, url: str | None, collection: str,
                     grpc_port: int, import_batch_size: int = 200) -> WeaviateReplayBuffer:
    """The Weaviate buffer for these real seed transitions: collection `seed_collection_name(collection, ...)`.

    Records in it that these transitions would not store (a different record under the same key) are deleted, so
    `add`-ing the transitions afterwards leaves it holding exactly them; an earlier complete index adds nothing and
    embeds nothing, a crashed one only what it lacks.
    """
    records = unique_records(transitions, "real")
    buffer = WeaviateReplayBuffer(encoder, url=url, collection=seed_collection_name(collection, records, encoder.name),
                                  grpc_port=grpc_port, import_batch_size=import_batch_size)
    try:
        wanted = ContentIndex(records).entries
        buffer._delete([key for key, entry in buffer._index.entries.items() if wanted.get(key) != entry])
    except BaseException:
        buffer.close()
        raise
    return buffer


# ------------------------------------------------------------------------------------------------------ factory
BACKENDS: dict[str, type[ReplayBuffer]] = {"embedded": FaissReplayBuffer, "weaviate": WeaviateReplayBuffer}


def open_replay_buffer(backend: str, encoder: Encoder, **settings: Any) -> ReplayBuffer:
    """A new (embedded) or connected (weaviate: url, collection, grpc_port) buffer for `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"buffer backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    return BACKENDS[backend](encoder, **settings)


def load_replay_buffer(directory: str | Path, encoder: Encoder, index: IndexSettings) -> ReplayBuffer:
    """Load whatever `save` wrote to `directory`, whichever backend wrote it (`index`: the embedded backend's)."""
    backend = _read_manifest(Path(directory))["backend"]
    if backend == FaissReplayBuffer.backend:
        return FaissReplayBuffer.load(directory, encoder, index)
    if backend not in BACKENDS:
        raise ValueError(f"{directory}: unknown buffer backend {backend!r}")
    return BACKENDS[backend].load(directory, encoder)  # type: ignore[attr-defined]
