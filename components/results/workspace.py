"""A study row's own workspace: rows that run at the same time cannot share one checkout (each writes its params
into params.yaml and its outputs into models/ and metrics/), so each gets a checkout of its own.

The workspace is a git clone of the project at the study's commit, with the study's params.yaml, data.dvc and
dvc.lock as they were when it started (what the study runs is the working state, not only what was committed), and
the project's DVC cache as its cache: data/ is checked out from it without a copy, and a stage that any workspace or
the project already ran with the same code, data and params is restored from DVC's run cache instead of run again
(the ablations reuse the warm start); its kept trainings (`models.kept_trainings`) are the project's folder too. On
several machines, the cache is one directory they all mount (`dvc cache dir`), as DVC documents for a shared cache.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from components.config import load_params, write_params
from components.files import LAST_CHECKPOINT_MARK, atomic_directory, numbered_checkpoints
from components.llm.sft import TRAINING_STATE

# What DVC needs of the project's working state, beside the commit's code
WORKING_STATE = ("params.yaml", "data.dvc", "dvc.lock")


def project_cache_dir(project: str | Path) -> Path:
    """The DVC cache the project uses (its configured cache.dir, else .dvc/cache)."""
    configured = subprocess.run(["dvc", "cache", "dir"], cwd=project, capture_output=True, text=True)
    path = Path(configured.stdout.strip()) if configured.returncode == 0 and configured.stdout.strip() else \
        Path(project) / ".dvc" / "cache"
    return path if path.is_absolute() else (Path(project) / path).resolve()


def make_workspace(project: str | Path, commit: str, path: str | Path, state: dict[str, str]) -> Path:
    """A checkout of `project` at `commit` in `path`, with the WORKING_STATE files `state` holds (name -> text),
    sharing the project's DVC cache, data/ checked out.

    An earlier workspace in `path` (the same row, stopped mid-run: a session's end) is resumed, as a row resumes in
    the project's own checkout: its tracked files become `commit`'s and `state`'s (what the stopped `dvc exp run`
    left in them is dropped), and what the row wrote and git ignores (checkpoints, DVC's temporary files) stays.
    Anything in `path` that is not a checkout of `project` is replaced."""
    project, path = Path(project).resolve(), Path(path).resolve()
    if not _checkout_of(project, path):
        if path.exists():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _run(["git", "clone", "--quiet", "--shared", "--no-checkout", str(project), str(path)])
    else:
        _run(["git", "fetch", "--quiet", "origin"], cwd=path)  # the study's commit may be newer than the workspace
    _run(["git", "checkout", "--quiet", "--force", "--detach", commit], cwd=path)
    for name, text in state.items():
        (path / name).write_text(text, encoding="utf-8")
    params = path / "params.yaml"
    if params.is_file() and (kept := load_params(params).models.kept_trainings) and not Path(kept).is_absolute():
        # the project's folder, not the workspace's copy: what a row keeps outlives its workspace (not a stage's dep)
        write_params({"models.kept_trainings": str(project / kept)}, params)
    _run(["dvc", "cache", "dir", "--local", str(project_cache_dir(project))], cwd=path)
    if (path / "data.dvc").is_file():
        _run(["dvc", "checkout", "--quiet", "data.dvc"], cwd=path)
    return path


# A checkpoint-N folder is parked whole once none of its files changed for this long (its trainer is done saving)
SETTLED_SECONDS = 30.0


def park(paths: Iterable[Path], root: str | Path, parked: str | Path, settled: float = SETTLED_SECONDS) -> int:
    """Mirror the resume state `paths` (files or folders under `root`, a row's workspace) in `parked`, a folder that
    outlives the machine (committed with the rows), so that a row whose machine is gone goes on elsewhere (`unpark`).

    Of a checkpoints folder's `checkpoint-N` folders only the newest that is settled (no file changed for `settled`
    seconds) is parked, whole, replacing the one parked before: a checkpoint copied mid-save would be the newest and
    broken. A trainer's last checkpoint (`finished_training`) is parked without what only continuing needs
    (TRAINING_STATE: the optimizer, most of its size), which the trainer does without on resuming.
    Other files (journals, stamps) are copied when their size or time changed; what the workspace no longer holds
    goes from `parked`. Returns the bytes copied."""
    root, parked, copied = Path(root), Path(parked), 0
    wanted: set[Path] = set()
    for path in paths:
        checkpoints = numbered_checkpoints(path) if path.is_dir() else []
        if newest := _newest_settled(checkpoints, settled):
            wanted.add(newest.relative_to(root))
            if not (target := parked / newest.relative_to(root)).is_dir():
                left_out = shutil.ignore_patterns(*(f"{name}*" for name in TRAINING_STATE)) \
                    if finished_training(newest) else None
                with atomic_directory(target) as partial:
                    shutil.copytree(newest, partial, dirs_exist_ok=True, ignore=left_out)
                copied += sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
        for source in files:
            if any(checkpoint in source.parents for checkpoint in checkpoints):
                continue  # a checkpoint's: parked whole above, or not at all
            relative = source.relative_to(root)
            wanted.add(relative)
            if not (target := parked / relative).is_file() or _stat(target) != _stat(source):
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
                copied += source.stat().st_size
    for path in sorted(parked.rglob("*"), reverse=True) if parked.is_dir() else []:  # deepest first
        relative = path.relative_to(parked)
        if relative in wanted or any(folder in wanted for folder in relative.parents):
            continue
        if path.is_file():
            path.unlink()
        elif not any(path.iterdir()):  # a folder whose files went
            path.rmdir()
    return copied


def unpark(parked: str | Path, root: str | Path) -> int:
    """Put what `park` kept in `parked` into `root` (a new workspace of the row), leaving what `root` holds; the
    files put back."""
    parked, root, restored = Path(parked), Path(root), 0
    for source in sorted(parked.rglob("*")) if parked.is_dir() else []:
        target = root / source.relative_to(parked)
        if source.is_file() and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
            restored += 1
    return restored


def finished_training(checkpoint: Path) -> bool:
    """Whether `checkpoint` is its training's last: our own loops' (PPO's) holds LAST_CHECKPOINT_MARK, a transformers
    Trainer's says so in its trainer_state.json (all steps done, or told to stop, as sim-to-real's budget does)."""
    if (checkpoint / LAST_CHECKPOINT_MARK).is_file():
        return True
    state_file = checkpoint / "trainer_state.json"
    if not state_file.is_file():
        return False
    state = json.loads(state_file.read_text(encoding="utf-8"))
    control = state.get("stateful_callbacks", {}).get("TrainerControl", {}).get("args", {})
    return 0 < state.get("max_steps", 0) <= state.get("global_step", 0) or bool(control.get("should_training_stop"))


def _newest_settled(checkpoints: list[Path], settled: float) -> Path | None:
    """The newest of `checkpoints` (oldest first) none of whose files changed for `settled` seconds, or None."""
    now = time.time()
    for checkpoint in reversed(checkpoints):
        times = [f.stat().st_mtime for f in checkpoint.rglob("*") if f.is_file()]
        if times and now - max(times) >= settled:
            return checkpoint
    return None


def _stat(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_size, status.st_mtime_ns


def _checkout_of(project: Path, path: Path) -> bool:
    """Whether `path` is a clone of `project` (its origin), which `make_workspace` resumes."""
    origin = _git_output(path, "remote", "get-url", "origin") if (path / ".git").is_dir() else ""
    return bool(origin) and Path(origin).resolve() == project


@contextmanager
def claimed(path: str | Path) -> Iterator[None]:
    """`path` (a row's workspace) held by this process while the block runs: a second process that claims it (the
    same row started twice) fails at once, naming it, instead of both writing one checkout. An exclusive lock on
    `path`.lock, which the system lets go when the process ends, however it ends."""
    import fcntl

    lock_path = Path(path).with_name(Path(path).name + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"{path} is in use: another process runs this row there now (a study started twice?); "
                               "let it finish, or stop it, then run the row again") from None
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)
            fcntl.flock(handle, fcntl.LOCK_UN)


def working_state(project: str | Path) -> dict[str, str]:
    """The project's WORKING_STATE files as text (those it has)."""
    return {name: (Path(project) / name).read_text(encoding="utf-8") for name in WORKING_STATE
            if (Path(project) / name).is_file()}


@dataclass
class CommitsDuringRun:
    commits: list[str] = field(default_factory=list)  # made in the checkout while the run ran, oldest first
    restored: bool = False  # put back on the branch


@contextmanager
def keeping_commits(cwd: str | Path = ".") -> Iterator[CommitsDuringRun]:
    """Around a `dvc exp run`: the commits made in the checkout while it ran, put back on the branch (what it yields
    says which, once the block is done).

    `dvc exp run` detaches HEAD at the branch's commit while it runs and, once done, commits the experiment on top
    of whatever HEAD then is and points HEAD back at the branch, which never moved: a commit made meanwhile (say,
    results committed while a long row ran) falls off the branch, its files left uncommitted in the working tree.
    Where the branch is still where the run started and those commits descend from it, the branch is moved to the
    last of them, with the index (`git reset`: the working tree, which holds their files and the run's outputs, is
    left as it is); otherwise they are only named, for the caller to report."""
    def git(*args: str) -> str:
        return _git_output(cwd, *args)

    def is_ancestor(commit: str, of: str) -> bool:
        return subprocess.run(["git", "merge-base", "--is-ancestor", commit, of], cwd=cwd,
                              capture_output=True).returncode == 0

    branch, start = git("symbolic-ref", "--quiet", "HEAD"), git("rev-parse", "--verify", "--quiet", "HEAD")
    seen = len(git("log", "--walk-reflogs", "--format=%H", "HEAD").splitlines())
    made = CommitsDuringRun()
    try:
        yield made
    finally:
        if branch and start:
            entries = git("log", "--walk-reflogs", "--format=%H %gs", "HEAD").splitlines()
            moves = [line.partition(" ")[::2] for line in entries[:max(0, len(entries) - seen)]]
            commits = [sha for sha, subject in moves if not subject.startswith("commit: dvc: commit experiment")
                       and subject.split(":", 1)[0] in ("commit", "commit (amend)", "commit (merge)", "cherry-pick",
                                                       "revert")]
            last, head = commits[0] if commits else "", git("rev-parse", "HEAD")  # the reflog is newest first
            if last and not is_ancestor(last, head):  # else on the branch: nothing fell off
                made.commits = git("rev-list", "--reverse", f"{start}..{last}").splitlines() or commits[::-1]
                if head == start and is_ancestor(start, last):
                    git("reset", "--quiet", last)
                    made.restored = git("rev-parse", "HEAD") == last


def reattach_head(cwd: str | Path = ".") -> str | None:
    """Put HEAD back on the branch a killed `dvc exp run` left it off; the branch's name, or None where HEAD was not
    left detached that way.

    `dvc exp run` detaches HEAD at the branch's commit while it runs (refs/exps/exec/EXEC_BASELINE marks that commit)
    and points it back at the branch once done. Killed (a session's end), it leaves HEAD detached, and every later
    run and commit in the checkout goes on there, off the branch. Where no DVC command is running in the checkout
    (its lock file names a live process while one is) and HEAD is still at the commit that run detached it from, HEAD
    goes back on the branch: nothing on disk changes."""
    def git(*args: str) -> str:
        return _git_output(cwd, *args)

    head = git("rev-parse", "--verify", "--quiet", "HEAD")
    if git("symbolic-ref", "--quiet", "HEAD") or not head or _dvc_running(cwd) or \
            git("rev-parse", "--verify", "--quiet", "refs/exps/exec/EXEC_BASELINE") != head:
        return None
    newest = git("log", "--walk-reflogs", "-1", "--format=%gs", "HEAD")
    detached = re.fullmatch(rf"checkout: moving from (\S+) to {head}", newest)
    branch = detached.group(1) if detached else ""
    if not branch or git("rev-parse", "--verify", "--quiet", f"refs/heads/{branch}") != head:
        return None
    git("symbolic-ref", "-m", "reattached after a killed dvc exp run", "HEAD", f"refs/heads/{branch}")
    return branch if git("symbolic-ref", "--quiet", "--short", "HEAD") == branch else None


def _dvc_running(cwd: str | Path) -> bool:
    """Whether a DVC command is running in the checkout: DVC's lock file holds the process id of the one that is."""
    try:
        pid = int((Path(cwd) / ".dvc" / "tmp" / "lock").read_text(encoding="utf-8").strip())
    except (OSError, ValueError):  # no lock file, or no process id in it
        return False
    if pid <= 0:  # os.kill would address a process group, not a process
        return False
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process, running
        pass
    return True


def _git_output(cwd: str | Path, *args: str) -> str:
    """A git command's output, or "" where it fails (a ref that does not exist, a detached HEAD's branch)."""
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def _run(command: list[str], cwd: str | Path | None = None) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode} in {cwd or '.'}: "
                           f"{(done.stderr or done.stdout).strip()[-2000:]}")
