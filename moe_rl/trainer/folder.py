"""Run folders that protect their data: one run at a time in a folder, and no silent replacement.

- **A lock for the run's life.** `claim_folder` takes an exclusive `filelock` lock on `<run>/.moe-rl.lock`
  (released by the OS when the process dies, so a killed run never leaves the folder locked) and
  records the holder's pid and host in `<run>/.moe-rl.owner`. A second run into a locked folder stops
  in one line naming that pid (FolderInUseError).
- **No fresh run over an old one.** A run without `resume=true` into a folder that already holds a run
  (any of RUN_FILES) is refused in one line (FolderHoldsRunError), unless `overwrite=true`: then the old
  files are moved, never deleted, into `<run>/overwritten-<UTC time>/`.
- **A run id.** Each run has an id, kept in `<run>/run_id.txt` and written into each of its checkpoints
  and its summary; a resume never loads a checkpoint of another id (moe_rl.trainer.checkpoint).

- **A sweep folder is owned the same way** (`SweepFolderCallback`, a Hydra callback in conf/config.yaml):
  before Hydra writes anything into `hydra.sweep.dir`, a sweep takes its lock `<sweep>/.moe-rl-sweep.lock`
  for its whole life, and a sweep into a folder that already holds one (its `multirun.yaml`) is refused
  unless `resume=true` (a sweep in sittings). A refused sweep exits in one line and writes nothing there:
  the other sweep's job folders and `multirun.yaml` stay byte for byte.

The lock and owner files are bookkeeping: a refused run may recreate them, and nothing else in the
folder changes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path, PurePath

from filelock import FileLock, Timeout
from hydra.experimental.callback import Callback

from moe_rl.errors import RunError
from moe_rl.trainer.checkpoint import CHECKPOINT, CORRUPT, PREVIOUS, TMP
from moe_rl.trainer.distributed import Dist

LOCK = ".moe-rl.lock"
OWNER = ".moe-rl.owner"
"""The lock holder's "pid host", for the message a second run prints (filelock's own file is truncated
by every process that tries the lock, so it cannot carry the pid)."""
RUN_ID = "run_id.txt"
HYDRA_LOG = "train.log"
"""Hydra's job log, which Hydra has opened (for appending) before the run starts: overwrite copies it
aside instead of moving it."""
RUN_FILES = (
    "metrics.jsonl",
    "events.jsonl",
    "summary.json",
    CHECKPOINT,
    PREVIOUS,
    CORRUPT,
    TMP,
    "policy",
    "wandb",
    "wandb_id.txt",
    RUN_ID,
)
"""What a run leaves in its folder: a folder holding any of these holds a run."""
BOOKKEEPING = (LOCK, OWNER)
ASIDE = "overwritten-"
"""The name prefix of the folder that overwrite=true moves an old run's files into."""


class FolderInUseError(RunError):
    """Another live process holds the run folder's lock."""


class FolderHoldsRunError(RunError):
    """A fresh run (no resume, no overwrite) into a folder that already holds a run."""


def run_files(run_dir: Path) -> list[str]:
    """The names of RUN_FILES present in `run_dir`: what makes it hold a run."""
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def _holder(folder: Path, owner: str = OWNER) -> str:
    """"pid P [on HOST]" of the process that holds `folder`'s lock, from its `owner` file."""
    try:
        pid, _, host = (folder / owner).read_text().strip().partition(" ")
    except OSError:
        return "pid unknown"
    return f"pid {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")


