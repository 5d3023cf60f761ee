"""The usable rows of an index in one memory-mapped file, `usable.idx` beside index.parquet.

Training reads rows through this file, not the parquet: every rank and DataLoader worker maps it
read-only, so they all share one copy in the page cache and none holds the index in its own memory
(at 233M rows: ~13 GB on disk, a few MB per process; benchmarks/index_scale.py). index.parquet stays
the form to inspect, and the source this file is derived from (index.py writes both).

Our own layout rather than an Arrow IPC file: numpy must index each column as one contiguous array
(a step's ids in one fancy-indexing call, `offsets[i]` in O(1)), and an IPC file written batch by
batch, as a 233M-row index has to be, splits every column into chunks. The layout:

    column regions, each 64-byte aligned: shard_id int32, image_ext uint8 (a code into `exts`),
    {image,txt,json}_offset int64 and {image,txt,json}_size int32 (-1 when absent),
    key_offsets int64 (rows + 1), key_bytes (UTF-8)
    footer: JSON (format, rows, where each column lies, exts, counts by status, shards, source)
    the footer's length (uint64, little-endian), MAGIC

The footer comes last, so a truncated file is told from a whole one, and so the writer can stream
the columns in and describe them at the end.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import InputError
from pipeline.io import atomic_path

USABLE_NAME = "usable.idx"
FORMAT = 1
MAGIC = b"DPFMIDX1"
TAIL = struct.Struct("<Q8s")  # footer length, MAGIC
ALIGN = 64
MEMBERS = ("image", "txt", "json")
ROW_COLUMNS = {"shard_id": "<i4", "image_ext": "u1",
               **{f"{m}_{f}": "<i8" if f == "offset" else "<i4" for m in MEMBERS for f in ("offset", "size")}}
DTYPES = {**ROW_COLUMNS, "key_offsets": "<i8", "key_bytes": "u1"}


class CorruptIndex(InputError, ValueError):
    """usable.idx is damaged: it cannot be trusted for any row."""


def _damaged(path: Path, what: str) -> CorruptIndex:
    return CorruptIndex(f"{path}: {what}. It is derived from index.parquet beside it: delete it to have it "
                        "rebuilt on the next open, or re-run the shards stage")


@dataclass
class UsableRows:
    """The usable rows of an index, as read-only arrays over the mapped file."""

    keys: Keys
    shard_id: np.ndarray              # int32
    image_ext: np.ndarray             # uint8 code into `exts`
    exts: list[str]
    offsets: dict[str, np.ndarray]    # member -> int64 byte offset of its data, -1 when absent
    sizes: dict[str, np.ndarray]      # member -> int32 size


class Keys:
    """Key of row i in O(1) from the mapped offsets and bytes. numpy bounds-checks every slice, so a
    damaged file gives an error (or a key the tar header check refuses), never a read outside the map."""

    def __init__(self, offsets: np.ndarray, data: np.ndarray, path: Path):
        self._offsets, self._data, self._path = offsets, data, path

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> str:
        i = range(len(self))[i]  # negative counts from the end; IndexError past it
        start, end = int(self._offsets[i]), int(self._offsets[i + 1])
        if not 0 <= start <= end <= len(self._data):
            raise _damaged(self._path, f"key {i} lies outside the key bytes")
        try:
            return bytes(self._data[start:end]).decode("utf-8")
        except UnicodeDecodeError:
            raise _damaged(self._path, f"key {i} is not UTF-8") from None


# -- identity of the parquet a file was derived from ---------------------------------------------------

def source_id(parquet: Path) -> dict:
    """The index.parquet's size and a digest of its footer, which records each row group's row count,
    byte sizes and column statistics: a re-written index changes it, and reading it costs no pass over
    the rows. Content, not mtime, so a copy or a DVC checkout of both files stays matched. (A hand
    edit that keeps every size and statistic goes unseen: delete usable.idx after one.)"""
    with open(parquet, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - 8))
        f.seek(max(0, size - 8 - int.from_bytes(f.read(4), "little")))
        h = hashlib.sha256()
        while block := f.read(1 << 20):
            h.update(block)
    return {"size": size, "footer_sha256": h.hexdigest()}


def derived_from(path: Path, parquet: Path) -> bool:
    """True when `path` exists, is of this format, and was derived from `parquet` as it is now."""
    if not path.exists():
        return False
    footer = read_footer(path)[0]
    return footer.get("format") == FORMAT and footer.get("source") == source_id(parquet)


@contextmanager
def build_lock(parquet: Path):
    """Ranks that find usable.idx missing at the same time: one builds it, the others wait for it."""
    with open(parquet, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: each builds a whole copy, and one rename wins
            pass
        yield


# -- writing -------------------------------------------------------------------------------------------

def _pwrite(fd: int, data, pos: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        done = os.pwrite(fd, view, pos)
        view, pos = view[done:], pos + done


class UsableWriter:
    """Fills a file of a known row count in one streaming pass: every column's region is placed up
    front, so each batch goes straight where it belongs and only one batch is ever in memory."""

    def __init__(self, fd: int, rows: int):
        self.fd, self.rows, self.written, self.key_bytes = fd, rows, 0, 0
        self.columns, pos = {}, 0
        for name, dtype, length in [*((c, d, rows) for c, d in ROW_COLUMNS.items()), ("key_offsets", "<i8", rows + 1)]:
            self.columns[name] = [pos, dtype, length]
            pos = -(-(pos + length * np.dtype(dtype).itemsize) // ALIGN) * ALIGN
        self.key_start = pos
        _pwrite(fd, np.zeros(1, "<i8"), self.columns["key_offsets"][0])  # the first key starts at byte 0
        self.finished = False

    def append(self, columns: dict[str, np.ndarray], key_offsets: np.ndarray, key_bytes) -> None:
        """One batch: every row column, and its keys as offsets (rows + 1, from any base) into key_bytes."""
        n = len(key_offsets) - 1
        if self.written + n > self.rows:
            raise ValueError(f"more than the {self.rows} rows announced")
        key_offsets = np.asarray(key_offsets, np.int64)
        ends = key_offsets[1:] - key_offsets[0] + self.key_bytes
        for name, (pos, dtype, _) in self.columns.items():
            values, row = (ends, self.written + 1) if name == "key_offsets" else (columns[name], self.written)
            _pwrite(self.fd, np.ascontiguousarray(values, dtype), pos + row * np.dtype(dtype).itemsize)
        _pwrite(self.fd, memoryview(key_bytes).cast("B")[key_offsets[0]:key_offsets[-1]],
                self.key_start + self.key_bytes)
        self.written += n
        self.key_bytes += int(key_offsets[-1] - key_offsets[0])

    def finish(self, *, exts: list[str], counts: dict, shards: list[dict], source: dict) -> None:
        if self.written != self.rows:
            raise ValueError(f"{self.written} rows written of the {self.rows} announced")
        columns = {**self.columns, "key_bytes": [self.key_start, "u1", self.key_bytes]}
        footer = json.dumps({"format": FORMAT, "rows": self.rows, "columns": columns, "exts": exts,
                             "counts": counts, "shards": shards, "source": source}, sort_keys=True).encode()
        _pwrite(self.fd, footer + TAIL.pack(len(footer), MAGIC), self.key_start + self.key_bytes)
        self.finished = True


@contextmanager
def usable_writer(path: Path, rows: int):
    """A UsableWriter into a temporary file that replaces `path` once finish() has run."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        writer = UsableWriter(f.fileno(), rows)
        yield writer
        if not writer.finished:
            raise RuntimeError(f"{path}: the writer was closed before finish()")


