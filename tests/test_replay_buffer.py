"""One conformance suite for every replay-buffer backend.

The embedded (faiss) backend always runs. The Weaviate backend runs only against a real server named by
WEAVIATE_URL (API key, if any, in WEAVIATE_API_KEY; gRPC port in WEAVIATE_GRPC_PORT, default 50051); each test
uses its own throwaway collection.

Most tests use `HashingEncoder`, a deterministic bag-of-words test double for the *encoder* only: it makes
cosine scores computable by hand and costs microseconds, while the index, filters and persistence under test are
the real ones. One test uses the real packaged all-MiniLM-L6-v2 to show a paraphrase finds its transition.
"""
from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from components.data.contract import Step, Task, Trajectory, transitions
from components.simulator.replay_buffer import (
    SYNTHETIC_KEYS,
    ContentIndex,
    FaissReplayBuffer,
    IndexSettings,
    ReplayBuffer,
    Retrieved,
    SentenceEncoder,
    WeaviateReplayBuffer,
    load_replay_buffer,
    open_replay_buffer,
    open_seed_buffer,
    render,
    run_collection_name,
    seed_collection_name,
    unique_records,
)
from tests.conftest import settings_from_params
from tests.hashing_encoder import HashingEncoder

INDEX = settings_from_params("buffer_index")  # params.yaml's: the small buffers here stay exact
WEAVIATE_URL = os.environ.get("WEAVIATE_URL")
NO_WEAVIATE = "WEAVIATE_URL not set: the Weaviate backend needs a running server (none can run here)"

BACKENDS = [
    "embedded",
    pytest.param("weaviate", marks=[pytest.mark.external, pytest.mark.skipif(not WEAVIATE_URL, reason=NO_WEAVIATE)]),
]




def open_buffer(backend: str, encoder, cleanup: list) -> ReplayBuffer:
    if backend == "embedded":
        return open_replay_buffer("embedded", encoder, index=INDEX)
    buffer = open_replay_buffer("weaviate", encoder, url=WEAVIATE_URL, collection=f"DreamGymTest{uuid.uuid4().hex}",
                                grpc_port=int(os.environ.get("WEAVIATE_GRPC_PORT", "50051")))
    cleanup.append(buffer)
    return buffer


@pytest.fixture
def make_buffer(request):
    """make_buffer(encoder=HashingEncoder()) -> a fresh, empty buffer of the parametrized backend."""
    backend, cleanup = request.param, []
    yield lambda encoder=None: open_buffer(backend, encoder or HashingEncoder(), cleanup)
    for buffer in cleanup:  # weaviate: drop the throwaway collection
        buffer.drop()
        buffer.close()


backends = pytest.mark.parametrize("make_buffer", BACKENDS, indirect=True)


def trajectory(trajectory_id: str, environment: str, pairs: list[tuple[str, str]], source: str = "expert",
               task_id: str = "task-1") -> Trajectory:
    """A contract trajectory whose steps have the given (state, action) pairs; reward 1 on the last step."""
    steps = [Step(state, action, f"after {action}", float(i == len(pairs) - 1), i == len(pairs) - 1)
             for i, (state, action) in enumerate(pairs)]
    return Trajectory(trajectory_id, Task(task_id, environment, "cook a meal", {}), steps, steps[-1].done,
                      steps[-1].reward, source)


KITCHEN = trajectory("tw-1", "textworld", [
    ("kitchen with a closed fridge", "open fridge"),
    ("open fridge holding a red potato", "take red potato"),
    ("you carry a red potato", "slice red potato with knife"),
    ("sliced potato on the counter", "cook potato with stove"),
    ("a cooked meal is ready", "eat meal"),
])
GARDEN = trajectory("tw-2", "textworld", [("garden with a shed", "open shed"),
                                          ("open shed with a shovel", "take shovel")])
WEB = trajectory("web-1", "miniwob", [(f"page with button {i}", f"click button {i}") for i in range(10)])


