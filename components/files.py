"""Crash-safe writes of whole directories (model caches, saved buffers)."""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(target: Path, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes `target` only if the block completes.

    It sits beside `target` (same filesystem, so the rename is atomic): a crash or Ctrl-C never leaves a
    half-written directory that later runs would trust. With `replace`, an existing `target` is swapped out;
    without, an existing one wins (another process finished the same work first, and its copy is as good).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        # mkdtemp makes the directory private (0700) and some writers use 0600; these are shared data.
        for path in [tmp, *tmp.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        if replace and target.exists():
            os.rename(target, old)  # two renames: a directory cannot be replaced in one
        try:
            os.rename(tmp, target)
        except OSError:
            if replace or not target.is_dir():
                raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
