"""Benchmark scripts run end to end on a tiny model (their figures are read by people, not asserted)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from conftest import REPO, run


def test_decode_speed_prints_a_row_per_dtype_and_width_with_trained_or_random_weights(tiny_model_dir: Path,
                                                                                   tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps([{"role": "system", "content": "You simulate the game."},
                                           {"role": "user", "content": f"Action: open fridge {i}"}]) + "\n"
                               for i in range(2)))
    for weights in ([], ["--random-weights"]):
        out = run(sys.executable, str(REPO / "benchmarks/decode_speed.py"), "--model", str(tiny_model_dir),
                  "--prompts", str(prompts), "--batches", "1", "3", "--new-tokens", "4", "--rounds", "1",
                  *weights, cwd=tmp_path).stdout
        assert ("random weights" if weights else "trained weights") in out
        rows = re.findall(r"^\|\s+float32 \|\s+(\d+) \|.*\|\s+([\d.]+)x \|\s+- \|$", out, re.MULTILINE)
        assert [width for width, _ in rows] == ["1", "3"], out
        assert rows[0][1] == "1.0", out  # the first width is the baseline of the speed column


def test_parallel_rows_prints_both_workloads_one_process_against_side_by_side(tiny_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    out = run(sys.executable, str(REPO / "benchmarks/parallel_rows.py"), "--model", str(tiny_model_dir),
              "--prompt-tokens", "8", "--new-tokens", "2", "--train-tokens", "8", "--repeats", "1", "--cores", "1",
              cwd=tmp_path).stdout
    rows = re.findall(r"^\|\s+(greedy turn|training step) \|\s+1 \|\s+[\d.]+ \|\s+[\d.]+ \|\s+[\d.]+x \|$", out,
                      re.MULTILINE)
    assert rows == ["greedy turn", "training step"], out
