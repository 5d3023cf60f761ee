"""How often the evaluation's 95% intervals (pipeline/eval/stats.py) hold the truth, over training seeds.

    python -m benchmarks.ci_coverage [--trials 300] [--seeds 1 2 3 5] [--examples 270 2000]

Simulated outcomes with a known truth: each test image has a difficulty u ~ U(0, 1), shared by every
seed and model, and a seed's model with accuracy p gets it right when u < p; the seeds' accuracies are
drawn around the truth with the spread `--seed-sd` (points). Two regimes: the test images dominate (a
small seed spread) and the seeds dominate (a large one). For each, the share of trials whose interval
holds the truth: the accuracy over S seeds (`accuracy_ci`) and its paired difference against a one-seed
baseline scored on the same images (`difference_ci`). A nominal 95% interval should read about 0.95;
below it, the interval is narrower than it says. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from pipeline.eval.stats import accuracy_ci, difference_ci

TRUTH, BASELINE = 0.85, 0.80


def coverage(seeds: int, examples: int, seed_sd: float, trials: int, resamples: int) -> dict:
    hits = {"accuracy": 0, "difference": 0}
    for trial in range(trials):
        rng = np.random.default_rng([seeds, examples, int(seed_sd * 1e4), trial])
        difficulty = rng.random(examples)  # the test images drawn
        accuracies = TRUTH + seed_sd * rng.normal(size=seeds)
        correct = difficulty[None] < accuracies[:, None]
        lo, hi = accuracy_ci(correct, seed=trial, resamples=resamples)
        hits["accuracy"] += lo <= TRUTH <= hi
        lo, hi = difference_ci(correct, difficulty[None] < BASELINE, seed=trial, resamples=resamples)["ci"]
        hits["difference"] += lo <= TRUTH - BASELINE <= hi
    return {k: v / trials for k, v in hits.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--resamples", type=int, default=500)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 5])
    ap.add_argument("--examples", type=int, nargs="+", default=[270, 2000])
    ap.add_argument("--seed-sd", type=float, nargs="+", default=[0.5, 3.0], help="seeds' spread, in points")
    args = ap.parse_args()
    t0, rows = time.time(), []
    print(f"{'test images':>11} {'seed s.d.':>9} {'seeds':>5}  {'accuracy':>8}  {'paired diff':>11}"
          "  (coverage; nominal 0.95)")
    for examples in args.examples:
        for sd in args.seed_sd:
            for seeds in args.seeds:
                if seeds == 1 and sd != args.seed_sd[0]:
                    continue  # one seed: the interval does not cover the seeds, whatever their spread
                row = {"examples": examples, "seed_sd_points": sd, "seeds": seeds,
                       **coverage(seeds, examples, sd / 100, args.trials, args.resamples)}
                rows.append(row)
                print(f"{examples:>11} {sd:>9.1f} {seeds:>5}  {row['accuracy']:>8.3f}  {row['difference']:>11.3f}",
                      flush=True)
    print(json.dumps({"benchmark": "ci_coverage", "trials": args.trials, "rows": rows,
                      "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