def fill(buffer: ReplayBuffer) -> None:
    for t in (KITCHEN, GARDEN, WEB):
        buffer.add(list(transitions(t)), "real")


def key(result) -> tuple[str, int]:
    return result.trajectory_id, result.step_index


@backends
def test_top_k_is_ordered_by_exact_cosine(make_buffer):
    encoder = HashingEncoder()
    buffer = make_buffer(encoder)
    fill(buffer)
    state, action = "a fridge in the kitchen", "open the fridge"
    results = buffer.retrieve(state, action, environment="textworld", k=4)

    stored = [t for traj in (KITCHEN, GARDEN) for t in transitions(traj)]
    query = encoder.encode([render(state, action)])[0]
    expected = {(t.trajectory_id, t.step_index): float(encoder.encode([render(t.state, t.action)])[0] @ query)
                for t in stored}
    assert len(results) == 4
    assert [r.score for r in results] == pytest.approx(sorted(expected.values(), reverse=True)[:4], abs=1e-5)
    assert all(r.score == pytest.approx(expected[key(r)], abs=1e-5) for r in results)
    best = results[0]
    assert (best.trajectory_id, best.step_index, best.action, best.next_state) == ("tw-1", 0, "open fridge",
                                                                                  "after open fridge")
    assert (best.task_id, best.environment, best.source, best.origin, best.done) == (
        "task-1", "textworld", "real", "expert", False)


@backends
def test_environment_filter_never_leaks_even_when_k_exceeds_its_size(make_buffer):
    buffer = make_buffer()
    fill(buffer)
    # The query matches a miniwob transition word for word, but only textworld's 7 transitions may come back.
    results = buffer.retrieve("page with button 3", "click button 3", environment="textworld", k=50)
    assert len(results) == 7
    assert {r.environment for r in results} == {"textworld"}
    assert {key(r) for r in results} == {(t.trajectory_id, t.step_index)
                                         for traj in (KITCHEN, GARDEN) for t in transitions(traj)}
    assert buffer.retrieve("page", "click", environment="no-such-environment", k=4) == []


@backends
def test_online_appends_are_visible_to_the_next_retrieve(make_buffer):
    buffer = make_buffer()
    fill(buffer)
    state, action = "a dark cellar with a lantern", "light lantern"
    assert key(buffer.retrieve(state, action, environment="textworld", k=1)[0]) != ("syn-1", 0)
    added = buffer.add(list(transitions(trajectory("syn-1", "textworld", [(state, action)], source="synthetic"))),
                       "synthetic")
    assert added == 1
    top = buffer.retrieve(state, action, environment="textworld", k=1)[0]
    assert (key(top), top.source, top.origin) == (("syn-1", 0), "synthetic", "synthetic")
    assert top.score == pytest.approx(1.0, abs=1e-5)


@backends
def test_exclude_trajectory_still_returns_k(make_buffer):
    buffer = make_buffer()
    fill(buffer)
    state, action = KITCHEN.steps[1].state, KITCHEN.steps[1].action
    assert key(buffer.retrieve(state, action, environment="textworld", k=3)[0]) == ("tw-1", 1)
    results = buffer.retrieve(state, action, environment="textworld", k=3, exclude_trajectory="tw-1")
    assert [r.trajectory_id for r in results] == ["tw-2", "tw-2"]  # all that is left, no padding, no tw-1
    results = buffer.retrieve("page with button 3", "click button 3", environment="miniwob", k=4,
                              exclude_trajectory="tw-1")  # a trajectory of another environment changes nothing
    assert len(results) == 4 and key(results[0]) == ("web-1", 3)


@backends
def test_batch_retrieval_matches_single_queries(make_buffer):
    buffer = make_buffer()
    fill(buffer)
    queries = [(s.state, s.action) for s in KITCHEN.steps[:3]] + [("garden", "take shovel")]
    excluded = [None, "tw-1", None, "tw-2"]
    batch = buffer.retrieve_batch(queries, environment="textworld", k=3, exclude_trajectories=excluded)
    single = [buffer.retrieve(s, a, environment="textworld", k=3, exclude_trajectory=x)
              for (s, a), x in zip(queries, excluded)]
    assert [[key(r) for r in hits] for hits in batch] == [[key(r) for r in hits] for hits in single]
    assert buffer.retrieve_batch([], environment="textworld", k=3) == []


