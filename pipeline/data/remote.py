"""Where shard bytes live: local files or any fsspec URL (http(s), s3, memory, ...).

Local files are read with os.pread (no shared file offset, so threads and forked workers may share
one descriptor); everything else through fsspec's stateless ranged reads (`cat_file`).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import fsspec

# Errors worth retrying: the network, not the data (a missing file is not retried).
try:
    from aiohttp import ClientError as _HttpError  # fsspec's http errors (5xx, dropped connections)
except ImportError:  # pragma: no cover - aiohttp comes with fsspec[http]
    _HttpError = OSError
TRANSIENT = (OSError, TimeoutError, _HttpError)


class ShardReadError(RuntimeError):
    """A shard could not be read as the index says: unreachable, or not the bytes it was indexed from."""


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def canonical(url: str) -> str:
    """Absolute local path, or the URL as given."""
    return str(Path(local_path(url)).resolve()) if is_local(url) else url


def filesystem(url: str):
    """(fsspec filesystem, path) with a clear error when the protocol's package is missing."""
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        protocol = url.split("://", 1)[0]
        extra = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}.get(protocol, str(e))
        raise ShardReadError(f"{url}: the {protocol}:// protocol needs the package {extra} "
                             f"(.venv/bin/pip install -c constraints.txt {extra})") from None


BACKOFF_S = 0.5  # first retry's mean wait; doubles each time


def backoff(attempt: int) -> None:
    time.sleep(BACKOFF_S * 2 ** attempt * (0.5 + random.random()))  # jitter: retries do not march in step


def retry(fn, *, attempts: int = 4, retry_on=TRANSIENT):
    """fn() with exponential backoff on transient errors; the last error is raised."""
    for attempt in range(attempts - 1):
        try:
            return fn()
        except FileNotFoundError:
            raise
        except retry_on:
            backoff(attempt)
    return fn()


class RangeReader:
    """Byte ranges of many shards, each opened lazily once per process."""

    def __init__(self, urls: list[str], attempts: int = 4):
        self.urls, self.attempts = urls, attempts
        self._fds: dict[int, int] = {}
        self._remote: dict[int, tuple] = {}
        self._pid = os.getpid()

    def read(self, shard_id: int, start: int, end: int) -> bytes:
        if os.getpid() != self._pid:  # a forked worker: fsspec clients do not survive a fork
            self._remote, self._pid = {}, os.getpid()
        url = self.urls[shard_id]
        if is_local(url):
            fd = self._fds.get(shard_id)
            if fd is None:
                try:
                    fd = self._fds[shard_id] = os.open(local_path(url), os.O_RDONLY)
                except FileNotFoundError:
                    raise ShardReadError(f"shard {url} is missing: re-run the shards stage") from None
            data = os.pread(fd, end - start, start)
        else:
            if shard_id not in self._remote:
                self._remote[shard_id] = filesystem(url)
            fs, path = self._remote[shard_id]
            try:
                data = retry(lambda: fs.cat_file(path, start=start, end=end), attempts=self.attempts)
            except Exception as e:
                raise ShardReadError(f"cannot read bytes {start}-{end} of {url}: {type(e).__name__}: {e}") from e
        if len(data) != end - start:
            hint = (" (the server ignores HTTP Range requests, which random access needs)"
                    if len(data) > end - start else " (the shard is shorter than the index says)")
            raise ShardReadError(f"asked {url} for bytes {start}-{end}, got {len(data)} bytes{hint}")
        return data

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._remote.clear()

    def __getstate__(self):  # worker processes open their own handles
        return {"urls": self.urls, "attempts": self.attempts}

    def __setstate__(self, state):
        self.__init__(state["urls"], state["attempts"])


def fingerprint(url: str) -> dict:
    """Size and, where the store has one, a version tag: enough to tell that a shard changed."""
    fs, path = filesystem(url)
    info = fs.info(path)
    out = {"size": info.get("size")}
    for key in ("mtime", "ETag", "etag", "LastModified", "generation"):
        if key in info:
            out[key] = str(info[key])
    return out


def open_stream(url: str):
    """A sequential binary reader (http: one streaming GET instead of many range requests)."""
    if is_local(url):
        return open(local_path(url), "rb")
    fs, path = filesystem(url)
    if url.startswith(("http://", "https://")):
        return fs.open(path, "rb", block_size=0)
    return fs.open(path, "rb", block_size=8 << 20)
