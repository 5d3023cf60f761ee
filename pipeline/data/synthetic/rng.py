"""Seeded randomness for program structure, frame times and mixing.

Pure Python on top of splitmix64 (pipeline/data/splitmix.py), so a program's
choices are stable across numpy and torch versions and no global RNG state is
touched.  `_np_uniform` is the same stream vectorised in numpy, for the noise
texture bank.
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.data.splitmix import GOLDEN, MASK64, mix64, mix64_np

# Tags appended to the key of each stream, so the program, time and mix streams
# of one (base_seed, program_id) never coincide.
_TAG_PROGRAM, _TAG_TIME, _TAG_MIX = 0x5EED_0001, 0x5EED_0002, 0x5EED_0003


def _hash_ints(*values: int) -> int:
    """Order-sensitive 64-bit hash of a tuple of (possibly negative) ints."""
    h = 0x6A09E667F3BCC909
    for v in values:
        h = mix64(((h ^ (int(v) & MASK64)) + GOLDEN) & MASK64)
    return h


class _Rng:
    """Tiny splitmix64 generator keyed by a tuple of ints (no global state)."""

    def __init__(self, *key: int):
        self.state = _hash_ints(*key)

    def random(self) -> float:
        self.state = (self.state + GOLDEN) & MASK64
        return (mix64(self.state) >> 11) * (1.0 / (1 << 53))

    def uniform(self, lo: float, hi: float) -> float:
        return lo + (hi - lo) * self.random()

    def loguniform(self, lo: float, hi: float) -> float:
        return math.exp(self.uniform(math.log(lo), math.log(hi)))

    def integers(self, lo: int, hi: int) -> int:
        """Uniform integer in [lo, hi] (inclusive)."""
        return lo + min(int(self.random() * (hi - lo + 1)), hi - lo)

    def chance(self, p: float) -> bool:
        return self.random() < p

    def sign(self) -> float:
        return 1.0 if self.random() < 0.5 else -1.0

    def choice(self, options, weights=None):
        if weights is None:
            return options[self.integers(0, len(options) - 1)]
        u = self.random() * sum(weights)
        for option, w in zip(options, weights):
            u -= w
            if u < 0:
                return option
        return options[-1]

    def normal(self) -> float:
        u1 = max(self.random(), 1e-300)
        # Box-Muller; 2.0 * math.pi * u is TAU * u bit for bit, without importing torch here
        return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * self.random())

    def gamma(self, alpha: float) -> float:
        """Marsaglia-Tsang; the alpha < 1 case uses the boost U**(1/alpha)."""
        if alpha < 1.0:
            return self.gamma(alpha + 1.0) * max(self.random(), 1e-300) ** (1.0 / alpha)
        d = alpha - 1.0 / 3.0
        c = 1.0 / math.sqrt(9.0 * d)
        while True:
            x = self.normal()
            v = (1.0 + c * x) ** 3
            if v <= 0:
                continue
            u = max(self.random(), 1e-300)
            if math.log(u) < 0.5 * x * x + d - d * v + d * math.log(v):
                return d * v

    def log_gamma(self, alpha: float) -> float:
        """log of `gamma(alpha)`'s draw, from the same random numbers: below alpha = 1 its boost
        U**(1/alpha) underflows to 0 (at alpha = 0.001, one U in five), where its log does not."""
        if alpha < 1.0:
            boosted = self.gamma(alpha + 1.0)
            return math.log(boosted) + math.log(max(self.random(), 1e-300)) / alpha
        return math.log(self.gamma(alpha))

    def dirichlet(self, k: int, alpha: float) -> list[float]:
        if alpha >= 1.0:
            g = [self.gamma(alpha) for _ in range(k)]
        else:  # normalised in log space: every draw may underflow, and 0/0 is no weight
            logs = [self.log_gamma(alpha) for _ in range(k)]
            g = [math.exp(x - max(logs)) for x in logs]
        s = sum(g)
        return [x / s for x in g]


def _np_uniform(n: int, seed: int) -> np.ndarray:
    """splitmix64 over a counter in numpy uint64 (wrapping maths, exact)."""
    z = (np.arange(n, dtype=np.uint64) + np.uint64(seed)) * np.uint64(GOLDEN)
    return (mix64_np(z) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