@backends
def test_examples_tied_in_score_come_in_trajectory_order(make_buffer):
    # Seed sets repeat transitions; tied copies must come back in one fixed order whatever the index returns first
    # (faiss's float sums depend on the thread count), or training data would change with the machine.
    buffer = make_buffer()
    copies = [trajectory(f"copy-{n}", "textworld", [("kitchen with a closed fridge", "open fridge")],
                         task_id=f"task-{n}") for n in (3, 1, 2)]
    for copy in copies:
        buffer.add(list(transitions(copy)), "real")
    [found] = buffer.retrieve_examples([("textworld", "kitchen with a closed fridge", "open fridge", "copy-1")], k=1)
    assert [key(r) for r in found] == [("copy-2", 0)]  # copy-1 is the query's own; copy-2 sorts before copy-3


@backends
def test_counts_by_environment_and_source_and_idempotent_adds(make_buffer):
    buffer = make_buffer()
    assert len(buffer) == 0
    fill(buffer)
    synthetic = trajectory("syn-1", "textworld", [("a", "b"), ("c", "d"), ("e", "f")], source="synthetic")
    assert buffer.add(list(transitions(synthetic)), "synthetic") == 3
    assert len(buffer) == 20
    assert buffer.count(source="real") == 17 and buffer.count(source="synthetic") == 3
    assert buffer.count(environment="textworld") == 10 and buffer.count(environment="miniwob") == 10
    assert buffer.count(environment="textworld", source="synthetic") == 3
    assert buffer.count(environment="miniwob", source="synthetic") == 0
    # Re-adding (a retried task) stores nothing twice; repeats inside one call count once.
    assert buffer.add(list(transitions(KITCHEN)) * 2, "real") == 0
    assert len(buffer) == 20
    with pytest.raises(ValueError, match="synthetic trajectory"):
        buffer.add(list(transitions(synthetic)), "real")
    with pytest.raises(ValueError, match="source"):
        buffer.add(list(transitions(GARDEN)), "imagined")


@backends
def test_save_and_load_give_identical_retrieval(make_buffer, tmp_path: Path):
    encoder = HashingEncoder()
    buffer = make_buffer(encoder)
    fill(buffer)
    queries = [(s.state, s.action) for s in KITCHEN.steps] + [("page with button 7", "click button 7")]
    before = {env: buffer.retrieve_batch(queries, environment=env, k=5) for env in ("textworld", "miniwob")}

    buffer.save(tmp_path / "buffer")
    buffer.save(tmp_path / "buffer")  # saving over an earlier save replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["buffer"]  # no temp or old directories left behind
    loaded = load_replay_buffer(tmp_path / "buffer", encoder, INDEX)
    try:
        assert type(loaded) is type(buffer) and len(loaded) == len(buffer)
        after = {env: loaded.retrieve_batch(queries, environment=env, k=5) for env in ("textworld", "miniwob")}
        assert after == before  # records and scores, exactly
        assert loaded.count(source="real") == 17
        assert loaded.add(list(transitions(KITCHEN)), "real") == 0  # keys survive the round trip
    finally:
        if loaded is not buffer:
            loaded.close()



def test_embedded_save_stores_the_columns_in_order(tmp_path: Path):
    import pyarrow.parquet as pq

    buffer = open_replay_buffer("embedded", HashingEncoder(), index=INDEX)
    fill(buffer)
    buffer.save(tmp_path / "buffer")
    schema = pq.read_schema(tmp_path / "buffer" / "metadata.parquet")
    assert [(f.name, str(f.type)) for f in schema] == [
        ("environment", "string"), ("task_id", "string"), ("trajectory_id", "string"), ("step_index", "int64"),
        ("state", "string"), ("action", "string"), ("next_state", "string"), ("reward", "double"),
        ("done", "bool"), ("source", "string"), ("origin", "string")]

