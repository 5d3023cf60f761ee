"""Poisson sampling for DP-SGD: every example joins step t's batch independently with probability q.

Drawn as |B_t| ~ Binomial(n, q) followed by a uniform subset of that size, which is exactly the same
distribution, in O(|B_t|) memory. Deterministic from (key, t): a resumed run redraws the same batches.
The key must stay secret: privacy amplification by sampling assumes nobody knows who was sampled.
"""

from __future__ import annotations

import numpy as np


class PoissonSampler:
    name = "poisson"

    def __init__(self, n: int, sample_rate: float, key: int):
        if n < 1:
            raise ValueError(f"Poisson sampling needs at least one example, got n={n}")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample rate q must be in (0, 1], got {sample_rate} "
                             f"(is the expected batch size larger than the {n} usable examples?)")
        self.n, self.q, self.key = n, sample_rate, key

    def batch(self, step: int) -> np.ndarray:
        """Sorted example indices of logical batch `step`."""
        rng = np.random.default_rng([self.key, step])
        size = rng.binomial(self.n, self.q)
        return np.sort(rng.choice(self.n, size=size, replace=False))

    @staticmethod
    def split(indices: np.ndarray, physical_batch_size: int, rank: int = 0, world_size: int = 1) -> list[np.ndarray]:
        """This rank's share of a logical batch, cut into physical micro-batches."""
        mine = indices[rank::world_size]
        return [mine[i:i + physical_batch_size] for i in range(0, len(mine), physical_batch_size)]
