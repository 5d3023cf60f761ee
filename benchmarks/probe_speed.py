"""How long the evaluate stage's logistic probe takes to choose its C and fit, against the probe it had.

    python -m benchmarks.probe_speed [--features encoder pixels] [--n 10000] [--set fashion-mnist]

The probe (pipeline/eval/probe.py, `evaluate.probe_c: auto`) chooses C by 3-fold cross-validation on
probe-train, then fits at it: that is most of what scoring an encoder costs (benchmarks/scale_utility.py:
minutes per row, against seconds for the features; `make run`: most of the curve and evaluate stages).
Baseline: the probe until 2026-12-04, on all d features; now: with fewer probe-train images than
features, on coordinates in the span of the training rows (the same optimum, r <= n weights per class).
With as many images as features or more both are the same probe. Both on the same features of n images
of the set (half probe-train, half probe-test), in one process, one after the other: `encoder` is a
random-init CPU-recipe ViT's pooled features of every block (768), `pixels` the raw-pixel baseline's
3,072 (`--set digits --n 539` is `make run`'s evaluation: 269 probe-train digits). Prints, per feature
kind, both times and their ratio and the C each chose; both final fits are at the baseline's C, so
their objectives (lower is nearer the optimum: L-BFGS stops at its tolerance, not at the optimum),
accuracies and the share of probe-test outcomes on which they disagree compare one problem's two
solutions. Then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import numpy as np
import torch
from scipy.special import logsumexp
from threadpoolctl import threadpool_limits

from pipeline.data import labelled_sets
from pipeline.eval.probe import extract_features, logreg_estimator, logreg_probe, pixel_features
from pipeline.models import build_encoder

IMAGE_SIZE = 32
ENCODER = {"size": "cpu", "img_size": IMAGE_SIZE, "patch_size": 4}


def baseline_probe(train_x, train_y, c, seed: int = 0):
    """logreg_probe as it was until 2026-12-04: on all the features, whatever their count."""
    probe = logreg_estimator(train_x, train_y, c, seed, row_space=False)
    with threadpool_limits(1), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return probe.fit(train_x, train_y)


def objective(probe, x, y) -> float:
    """What the fit minimises: C × the summed cross-entropy + half the squared weights (sklearn's L2 loss)."""
    model = probe[-1]
    logits = probe.decision_function(x)
    nll = -(logits[np.arange(len(y)), np.searchsorted(model.classes_, y)] - logsumexp(logits, axis=1)).sum()
    return float(model.C * nll + 0.5 * np.square(model.coef_).sum())


def choose_and_fit(probe, x, y, tr, te, common_c: float | None = None) -> dict:
    """auto's choice of C, then the probe at `common_c` (default: the C chosen): seconds of each, the
    final fit's objective and its probe-test outcomes."""
    t0 = time.perf_counter()
    cv = probe(x[tr], y[tr], "auto")[-1]
    c = float(cv.C_[0])
    t1 = time.perf_counter()
    fitted = probe(x[tr], y[tr], c if common_c is None else common_c)
    t2 = time.perf_counter()
    return {"c": c, "choose_s": t1 - t0, "fit_s": t2 - t1, "objective": objective(fitted, x[tr], y[tr]),
            "correct": fitted.predict(x[te]) == y[te]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", nargs="+", default=["encoder"], choices=["encoder", "pixels"])
    ap.add_argument("--n", type=int, default=10_000, help="images: half probe-train, half probe-test")
    ap.add_argument("--set", default="fashion-mnist", choices=sorted(labelled_sets.SETS),
                    help="fashion-mnist needs `make fashion-mnist` first")
    args = ap.parse_args()
    grey, labels = labelled_sets.get(args.set).load()
    rng = np.random.default_rng(0)
    pick = np.sort(rng.choice(len(labels), size=min(args.n, len(labels)), replace=False))
    images, y = labelled_sets.rgb(np.asarray(grey[pick]), IMAGE_SIZE), labels[pick]
    order = rng.permutation(len(y))
    tr, te = np.sort(order[: len(y) // 2]), np.sort(order[len(y) // 2:])
    out = {}
    for kind in args.features:
        if kind == "pixels":
            x = pixel_features(images)
        else:
            torch.manual_seed(0)
            x = extract_features(build_encoder(ENCODER), images, "cls+mean", "all")
        before = choose_and_fit(baseline_probe, x, y, tr, te)
        now = choose_and_fit(logreg_probe, x, y, tr, te, common_c=before["c"])
        total_before, total_now = before["choose_s"] + before["fit_s"], now["choose_s"] + now["fit_s"]
        out[kind] = {"features": int(x.shape[1]), "train_images": len(tr),
                     "before": {k: round(v, 2 if k.endswith("_s") else 4) for k, v in before.items() if k != "correct"},
                     "now": {k: round(v, 2 if k.endswith("_s") else 4) for k, v in now.items() if k != "correct"},
                     "speedup": round(total_before / total_now, 2),
                     "outcomes_differ": round(float((before["correct"] != now["correct"]).mean()), 4),
                     "accuracy_before": round(float(before["correct"].mean()), 4),
                     "accuracy_now": round(float(now["correct"].mean()), 4)}
        r = out[kind]
        print(f"probe_speed: {kind:<8} {x.shape[1]:>5} features, {len(tr)} probe-train images: choose C + fit "
              f"{total_before:6.1f} s before ({before['choose_s']:.1f} + {before['fit_s']:.1f}), "
              f"{total_now:6.1f} s now ({now['choose_s']:.1f} + {now['fit_s']:.1f}): {r['speedup']:.2f}x; "
              f"C {before['c']:g} / {now['c']:g}; objective at C {before['c']:g} {before['objective']:.4f} / "
              f"{now['objective']:.4f}; accuracy {100 * r['accuracy_before']:.2f}% / "
              f"{100 * r['accuracy_now']:.2f}%, outcomes differ on {100 * r['outcomes_differ']:.2f}%", flush=True)
    print(json.dumps({"benchmark": "probe_speed", "set": args.set, "threads": torch.get_num_threads(), **out}))


if __name__ == "__main__":
    main()
