"""Confidence intervals for accuracies on a finite test set, over training seeds.

A test set of a few hundred examples moves an accuracy by several points by chance alone, so every
accuracy in metrics.json carries a 95% percentile-bootstrap interval over the test examples, and
every comparison between two models a paired one: both models are scored on the same resampled
examples, which removes the variation they share (the difficulty of the draw) from their difference.

Outcomes may be one row per training seed, (seeds, examples): the accuracy is then the mean over
seeds, and the bootstrap resamples the seeds too (a two-level bootstrap), so the interval also
covers how much a re-run with another seed would move it, with the seeds' spread scaled to its
unbiased estimate (a bootstrap over S seeds alone reads (S-1)/S of it). Two or three seeds still
estimate that spread loosely, and a bootstrap over them has no tails: where the seeds spread by more
than the test images resolve, the interval is narrower than 95%. Measured (`python -m
benchmarks.ci_coverage`, 300 trials each, ±1.3 points): 5,000 test images and seeds 0.6 points apart
(s.d.), a paired difference over two seeds against one fixed model covers 84%, over four 93%; seeds
0.3 apart, 91% and 94%; 2,000 images and seeds 3 points apart, 71% over two, 83% over three, 91% over
five. With the test images dominating it reads 92-95%. A Student-t seed term would restore 95% at the
cost of an interval over two seeds wider than most tables could use (t₁ = 12.7).

A probe fit on a few thousand images moves by about half a point (one s.d.) with the images it is
fit on, as much as the test images move it. Given `refits`, the outcomes of probes refit on
bootstrap resamples of the probe-train part (resample r the same for every model), each draw also
picks one refit, shared by every seed and by both models of a pair, so the interval covers that
spread too. It is centred on the full fit: a probe fit on a
resample (about 63% distinct images) is a little weaker, and the shift takes that bias out.

Two guards keep an interval honest where the bootstrap is not. Near 0% or 100% a resample of the
test images cannot move the count of errors past the few it holds: at 99.5% on 270 images a quarter
of the intervals read 100.0–100.0% and they cover 76% (measured). An accuracy's interval is
therefore never narrower than the Wilson score interval of its test images, which keeps its level
there, and a paired difference's never narrower than Bonett and Price's adjusted Wald interval of
the examples on which the two models disagree (two models that agree on every test image read
0.0–0.0 by the bootstrap alone). And the shift to the full fit can carry a skewed bootstrap (one
collapsed refit among fifty) past the estimate: every interval is stretched to hold its own estimate.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95


def released(row: dict) -> dict:
    """A metrics row's figures for the one checkpoint a stage released: a row over evaluate.seeds > 1 is
    a mean of several trainings, and keeps the first's own (the released one) as `first_seed`."""
    return row.get("first_seed", row)


def chance(labels) -> float:
    """The accuracy of always answering the most frequent class of `labels`: of the images scored,
    which is not the whole set's where an official split's test part is balanced otherwise."""
    labels = np.asarray(labels)
    return float(np.bincount(labels).max() / len(labels))


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


def _spread_as_estimated(seeds: np.ndarray) -> np.ndarray:
    """Rows (seeds, ...) moved away from their mean by sqrt(S/(S-1)). The mean of S seeds drawn with
    replacement from S varies by (S-1)/S of what the mean of S fresh seeds does (the plug-in variance
    divides by S, not S-1): at two seeds the interval would read half the seed variance. Scaling the
    deviations makes the bootstrap's seed variance the unbiased estimate and leaves the mean as it was."""
    s = len(seeds)
    if s < 2:
        return seeds
    mean = seeds.mean(axis=0, dtype=np.float64)
    return mean + np.sqrt(s / (s - 1)) * (seeds - mean)


def _resampled_means(models: list[np.ndarray], seed: int, resamples: int, chunk: int = 100) -> np.ndarray:
    """Over `resamples` draws of the test examples with replacement (the same draws for every model of
    a set, seeded by their count), of one fit for all seeds and of several seeds of each model's seeds:
    the mean of `models[0]` (seeds, fits, n), minus that of `models[1]` when given. Two models with as
    many seeds draw the same seeds, paired seed s with seed s (the way a sweep trains them); with
    unequal counts each model draws from its own, so each interval reads its own seeds' spread. Made
    `chunk` draws at a time to bound memory."""
    models = [_spread_as_estimated(m) for m in models]
    f, n = models[0].shape[1:]
    most = max(len(m) for m in models)
    rng, fit_rng = np.random.default_rng([seed, n]), np.random.default_rng([seed, n, most, f])
    seed_rngs = {len(m): np.random.default_rng([seed, n, len(m)] + ([most] if len(m) < most else []))
                 for m in models}
    signs = (1.0, -1.0)[:len(models)]
    out = []
    for i in range(0, resamples, chunk):
        k = min(chunk, resamples - i)
        cols = rng.integers(0, n, size=(k, n))
        rows = {s: g.integers(0, s, size=(k, s)) if s > 1 else np.zeros((k, 1), np.int64)
                for s, g in seed_rngs.items()}
        fits = fit_rng.integers(0, f, size=k) if f > 1 else np.zeros(k, np.int64)
        out.append(np.array([sum(sign * m[rows[len(m)][d], fits[d]][:, cols[d]].mean()
                                 for sign, m in zip(signs, models)) for d in range(k)]))
    return np.concatenate(out)