# -- reading -------------------------------------------------------------------------------------------

def read_footer(path: Path) -> tuple[dict, int]:
    """(footer, where it starts): a few small reads, whatever the row count."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < TAIL.size:
            raise _damaged(path, f"only {size} bytes (truncated?)")
        f.seek(size - TAIL.size)
        length, magic = TAIL.unpack(f.read(TAIL.size))
        start = size - TAIL.size - length
        if magic != MAGIC or start < 0:
            raise _damaged(path, "no end marker (truncated, or not a usable-rows file)")
        f.seek(start)
        try:
            footer = json.loads(f.read(length))
        except ValueError:
            footer = None
    if not isinstance(footer, dict):
        raise _damaged(path, "unreadable footer")
    return footer, start


def _spans(path: Path, footer: dict, data_end: int) -> dict[str, tuple[int, int]]:
    """(offset, length) of each column, checked against the row count and the file's size."""
    try:
        rows = footer["rows"]
        spans = {name: (int(offset), int(length)) for name, (offset, dtype, length) in footer["columns"].items()
                 if DTYPES[name] == dtype}
        lengths = {**dict.fromkeys(ROW_COLUMNS, rows), "key_offsets": rows + 1, "key_bytes": spans["key_bytes"][1]}
        fits = [isinstance(rows, int) and rows >= 0] + [spans[name][1] == length for name, length in lengths.items()]
        fits += [isinstance(footer[k], t) for k, t in (("exts", list), ("counts", dict), ("shards", list))]
    except (KeyError, TypeError, ValueError):
        raise _damaged(path, "unreadable footer") from None
    if not all(fits) or len(spans) != len(DTYPES):
        raise _damaged(path, "the footer does not describe the columns of its row count")
    for name, (offset, length) in spans.items():
        if length < 0 or not 0 <= offset <= data_end - length * np.dtype(DTYPES[name]).itemsize:
            raise _damaged(path, f"column {name} runs past the end of the data")
    return spans


def map_usable(path: Path) -> tuple[UsableRows, dict]:
    """The rows of `path` as read-only arrays over one shared mapping, and its footer.

    Checks all that costs no pass over the rows: each column lies inside the file with the length
    the row count gives it, and the key offsets span the key bytes exactly.
    """
    footer, data_end = read_footer(path)
    spans = _spans(path, footer, data_end)
    # Default read-ahead, not MADV_RANDOM: a step's ids are sorted and dense enough that the pages read
    # around one fault serve the next ids (from a cold page cache, steps ran 3-10x faster so).
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cols = {name: np.frombuffer(mapped, DTYPES[name], count=length, offset=offset)
            for name, (offset, length) in spans.items()}
    if cols["key_offsets"][0] != 0 or cols["key_offsets"][-1] != len(cols["key_bytes"]):
        raise _damaged(path, "the key offsets do not span the key bytes")
    rows = UsableRows(keys=Keys(cols["key_offsets"], cols["key_bytes"], path), shard_id=cols["shard_id"],
                      image_ext=cols["image_ext"], exts=footer["exts"],
                      offsets={m: cols[f"{m}_offset"] for m in MEMBERS}, sizes={m: cols[f"{m}_size"] for m in MEMBERS})
    return rows, footer
