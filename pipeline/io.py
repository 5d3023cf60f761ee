"""Atomic file writes: a later stage must never mistake a half-written artifact for a good one."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | Path, mode: int | None = None):
    """Yield a temporary path beside `path`; on success fsync it and rename it over `path`, with
    permissions `mode` (default: an ordinary file's). The file is owner-only until the rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask() if mode is None else mode)  # mkstemp makes owner-only files
        os.replace(tmp, path)
    except OSError as e:
        if e.errno in DISK_FULL:  # say which file and that the old one survived, not just "errno 28"
            raise OSError(e.errno, f"{os.strerror(e.errno)} while writing {path}; any previous {path.name} "
                                   "is intact: free space and re-run", str(path)) from e
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def append_durably(fd: int, text: str, path: str | Path) -> None:
    """Append `text` to the file open at `fd` (O_APPEND) and fsync it: a record that must be on disk
    before what it records happens (a ledger's charge, a budget's run). Unbuffered, so that a full disk
    raises here, naming the file, and not again from a close; the torn line it may leave is dropped by
    the next reader (drop_torn_tail)."""
    data = text.encode()
    try:
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    except OSError as e:
        if e.errno in DISK_FULL:
            raise OSError(e.errno, f"{os.strerror(e.errno)} while appending to {path}: the record was not made, "
                                   "and what it records did not happen: free space and re-run", str(path)) from e
        raise


def remove_stale_temps(directory: str | Path, name: str = "*") -> None:
    """Delete the temporaries that atomic writes of `name` in `directory` left behind when killed
    (kill -9 skips every `finally`). Call it where one writer owns the directory: at a stage's start."""
    for stale in Path(directory).glob(f".{name}.*.tmp"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def drop_torn_tail(path: str | Path) -> None:
    """An append-only record (one JSON line per entry, each fsynced before it counts) killed inside
    an append can end in a line without its newline. That entry never counted; cut it, or the next
    append would be glued to it and both be lost to a reader."""
    data = Path(path).read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
            os.fsync(f.fileno())


def write_json(path: str | Path, obj, mode: int | None = None) -> None:
    with atomic_path(path, mode) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str | Path):
    return json.loads(Path(path).read_text())


@contextmanager
def atomic_dir(path: str | Path):
    """Yield a fresh temporary directory; on success it replaces `path` as a whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent, path.name)  # a killed earlier run's half-written copy
    old = path.with_name(f".{path.name}.old")
    if old.exists() and not path.exists():  # killed between the two renames below: the last output back
        os.replace(old, path)
    shutil.rmtree(old, ignore_errors=True)  # (of the private shards, a whole copy that no clean-up sees)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        if path.exists():
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def file_stamp(path: str | Path) -> list[int]:
    """[size, mtime_ns, inode]: what moves when a file is rewritten (atomic writes rename, so a new inode),
    recorded beside a digest so that an unchanged file need not be read again (as DVC's state does)."""
    st = Path(path).stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def file_digest(path: str | Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file's bytes, read in 1 MiB blocks (shards can be large)."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()
