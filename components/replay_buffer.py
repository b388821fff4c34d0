"""The experience replay buffer: transitions with metadata, embedded, retrieved top-k by cosine similarity.

DreamGym's experience model conditions each prediction on the k past transitions most similar to the current
(state, action). The buffer is seeded with offline real trajectories and grows online with synthetic ones.

Two backends behind one interface (`ReplayBuffer`), picked by `open_replay_buffer(backend, ...)`:

- `embedded` (`FaissReplayBuffer`, the default): faiss in-process, no server. Saved to and loaded from a
  directory (`metadata.parquet`, one faiss index file per environment, `buffer.json`), which the artifact store
  keeps as the run's `buffer` artifact.
- `weaviate` (`WeaviateReplayBuffer`): a Weaviate server (weaviate-client 4.x) for buffers shared by many
  rollout workers or too big for one machine.

What gets embedded: `render(state, action)`, i.e. the text "action: {action}\\nstate: {state}". The action
comes first on purpose: encoders truncate (all-MiniLM-L6-v2 at 256 word pieces) and states run to thousands of
characters, so a state-first rendering would silently drop the action from long-state embeddings. Queries are
rendered the same way, so a query and a stored transition are compared like for like.

A transition is identified by (trajectory_id, step_index). Adding one that is already stored is a no-op (a retried
task can re-add a trajectory safely); `add` returns how many were new.
"""
from __future__ import annotations

import json
import os
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol
from urllib.parse import urlparse

import numpy as np

from components.contract import Transition
from components.files import atomic_directory

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
            from components.models import load_sentence_embedder

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
@dataclass(frozen=True, slots=True)
class Retrieved:
    """A stored transition as the experience model sees it, with its cosine similarity to the query."""

    environment: str
    task_id: str
    trajectory_id: str
    step_index: int
    state: str
    action: str
    next_state: str
    reward: float
    done: bool
    source: Source  # real or synthetic: where the buffer got it
    origin: str  # the trajectory's contract source: expert, random, policy, synthetic, human
    score: float = float("nan")  # cosine similarity; NaN on a stored record that no query produced


COLUMNS = tuple(f.name for f in fields(Retrieved) if f.name != "score")