def test_a_buffer_embedded_on_another_cpu_is_the_same_buffer_and_other_records_are_another(tmp_path: Path):
    """Another CPU rounds the encoder's vectors otherwise (a saved index's bytes differ by about 1e-7): work made from
    the buffer (an RL run's checkpoints) must still resume there, so its identity is its records, not its bytes."""
    from components.files import directory_identity, directory_sha256

    class OtherRounding(HashingEncoder):
        def encode(self, texts: list[str]) -> np.ndarray:
            vectors = super().encode(texts)
            return vectors + np.float32(1e-7) * np.sign(vectors)

    for name, encoder in (("here", HashingEncoder()), ("there", OtherRounding())):
        buffer = open_replay_buffer("embedded", encoder, index=INDEX)
        fill(buffer)
        buffer.save(tmp_path / name)
    assert directory_sha256(tmp_path / "here") != directory_sha256(tmp_path / "there")
    assert directory_identity(tmp_path / "here") == directory_identity(tmp_path / "there")
    buffer.add(list(transitions(trajectory("tw-3", "textworld", [("a hall", "go north")]))), "real")
    buffer.save(tmp_path / "more")
    assert directory_identity(tmp_path / "more") != directory_identity(tmp_path / "there")


def test_embedded_load_refuses_another_encoder(tmp_path: Path):
    buffer = open_replay_buffer("embedded", HashingEncoder(), index=INDEX)
    fill(buffer)
    buffer.save(tmp_path / "buffer")
    other = HashingEncoder()
    other.name = "another-encoder"
    with pytest.raises(ValueError, match="another-encoder"):
        FaissReplayBuffer.load(tmp_path / "buffer", other, INDEX)
    with pytest.raises(FileNotFoundError, match="not a saved replay buffer"):
        load_replay_buffer(tmp_path, HashingEncoder(), INDEX)


# ------------------------------------------------------------------- embedded: the approximate index past a size
DIM = 64  # small vectors keep these tests fast; the quantizer's code width (2 dimensions) divides it
APPROXIMATE = IndexSettings(approximate_above=1000, rerank=64, subquantizer_dims=2)  # a 64-of-3000 re-rank
EXACT = IndexSettings(approximate_above=None, rerank=64, subquantizer_dims=2)


def clustered(rng: np.random.Generator, centres: np.ndarray, n: int, noise: float = 0.3) -> np.ndarray:
    """Unit vectors around random centres, as real embeddings cluster (random ones are no structure at all)."""
    x = centres[rng.integers(0, len(centres), n)] + rng.standard_normal((n, DIM)) * noise / np.sqrt(DIM)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def vector_records(start: int, stop: int, prefix: str = "traj") -> list[Retrieved]:
    """Records of 10-step trajectories `<prefix>-<i // 10>`."""
    return [Retrieved.from_columns("textworld", "task-1", f"{prefix}-{i // 10}", i % 10, f"s{i}", f"a{i}", f"n{i}",
                                   0.0, i % 10 == 9, "real", "expert") for i in range(start, stop)]


def grown(settings: IndexSettings, vectors: np.ndarray, chunk: int = 500) -> FaissReplayBuffer:
    """A buffer grown by online appends of `chunk` rows, as a buffer grows during RL."""
    buffer = FaissReplayBuffer(HashingEncoder(), settings)
    for start in range(0, len(vectors), chunk):
        stop = min(start + chunk, len(vectors))
        buffer.add_vectors(vector_records(start, stop), vectors[start:stop])
    return buffer


def approximate_environments(buffer: FaissReplayBuffer, directory: Path) -> dict[str, int]:
    buffer.save(directory)
    return json.loads((directory / "buffer.json").read_text()).get("approximate", {})


@pytest.fixture(scope="module")
def structured():
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((300, DIM))
    return clustered(rng, centres, 3000), clustered(rng, centres, 100)


