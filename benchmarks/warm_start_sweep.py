"""Which pretraining makes the best warm start? Its linear probe on a validation part, per recipe.

    python -m benchmarks.warm_start_sweep --dir DIR --recipes pretrain.lr=0.0015 pretrain.lr=0.0005 [...]
                                          [--refits 20]

Each recipe (one `SECTION.KEY=VALUE` override, or several joined by commas, of the scale benchmark's
recipe: `benchmarks/scale_utility.py`, MAE's schedule) pretrains its own warm start on the shader
images in DIR/<recipe>/ (the Fashion-MNIST shards, shader images and tokenizer are made once, in the
first recipe's folder, and shared; a recipe that sets `synthetic.*` renders its own images). The warm
start's encoder is then scored as the scale benchmark's `--validate` scores a row: on the probe-train
part of the public eval set, 3-fold cross-fitted, C chosen on each fold's fit part, with --refits
probes refit on resamples for the intervals; the probe-test part is never read. Prints each recipe's
accuracy, then each against the first, paired (95% bootstrap over images and refits), then ONE JSON
line. `make fashion-mnist` first.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks import scale_utility as su
from benchmarks.scale_report import paired_gain
from pipeline import checkpoints
from pipeline.cli import resolve_device
from pipeline.config import load_params
from pipeline.eval.probe import features, linear_probe, refit_correct, with_chosen_c

SHARED = ("data/shards", "data/synthetic", "models/tokenizer")  # the same for every pretraining recipe


def validation_row(params: dict, work: Path, device: str, refits: int) -> dict:
    """The warm start in `work`, scored on probe-train by cross-fitting: {"probe", "refits"} as a row."""
    with su.inside(work):
        warm = checkpoints.load("models/pretrain/checkpoint.pt")
        scorer = su.Scorer(params, warm.model_cfg["img_size"])
        folds = su.validation_folds(scorer.split, scorer.es.labels)
        scored = np.sort(np.concatenate([part for _, part in folds]))
        x, labels = features(warm.build_encoder(), scorer.es.images, scorer.cfg, device), scorer.es.labels
        correct, refit = np.empty(len(scored), bool), np.empty((refits, len(scored)), bool)
        for fold in folds:
            at = np.searchsorted(scored, fold[1])
            cfg = with_chosen_c(x, labels, fold[0], scorer.cfg, 0, device)
            correct[at] = linear_probe(x, labels, fold, cfg, 0, device)
            refit[:, at] = refit_correct(x, labels, fold, cfg, refits, 0, device)
    return {"probe": correct[None], "refits": refit[None]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="one folder per recipe, reused by later runs")
    ap.add_argument("--recipes", nargs="+", required=True, metavar="SECTION.KEY=VALUE[,...]")
    ap.add_argument("--refits", type=int, default=20)
    args = ap.parse_args()
    rows, first, started = {}, None, time.time()
    for recipe in args.recipes:
        t0 = time.time()
        params = load_params(str(su.ROOT / "params.yaml"), [*su.RECIPE, *su.SCHEDULES["mae"], *recipe.split(",")])
        params["shards"]["path"] = str(su.ROOT / "data/public/fashion-mnist")
        device = resolve_device(params["run"]["device"])
        work = (args.dir / recipe.replace("/", "_") / f"n-{su.FULL}").resolve()
        own_images = any(o.startswith("synthetic.") for o in recipe.split(","))
        for rel in [r for r in SHARED if not (own_images and r == "data/synthetic")] if first is not None else ():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            if not (work / rel).exists():
                (work / rel).symlink_to(first / rel)
        su.prepare(work, su.size_params(params, su.FULL, None), device, None)
        first = first or work
        rows[recipe] = validation_row(params, work, device, args.refits)
        print(f"warm_start_sweep: {recipe}: validation linear probe {rows[recipe]['probe'].mean():.4f} "
              f"({time.time() - t0:.0f} s)", flush=True)
    base, out = args.recipes[0], {}
    for recipe in args.recipes:
        d = paired_gain(rows[recipe], rows[base]) if recipe != base else None
        out[recipe] = {"accuracy": round(float(rows[recipe]["probe"].mean()), 4)} | (
            {"versus_first": round(d["diff"], 4), "ci": [round(c, 4) for c in d["ci"]]} if d else {})
        if d:
            print(f"warm_start_sweep: {recipe} minus {base}: {100 * d['diff']:+.1f} points "
                  f"({100 * d['ci'][0]:+.1f} to {100 * d['ci'][1]:+.1f})", flush=True)
    print(json.dumps({"recipes": out, "seconds": round(time.time() - started)}))


if __name__ == "__main__":
    main()
