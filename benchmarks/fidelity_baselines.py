"""Fidelity baselines on the held-out real transitions of the seed data: state-unchanged and copy-nearest-neighbour.

    .venv/bin/python benchmarks/fidelity_baselines.py [--data data/trajectories.jsonl] [--buffer buffer]
                                                      [--k 1] [--json fidelity_baselines.json] [--no-embeddings]

Held-out tasks are `data.heldout_task_fraction` of params.yaml (kept out of the buffer, so the nearest neighbour is
always another task's transition). The buffer is loaded with `models.embedder` from `models.cache_dir`, the encoder
it was built with; the same encoder scores next-state embedding similarity. These are the floors the trained
experience model has to beat.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from components import builders  # noqa: E402
from components.config import load_params  # noqa: E402
from components.data.contract import read_trajectories  # noqa: E402
from components.simulator.fidelity import (  # noqa: E402
    copy_nearest_neighbour,
    evaluate,
    fidelity_report,
    heldout_transitions,
    state_unchanged,
)
from components.simulator.replay_buffer import SentenceEncoder, load_replay_buffer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--data", default="data/trajectories.jsonl")
    parser.add_argument("--buffer", default=None, help="saved buffer directory (default: buffer.out_dir)")
    parser.add_argument("--k", type=int, default=1, help="neighbours retrieved; reward/done by majority over k")
    parser.add_argument("--json", default=None, help="also write the metrics here")
    parser.add_argument("--no-embeddings", action="store_true", help="skip next-state embedding similarity")
    args = parser.parse_args()

    params = load_params(args.params)
    trajectories = read_trajectories(args.data)
    held = heldout_transitions(trajectories, params.data.heldout_task_fraction)
    encoder = SentenceEncoder(params.models.embedder, params.models.cache_dir,
                              batch_size=params.buffer.encode_batch_size)
    buffer = load_replay_buffer(args.buffer or params.buffer.out_dir, encoder, builders.buffer_index(params))
    held_ids = {t.trajectory_id for t in held}
    print(f"{len(trajectories)} trajectories, {len(held)} held-out transitions from "
          f"{len({t.task.task_id for t in held})} held-out tasks ({len(held_ids)} trajectories); "
          f"buffer: {len(buffer)} transitions, encoder {encoder.name}", file=sys.stderr)

    started = time.perf_counter()
    predictors = {"state-unchanged": state_unchanged,
                  ("copy-nearest-neighbour" if args.k == 1 else f"copy-nearest-neighbour-k{args.k}"):
                      copy_nearest_neighbour(buffer, k=args.k)}
    results = evaluate(predictors, held, encoder=None if args.no_embeddings else encoder)
    print(f"evaluated in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    print(fidelity_report(results, title="Fidelity baselines on held-out real transitions"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
