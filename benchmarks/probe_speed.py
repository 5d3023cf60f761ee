"""How long the evaluate stage's logistic probe takes to choose its C and fit, against the probe it had.

    python -m benchmarks.probe_speed [--features encoder pixels] [--n 10000] [--set fashion-mnist]
        [--encoder cpu | vit-s16-224] [--device cuda]

The probe (pipeline/eval/probe.py, `evaluate.probe_c: auto`) chooses C by 3-fold cross-validation on
probe-train, then fits at it: that is most of what scoring an encoder costs (benchmarks/scale_utility.py:
minutes per row, against seconds for the features; `make run`: most of the curve and evaluate stages).
On the CPU, baseline: the probe until 2026-12-04, on all d features; now: with fewer probe-train images
than features, on coordinates in the span of the training rows (the same optimum, r <= n weights per
class). With as many images as features or more both are the same probe. With `--device cuda`,
baseline: today's CPU probe (scikit-learn, one fit per core); now: the same problem solved on the GPU
(pipeline/eval/device_logreg.py). Both on the same features of n images of the set (half probe-train,
half probe-test), in one process, the new one first: `encoder` is a random-init ViT's pooled features
of every block (the CPU recipe's at 32 px: 768; `vit-s16-224`, the 224 px table's ViT-S/16: 9,216),
`pixels` the raw-pixel baseline's 3,072 (`--set digits --n 539` is `make run`'s evaluation: 269
probe-train digits). Prints, per feature kind, both times and their ratio and the C each chose; both
final fits are at the new probe's C, so their objectives (lower is nearer the optimum: L-BFGS stops at
its tolerance, not at the optimum), accuracies and the share of probe-test outcomes on which they
disagree compare one problem's two solutions. Then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from functools import partial

import numpy as np
import torch
from scipy.special import logsumexp
from threadpoolctl import threadpool_limits

from pipeline.data import labelled_sets
from pipeline.eval.device_logreg import DeviceLogreg
from pipeline.eval.probe import extract_features, logreg_estimator, logreg_probe, on_gpu, pixel_features
from pipeline.models import build_encoder

ENCODERS = {"cpu": {"size": "cpu", "img_size": 32, "patch_size": 4},
            "vit-s16-224": {"size": "tiny", "img_size": 224, "patch_size": 16}}


def baseline_probe(train_x, train_y, c, seed: int = 0):
    """logreg_probe as it was until 2026-12-04: on all the features, whatever their count."""
    probe = logreg_estimator(train_x, train_y, c, seed, row_space=False)
    with threadpool_limits(1), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return probe.fit(train_x, train_y)


def solution(probe) -> dict:
    """A fitted probe of either route, as the comparison reads it: C, logits, labels and weights."""
    if isinstance(probe, DeviceLogreg):
        return {"c": probe.C_, "logits": lambda x: probe.logits(x)[0].cpu().numpy(), "classes": probe.classes,
                "weights": probe.weights[0, :-1].cpu().numpy()}
    model = probe[-1]
    c = model.C_[0] if hasattr(model, "C_") else model.C
    return {"c": float(c), "logits": probe.decision_function,
            "classes": model.classes_, "weights": model.coef_}


def objective(fit: dict, x, y) -> float:
    """What the fit minimises: C × the summed cross-entropy + half the squared weights (sklearn's L2 loss)."""
    logits = fit["logits"](x)
    nll = -(logits[np.arange(len(y)), np.searchsorted(fit["classes"], y)] - logsumexp(logits, axis=1)).sum()
    return float(fit["c"] * nll + 0.5 * np.square(fit["weights"]).sum())


def choose_and_fit(probe, x, y, tr, te, common_c: float | None = None) -> dict:
    """auto's choice of C, then the probe at `common_c` (default: the C chosen): seconds of each, the
    final fit's objective and its probe-test outcomes."""
    t0 = time.perf_counter()
    c = solution(probe(x[tr], y[tr], "auto"))["c"]
    t1 = time.perf_counter()
    fitted = solution(probe(x[tr], y[tr], c if common_c is None else common_c))
    t2 = time.perf_counter()
    correct = fitted["classes"][fitted["logits"](x[te]).argmax(1)] == y[te]
    return {"c": c, "choose_s": t1 - t0, "fit_s": t2 - t1, "objective": objective(fitted, x[tr], y[tr]),
            "correct": correct}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", nargs="+", default=["encoder"], choices=["encoder", "pixels"])
    ap.add_argument("--n", type=int, default=10_000, help="images: half probe-train, half probe-test")
    ap.add_argument("--set", default="fashion-mnist", choices=sorted(labelled_sets.SETS),
                    help="fashion-mnist needs `make fashion-mnist` first")
    ap.add_argument("--encoder", default="cpu", choices=sorted(ENCODERS), help="the random-init ViT of `encoder`")
    ap.add_argument("--device", default="cpu", help="cuda: the GPU's probe against the CPU's")
    args = ap.parse_args()
    encoder = ENCODERS[args.encoder]
    if on_gpu(args.device):
        baseline, new = logreg_probe, partial(logreg_probe, seed=0, device=args.device)
    else:
        baseline, new = baseline_probe, logreg_probe
    grey, labels = labelled_sets.get(args.set).load()
    rng = np.random.default_rng(0)
    pick = np.sort(rng.choice(len(labels), size=min(args.n, len(labels)), replace=False))
    images, y = labelled_sets.rgb(np.asarray(grey[pick]), encoder["img_size"]), labels[pick]
    order = rng.permutation(len(y))
    tr, te = np.sort(order[: len(y) // 2]), np.sort(order[len(y) // 2:])
    out = {}
    for kind in args.features:
        if kind == "pixels":
            x = pixel_features(images)
        else:
            torch.manual_seed(0)
            x = extract_features(build_encoder(encoder), images, "cls+mean", "all", args.device)
        now = choose_and_fit(new, x, y, tr, te)
        print(f"probe_speed: {kind}: now {now['choose_s'] + now['fit_s']:.1f} s; the baseline's turn", flush=True)
        before = choose_and_fit(baseline, x, y, tr, te, common_c=now["c"])
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
              f"C {before['c']:g} / {now['c']:g}; objective at C {now['c']:g} {before['objective']:.4f} / "
              f"{now['objective']:.4f}; accuracy {100 * r['accuracy_before']:.2f}% / "
              f"{100 * r['accuracy_now']:.2f}%, outcomes differ on {100 * r['outcomes_differ']:.2f}%", flush=True)
    print(json.dumps({"benchmark": "probe_speed", "set": args.set, "encoder": args.encoder, "device": args.device,
                      "threads": torch.get_num_threads(), **out}))


if __name__ == "__main__":
    main()