def _record(transition: Transition, source: Source) -> Retrieved:
    if source not in BUFFER_SOURCES:
        raise ValueError(f"source {source!r}: expected one of {BUFFER_SOURCES}")
    if source == "real" and transition.source == "synthetic":
        raise ValueError(f"transition {transition.trajectory_id}/{transition.step_index} comes from a synthetic "
                         "trajectory and cannot be added as real")
    return Retrieved(transition.task.environment, transition.task.task_id, transition.trajectory_id,
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


class FaissReplayBuffer(ReplayBuffer):
    """In-process buffer: one exact inner-product index (`faiss.IndexFlatIP`) per environment.

    Why one index per environment rather than one index plus a filter: the environment filter is then structural,
    so a query can never see another environment's transitions and top-k is exact within its environment even when
    k exceeds that environment's size (a global index with post-filtering would need k' >> k to fill k slots; an
    IDSelector would rebuild an id set per query). Search cost also scales with the environment, not the buffer.
    Flat (brute-force) search over unit vectors is exact cosine. benchmarks/buffer_retrieval.py measured, at 10^6
    stored (5 x 10^5 per environment) on a shared 2-core CPU with one faiss thread: p50 88 ms per single query,
    450 ms per batch of 32 queries; 10^5: 6 ms and 36 ms; 1.5 GB of vectors per 10^6. An approximate index (HNSW,
    IVF) is the next step past that, at some cost in recall.

    Rows are numbered in insertion order (global ids, stable across save/load); per environment we keep the global
    id of each index row, and per (environment, trajectory) a count so `exclude_trajectory` over-fetches exactly
    enough to still return k.
    """

    backend = "embedded"

    def __init__(self, encoder: Encoder):
        super().__init__(encoder)
        self._records: list[Retrieved] = []
        self._keys: set[tuple[str, int]] = set()
        self._indexes: dict[str, Any] = {}  # environment -> faiss.IndexFlatIP
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
            return len(records)

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
            scores, rows = index.search(vectors, min(k + extra, index.ntotal))
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
            _write_manifest(tmp, self.backend, encoder=self.encoder.name, dimension=self._dimension,
                            count=len(self._records), indexes=files)
        return target

    @classmethod
    def load(cls, directory: str | Path, encoder: Encoder) -> FaissReplayBuffer:
        import pyarrow.parquet as pq

        faiss = _faiss()
        directory = Path(directory)
        manifest = _read_manifest(directory)
        if manifest["backend"] != cls.backend:
            raise ValueError(f"{directory} holds a {manifest['backend']!r} buffer, not an embedded one")
        _check_encoder(manifest["encoder"], encoder, directory)
        buffer = cls(encoder)
        buffer._dimension = manifest["dimension"]
        table = pq.read_table(directory / "metadata.parquet")
        buffer._records = [Retrieved(*row) for row in zip(*(table.column(c).to_pylist() for c in COLUMNS))]
        for global_id, record in enumerate(buffer._records):
            buffer._rows.setdefault(record.environment, []).append(global_id)  # id order = index row order
            buffer._keys.add((record.trajectory_id, record.step_index))
            buffer._per_trajectory[(record.environment, record.trajectory_id)] += 1
            buffer._sources[(record.environment, record.source)] += 1
        for environment, name in manifest["indexes"].items():
            buffer._indexes[environment] = faiss.read_index(str(directory / name))
        for environment, rows in buffer._rows.items():
            stored = buffer._indexes[environment].ntotal if environment in buffer._indexes else 0
            if stored != len(rows):
                raise ValueError(f"{directory}: environment {environment!r} has {len(rows)} metadata rows but "
                                 f"{stored} vectors; the buffer is corrupt, rebuild it")
        return buffer


def _with_score(record: Retrieved, score: float) -> Retrieved:
    return replace(record, score=score)


# ------------------------------------------------------------------------------------------------------ weaviate
class WeaviateReplayBuffer(ReplayBuffer):
    """The buffer in a Weaviate collection: our own vectors (no vectorizer), cosine HNSW, filtered near_vector.

    Object UUIDs are uuid5(trajectory_id/step_index), so ids are stable and a re-import overwrites, never
    duplicates. Filter properties use `field` tokenization: with the default `word` tokenization an equality
    filter on "textworld-cooking" would also match any environment containing the words "textworld" and
    "cooking". Weaviate searches a filtered set smaller than the index's flat-search cutoff (40,000 objects by
    default) by brute force, i.e. exactly; beyond that HNSW is approximate, like any Weaviate query.
    The API key, if any, comes from the `WEAVIATE_API_KEY` environment variable, never from params.
    """

    backend = "weaviate"
    VECTOR = "state_action"  # the collection's one named vector: embedding of render(state, action)

    def __init__(self, encoder: Encoder, *, url: str | None, collection: str, grpc_port: int,
                 import_batch_size: int = 200):
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
        self.client = weaviate.connect_to_custom(
            http_host=parsed.hostname, http_port=parsed.port or (443 if secure else 80), http_secure=secure,
            grpc_host=parsed.hostname, grpc_port=grpc_port, grpc_secure=secure,
            auth_credentials=Auth.api_key(api_key) if api_key else None,
        )
        try:
            self.collection = self._ensure_collection()
        except BaseException:
            self.client.close()
            raise

    def _ensure_collection(self) -> Any:
        from weaviate.classes.config import Configure, DataType, Property, Tokenization, VectorDistances

        if self.client.collections.exists(self.collection_name):
            return self.client.collections.get(self.collection_name)

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
        return len(records)

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
            hits = [Retrieved(**{name: obj.properties[name] for name in COLUMNS},
                              score=1.0 - float(obj.metadata.distance))  # cosine distance = 1 - cosine similarity
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

    def save(self, directory: str | Path) -> Path:
        """The data stays in the server: save a reference (URL without credentials, collection, count)."""
        target = Path(directory)
        with atomic_directory(target, replace=True) as tmp:
            _write_manifest(tmp, self.backend, encoder=self.encoder.name, url=self.url, grpc_port=self.grpc_port,
                            collection=self.collection_name, count=self.count())
        return target

    @classmethod
    def load(cls, directory: str | Path, encoder: Encoder) -> WeaviateReplayBuffer:
        directory = Path(directory)
        manifest = _read_manifest(directory)
        if manifest["backend"] != cls.backend:
            raise ValueError(f"{directory} holds a {manifest['backend']!r} buffer, not a weaviate one")
        _check_encoder(manifest["encoder"], encoder, directory)
        return cls(encoder, url=manifest["url"], collection=manifest["collection"], grpc_port=manifest["grpc_port"])

    def drop(self) -> None:
        """Delete the collection and everything in it (tests, rebuilds)."""
        self.client.collections.delete(self.collection_name)

    def close(self) -> None:
        self.client.close()


# ------------------------------------------------------------------------------------------------------ factory
BACKENDS: dict[str, type[ReplayBuffer]] = {"embedded": FaissReplayBuffer, "weaviate": WeaviateReplayBuffer}


def open_replay_buffer(backend: str, encoder: Encoder, **settings: Any) -> ReplayBuffer:
    """A new (embedded) or connected (weaviate: url, collection, grpc_port) buffer for `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"buffer backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    return BACKENDS[backend](encoder, **settings)


def load_replay_buffer(directory: str | Path, encoder: Encoder) -> ReplayBuffer:
    """Load whatever `save` wrote to `directory`, whichever backend wrote it."""
    backend = _read_manifest(Path(directory))["backend"]
    if backend not in BACKENDS:
        raise ValueError(f"{directory}: unknown buffer backend {backend!r}")
    return BACKENDS[backend].load(directory, encoder)  # type: ignore[attr-defined]
