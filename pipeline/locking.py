"""One process per stage and workdir, and one per training's state directory. Snakemake locks a
workdir against a second `snakemake`, but not against `dpfm <stage>` run by hand beside it, nor the
curve's point that repeats dp-train against dp-train (one run, two stages); two processes on one
training would interleave one ledger and checkpoint and delete each other's temporary files."""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path

from pipeline.errors import StageBusy

LOCK_DIR = Path(".dpfm/locks")
_HELD: set[int] = set()  # descriptors of the locks this process holds


def _drop_inherited_locks() -> None:
    """In a forked child, point every lock descriptor it inherited at /dev/null. A flock belongs to the
    open file, which a child shares: a child left behind when its parent died (a scan worker after
    kill -9) held the lock for ever. The number stays a valid descriptor, so nothing that closes it
    later closes another file."""
    if _HELD:
        null = os.open(os.devnull, os.O_RDONLY)
        for fd in _HELD:
            os.dup2(null, fd)
        os.close(null)
        _HELD.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


@contextmanager
def stage_lock(stage: str):
    """Hold `.dpfm/locks/<stage>.lock` while the stage runs. The kernel drops the lock when the
    holder dies, even by kill -9, and the processes it forks do not hold it (`_drop_inherited_locks`),
    so a crash never leaves a stale lock behind."""
    with exclusive(LOCK_DIR / f"{stage}.lock", f"{stage} is already running in this directory"):
        yield


def training_lock(state: Path, name: str, wait: bool):
    """Held by the one process that trains in the state directory `state` (the main rank), as
    `.dpfm/locks/<name>.lock`; with `wait`, a second process waits for the first to end (then it finds
    the run where the first left it) instead of stopping."""
    return exclusive(LOCK_DIR / f"{name}.lock", f"a training in {state} is already running", wait)


@contextmanager
def exclusive(path: Path, busy: str, wait: bool = False):
    """Hold the lock file `path`; if another process holds it, wait for it (saying so) or raise
    StageBusy(`busy` and who holds it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            if not wait:
                raise StageBusy(f"{busy} ({holder}, {path}): wait for it to end, or stop it, then re-run") from None
            print(f"dpfm: {busy} ({holder}, {path}): waiting for it to end", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:  # a file system without locks (Lustre mounted without -o flock): go on
            print(f"dpfm: WARNING cannot lock {path} ({e.strerror}); not guarded against a second holder",
                  file=sys.stderr)
            yield
            return
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}")
        f.flush()
        _HELD.add(f.fileno())
        try:
            yield
        finally:  # released now, even if a forked worker still holds a copy of the descriptor
            _HELD.discard(f.fileno())
            fcntl.flock(f, fcntl.LOCK_UN)