def recall(found: list[list], exact: list[list]) -> float:
    return float(np.mean([len({key(r) for r in f} & {key(r) for r in e}) / len(e) for f, e in zip(found, exact)]))


def test_past_the_threshold_the_index_is_approximate_with_exact_scores_and_high_recall(structured, tmp_path: Path):
    stored, queries = structured
    approximate, exact = grown(APPROXIMATE, stored), grown(EXACT, stored)
    assert approximate_environments(approximate, tmp_path / "a") == {"textworld": 1500}  # crossed at the 3rd add
    assert approximate_environments(exact, tmp_path / "e") == {}
    found = approximate.search(queries, environment="textworld", k=4)
    truth = exact.search(queries, environment="textworld", k=4)
    assert recall(found, truth) >= 0.95
    for query, hits in zip(queries, found):  # scores are exact cosines, not the codes' estimates
        assert [r.score for r in hits] == pytest.approx([float(stored[int(r.trajectory_id[5:]) * 10 + r.step_index]
                                                              @ query) for r in hits], abs=1e-5)
    assert all(len(hits) == 4 and [r.score for r in hits] == sorted((r.score for r in hits), reverse=True)
               for hits in found)
    records, vectors = approximate.export()  # the stored vectors, not their codes
    assert np.array_equal(vectors, exact.export()[1]) and len(records) == 3000


def test_approximate_search_excludes_a_trajectory_and_still_returns_k(structured):
    stored, _ = structured
    approximate, exact = grown(APPROXIMATE, stored), grown(EXACT, stored)
    queries = stored[::100] + 0.01  # each near a stored row of trajectory traj-(10 * q)
    excluded = [f"traj-{i * 10}" for i in range(len(queries))]
    found = approximate.search(queries, environment="textworld", k=5, exclude_trajectories=excluded)
    truth = exact.search(queries, environment="textworld", k=5, exclude_trajectories=excluded)
    assert all(len(hits) == 5 and all(r.trajectory_id != x for r in hits) for hits, x in zip(found, excluded))
    assert recall(found, truth) >= 0.95


def test_approximate_buffer_round_trips_and_retrains_as_it_grows(structured, tmp_path: Path):
    stored, queries = structured
    buffer = grown(APPROXIMATE, stored)
    before = buffer.search(queries, environment="textworld", k=4, exclude_trajectories=["traj-3"] * len(queries))
    buffer.save(tmp_path / "buffer")
    loaded = load_replay_buffer(tmp_path / "buffer", HashingEncoder(), APPROXIMATE)
    assert loaded.search(queries, environment="textworld", k=4, exclude_trajectories=["traj-3"] * len(queries)) \
        == before  # records and scores, exactly
    more = clustered(np.random.default_rng(1), stored[:300], 3000)  # to 6000 rows: 4x the 1500 it was trained at
    rows = vector_records(0, 3000, prefix="more")
    assert loaded.add_vectors(rows, more) == 3000
    assert approximate_environments(loaded, tmp_path / "grown") == {"textworld": 6000}
    exact = grown(EXACT, stored)
    exact.add_vectors(rows, more)
    assert recall(loaded.search(queries, environment="textworld", k=4),
                  exact.search(queries, environment="textworld", k=4)) >= 0.95


def test_an_old_flat_save_loads_and_small_buffers_stay_exact(structured, tmp_path: Path):
    stored, queries = structured
    small = stored[:900]  # below the threshold: the exact index, results as with no threshold at all
    below, never = grown(APPROXIMATE, small), grown(EXACT, small)
    assert below.search(queries, environment="textworld", k=6) == never.search(queries, environment="textworld", k=6)
    # Saved as before approximate indexes existed (flat indexes, the manifest's old keys only), so old saves load.
    below.save(tmp_path / "old")
    manifest = json.loads((tmp_path / "old" / "buffer.json").read_text())
    assert set(manifest) == {"backend", "count", "dimension", "encoder", "format", "indexes"}
    old = load_replay_buffer(tmp_path / "old", HashingEncoder(), APPROXIMATE)
    assert old.search(queries, environment="textworld", k=6) == never.search(queries, environment="textworld", k=6)
    old.add_vectors(vector_records(900, 1500), stored[900:1500])  # past the threshold from its next add on
    assert approximate_environments(old, tmp_path / "new") == {"textworld": 1500}


