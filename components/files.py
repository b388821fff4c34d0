"""Files and directories: crash-safe writes of whole files and directories (model caches, saved buffers), content
digests."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


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
            if old.exists():  # the swap failed halfway: put the old copy back rather than lose it
                os.rename(old, target)
            if replace or not target.is_dir():
                raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (a temporary file beside it, then a rename): a crash never leaves half of it
    for a later run to trust. Each writer has a temporary file of its own, so processes writing the same file at once
    each leave a whole one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")
    try:
        partial.write_bytes(data)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    """`atomic_write_bytes` of `text` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1024 * 1024), b""):
            digest.update(block)
    return digest.hexdigest()


# In a directory that a known recipe made (a merged model, a saved replay buffer): the fingerprint of that recipe.
MADE_FROM = "made_from.txt"


def write_made_from(directory: Path, recipe: str) -> None:
    """Say in `directory` what made it (`directory_identity`)."""
    atomic_write_text(directory / MADE_FROM, recipe + "\n")


def directory_identity(path: str | Path) -> str:
    """What a directory is, for the fingerprint of work made from it: the recipe its maker wrote in MADE_FROM, else its
    content (`directory_sha256`). By recipe because a model merged, or a buffer embedded, on another CPU has other
    bytes by float rounding, not other content: work parked on one machine must resume on the next."""
    made_from = Path(path) / MADE_FROM
    if made_from.is_file():
        return f"made from {made_from.read_text(encoding='utf-8').strip()}"
    return directory_sha256(path)


def directory_sha256(path: str | Path) -> str:
    """The sha256 of a directory's content: every file's relative path and bytes (a model retrained in place is
    another model)."""
    root = Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(root).as_posix()}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def discard_unless_stamped(path: Path, fingerprint: str, stamp: Path) -> bool:
    """Delete `path` (a file or directory of resumable work) unless `stamp` holds `fingerprint`, then stamp it; say
    whether it was deleted.

    Work left by other settings, data or code must not be resumed: continuing it would mix two runs. A directory's stamp
    may lie inside it: it goes with the directory, and writing the new one creates the directory afresh.
    """
    discard = path.exists() and (not stamp.is_file() or stamp.read_text().strip() != fingerprint)
    if discard and path.is_dir():
        shutil.rmtree(path)
    elif discard:
        path.unlink()
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(fingerprint + "\n")
    return discard


def fingerprint(values: Any, sources: Iterable[Path] = ()) -> str:
    """The sha256 of `values` (as JSON, keys sorted, other objects as their str) and of each source file's bytes: what
    a piece of resumable work is made from, so that only the same work resumes it."""
    payload = json.dumps([values, [sha256_file(Path(source)) for source in sources]], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def checkpoint_number(checkpoint: Path) -> int:
    """N of `checkpoint-N`: the iterations (GRPO: optimizer steps, one per iteration) it holds."""
    return int(checkpoint.name.rsplit("-", 1)[-1])


# Our own training loops' last checkpoint holds this file (a transformers Trainer's says so in its trainer_state.json):
# what only continuing needs (the optimizer) may then go, as a continued run starts a fresh one
LAST_CHECKPOINT_MARK = "last_checkpoint.json"


def numbered_checkpoints(checkpoints: Path) -> list[Path]:
    """The `checkpoint-N` folders in `checkpoints`, oldest first."""
    found = [p for p in checkpoints.glob("checkpoint-*") if p.name.rsplit("-", 1)[-1].isdigit()]
    return sorted(found, key=checkpoint_number)
