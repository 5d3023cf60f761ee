"""Poisson sampling (pipeline/privacy/sampling.py): the distribution the accountant assumes, exactly.

Each statistical check is run on the real sampler (must pass) and on deliberately broken samplers
(must fail), so the checks are shown to have the power to catch the bugs that matter: fixed-size
batches, the wrong size distribution, an example that is never drawn, correlated inclusion, state
that makes a resumed run draw different batches, and O(n) memory.
"""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from scipy import stats

from pipeline.privacy.sampling import BUCKET_MICRO_BATCHES, PoissonSampler, bucket_count, bucket_of, split_by_index

N, Q, STEPS, KEY = 400, 0.3, 3000, 20240611
ALPHA = 1e-3  # the fixed keys make these deterministic: a pass is a pass on every run


# -- broken samplers the checks must catch -------------------------------------------------------

class FixedSize(PoissonSampler):
    """Shuffle-and-take-q·n batches: what trainers without Poisson sampling do."""

    def batch(self, step):
        rng = np.random.default_rng([self.key, step])
        return np.sort(rng.choice(self.n, size=round(self.n * self.q), replace=False))


class PoissonSize(PoissonSampler):
    """Batch size ~ Poisson(q·n) instead of Binomial(n, q): right mean, wrong spread."""

    def batch(self, step):
        rng = np.random.default_rng([self.key, step])
        size = min(self.n, rng.poisson(self.n * self.q))
        return np.sort(rng.choice(self.n, size=size, replace=False))


class WithReplacement(PoissonSampler):
    """Indices drawn with replacement, duplicates dropped: batches too small."""

    def batch(self, step):
        rng = np.random.default_rng([self.key, step])
        return np.unique(rng.integers(0, self.n, rng.binomial(self.n, self.q)))


class LastNeverDrawn(PoissonSampler):
    """An off-by-one: the last example is never sampled."""

    def batch(self, step):
        rng = np.random.default_rng([self.key, step])
        size = rng.binomial(self.n - 1, self.q)
        return np.sort(rng.choice(self.n - 1, size=size, replace=False))


class ContiguousWindow(PoissonSampler):
    """Binomial size, uniform start, consecutive examples: right marginals, correlated inclusion."""

    def batch(self, step):
        rng = np.random.default_rng([self.key, step])
        size = rng.binomial(self.n, self.q)
        return np.sort((rng.integers(self.n) + np.arange(size)) % self.n)


class Stateful(PoissonSampler):
    """One generator advanced call by call: a resumed run would draw other batches."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rng = np.random.default_rng(self.key)

    def batch(self, step):
        return np.sort(self.rng.choice(self.n, size=self.rng.binomial(self.n, self.q), replace=False))


class Materialised(PoissonSampler):
    """A Bernoulli coin per example: exact, but O(n) memory per step."""

    def batch(self, step):
        rng = np.random.default_rng([self.key, step])
        return np.flatnonzero(rng.random(self.n) < self.q)


# -- the checks ------------------------------------------------------------------------------------

def batch_size_pvalue(sampler: PoissonSampler, steps: int = STEPS) -> float:
    """Chi-square goodness of fit of the realised batch sizes to Binomial(n, q), bins of >= 5 expected."""
    sizes = np.array([len(sampler.batch(t)) for t in range(steps)])
    expected = steps * stats.binom.pmf(np.arange(sampler.n + 1), sampler.n, sampler.q)
    observed = np.bincount(sizes, minlength=sampler.n + 1).astype(float)
    edges, acc = [0], 0.0
    for k, e in enumerate(expected):
        acc += e
        if acc >= 5:
            edges.append(k + 1)
            acc = 0.0
    edges[-1] = sampler.n + 1  # the thin right tail joins the last bin
    obs = np.add.reduceat(observed, edges[:-1])
    exp = np.add.reduceat(expected, edges[:-1])
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def inclusion_counts(sampler: PoissonSampler, steps: int = STEPS) -> np.ndarray:
    counts = np.zeros(sampler.n)
    for t in range(steps):
        counts[sampler.batch(t)] += 1
    return counts


def inclusion_pvalue(sampler: PoissonSampler, steps: int = STEPS) -> float:
    """Every example's inclusion count ~ Binomial(T, q), independently: Σ z² ~ χ²(n)."""
    counts = inclusion_counts(sampler, steps)
    mean, var = steps * sampler.q, steps * sampler.q * (1 - sampler.q)
    return float(stats.chi2.sf(((counts - mean) ** 2 / var).sum(), df=sampler.n))


