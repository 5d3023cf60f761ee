"""Poisson sampling for DP-SGD: every example joins step t's batch independently with probability q.

Drawn as |B_t| ~ Binomial(n, q) followed by a uniform subset of that size, which is exactly the same
distribution (given its size, a Poisson sample is a uniform subset). The subset comes from numpy's
Floyd's-algorithm path of `choice(replace=False)`, so a draw costs O(|B_t|) time and memory, not
O(n): about 15 ms and a few MB at n = 233M, q·n = 98,304 (benchmarks/sampling.py). That path is
numpy's for q below about 1/20 only; above it numpy permutes all n (8n bytes, 1.9 GB at 233M), a
rate no recipe here comes near (DP-Cap's 1.3M of 233M is q = 0.0056).

Deterministic from (key, t) alone: a resumed run, or any data-parallel rank, redraws the same batch
without replaying earlier steps. The key must stay secret: privacy amplification by sampling
assumes nobody knows who was sampled.

Then the batch is cut into each rank's micro-batches: a per-example sum by index range
(`split_by_index`), so that one example in or out regroups only its own range; a per-batch loss by
place (`PoissonSampler.split`).
"""

from __future__ import annotations

import math

import numpy as np


class PoissonSampler:
    name = "poisson"

    def __init__(self, n: int, sample_rate: float, key: int):
        if n < 1:
            raise ValueError(f"Poisson sampling needs at least one example, got n={n}")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample rate q must be in (0, 1], got {sample_rate} "
                             f"(is the expected batch size larger than the {n} usable examples?)")
        if key < 0:
            raise ValueError(f"sampling key must be a non-negative integer, got {key}")
        self.n, self.q, self.key = int(n), float(sample_rate), int(key)

    def batch(self, step: int) -> np.ndarray:
        """Sorted example indices (int64) of logical batch `step`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng([self.key, int(step)])
        size = rng.binomial(self.n, self.q)
        # shuffle=False: the order is discarded by the sort anyway.
        return np.sort(rng.choice(self.n, size=size, replace=False, shuffle=False).astype(np.int64, copy=False))

    @staticmethod
    def split(indices: np.ndarray, physical_batch_size: int, rank: int = 0, world_size: int = 1) -> list[np.ndarray]:
        """This rank's share of a logical batch, cut into physical micro-batches, by place in the batch.

        Every rank gets the same number of micro-batches (the last ones may be short or empty), so
        ranks that synchronise per micro-batch stay in step (Dp-CLIP's gathers); the shares are
        disjoint and cover the batch.
        """
        _check_split(physical_batch_size, rank, world_size)
        mine = indices[rank::world_size]
        largest_share = -(-len(indices) // world_size)
        chunks = -(-largest_share // physical_batch_size)
        return [mine[i * physical_batch_size:(i + 1) * physical_batch_size] for i in range(chunks)]


class FixedBatch:
    """A sampler that gives `indices` at every step, out of range(n), each example expected (q = 1): two
    neighbours given the same n are cut into the same buckets (`split_by_index`)."""

    def __init__(self, indices: np.ndarray, n: int | None = None):
        self.indices, self.n, self.q = indices, len(indices) if n is None else n, 1.0

    def batch(self, step: int) -> np.ndarray:
        return self.indices


# Micro-batches per bucket (expected). A per-example sum is cut by the examples' indices, not their
# places in the batch, so one example leaving regroups its own bucket only: the others' rounding is
# then that of one bucket, whatever B (docs/privacy.md, "Mixed precision"). Larger buckets waste less
# (a bucket's last micro-batch is part-filled: 3-4% more micro-batches than B/P).
BUCKET_MICRO_BATCHES = 16


def bucket_count(expected_batch_size: float, physical_batch_size: int, world_size: int) -> int:
    """Buckets of the index range: a multiple of the world size (every rank as many), each expecting
    at most BUCKET_MICRO_BATCHES micro-batches. From public settings only, so the same for neighbours."""
    per_rank = expected_batch_size / (world_size * BUCKET_MICRO_BATCHES * physical_batch_size)
    # n·q recomputes the expected batch size with a rounding of its own (4096 as 4096.000000001): not a
    # reason for twice the buckets, nor for neighbours (n ± 1) to get different ones.
    return world_size * max(1, math.ceil(per_rank - 1e-9))


def bucket_of(indices: np.ndarray, n: int, buckets: int) -> np.ndarray:
    """The bucket of each index of range(n) cut into `buckets` equal ranges (non-decreasing in the index)."""
    return np.asarray(indices, dtype=np.int64) * buckets // n


def split_by_index(indices: np.ndarray, n: int, expected_batch_size: float, physical_batch_size: int,
                   rank: int = 0, world_size: int = 1) -> list[np.ndarray]:
    """Positions in `indices` (a step's sorted sample from range(n)) that this rank sums, as micro-batches.

    The index range is cut into `bucket_count` equal buckets, dealt to the ranks in turn; each bucket's
    examples are cut in order into micro-batches of `physical_batch_size`, the last one of the bucket
    holding the rest (a rest of one shares the last full micro-batch's examples, in two halves). Which micro-batch an example joins depends on its own bucket's examples alone,
    so a neighbour (one example in or out) changes one bucket's micro-batches and no other's, on any
    rank. The shares are disjoint and cover the batch; ranks may get different numbers of micro-batches.
    """
    _check_split(physical_batch_size, rank, world_size)
    indices = np.asarray(indices, dtype=np.int64)
    if len(indices) and (indices[0] < 0 or indices[-1] >= n or np.any(indices[1:] <= indices[:-1])):
        raise ValueError(f"a batch to split must be increasing indices in range({n})")
    buckets = bucket_count(expected_batch_size, physical_batch_size, world_size)
    of = bucket_of(indices, n, buckets)  # non-decreasing: the indices are sorted
    edges = np.searchsorted(of, np.arange(buckets + 1))
    parts = []
    for b in range(rank, buckets, world_size):
        start, stop = int(edges[b]), int(edges[b + 1])
        # Full micro-batches and one remainder, as the compiled step expects (compiled_records.py: one
        # graph for full micro-batches, one dynamic in the batch for every smaller size).
        cut = list(range(start, stop, physical_batch_size)) + [stop]
        if stop - start > physical_batch_size >= 3 and (stop - start) % physical_batch_size == 1:
            # A remainder of one example: Dynamo specialises size 1 (a third graph, compiled again in each
            # run), so the last full micro-batch and that example are cut into two halves instead.
            cut[-2] = cut[-3] + (physical_batch_size + 1) // 2
        parts += [np.arange(first, last) for first, last in zip(cut, cut[1:])]
    return parts


def _check_split(physical_batch_size: int, rank: int, world_size: int) -> None:
    if physical_batch_size < 1:
        raise ValueError(f"physical batch size must be >= 1, got {physical_batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
