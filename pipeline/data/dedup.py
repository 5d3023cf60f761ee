"""Duplicate rows across every shard of a build, found with memory flat in n.

Each candidate row's 64-bit hash and position go to one of 2^b bucket files on disk, chosen by the
hash's top bits, so equal hashes share a bucket; each bucket is then sorted alone. Rows reach a
bucket in the order of the build, and a stable sort keeps that order among equal hashes, so the first
row of every hash is kept, as one sort of the whole column would. A hash repeated within a piece is
marked there, so a bucket holds at most one row of a hash per piece: an image copied a million times
(a crawl's placeholder) does not fill one bucket with it. What is held whole is one bit per
row (29 MB at 233M rows) and one bucket at a time, where the sort of the whole column held about 52
bytes a row (12 GB; `python -m benchmarks.dedup_memory`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import numpy as np

BUCKET_ROWS = 1 << 20  # rows a bucket holds on average: 16 MB of (hash, position) pairs, ~40 MB to sort


class RowBits:
    """One bit per row of a build."""

    def __init__(self, rows: int):
        self.bits = np.zeros((rows + 7) // 8, dtype=np.uint8)

    def set(self, positions: np.ndarray) -> None:
        positions = positions.astype(np.int64)
        np.bitwise_or.at(self.bits, positions >> 3, (1 << (positions & 7)).astype(np.uint8))

    def get(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) as booleans."""
        first = start >> 3
        window = np.unpackbits(self.bits[first:(stop + 7) >> 3], bitorder="little")
        return window[start - 8 * first:stop - 8 * first].astype(bool)


def duplicate_mask(hashes: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """True for every usable row whose hash (of its key, or of its content) equals an earlier usable
    row's (the first is kept), in one sort: for what fits in memory (and as the reference).

    64-bit hashes: a collision between different keys or contents (~n²/2⁶⁵) only drops one more
    example, and the n counted is still what training reads.
    """
    dup = np.zeros(len(hashes), dtype=bool)
    idx = np.flatnonzero(usable)
    order = np.argsort(hashes[idx], kind="stable")
    ranked = hashes[idx][order]
    dup[idx[order[1:][ranked[1:] == ranked[:-1]]]] = True
    return dup


def duplicate_rows(pieces: Iterable[tuple[np.ndarray, np.ndarray]], rows: int, workdir: str | Path,
                   bucket_rows: int | None = None) -> RowBits:
    """The rows whose hash equals an earlier candidate row's, among candidates, as duplicate_mask marks
    them over the whole build. `pieces`: (uint64 hashes, candidate mask) of consecutive rows, in the
    build's order, `rows` in all; the buckets go to `workdir` (16 bytes a candidate row, removed after)."""
    bits = max(0, math.ceil(math.log2(max(1.0, rows / (bucket_rows or BUCKET_ROWS)))))
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    paths = [workdir / f"bucket-{b}.bin" for b in range(1 << bits)]
    found = RowBits(rows)
    files = [open(p, "wb") for p in paths]
    try:
        start = 0
        for hashes, candidate in pieces:
            where = np.flatnonzero(candidate)
            _, first = np.unique(hashes[where], return_index=True)  # each hash's first row in the piece
            later = np.ones(len(where), dtype=bool)
            later[first] = False
            found.set(where[later] + start)
            where = where[np.sort(first)]
            pairs = np.column_stack([hashes[where].astype(np.uint64), (where + start).astype(np.uint64)])
            bucket = pairs[:, 0] >> np.uint64(64 - bits) if bits else np.zeros(len(pairs), np.uint64)
            order = np.argsort(bucket, kind="stable")  # each bucket's rows stay in the build's order
            bounds = np.searchsorted(bucket[order], np.arange(len(files) + 1, dtype=np.uint64))
            for b in np.flatnonzero(np.diff(bounds)):
                pairs[order[bounds[b]:bounds[b + 1]]].tofile(files[b])
            start += len(hashes)
    finally:
        for f in files:
            f.close()
    for path in paths:
        pairs = np.fromfile(path, dtype=np.uint64).reshape(-1, 2)
        path.unlink()
        order = np.argsort(pairs[:, 0], kind="stable")
        ranked = pairs[order, 0]
        found.set(pairs[order[1:][ranked[1:] == ranked[:-1]], 1])
    return found