def pair_pvalue(sampler: PoissonSampler, steps: int = STEPS) -> float:
    """Disjoint neighbour pairs (2i, 2i+1) are drawn together ~ Binomial(T, q²) times: independence."""
    both = np.zeros(sampler.n // 2)
    for t in range(steps):
        member = np.zeros(sampler.n + 1, dtype=bool)
        member[sampler.batch(t)] = True
        both += member[0:sampler.n - 1:2] & member[1:sampler.n:2]
    p2 = sampler.q ** 2
    z2 = (both - steps * p2) ** 2 / (steps * p2 * (1 - p2))
    return float(stats.chi2.sf(z2.sum(), df=len(both)))


def resumes_identically(cls, resume_at: int = 7, steps: int = 15) -> bool:
    first = cls(N, Q, KEY)
    straight = [first.batch(t) for t in range(steps)]
    resumed = cls(N, Q, KEY)  # a new process after a crash: starts at step `resume_at`
    return all(np.array_equal(resumed.batch(t), straight[t]) for t in range(resume_at, steps))


def peak_bytes(sampler: PoissonSampler, step: int = 0) -> int:
    tracemalloc.start()
    try:
        sampler.batch(step)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- the real sampler passes, each broken one is caught ---------------------------------------------

def test_batch_sizes_follow_binomial():
    assert batch_size_pvalue(PoissonSampler(N, Q, KEY)) > ALPHA


@pytest.mark.parametrize("broken", [FixedSize, PoissonSize, WithReplacement])
def test_batch_size_check_catches(broken):
    assert batch_size_pvalue(broken(N, Q, KEY)) < 1e-6


def test_inclusion_is_uniform_over_examples():
    counts = inclusion_counts(PoissonSampler(N, Q, KEY))
    assert counts.min() > 0
    assert inclusion_pvalue(PoissonSampler(N, Q, KEY)) > ALPHA


def test_inclusion_check_catches_an_example_never_drawn():
    assert inclusion_pvalue(LastNeverDrawn(N, Q, KEY)) < 1e-6


def test_examples_are_included_independently():
    assert pair_pvalue(PoissonSampler(N, Q, KEY)) > ALPHA


def test_independence_check_catches_correlated_inclusion():
    window = ContiguousWindow(N, Q, KEY)
    # Every example is drawn q·T times on average, as it should be...
    assert abs(inclusion_counts(window).mean() / STEPS - Q) < 0.01
    # ...but neighbours come together: inclusion is not independent.
    assert pair_pvalue(window) < 1e-6


def test_small_rate_large_n_sizes_follow_binomial():
    # The regime of real runs: q·n in the thousands, q ~ 1e-3 (Floyd's algorithm path of numpy).
    assert batch_size_pvalue(PoissonSampler(2_000_000, 1e-3, KEY), steps=1500) > ALPHA


def test_batches_are_sorted_unique_and_in_range():
    s = PoissonSampler(N, Q, KEY)
    for t in range(50):
        b = s.batch(t)
        assert b.dtype == np.int64
        assert np.all(np.diff(b) > 0)
        assert b.size == 0 or (b[0] >= 0 and b[-1] < N)


def test_q_one_takes_everyone():
    assert np.array_equal(PoissonSampler(10, 1.0, KEY).batch(3), np.arange(10))


# -- determinism and resume ------------------------------------------------------------------------

def test_deterministic_from_key_and_step_and_resumes_mid_sequence():
    assert resumes_identically(PoissonSampler)
    s = PoissonSampler(N, Q, KEY)
    assert not np.array_equal(s.batch(0), s.batch(1))
    assert not np.array_equal(s.batch(0), PoissonSampler(N, Q, KEY + 1).batch(0))
    # Every bit of the key counts: keys alike in their low 32 bits draw other batches (a sampler seeded
    # from 32 of them would be one of 2^32 searchable sequences).
    for key in (KEY + (1 << 32), KEY + (1 << 62)):
        assert not np.array_equal(s.batch(0), PoissonSampler(N, Q, key).batch(0)), hex(key)


def test_resume_check_catches_a_stateful_sampler():
    assert not resumes_identically(Stateful)


def test_same_batches_in_another_process():
    code = ("from pipeline.privacy.sampling import PoissonSampler as P; "
            f"print(P({N}, {Q}, {KEY}).batch(11).tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout
    assert eval(out) == PoissonSampler(N, Q, KEY).batch(11).tolist()


# -- memory: O(|B|), not O(n) --------------------------------------------------------------------

def _within_batch_budget(sampler: PoissonSampler) -> bool:
    expected = sampler.n * sampler.q
    return peak_bytes(sampler) < 64 * expected + (1 << 20)


def test_memory_grows_with_the_batch_not_the_dataset():
    assert _within_batch_budget(PoissonSampler(500_000_000, 20_000 / 500_000_000, KEY))


def test_memory_check_catches_a_materialised_draw():
    assert not _within_batch_budget(Materialised(10_000_000, 1e-3, KEY))


# -- splitting across ranks and micro-batches --------------------------------------------------------

@pytest.mark.parametrize("size, physical, world", [(0, 4, 3), (1, 4, 3), (10, 4, 1), (37, 5, 4), (64, 8, 8)])
def test_split_covers_batch_disjointly_with_equal_chunk_counts(size, physical, world):
    batch = np.sort(np.random.default_rng(size).choice(1000, size, replace=False))
    per_rank = [PoissonSampler.split(batch, physical, r, world) for r in range(world)]
    assert len({len(chunks) for chunks in per_rank}) == 1  # ranks stay in lock step
    flat = np.concatenate([c for chunks in per_rank for c in chunks] or [np.array([], dtype=int)])
    assert sorted(flat.tolist()) == batch.tolist()
    assert all(len(c) <= physical for chunks in per_rank for c in chunks)
    if world == 1:
        assert sum(1 for c in per_rank[0] if len(c)) == -(-size // physical)


@pytest.mark.parametrize("n, expected, physical, world", [(1000, 0, 4, 3), (1000, 1, 4, 3), (1000, 300, 4, 1),
                                                          (1000, 300, 5, 4), (100_000, 9_000, 16, 2), (1000, 64, 8, 8)])
def test_split_by_index_covers_the_batch_disjointly_in_micro_batches(n, expected, physical, world):
    batch = PoissonSampler(n, max(expected, 1) / n, KEY).batch(0)[:expected or None]
    per_rank = [split_by_index(batch, n, max(expected, 1), physical, r, world) for r in range(world)]
    flat = np.concatenate([c for chunks in per_rank for c in chunks] or [np.array([], dtype=int)])
    assert sorted(flat.tolist()) == list(range(len(batch)))
    assert all(0 < len(c) <= physical for chunks in per_rank for c in chunks)
    buckets = bucket_count(max(expected, 1), physical, world)
    assert buckets % world == 0 and max(expected, 1) / buckets <= BUCKET_MICRO_BATCHES * physical
    if expected > 1000:  # ranks share the work evenly (the buckets' Binomial spread aside)
        assert max(sum(map(len, chunks)) for chunks in per_rank) < 1.1 * len(batch) / world


@pytest.mark.parametrize("physical, world", [(3, 1), (8, 2), (16, 1)])
def test_no_micro_batch_holds_one_example_unless_its_bucket_does(physical, world):
    """Dynamo specialises a batch of one (a third compiled graph): a bucket's remainder of one shares its
    last full micro-batch, in two halves, each of at least two examples and at most a full one."""
    n, expected = 20_000, 60 * physical
    remainders = set()
    for step in range(40):
        batch = PoissonSampler(n, expected / n, KEY).batch(step)
        buckets = bucket_count(expected, physical, world)
        counts = np.bincount(bucket_of(batch, n, buckets), minlength=buckets)
        remainders |= {int(c % physical) for c in counts if c > physical}
        sizes = [len(p) for r in range(world) for p in split_by_index(batch, n, expected, physical, r, world)]
        assert all(2 <= size <= physical for size in sizes) or 1 in counts
    assert 1 in remainders  # the case arose


def test_the_bucket_count_does_not_follow_the_rounding_of_n_times_q():
    """dp_step reads the expected batch size back as n·q, which is above it in its last bit for about a
    quarter of n (16,000 as 16,000.000000000002): neither more buckets nor other ones for n ± 1."""
    expected, physical = 16_000, 250  # 4 buckets' worth of micro-batches on one rank
    above = [n for n in range(10**6, 10**6 + 200) if n * (expected / n) > expected]
    assert above  # the case arises
    assert {bucket_count(n * (expected / n), physical, w) for n in above for w in (1, 2, 4)} == {4}
    assert bucket_count(expected + 1, physical, 1) == 5


def positional(indices, n, expected, physical, rank=0, world_size=1):
    """The split by place in the batch (every micro-batch after the example shifts when it leaves)."""
    return PoissonSampler.split(np.arange(len(indices)), physical, rank, world_size)


def engine_share(indices, n, expected, physical, rank=0, world_size=1):
    """The engine's own split of a step's batch (privacy/engine.py), from a sampler of that n and rate: the
    expected size it cuts buckets by must be the public n·q, never the batch's realised (private) size."""
    from pipeline.distributed import World
    from pipeline.privacy.engine import micro_batches

    sampler = PoissonSampler(n, expected / n, KEY)
    return list(micro_batches(indices, sampler, "per_sample", physical, World(rank, world_size)))


@pytest.mark.parametrize("split, locality", [(split_by_index, True), (engine_share, True), (positional, False)])
@pytest.mark.parametrize("world", [1, 2])
def test_a_neighbour_regroups_its_own_bucket_and_no_other(split, locality, world):
    """Removing one example leaves every micro-batch outside its bucket the same examples, on every rank,
    so the fp32 rounding of those micro-batches' sums is unchanged (tests/test_sum_rounding.py); the
    split by place regroups every later micro-batch."""
    n, expected, physical = 50_000, 4_000, 16
    buckets = bucket_count(expected, physical, world)
    assert buckets >= 16  # enough buckets that locality means something
    # A Poisson batch, and one of 4,097 = 16·16·16 + 1 examples: its neighbour of 4,096 sits on the edge
    # where a bucket count taken from the realised size (private) would change for every bucket.
    on_the_edge = np.sort(np.random.default_rng(0).choice(n, 16 * 16 * physical + 1, replace=False))
    local = []
    for batch in (PoissonSampler(n, expected / n, KEY).batch(3), on_the_edge):
        for x in batch[[0, len(batch) // 3, -1]]:
            neighbour = batch[batch != x]
            for rank in range(world):
                parts = {tuple(batch[p]) for p in split(batch, n, expected, physical, rank, world)}
                others = {tuple(neighbour[p]) for p in split(neighbour, n, expected, physical, rank, world)}
                moved = {i for part in parts ^ others for i in part}
                local.append(all(bucket_of(i, n, buckets) == bucket_of(x, n, buckets) for i in moved))
    assert all(local) == locality


def test_split_by_index_refuses_what_is_not_a_sorted_sample_of_the_range():
    for bad in (np.array([3, 1]), np.array([1, 1]), np.array([-1, 2]), np.array([2, 10])):
        with pytest.raises(ValueError, match=r"increasing indices in range\(10\)"):
            split_by_index(bad, 10, 2, 4)


# -- bad arguments -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, match", [((0, 0.1, 1), "at least one example"), ((10, 0.0, 1), r"\(0, 1\]"),
                                         ((10, 1.5, 1), "expected batch size larger"), ((10, 0.1, -1), "non-negative")])
def test_rejects_bad_parameters(args, match):
    with pytest.raises(ValueError, match=match):
        PoissonSampler(*args)


def test_rejects_bad_step_and_split_arguments():
    with pytest.raises(ValueError, match="step"):
        PoissonSampler(10, 0.5, 1).batch(-1)
    with pytest.raises(ValueError, match="rank"):
        PoissonSampler.split(np.arange(4), 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="physical"):
        PoissonSampler.split(np.arange(4), 0)
