"""index_buffer: the real seed transitions of training tasks embedded into the replay buffer, saved (buffer.out_dir)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from components.config import Params
from components.data.contract import TRAJECTORIES, is_heldout_task, read_trajectories, transitions
from components.reports import markdown_table, write_stage_outputs
from components.simulator.replay_buffer import IndexSettings, SentenceEncoder, open_replay_buffer, open_seed_buffer


def run(params: Params, root: str | Path = ".", log=print) -> dict[str, Any]:
    """Embed the real seed transitions of training tasks into the replay buffer and save it (buffer.out_dir)."""
    root = Path(root)
    trajectories = read_trajectories(root / params.data.dir / TRAJECTORIES)
    fraction = params.data.heldout_task_fraction
    train = [t for t in trajectories if not is_heldout_task(t.task.task_id, fraction)]
    pending = [transition for trajectory in train for transition in transitions(trajectory)]
    encoder = SentenceEncoder(params.models.embedder, root / params.models.cache_dir, params.buffer.encode_batch_size)
    if params.buffer.backend == "weaviate":  # a collection named by these transitions, the embedder and the schema
        buffer = open_seed_buffer(encoder, pending, **params.buffer.weaviate.model_dump())
    else:  # builders.buffer_index's one line: importing builders would add its modules to this stage's deps
        index = IndexSettings(**params.buffer.index.model_dump())
        buffer = open_replay_buffer(params.buffer.backend, encoder, index=index)
    start, chunk = time.monotonic(), 256
    for done in range(0, len(pending), chunk):
        buffer.add(pending[done:done + chunk], source="real")
        rate = (done + chunk) / (time.monotonic() - start)
        log(f"[index_buffer] {min(done + chunk, len(pending))}/{len(pending)} transitions, {rate:.0f}/s, "
            f"ETA {max(0.0, (len(pending) - done - chunk) / rate):.0f}s")
    buffer.save(root / params.buffer.out_dir)
    environments = sorted({t.task.environment for t in trajectories})
    metrics = {
        "transitions": len(buffer),
        "transitions_by_environment": {env: buffer.count(environment=env) for env in environments},
        "train_tasks": len({t.task.task_id for t in train}),
        "heldout_tasks": len({t.task.task_id for t in trajectories}) - len({t.task.task_id for t in train}),
        "encode_per_s": round(len(pending) / (time.monotonic() - start), 1),
    }
    buffer.close()
    write_stage_outputs("index_buffer", metrics, report(params, metrics), root)
    return metrics


def report(params: Params, metrics: dict[str, Any]) -> str:
    rows = [[env, count] for env, count in metrics["transitions_by_environment"].items()]
    return (f"# Replay buffer\n\n{metrics['transitions']} real transitions from {metrics['train_tasks']} training "
            f"tasks, embedded with `{params.models.embedder}` (backend `{params.buffer.backend}`); "
            f"{metrics['heldout_tasks']} seed tasks ({params.data.heldout_task_fraction:.0%}) are held out for "
            "fidelity evaluation.\n\n"
            + markdown_table(["environment", "transitions"], rows))