def test_a_code_width_that_does_not_divide_the_dimension_is_named():
    buffer = FaissReplayBuffer(HashingEncoder(), IndexSettings(approximate_above=1000, rerank=64,
                                                               subquantizer_dims=3))
    with pytest.raises(ValueError, match="subquantizer_dims 3"):
        buffer.add_vectors(vector_records(0, 1001), np.eye(1001, DIM, dtype=np.float32) + 0.1)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="embedded, weaviate"):
        open_replay_buffer("chroma", HashingEncoder())


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> SentenceEncoder:
    return SentenceEncoder("all-minilm-l6-v2", tmp_path_factory.mktemp("models"))


@backends
def test_minilm_retrieves_a_paraphrase(make_buffer, minilm: SentenceEncoder):
    buffer = make_buffer(minilm)
    fill(buffer)
    # No word in common with the stored "kitchen with a closed fridge" / "open fridge" beyond stop words.
    results = buffer.retrieve("You are in the cooking room; the refrigerator is shut.", "pull the refrigerator door",
                              environment="textworld", k=3)
    assert key(results[0]) == ("tw-1", 0), [(key(r), r.score) for r in results]
    assert results[0].score > results[1].score
    vectors = minilm.encode(["one", "two words"])
    assert vectors.dtype == np.float32 and vectors.shape == (2, 384)
    assert np.linalg.norm(vectors, axis=1) == pytest.approx(1.0, abs=1e-5)


# ------------------------------------------------------------------------------ weaviate: identities and copies
def records_of(*trajectories: Trajectory, source: str = "real") -> list:
    return unique_records([t for traj in trajectories for t in transitions(traj)], source)


def test_seed_collection_names_follow_the_buffer_identity():
    name = seed_collection_name("DreamGymTransitions", records_of(KITCHEN, GARDEN), "enc")
    assert re.fullmatch(r"DreamGymTransitions_[0-9a-f]{16}", name)
    # Equal data, whatever its order or repeats, gets the same collection ...
    assert seed_collection_name("DreamGymTransitions", records_of(GARDEN, KITCHEN, GARDEN), "enc") == name
    # ... other data, another embedder or prefix another one.
    changed = trajectory("tw-2", "textworld", [("garden with a shed", "open shed"),
                                               ("open shed with a shovel", "take spade")])
    others = [seed_collection_name("DreamGymTransitions", records_of(KITCHEN, changed), "enc"),
              seed_collection_name("DreamGymTransitions", records_of(KITCHEN), "enc"),
              seed_collection_name("DreamGymTransitions", records_of(KITCHEN, GARDEN), "other-enc"),
              seed_collection_name("Other", records_of(KITCHEN, GARDEN), "enc")]
    assert len({name, *others}) == 5
    with pytest.raises(ValueError, match="upper-case"):
        seed_collection_name("dreamgym-transitions", records_of(KITCHEN), "enc")


def test_run_collection_names_are_one_per_run():
    seed = seed_collection_name("DreamGymTransitions", records_of(KITCHEN), "enc")
    run = run_collection_name(seed, "fingerprint-a/models/policy/synthetic_rl")
    assert run.startswith(f"{seed}_run_") and re.fullmatch(r"[A-Z][_0-9A-Za-z]*", run)
    assert run_collection_name(seed, "fingerprint-a/models/policy/synthetic_rl") == run
    assert run_collection_name(seed, "fingerprint-b/models/policy/synthetic_rl") != run


