"""Confidence intervals for accuracies on a finite test set.

A test set of a few hundred examples moves an accuracy by several points by chance alone, so every
accuracy in metrics.json carries a 95% percentile-bootstrap interval over the test examples, and
every comparison between two models a paired one: both models are scored on the same resampled
examples, which removes the variation they share (the difficulty of the draw) from their difference.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95


def _resampled_means(values: np.ndarray, seed: int, resamples: int, chunk: int = 100) -> np.ndarray:
    """The mean of `values` over `resamples` draws of its examples with replacement: the same draws
    for every model of a set (seeded by the set's size), made `chunk` at a time to bound memory."""
    rng, n = np.random.default_rng([seed, values.size]), values.size
    return np.concatenate([values[rng.integers(0, n, size=(min(chunk, resamples - i), n))].mean(axis=1)
                           for i in range(0, resamples, chunk)])


def _interval(values: np.ndarray, level: float) -> list[float]:
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


def accuracy_ci(correct: np.ndarray, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL) -> list[float]:
    """[lo, hi] of the accuracy of per-example outcomes `correct` (bool)."""
    correct = np.asarray(correct, dtype=bool)
    if correct.size == 0:
        raise ValueError("an accuracy needs at least one test example")
    return _interval(_resampled_means(correct, seed, resamples), level)


def difference_ci(correct_a: np.ndarray, correct_b: np.ndarray, seed: int = 0, resamples: int = RESAMPLES,
                  level: float = LEVEL) -> dict:
    """Accuracy of a minus accuracy of b on the same test examples: {"diff", "ci": [lo, hi]}."""
    a, b = np.asarray(correct_a, dtype=bool), np.asarray(correct_b, dtype=bool)
    if a.shape != b.shape:
        raise ValueError(f"paired outcomes need the same test examples, got {a.shape} and {b.shape}")
    delta = a.astype(np.int8) - b.astype(np.int8)
    return {"diff": float(delta.mean()), "ci": _interval(_resampled_means(delta, seed, resamples), level)}
