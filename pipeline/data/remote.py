"""Where shard bytes live: local files or any fsspec URL (http(s), s3, memory, ...).

Local files are read with os.pread (no shared file offset, so threads and forked workers may share
one descriptor); everything else through fsspec's stateless ranged reads. A batch of ranges (one
sampled micro-batch) is read as few, concurrent requests: ranges close together in a shard become one
request, and the requests of a batch are in flight together, so a far object store's latency is paid
about once per batch rather than once per example.
"""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import fsspec
from fsspec.asyn import AsyncFileSystem

from pipeline.errors import InputError

# Errors worth retrying: the network, not the data (a missing file is not retried).
try:
    from aiohttp import ClientError as _HttpError  # fsspec's http errors (5xx, dropped connections)
except ImportError:  # pragma: no cover - aiohttp comes with fsspec[http]
    _HttpError = OSError
TRANSIENT = (OSError, TimeoutError, _HttpError)

# Ranges of one shard at most this far apart are read as one request: reading through 64 KiB costs
# well under a millisecond of bandwidth, one more request a round trip (~20 ms to an object store).
MAX_GAP = 64 << 10
# Requests in flight at once per process: at ~20 ms each, a micro-batch of 256 scattered examples
# takes about three round trips. 100 is also the connection pool of aiohttp (fsspec's http client),
# beyond which requests would only queue; object stores serve thousands of GETs/s per client.
MAX_CONCURRENCY = 100


class ShardReadError(InputError, RuntimeError):
    """A shard could not be read as the index says: unreachable, or not the bytes it was indexed from."""


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def canonical(url: str) -> str:
    """Absolute local path, or the URL as given."""
    return str(Path(local_path(url)).resolve()) if is_local(url) else url


# A stalled connection is given up on and retried, not waited on: aiohttp (fsspec's http client) waits
# 300 s for a whole answer and forever for its next byte, and `retry`'s attempts of that would outlast
# NCCL's 10-minute watchdog, which kills the other ranks with an error that names no shard.
CONNECT_TIMEOUT_S = 30
READ_TIMEOUT_S = 60  # the longest silence within one answer, not its whole length


def storage_options(protocol: str) -> dict:
    """The connect and read timeouts, in each client's own terms."""
    if protocol in ("http", "https"):
        import aiohttp

        return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                                                   sock_read=READ_TIMEOUT_S)}}
    if protocol in ("s3", "s3a"):
        return {"config_kwargs": {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S}}
    return {}


def filesystem(url: str):
    """(fsspec filesystem, path) with a clear error when the protocol's package is missing."""
    try:
        return fsspec.core.url_to_fs(url, **storage_options(url.split("://", 1)[0] if "://" in url else "file"))
    except ImportError as e:
        protocol = url.split("://", 1)[0]
        extra = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}.get(protocol, str(e))
        raise ShardReadError(f"{url}: the {protocol}:// protocol needs the package {extra} "
                             f"(.venv/bin/pip install -c constraints.txt {extra})") from None


BACKOFF_S = 0.5  # first retry's mean wait; doubles each time


def backoff(attempt: int) -> None:
    time.sleep(BACKOFF_S * 2 ** attempt * (0.5 + random.random()))  # jitter: retries do not march in step


PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def transient(e: BaseException) -> bool:
    """Worth retrying (see TRANSIENT): not a missing or forbidden file, nor an HTTP answer that a retry
    gets again (403 from an expired credential, 416); a timeout (408), throttling (429) or 5xx is."""
    status = getattr(e, "status", None)  # aiohttp's ClientResponseError
    if isinstance(e, PERMANENT) or (isinstance(status, int) and status < 500 and status not in (408, 425, 429)):
        return False
    return isinstance(e, TRANSIENT)


def retry(fn, *, attempts: int = 4, retry_on=TRANSIENT):
    """fn() with exponential backoff on transient errors; the last error is raised."""
    for attempt in range(attempts - 1):
        try:
            return fn()
        except retry_on as e:
            if not transient(e):
                raise
            backoff(attempt)
    return fn()


@dataclass(eq=False)
class Span:
    """One request: bytes [start, end) of a shard, serving the requests at `positions`."""
    shard_id: int
    start: int
    end: int
    positions: list[int]


def coalesce(requests: list[tuple[int, int, int]], max_gap: int = MAX_GAP) -> list[Span]:
    """The (shard_id, start, end) requests as few spans as ranges at most `max_gap` apart allow."""
    spans: list[Span] = []
    for k in sorted(range(len(requests)), key=requests.__getitem__):
        shard_id, start, end = requests[k]
        last = spans[-1] if spans else None
        if last and last.shard_id == shard_id and start <= last.end + max_gap:
            last.end = max(last.end, end)
            last.positions.append(k)
        else:
            spans.append(Span(shard_id, start, end, [k]))
    return spans


# Local shards a reader holds open at once: one descriptor per shard touched ran past the usual limit of
# 1,024 open files at 23k shards, in each process and loader worker.
MAX_OPEN = 64