def test_content_index_gives_the_manifest_content():
    real, synthetic = records_of(KITCHEN, GARDEN), records_of(
        trajectory("syn-1", "textworld", [("a", "b"), ("c", "d")], source="synthetic"), source="synthetic")
    index = ContentIndex(real + synthetic)
    manifest = index.manifest()
    assert manifest["count"] == 9 and manifest["sources"] == {"real": 7, "synthetic": 2}
    assert manifest["content_hash"] == ContentIndex(list(reversed(real + synthetic))).content_hash()  # any order
    assert index.keys("synthetic") == [("syn-1", 0), ("syn-1", 1)]
    # Kept one record at a time: removing the synthetic records gives the hash of the real ones alone.
    index.remove(index.keys("synthetic"))
    assert index.content_hash() == ContentIndex(real).content_hash() != manifest["content_hash"]
    # Any field counts, and the types the server hands back do not.
    def changed(record, **fields):  # the record with some of its transition's fields changed
        return replace(record, transition=replace(record.transition, **fields))

    assert ContentIndex([changed(real[0], next_state="elsewhere")] + real[1:]).content_hash() != index.content_hash()
    assert ContentIndex([changed(real[0], reward=0, step_index=np.int64(0))] + real[1:]).content_hash() == \
        index.content_hash()
    assert ContentIndex().manifest() == {"count": 0, "sources": {"real": 0, "synthetic": 0},
                                         "content_hash": "0" * 64}


external_weaviate = pytest.mark.skipif(not WEAVIATE_URL, reason=NO_WEAVIATE)


@pytest.fixture
def weaviate_seed():
    """weaviate_seed(*trajectories) -> a seed buffer as index_buffer builds it, under a throwaway prefix; every
    collection a test opens (seed, copies) is dropped afterwards."""
    prefix, opened = f"DreamGymTest{uuid.uuid4().hex}", []

    def make(*trajectories: Trajectory) -> WeaviateReplayBuffer:
        pending = [t for traj in trajectories for t in transitions(traj)]
        buffer = open_seed_buffer(HashingEncoder(), pending, url=WEAVIATE_URL, collection=prefix,
                                  grpc_port=int(os.environ.get("WEAVIATE_GRPC_PORT", "50051")))
        opened.append(buffer)
        buffer.add(pending, "real")
        return buffer

    yield make, opened
    dropped = set()
    for buffer in opened:  # several buffers may share a collection: drop each once
        if buffer.collection_name not in dropped:
            buffer.drop()
            dropped.add(buffer.collection_name)
        buffer.close()


SYNTHETIC = trajectory("syn-1", "textworld", [("a dark cellar", "light lantern"), ("a lit cellar", "go up")],
                       source="synthetic")
LATER = trajectory("syn-2", "textworld", [("an attic", "open window")], source="synthetic")


@pytest.mark.external
@external_weaviate
def test_weaviate_seed_collections_are_named_by_identity(weaviate_seed):
    make, _ = weaviate_seed
    first = make(KITCHEN, GARDEN)
    again = make(GARDEN, KITCHEN)  # re-indexing the same data: the same collection, nothing added twice
    other = make(KITCHEN, WEB)
    assert again.collection_name == first.collection_name != other.collection_name
    assert len(again) == len(first) == 7 and len(other) == 15
    assert again.content_hash() == first.content_hash() == ContentIndex(records_of(KITCHEN, GARDEN)).content_hash()


@pytest.mark.external
@external_weaviate
def test_weaviate_synthetic_copy_leaves_the_seed_untouched(weaviate_seed, tmp_path: Path):
    make, opened = weaviate_seed
    seed = make(KITCHEN, GARDEN)
    seed.save(tmp_path / "seed")
    before = (len(seed), seed.content_hash())
    copy = seed.copy(run_collection_name(seed.collection_name, "run-1"))
    opened.append(copy)
    assert copy.content_hash() == seed.content_hash() and len(copy) == 7
    assert copy.add(list(transitions(SYNTHETIC)), "synthetic") == 2
    assert (len(copy), copy.count(source="synthetic")) == (9, 2)
    assert (len(seed), seed.content_hash()) == before
    reloaded = load_replay_buffer(tmp_path / "seed", seed.encoder, INDEX)  # checks the server against the manifest
    reloaded.close()
    # The copy's retrieval sees the seed's transitions with the seed's vectors.
    state, action = KITCHEN.steps[1].state, KITCHEN.steps[1].action
    assert [key(r) for r in copy.retrieve(state, action, environment="textworld", k=3)] == \
        [key(r) for r in seed.retrieve(state, action, environment="textworld", k=3)]


