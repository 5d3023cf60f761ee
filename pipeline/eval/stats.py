"""Confidence intervals for accuracies on a finite test set, over training seeds.

A test set of a few hundred examples moves an accuracy by several points by chance alone, so every
accuracy in metrics.json carries a 95% percentile-bootstrap interval over the test examples, and
every comparison between two models a paired one: both models are scored on the same resampled
examples, which removes the variation they share (the difficulty of the draw) from their difference.

Outcomes may be one row per training seed, (seeds, examples): the accuracy is then the mean over
seeds, and the bootstrap resamples the seeds too (a two-level bootstrap), so the interval also
covers how much a re-run with another seed would move it.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95


def _as_rows(values) -> np.ndarray:
    """(examples,) or (seeds, examples) -> (seeds, examples)."""
    values = np.asarray(values)
    if values.ndim not in (1, 2):
        raise ValueError(f"outcomes must be (examples,) or (seeds, examples), got shape {values.shape}")
    return values[None] if values.ndim == 1 else values


def _resampled_means(values: np.ndarray, seed: int, resamples: int, chunk: int = 100) -> np.ndarray:
    """The mean of `values` (seeds, n) over `resamples` draws of its examples with replacement (the
    same draws for every model of a set, seeded by its size) and, with several seeds, of its seeds,
    made `chunk` at a time to bound memory."""
    s, n = values.shape
    rng, seed_rng = np.random.default_rng([seed, n]), np.random.default_rng([seed, n, s])
    out = []
    for i in range(0, resamples, chunk):
        k = min(chunk, resamples - i)
        cols = rng.integers(0, n, size=(k, n))
        rows = seed_rng.integers(0, s, size=(k, s)) if s > 1 else np.zeros((k, 1), np.int64)
        out.append(np.stack([values[r][:, c].mean() for r, c in zip(rows, cols)]))
    return np.concatenate(out)


def _interval(values: np.ndarray, level: float) -> list[float]:
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


def accuracy_ci(correct, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL) -> list[float]:
    """[lo, hi] of the accuracy of per-example outcomes `correct` (bool; one row per seed if 2-D)."""
    correct = _as_rows(correct).astype(bool)
    if correct.size == 0:
        raise ValueError("an accuracy needs at least one test example")
    return _interval(_resampled_means(correct, seed, resamples), level)


def difference_ci(correct_a, correct_b, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL) -> dict:
    """Accuracy of a minus accuracy of b on the same test examples: {"diff", "ci": [lo, hi]}.

    With one row per seed, a's and b's rows are paired by seed (seed s of each model), the way a
    sweep trains them."""
    a, b = _as_rows(correct_a).astype(bool), _as_rows(correct_b).astype(bool)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"paired outcomes need the same test examples, got {a.shape} and {b.shape}")
    if a.shape[0] != b.shape[0]:  # a model with seeds against one without: the single row against each seed
        if min(a.shape[0], b.shape[0]) != 1:
            raise ValueError(f"paired outcomes need the same seeds, got {a.shape[0]} and {b.shape[0]} rows")
        a, b = (a, np.broadcast_to(b, a.shape)) if b.shape[0] == 1 else (np.broadcast_to(a, b.shape), b)
    delta = a.astype(np.int8) - b.astype(np.int8)
    return {"diff": float(delta.mean()), "ci": _interval(_resampled_means(delta, seed, resamples), level)}
