"""Bootstrap intervals of pipeline/eval/stats.py: they cover the truth at their level, and a paired
difference sees what two overlapping intervals cannot."""

import numpy as np
import pytest

from pipeline.eval.stats import accuracy_ci, difference_ci


def test_accuracy_interval_covers_the_true_accuracy_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    covered = []
    for trial in range(200):
        correct = rng.random(300) < 0.7
        lo, hi = accuracy_ci(correct, seed=trial, resamples=400)
        assert lo <= correct.mean() <= hi
        covered.append(lo <= 0.7 <= hi)
    assert 0.88 <= np.mean(covered) <= 0.99


def test_interval_narrows_with_more_test_examples():
    rng = np.random.default_rng(1)
    small, large = (accuracy_ci(rng.random(n) < 0.5) for n in (100, 10_000))
    assert (large[1] - large[0]) < (small[1] - small[0]) / 5


def test_paired_difference_separates_models_whose_intervals_overlap():
    rng = np.random.default_rng(2)
    a = rng.random(500) < 0.6
    b = a.copy()
    b[np.flatnonzero(a)[:20]] = False  # b is a, wrong on 20 more examples: 4 points worse
    ci_a, ci_b = accuracy_ci(a), accuracy_ci(b)
    assert ci_b[1] > ci_a[0]  # the separate intervals overlap...
    d = difference_ci(a, b)
    assert d["diff"] == pytest.approx(0.04) and d["ci"][0] > 0  # ...the paired one excludes 0
    same = difference_ci(a, a)
    assert same == {"diff": 0.0, "ci": [0.0, 0.0]}


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="same test examples"):
        difference_ci(np.ones(3, bool), np.ones(4, bool))
    with pytest.raises(ValueError, match="at least one test example"):
        accuracy_ci(np.array([], bool))


def test_seed_rows_widen_the_interval_when_seeds_disagree():
    """Three training seeds whose accuracies differ by 10 points: the two-level bootstrap's interval
    must cover that spread, where pooling the rows as one long test set would hide it."""
    rng = np.random.default_rng(3)
    rows = np.stack([rng.random(400) < p for p in (0.6, 0.7, 0.8)])
    lo, hi = accuracy_ci(rows)
    pooled_lo, pooled_hi = accuracy_ci(rows.reshape(-1))
    assert lo <= rows.mean() <= hi
    assert (hi - lo) > 1.5 * (pooled_hi - pooled_lo)
    agreeing = np.stack([rows[1]] * 3)  # identical seeds: no seed variation to add
    assert accuracy_ci(agreeing) == accuracy_ci(rows[1])


def test_seed_rows_pair_by_seed_and_against_a_single_row():
    rng = np.random.default_rng(4)
    a = rng.random((3, 500)) < 0.7
    b = a.copy()
    b[:, :40] = False
    d = difference_ci(a, b)
    assert d["diff"] == pytest.approx(a[:, :40].mean() * 40 / 500) and d["ci"][0] > 0
    single = difference_ci(a, a[0])  # e.g. the untrained encoder: one row, against each seed
    assert single["diff"] == pytest.approx(a.mean() - a[0].mean())
    with pytest.raises(ValueError, match="examples"):
        accuracy_ci(np.ones((2, 3, 4), bool))
