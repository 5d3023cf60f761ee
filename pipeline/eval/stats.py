"""Confidence intervals for accuracies on a finite test set, over training seeds.

A test set of a few hundred examples moves an accuracy by several points by chance alone, so every
accuracy in metrics.json carries a 95% percentile-bootstrap interval over the test examples, and
every comparison between two models a paired one: both models are scored on the same resampled
examples, which removes the variation they share (the difficulty of the draw) from their difference.

Outcomes may be one row per training seed, (seeds, examples): the accuracy is then the mean over
seeds, and the bootstrap resamples the seeds too (a two-level bootstrap), so the interval also
covers how much a re-run with another seed would move it.

A probe fit on a few thousand images moves by about half a point (one s.d.) with the images it is
fit on, as much as the test images move it. Given `refits`, the outcomes of probes refit on
bootstrap resamples of the probe-train part (resample r the same for every model), each draw also
picks one refit, shared by every seed and by both models of a pair, so the interval covers that
spread too. It is centred on the full fit: a probe fit on a
resample (about 63% distinct images) is a little weaker, and the shift takes that bias out.
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


def _as_fits(refits, seeds: int, examples: int) -> np.ndarray:
    """(fits, examples) or (seeds, fits, examples) -> (seeds, fits, examples), checked against the
    full fit's outcomes."""
    refits = np.asarray(refits)
    if refits.ndim == 2:
        refits = refits[None]
    if refits.ndim != 3 or refits.shape[0] not in (1, seeds) or refits.shape[2] != examples:
        raise ValueError(f"refits must be (fits, {examples}) or ({seeds}, fits, {examples}), got {refits.shape}")
    return np.broadcast_to(refits, (seeds, *refits.shape[1:]))


def _resampled_means(values: np.ndarray, seed: int, resamples: int, chunk: int = 100) -> np.ndarray:
    """The mean of `values` (seeds, fits, n) over `resamples` draws of its examples with replacement
    (the same draws for every model of a set, seeded by its size), with several seeds of its seeds,
    and with several fits of one fit for all seeds, made `chunk` at a time to bound memory."""
    s, f, n = values.shape
    rng, seed_rng = np.random.default_rng([seed, n]), np.random.default_rng([seed, n, s])
    fit_rng = np.random.default_rng([seed, n, s, f])
    out = []
    for i in range(0, resamples, chunk):
        k = min(chunk, resamples - i)
        cols = rng.integers(0, n, size=(k, n))
        rows = seed_rng.integers(0, s, size=(k, s)) if s > 1 else np.zeros((k, 1), np.int64)
        fits = fit_rng.integers(0, f, size=k) if f > 1 else np.zeros(k, np.int64)
        out.append(np.stack([values[r, j][:, c].mean() for r, j, c in zip(rows, fits, cols)]))
    return np.concatenate(out)


def _interval(values: np.ndarray, level: float, shift: float = 0.0) -> list[float]:
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo + shift), float(hi + shift)]


def _bootstrap(full: np.ndarray, refits, seed: int, resamples: int, level: float) -> list[float]:
    """The interval of the mean of `full` (seeds, n), its spread from `refits` when given."""
    if refits is None:
        return _interval(_resampled_means(full[:, None], seed, resamples), level)
    fits = _as_fits(refits, *full.shape)
    return _interval(_resampled_means(fits, seed, resamples), level, float(full.mean() - fits.mean()))


def accuracy_ci(correct, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL,
                refits=None) -> list[float]:
    """[lo, hi] of the accuracy of per-example outcomes `correct` (bool; one row per seed if 2-D);
    `refits`: the same model's outcomes from probes refit on resamples of probe-train (module doc)."""
    correct = _as_rows(correct).astype(bool)
    if correct.size == 0:
        raise ValueError("an accuracy needs at least one test example")
    lo, hi = _bootstrap(correct, None if refits is None else np.asarray(refits, bool), seed, resamples, level)
    return [max(lo, 0.0), min(hi, 1.0)]  # the shift to the full fit can carry an end past what an accuracy can be


def _paired(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two models' outcomes with one seed axis, seed s against seed s. A model with k seeds against one
    with a multiple of k repeats its rows to meet each of the other's (k = 1: a model without seeds
    against each seed), so the difference's mean is still the two models' means' difference. The seed
    resample then draws the repeated rows as often as the other's, so the interval reads a little less
    of the fewer-seeded model's seed spread than its own count would (the test images dominate here)."""
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"paired outcomes need the same test examples, got {a.shape} and {b.shape}")
    fewer, more = sorted((a.shape[0], b.shape[0]))
    if more % fewer:
        raise ValueError(f"paired outcomes need the same seeds or a multiple, got {a.shape[0]} and {b.shape[0]} rows")
    tile = (more // fewer,) + (1,) * (a.ndim - 1)
    return (np.tile(a, tile), b) if a.shape[0] == fewer else (a, np.tile(b, tile))


def difference_ci(correct_a, correct_b, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL,
                  refits_a=None, refits_b=None) -> dict:
    """Accuracy of a minus accuracy of b on the same test examples: {"diff", "ci": [lo, hi]}.

    With one row per seed, a's and b's rows are paired by seed (seed s of each model), the way a
    sweep trains them. With refits (both or neither), refit r of a is paired with refit r of b: the
    two probes were fit on the same resample."""
    a, b = _paired(_as_rows(correct_a).astype(np.int8), _as_rows(correct_b).astype(np.int8))
    delta = a - b
    if (refits_a is None) != (refits_b is None):
        raise ValueError("a paired difference needs the refits of both models or of neither")
    refits = None
    if refits_a is not None:
        fa, fb = (_as_fits(np.asarray(r, bool), len(x), x.shape[1]).astype(np.int8)
                  for r, x in ((refits_a, _as_rows(correct_a)), (refits_b, _as_rows(correct_b))))
        if fa.shape[1] != fb.shape[1]:
            raise ValueError(f"paired refits need the same resamples, got {fa.shape[1]} and {fb.shape[1]} fits")
        fa, fb = _paired(fa, fb)
        refits = fa - fb
    return {"diff": float(delta.mean()), "ci": _bootstrap(delta, refits, seed, resamples, level)}
