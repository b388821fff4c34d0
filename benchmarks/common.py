"""What the benchmark scripts share: an aligned markdown table and loading a model by directory or name."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any


def print_machine(threads: int) -> None:
    """Set torch's threads when asked (0: its default), then print the command line and the machine."""
    import torch

    from components.llm.sft import hardware

    if threads:
        torch.set_num_threads(threads)
    print(f"$ {shlex.join([Path(sys.executable).name, *sys.argv])}")
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads, "
          f"device {hardware()}", flush=True)


def table(header: list[str], rows: list[list[str]]) -> str:
    """An aligned markdown table (cells are strings; numbers right-aligned)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    return "\n".join(lines)


def load_model(name: str, cache_dir: str) -> tuple[Any, Any, str]:
    """A saved model directory (merged or adapter, via load_trained_model), else a packaged alias / HF id."""
    if Path(name).is_dir():
        from components.llm.sft import load_trained_model

        model, tokenizer = load_trained_model(name)
        return model, tokenizer, str(Path(name).resolve())
    from components.llm.models import load_causal_lm

    model, tokenizer = load_causal_lm(name, cache_dir=cache_dir)
    return model, tokenizer, f"{name} (from {cache_dir})"