def normal_quantile(p: float) -> float:
    from scipy import stats  # ~1 s to import: here, not in every stage that imports tracking (which imports released)

    return float(stats.norm.ppf(p))


def wilson(accuracy: float, n: int, level: float = LEVEL) -> list[float]:
    """The Wilson score interval of an accuracy over n independent test examples: the test images'
    own uncertainty, which keeps its level at 0% and 100% where a bootstrap of them collapses."""
    z = normal_quantile((1 + level) / 2)
    centre = (accuracy + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * np.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n))
    return [float(centre - half), float(centre + half)]


def paired_wald(discordant_a: float, discordant_b: float, n: int, level: float = LEVEL) -> list[float]:
    """Bonett and Price's adjusted Wald interval of a paired difference over n test examples, from the
    counts only model a gets right (discordant_a) and only model b does: the test images' own
    uncertainty, which a bootstrap of them loses where the two models disagree on few or none."""
    z = normal_quantile((1 + level) / 2)
    only_a, only_b = (discordant_a + 1) / (n + 2), (discordant_b + 1) / (n + 2)
    half = z * np.sqrt((only_a + only_b - (only_a - only_b) ** 2) / (n + 2))
    return [float(only_a - only_b - half), float(only_a - only_b + half)]


def _discordant(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """How many test examples (a mean over seeds) only a gets right, and only b: seed by seed where the
    two are paired by seed, else from each example's rate over each model's own seeds."""
    if len(a) != len(b):
        a, b = a.mean(axis=0, keepdims=True), b.mean(axis=0, keepdims=True)
    return float((a * (1 - b)).mean(axis=0).sum()), float(((1 - a) * b).mean(axis=0).sum())


def _guarded(ci: list[float], floor: list[float], estimate: float, bounds: tuple[float, float]) -> list[float]:
    """`ci` never narrower than `floor`, holding its own `estimate` (module doc), and within `bounds`, what
    the figure can be (the shift to the full fit can carry an end past them)."""
    lo, hi = min(ci[0], floor[0], estimate), max(ci[1], floor[1], estimate)
    return [max(lo, bounds[0]), min(hi, bounds[1])]


def _interval(values: np.ndarray, level: float, shift: float = 0.0) -> list[float]:
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo + shift), float(hi + shift)]


def _bootstrap(full: list[np.ndarray], refits: list | None, seed: int, resamples: int, level: float) -> list[float]:
    """The interval of the mean of `full[0]` (seeds, n), minus that of `full[1]` when given; their
    spread from probe refits when `refits` holds each model's."""
    if len(full) == 2 and len(full[0]) == len(full[1]):  # paired seed by seed: one model of differences
        full, refits = [full[0] - full[1]], None if refits is None else [refits[0] - refits[1]]
    sign = np.array([1.0, -1.0][:len(full)])
    if refits is None:
        return _interval(_resampled_means([x[:, None] for x in full], seed, resamples), level)
    fits = [_as_fits(r, *x.shape) for r, x in zip(refits, full)]
    shift = sign @ [x.mean() for x in full] - sign @ [x.mean() for x in fits]
    return _interval(_resampled_means(fits, seed, resamples), level, float(shift))


def accuracy_ci(correct, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL,
                refits=None) -> list[float]:
    """[lo, hi] of the accuracy of per-example outcomes `correct` (bool; one row per seed if 2-D);
    `refits`: the same model's outcomes from probes refit on resamples of probe-train (module doc)."""
    correct = _as_rows(correct).astype(bool)
    if correct.size == 0:
        raise ValueError("an accuracy needs at least one test example")
    ci = _bootstrap([correct], None if refits is None else [np.asarray(refits, bool)], seed, resamples, level)
    accuracy = float(correct.mean())
    floor = wilson(accuracy, correct.shape[1], level)  # a resample of the test images collapses at 0% and 100%
    return _guarded(ci, floor, accuracy, (0.0, 1.0))


def difference_ci(correct_a, correct_b, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL,
                  refits_a=None, refits_b=None) -> dict:
    """Accuracy of a minus accuracy of b on the same test examples: {"diff", "ci": [lo, hi]}.

    With one row per seed, two models with as many seeds are paired by seed (seed s of each), the way
    a sweep trains them; with unequal counts (one, two or four seeds) each model's seeds are
    resampled on their own. With refits (both or neither), refit r of a is paired with refit r of b: the
    two probes were fit on the same resample."""
    a, b = (_as_rows(x).astype(np.int8) for x in (correct_a, correct_b))
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"paired outcomes need the same test examples, got {a.shape} and {b.shape}")
    if (refits_a is None) != (refits_b is None):
        raise ValueError("a paired difference needs the refits of both models or of neither")
    refits = None
    if refits_a is not None:
        refits = [_as_fits(np.asarray(r, bool), *x.shape).astype(np.int8) for r, x in ((refits_a, a), (refits_b, b))]
        if refits[0].shape[1] != refits[1].shape[1]:
            raise ValueError(f"paired refits need the same resamples, got {refits[0].shape[1]} and {refits[1].shape[1]} fits")
    diff = float(a.mean() - b.mean())
    ci = _bootstrap([a, b], refits, seed, resamples, level)
    floor = paired_wald(*_discordant(a, b), a.shape[1], level)  # a resample cannot move discordance it never saw
    return {"diff": diff, "ci": _guarded(ci, floor, diff, (-1.0, 1.0))}
