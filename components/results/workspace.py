"""A study row's own workspace: rows that run at the same time cannot share one checkout (each writes its params
into params.yaml and its outputs into models/ and metrics/), so each gets a checkout of its own.

The workspace is a git clone of the project at the study's commit, with the study's params.yaml, data.dvc and
dvc.lock as they were when it started (what the study runs is the working state, not only what was committed), and
the project's DVC cache as its cache: data/ is checked out from it without a copy, and a stage that any workspace or
the project already ran with the same code, data and params is restored from DVC's run cache instead of run again
(the ablations reuse the warm start). On several machines, the cache is one directory they all mount (`dvc cache
dir`), as DVC documents for a shared cache.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

# What DVC needs of the project's working state, beside the commit's code
WORKING_STATE = ("params.yaml", "data.dvc", "dvc.lock")


def project_cache_dir(project: str | Path) -> Path:
    """The DVC cache the project uses (its configured cache.dir, else .dvc/cache)."""
    configured = subprocess.run(["dvc", "cache", "dir"], cwd=project, capture_output=True, text=True)
    path = Path(configured.stdout.strip()) if configured.returncode == 0 and configured.stdout.strip() else \
        Path(project) / ".dvc" / "cache"
    return path if path.is_absolute() else (Path(project) / path).resolve()


def make_workspace(project: str | Path, commit: str, path: str | Path, state: dict[str, str]) -> Path:
    """A fresh checkout of `project` at `commit` in `path` (an earlier one there is replaced), with the WORKING_STATE
    files `state` holds (name -> text), sharing the project's DVC cache, data/ checked out."""
    project, path = Path(project).resolve(), Path(path).resolve()
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _run(["git", "clone", "--quiet", "--shared", "--no-checkout", str(project), str(path)])
    _run(["git", "checkout", "--quiet", "--detach", commit], cwd=path)
    for name, text in state.items():
        (path / name).write_text(text, encoding="utf-8")
    _run(["dvc", "cache", "dir", "--local", str(project_cache_dir(project))], cwd=path)
    if (path / "data.dvc").is_file():
        _run(["dvc", "checkout", "--quiet", "data.dvc"], cwd=path)
    return path


def working_state(project: str | Path) -> dict[str, str]:
    """The project's WORKING_STATE files as text (those it has)."""
    return {name: (Path(project) / name).read_text(encoding="utf-8") for name in WORKING_STATE
            if (Path(project) / name).is_file()}


def _run(command: list[str], cwd: str | Path | None = None) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode} in {cwd or '.'}: "
                           f"{(done.stderr or done.stdout).strip()[-2000:]}")