@pytest.mark.external
@external_weaviate
def test_weaviate_save_records_the_content_hash(weaviate_seed, tmp_path: Path):
    make, _ = weaviate_seed
    buffer = make(KITCHEN)
    buffer.save(tmp_path / "first")
    first = json.loads((tmp_path / "first" / "buffer.json").read_text())
    assert (first["collection"], first["count"], first["sources"]) == (buffer.collection_name, 5,
                                                                      {"real": 5, "synthetic": 0})
    assert first["content_hash"] == ContentIndex(records_of(KITCHEN)).content_hash()
    buffer.add(list(transitions(SYNTHETIC)), "synthetic")
    buffer.save(tmp_path / "second")
    second = json.loads((tmp_path / "second" / "buffer.json").read_text())
    assert second["count"] == 7 and second["content_hash"] != first["content_hash"]
    assert (tmp_path / "second" / SYNTHETIC_KEYS).read_text() == '["syn-1", 0]\n["syn-1", 1]\n'
    with pytest.raises(ValueError, match=f"{buffer.collection_name}.*{first['content_hash']}.*"
                                         f"{second['content_hash']}.*index_buffer"):
        load_replay_buffer(tmp_path / "first", buffer.encoder, INDEX)


@pytest.mark.external
@external_weaviate
def test_weaviate_export_returns_the_synthetic_records(weaviate_seed):
    make, _ = weaviate_seed
    buffer = make(KITCHEN, GARDEN)
    buffer.add(list(transitions(SYNTHETIC)), "synthetic")
    records, vectors = buffer.export(source="synthetic")
    assert [(key(r), r.source, r.origin, r.action) for r in records] == [
        (("syn-1", 0), "synthetic", "synthetic", "light lantern"), (("syn-1", 1), "synthetic", "synthetic", "go up")]
    expected = buffer.encoder.encode([render(r.state, r.action) for r in records])
    np.testing.assert_allclose(vectors, expected, atol=1e-6)
    everything, all_vectors = buffer.export()
    assert len(everything) == len(all_vectors) == 9


@pytest.mark.external
@external_weaviate
def test_weaviate_restore_drops_records_added_after_the_checkpoint(weaviate_seed, tmp_path: Path):
    make, opened = weaviate_seed
    seed = make(KITCHEN)
    copy = seed.copy(run_collection_name(seed.collection_name, "run-1"))
    opened.append(copy)
    copy.add(list(transitions(SYNTHETIC)), "synthetic")
    copy.save(tmp_path / "checkpoint")
    checkpoint_hash = copy.content_hash()
    copy.add(list(transitions(LATER)), "synthetic")  # the killed run went on past its checkpoint
    # A resumed process connects anew: the run's copy is found again, with the extra record.
    resumed = seed.copy(run_collection_name(seed.collection_name, "run-1"))
    opened.append(resumed)
    assert resumed.collection_name == copy.collection_name and len(resumed) == 8
    resumed.restore(tmp_path / "checkpoint")
    assert (len(resumed), resumed.content_hash()) == (7, checkpoint_hash)
    assert {key(r) for r in resumed.export(source="synthetic")[0]} == {("syn-1", 0), ("syn-1", 1)}
    load_replay_buffer(tmp_path / "checkpoint", seed.encoder, INDEX).close()  # the checkpoint's manifest holds again
    resumed.restore(None)  # a fresh start: the seed's content only
    assert resumed.content_hash() == seed.content_hash() and resumed.count(source="synthetic") == 0
    with pytest.raises(ValueError, match="no longer on the server"):
        resumed.restore(tmp_path / "checkpoint")
