"""splitmix64 (Steele, Lea & Flood 2014): the one 64-bit mixer the project uses.

`mix64` is its finaliser on a Python int; `mix64_np` is the same function on numpy uint64
arrays, where wrapping multiplication is exact.  The k-th output of the splitmix64 stream
seeded with s is mix64(s + k * GOLDEN mod 2**64).

Seeded data depends on these exact bits (the eval split in index.py, every synthetic image),
so they must never change; tests/test_synthetic.py and tests/test_shards.py pin them.
"""

from __future__ import annotations

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: the stream's increment
MASK64 = (1 << 64) - 1
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix64(z: int) -> int:
    """splitmix64 finaliser: a bijective 64-bit mixer."""
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


def mix64_np(z: np.ndarray) -> np.ndarray:
    """mix64 element-wise on uint64 values (arithmetic wraps mod 2**64, as above)."""
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):  # numpy scalars warn on the (intended) wrap-around
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
        return z ^ (z >> np.uint64(31))
