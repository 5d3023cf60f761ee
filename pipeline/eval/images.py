"""An eval set's images, decoded on demand: memory stays flat in the set's size.

`Images` looks like the (N, S, S, 3) uint8 array the eval code used to get: `len`, `shape`, and
`images[key]` (a slice, an int array or a boolean mask) -> that batch decoded, as an ndarray.
`images.subset(indices)` is a view that decodes nothing until it is indexed.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np

Reader = Callable[[np.ndarray], np.ndarray]  # row ids of the source -> (B, *item_shape) uint8
Item = TypeVar("Item")
# Pillow lets go of the GIL while it decodes and resizes, so threads decode a batch in parallel
# (benchmarks/eval_decode.py); the features' forward passes run between batches, not beside them.
DECODE_THREADS = min(8, os.cpu_count() or 1)


class Images:
    """The rows `rows` of a source whose `read` decodes any rows asked for, one batch at a time."""

    def __init__(self, read: Reader, rows: np.ndarray, item_shape: tuple[int, ...]):
        self._read, self._rows, self.item_shape = read, rows, tuple(item_shape)

    @classmethod
    def of(cls, images: Images | np.ndarray) -> Images:
        """Wraps an in-memory (N, H, W, 3) array (small sets, tests); an `Images` stays as it is."""
        if isinstance(images, Images):
            return images
        images = np.asarray(images)
        return cls(images.__getitem__, np.arange(len(images)), images.shape[1:])

    @classmethod
    def decoded(cls, decode: Callable[[int], np.ndarray], count: int, item_shape: tuple[int, ...]) -> Images:
        """Row i is `decode(i)`, called only when a batch holding row i is asked for."""
        return cls(lambda rows: fill(decoded(decode, rows.tolist()), len(rows), item_shape), np.arange(count),
                   item_shape)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.item_shape)

    def __getitem__(self, key) -> np.ndarray:
        rows = self._rows[key]
        if rows.ndim == 0:  # one image, as an array would give
            return self._read(rows[None])[0]
        return self._read(rows)

    def subset(self, indices) -> Images:
        """A lazy view of the rows `indices` (int array or boolean mask) picks."""
        return Images(self._read, self._rows[indices], self.item_shape)


def decoded(decode: Callable[[Item], np.ndarray], items: list[Item]) -> Iterator[np.ndarray]:
    """decode(item) for each item, in order, on DECODE_THREADS threads; the first failure is raised."""
    if DECODE_THREADS == 1 or len(items) < 2:
        yield from map(decode, items)
        return
    with ThreadPoolExecutor(DECODE_THREADS) as pool:
        yield from pool.map(decode, items)


def fill(arrays: Iterable[np.ndarray], count: int, item_shape: tuple[int, ...]) -> np.ndarray:
    """The `count` arrays as one uint8 batch, copied into a single allocation as they come: np.stack
    of a list of image-sized arrays fragments glibc's heap, and RSS then creeps up batch after batch."""
    out = np.empty((count, *item_shape), np.uint8)
    for j, array in enumerate(arrays):
        out[j] = array
    return out


def concat(parts: list[Images]) -> Images:
    """One collection of the parts' rows, in order (an official split's train part, then its test part)."""
    if len(parts) == 1:
        return parts[0]
    starts = np.cumsum([0] + [len(p) for p in parts])
    item_shape = parts[0].item_shape

    def read(rows: np.ndarray) -> np.ndarray:
        owner = np.searchsorted(starts, rows, side="right") - 1
        out = np.empty((len(rows), *item_shape), np.uint8)
        for p in np.unique(owner):
            mine = owner == p
            out[mine] = parts[p][rows[mine] - starts[p]]
        return out

    return Images(read, np.arange(starts[-1]), item_shape)