@contextlib.contextmanager
def folder_lock(run_dir: Path) -> Iterator[None]:
    """Hold the exclusive lock on `run_dir` for the body; FolderInUseError (one line) if another process has it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(run_dir / LOCK), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        time.sleep(0.2)  # the holder writes its pid just after it takes the lock
        raise FolderInUseError(
            f"{run_dir} is in use by another run ({_holder(run_dir)}): wait for it to end, or give this run "
            "a folder of its own (hydra.run.dir=...)"
        ) from None
    try:
        (run_dir / OWNER).write_text(f"{os.getpid()} {socket.gethostname()}\n")
        yield
    finally:
        (run_dir / OWNER).unlink(missing_ok=True)
        lock.release()


def move_aside(run_dir: Path) -> Path:
    """Move everything in `run_dir` but the lock's bookkeeping and earlier `overwritten-*` folders into a new
    `overwritten-<UTC time>/` folder there (Hydra's open train.log is copied, not moved); returns it."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.gmtime())
    aside = run_dir / f"{ASIDE}{stamp}"
    n = 1
    while aside.exists():
        n += 1
        aside = run_dir / f"{ASIDE}{stamp}-{n}"
    aside.mkdir()
    for entry in sorted(run_dir.iterdir()):
        if entry == aside or entry.name in BOOKKEEPING or entry.name.startswith(ASIDE):
            continue
        if entry.name == HYDRA_LOG:
            shutil.copy2(entry, aside / entry.name)
        else:
            os.replace(entry, aside / entry.name)
    return aside


def set_aside(path: Path | PurePath) -> bool:
    """Whether `path`, relative to a sweep folder, lies in Hydra's record (`.hydra/`) or in an old run's
    files that overwrite=true moved aside: not a run folder of the sweep."""
    return any(part == ".hydra" or part.startswith(ASIDE) for part in path.parts)


def check_fresh_start(run_dir: Path, *, resume: bool, overwrite: bool) -> Path | None:
    """Refuse (FolderHoldsRunError, one line) a fresh run into a folder that holds a run, unless `resume`
    (the run continues) or `overwrite` (its files are moved aside: the folder they went to is returned)."""
    held = run_files(run_dir)
    if resume or not held:
        return None
    if not overwrite:
        raise FolderHoldsRunError(
            f"{run_dir} already holds a run ({', '.join(held)}): add resume=true to continue it, overwrite=true "
            "to move its files aside and start again, or give this run a folder of its own (hydra.run.dir=...)"
        )
    return move_aside(run_dir)


@contextlib.contextmanager
def claim(run_dir: Path, dist: Dist, *, resume: bool, overwrite: bool) -> Iterator[None]:
    """Rank 0 holds the folder's lock for the body, after refusing a fresh run over an old one (or moving
    it aside under overwrite=true: `check_fresh_start`); every rank raises rank 0's refusal, so none waits
    on a collective."""
    with contextlib.ExitStack() as held:
        refusal, aside = None, None
        if dist.main:
            try:
                held.enter_context(folder_lock(run_dir))
                aside = check_fresh_start(run_dir, resume=resume, overwrite=overwrite)
            except RunError as err:
                refusal = err
        message = dist.broadcast(str(refusal) if refusal else None)
        if refusal is not None:
            raise refusal
        if message is not None:
            raise RunError(message)
        if aside is not None:
            warnings.warn(f"overwrite=true: the earlier run's files are now in {aside}", RuntimeWarning, stacklevel=3)
        yield


def record_run_id(run_dir: Path, run_id: str | None) -> str:
    """The run's id, `run_id` (the folder's, or the checkpoint's it resumes) or else a new one, recorded in
    the folder's `run_id.txt`."""
    run_id = run_id or uuid.uuid4().hex[:12]
    if folder_run_id(run_dir) != run_id:
        (run_dir / RUN_ID).write_text(run_id + "\n")
    return run_id


def folder_run_id(run_dir: Path) -> str | None:
    """The folder's run id if it has one (None for a new folder, or one written before run ids)."""
    path = run_dir / RUN_ID
    text = path.read_text().strip() if path.is_file() else ""
    return text or None


SWEEP_LOCK = ".moe-rl-sweep.lock"
SWEEP_OWNER = ".moe-rl-sweep.owner"


class SweepFolderCallback(Callback):
    """Hydra callback: own `hydra.sweep.dir` from the sweep's start to its end (module docstring)."""

    def __init__(self) -> None:
        self._lock: FileLock | None = None

    def __getstate__(self) -> dict:
        """Launchers pickle the callbacks into every job: the lock stays with the sweep's own process."""
        return {**self.__dict__, "_lock": None}

    def on_multirun_start(self, config, **kwargs) -> None:
        sweep = Path(config.hydra.sweep.dir)
        problem = sweep_problem(sweep, resume=bool(config.get("resume", False)))
        if problem is None:
            sweep.mkdir(parents=True, exist_ok=True)
            self._lock = FileLock(str(sweep / SWEEP_LOCK), timeout=0)
            try:
                self._lock.acquire()
                (sweep / SWEEP_OWNER).write_text(f"{os.getpid()} {socket.gethostname()}\n")
            except Timeout:  # taken between the check and here
                self._lock, problem = None, _in_use(sweep)
        if problem is not None:
            print(f"moe-rl-train: {problem}", file=sys.stderr)
            sys.exit(2)

    def on_multirun_end(self, config, **kwargs) -> None:
        if self._lock is not None:
            (Path(config.hydra.sweep.dir) / SWEEP_OWNER).unlink(missing_ok=True)
            self._lock.release()
            self._lock = None


def _in_use(sweep: Path) -> str:
    return (f"{sweep} is in use by another sweep ({_holder(sweep, SWEEP_OWNER)}): wait for it to end, or give "
            "this sweep a folder of its own (hydra.sweep.dir=...)")


def sweep_problem(sweep: Path, resume: bool) -> str | None:
    """Why a sweep must not start in `sweep`, or None: another live sweep holds its lock, or it holds a
    sweep (its multirun.yaml) and `resume` is off. Reads, writes nothing."""
    if (sweep / SWEEP_LOCK).exists():
        probe = FileLock(str(sweep / SWEEP_LOCK), timeout=0)
        try:
            probe.acquire()
            probe.release()
        except Timeout:
            time.sleep(0.2)  # the holder writes its pid just after it takes the lock
            return _in_use(sweep)
    if (sweep / "multirun.yaml").exists() and not resume:
        return (f"{sweep} already holds a sweep (multirun.yaml): add resume=true to continue it (its finished "
                "runs are left as they are), or give this sweep a folder of its own (hydra.sweep.dir=...)")
    return None