class RangeReader:
    """Byte ranges of many shards, opened lazily, the MAX_OPEN most recently read of them kept open."""

    def __init__(self, urls: list[str], attempts: int = 4, max_gap: int = MAX_GAP):
        self.urls, self.attempts, self.max_gap = urls, attempts, max_gap
        self._fds: dict[int, int] = {}
        self._remote: dict[int, tuple] = {}
        self._pid = os.getpid()

    def read(self, shard_id: int, start: int, end: int) -> bytes:
        return self.read_many([(shard_id, start, end)])[0]

    def read_many(self, requests: list[tuple[int, int, int]]) -> list[bytes]:
        """The bytes of each (shard_id, start, end), in order: close ranges are read as one request,
        remote requests concurrently, and a failed one is retried on its own."""
        if os.getpid() != self._pid:  # a forked worker: fsspec clients do not survive a fork
            self._remote, self._pid = {}, os.getpid()
        spans = coalesce(requests, self.max_gap)
        remote = [s for s in spans if not is_local(self.urls[s.shard_id])]
        blobs = self._fetch_retrying(remote)
        out: list[bytes] = [b""] * len(requests)
        for span in spans:
            blob = blobs[span] if span in blobs else self._pread(span)
            self._check_length(span, blob)
            for k in span.positions:
                _, start, end = requests[k]
                out[k] = blob[start - span.start:end - span.start]
        return out

    def _pread(self, span: Span) -> bytes:
        fd = self._fds.pop(span.shard_id, None)
        if fd is None:
            url = self.urls[span.shard_id]
            try:
                fd = os.open(local_path(url), os.O_RDONLY)
            except FileNotFoundError:
                raise ShardReadError(f"shard {url} is missing: re-run the shards stage") from None
            if len(self._fds) >= MAX_OPEN:  # the least recently read goes
                os.close(self._fds.pop(next(iter(self._fds))))
        self._fds[span.shard_id] = fd  # the most recently read last
        return os.pread(fd, span.end - span.start, span.start)

    def _fetch_retrying(self, spans: list[Span]) -> dict[Span, bytes]:
        """Each span's bytes; after a transient error only the spans that failed are asked for again."""
        got: dict[Span, bytes] = {}
        pending = spans
        for attempt in range(self.attempts):
            if attempt:
                backoff(attempt - 1)
            failed = []
            for span, result in zip(pending, self._fetch(pending)):
                if isinstance(result, BaseException):
                    failed.append((span, result))
                else:
                    got[span] = result
            pending = [span for span, _ in failed]
            if not failed or not all(transient(e) for _, e in failed):
                break
        if failed:
            span, e = next(((s, e) for s, e in failed if not transient(e)), failed[0])
            raise ShardReadError(f"cannot read bytes {span.start}-{span.end} of {self.urls[span.shard_id]}: "
                                 f"{type(e).__name__}: {e}") from e
        return got

    def _fetch(self, spans: list[Span]) -> list:
        """One request per span, at most MAX_CONCURRENCY in flight; each result is bytes or the error."""
        by_fs: dict = {}
        for k, span in enumerate(spans):
            fs, path = self._filesystem(span.shard_id)
            by_fs.setdefault(fs, []).append((k, path, span))
        out: list = [None] * len(spans)
        for fs, group in by_fs.items():
            ks, paths, group_spans = zip(*group)
            starts, ends = [s.start for s in group_spans], [s.end for s in group_spans]
            if isinstance(fs, AsyncFileSystem):  # http, s3, gcs...: all on fsspec's event loop
                results = fs.cat_ranges(list(paths), starts, ends, on_error="return", batch_size=MAX_CONCURRENCY)
            else:
                with ThreadPoolExecutor(min(MAX_CONCURRENCY, len(paths))) as pool:
                    results = list(pool.map(lambda p, s, e: _cat_or_error(fs, p, s, e), paths, starts, ends))
            for k, result in zip(ks, results):
                out[k] = result
        return out

    def _filesystem(self, shard_id: int):
        if shard_id not in self._remote:
            self._remote[shard_id] = filesystem(self.urls[shard_id])
        return self._remote[shard_id]

    def _check_length(self, span: Span, data: bytes) -> None:
        if len(data) != span.end - span.start:
            hint = (" (the server ignores HTTP Range requests, which random access needs)"
                    if len(data) > span.end - span.start else " (the shard is shorter than the index says)")
            raise ShardReadError(f"asked {self.urls[span.shard_id]} for bytes {span.start}-{span.end}, "
                                 f"got {len(data)} bytes{hint}")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._remote.clear()

    def __getstate__(self):  # worker processes open their own handles
        return {"urls": self.urls, "attempts": self.attempts, "max_gap": self.max_gap}

    def __setstate__(self, state):
        self.__init__(**state)


def _cat_or_error(fs, path: str, start: int, end: int):
    try:
        return fs.cat_file(path, start=start, end=end)
    except Exception as e:  # noqa: BLE001 - handed back to be retried or reported with its range
        return e


# What a store says of an object's content version (HTTP's and S3's ETag, GCS's generation): the tags
# the index keeps, to tell before training that a shard was rewritten in place. Times are not among them:
# a copy, or a re-upload of the same bytes, moves them.
VERSION_TAGS = ("ETag", "etag", "generation")


def fingerprint(url: str) -> dict:
    """Size and, where the store has one, a version tag: enough to tell that a shard changed."""
    fs, path = filesystem(url)
    info = fs.info(path)
    out = {"size": info.get("size")}
    for key in ("mtime", *VERSION_TAGS, "LastModified"):
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
