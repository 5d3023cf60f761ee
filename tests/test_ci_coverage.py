"""benchmarks/ci_coverage.py: a trial counts as covered only where its interval holds the truth it is of."""

import pytest

from benchmarks import ci_coverage
from benchmarks.ci_coverage import BASELINE, TRUTH, coverage

# One interval per trial (the trial is the seed coverage passes on), with whether it holds the truth.
ACCURACY = [([0.80, 0.90], True), ([0.0, 0.5], False), ([0.9, 1.0], False), ([TRUTH, TRUTH], True)]
DIFFERENCE = [([0.04, 0.06], True), ([0.80, 0.90], False), ([-0.1, 0.0], False), ([0.0, 0.1], True)]


def test_a_trial_counts_only_where_its_interval_holds_the_truth(monkeypatch):
    """An accuracy interval wholly below the truth misses it, as one above does; a difference's interval
    is of the gain over the baseline (TRUTH - BASELINE), and one that holds the accuracy itself misses it."""
    monkeypatch.setattr(ci_coverage, "accuracy_ci", lambda correct, seed, resamples: ACCURACY[seed][0])
    monkeypatch.setattr(ci_coverage, "difference_ci",
                        lambda a, b, seed, resamples: {"ci": DIFFERENCE[seed][0]})
    assert DIFFERENCE[0][0][0] <= TRUTH - BASELINE <= DIFFERENCE[0][0][1]
    expected = {"accuracy": sum(hit for _, hit in ACCURACY) / len(ACCURACY),
                "difference": sum(hit for _, hit in DIFFERENCE) / len(DIFFERENCE)}
    assert coverage(2, 50, 0.01, len(ACCURACY), 10) == pytest.approx(expected)  # 0.5 each


def test_with_the_test_images_dominating_the_intervals_cover_about_95_percent():
    """One seed spread by 0.2 points: the intervals are what they say, near their nominal 95% (100 trials,
    about 1 s)."""
    got = coverage(1, 270, 0.002, 100, 200)
    assert 0.85 <= got["accuracy"] <= 1.0 and 0.85 <= got["difference"] <= 1.0, got


def test_one_seed_cannot_cover_a_seed_spread_it_never_sees():
    """One seed and seeds 5 points apart on 2,000 images: the interval (about ±1.6 points) is of the test
    images alone and misses most seeds' distance from the truth; the benchmark has to show that, not count
    every interval that starts below the truth."""
    got = coverage(1, 2000, 0.05, 40, 200)
    assert got["accuracy"] < 0.5 and got["difference"] < 0.5, got
