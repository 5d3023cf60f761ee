"""Is a DP encoder worth more than its synthetic warm start, random weights and raw pixels?

    python -m benchmarks.utility [--dir DIR] [--seeds 3] [--epsilons 1 8 inf] [--objectives mae caption clip]
                                 [--set SECTION.KEY=VALUE ...]

The real pipeline stages, in-process, on params.yaml's defaults (the bundled digits; `--set` points
them elsewhere, e.g. `--set shards.source=fashion-mnist`): shards, synthetic images and tokenizer
once; then per training seed s (run.seed = s, a known noise seed: this is public data) the
synthetic pretraining, and per objective the curve stage's own `train_point` from each init
(synthetic warm start, random) at each ε (∞: the same recipe without clipping or noise). Every
encoder is probed with the `evaluate` protocol of params.yaml on the first eval set, all on the same
probe-train / probe-test split (chosen once, seed 0), so rows pair example by example and seed by
seed. Rows with "epsilon": null are the untrained random-init and the synthetic-only encoders.

Each row's accuracy is the mean over seeds; its 95% interval a bootstrap over seeds, test images and
the probe's refits on resamples of probe-train (evaluate.probe_refits, as the evaluate stage's;
pipeline/eval/stats.py). Each trained row shows its schedule's σ, σ/B and the noise on one coordinate
of the released averaged gradient, and every encoder its gain over synthetic-only, paired by seed,
test image and probe resample. The targets compare rows by paired intervals:
  a  ε = ∞ from synthetic beats the random-init encoder, per objective
  b  at ε = 8, DP from synthetic beats DP from random init, per objective
  c  synthetic-init rows: ε = ∞ ≥ ε = 8 ≥ ε = 1 (no step significantly down)
  d  the best encoder row is not significantly below the raw pixels (paired)
  e  DP-Cap's zero-shot at ε = 8 is above chance wherever its non-private twin's is
Prints a table as it goes and ONE JSON line, the last line of stdout (and to --json). About 23 minutes on 2 cores.

A second public set, Fashion-MNIST (`make fashion-mnist` first). Its encoders need a non-private
twin that trains longer than the 40-step DP recipe (`dp.nonprivate`, the ε = ∞ rows):
    python -m benchmarks.utility --dir /tmp/ut-fashion --seeds 2 --epsilons 8 inf \
        --set shards.source=fashion-mnist --set shards.limit=3000 --set shards.path=$PWD/data/public/fashion-mnist \
        --set 'evaluate.sets=[{name: fashion-mnist, source: fashion-mnist}]' \
        --set dp.nonprivate.steps=500 --set dp.nonprivate.lr=0.001 --set dp.nonprivate.encoder_lr_scale=1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pipeline import checkpoints
from pipeline.cli import StageContext, runner
from pipeline.config import load_params
from pipeline.eval import stats
from pipeline.eval.evalsets import load_eval_set
from pipeline.eval.probe import features, probe_outcomes
from pipeline.eval.stats import accuracy_ci, difference_ci
from pipeline.eval.zeroshot import ZERO_SHOT_OBJECTIVES, class_scores
from pipeline.io import atomic_path, read_json
from pipeline.models import build_encoder
from pipeline.privacy import training
from pipeline.stages import stage
from pipeline.tracking import NullRun

ROOT = Path(__file__).resolve().parent.parent
OBJECTIVES = ("mae", "caption", "clip")
INIT_NAMES = {"pretrain": "synthetic", "random": "random"}  # curve's init names -> the JSON's
PIXELS = (None, "pixels", None)  # the raw-pixel row: the same probe on the input pixels


@contextlib.contextmanager
def inside(directory: Path):
    """Stages read and write paths relative to the working directory: run them in `directory`."""
    before = os.getcwd()
    directory.mkdir(parents=True, exist_ok=True)
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(before)


def context(name: str) -> StageContext:
    return StageContext(stage(name), NullRun(), torch.get_num_threads(), "cpu")


def run_stage(name: str, params: dict) -> None:
    runner(name)(params, context(name))


def parse_epsilon(text: str) -> float:
    return math.inf if text.lower() in ("inf", "infinity", "∞") else float(text)


class Scorer:
    """Probe outcomes (and zero-shot outcomes) of encoders on the fixed probe-test split."""

    def __init__(self, params: dict, image_size: int):
        self.cfg = params["evaluate"]
        self.es = load_eval_set(self.cfg["sets"][0], image_size)
        self.split = self.es.split(self.cfg["probe_fraction"], 0)

    def probe(self, encoder, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The evaluate stage's probe: whether it is right on each probe-test image, and the same for
        its refits on resamples of probe-train ((evaluate.probe_refits, images); None without)."""
        x = features(encoder, self.es.images, self.cfg, "cpu")
        return probe_outcomes(x, self.es.labels, self.split, self.cfg, seed)

    def zero_shot(self, model, objective: str, tokenizer, max_len: int, te: np.ndarray | None = None,
                  device: str = "cpu") -> np.ndarray:
        """Per image of `te` (default: the probe-test part), whether the class zero-shot picks is right."""
        te = self.split[1] if te is None else te
        scores = class_scores(model, objective, self.es.images.subset(te), self.es.prompts(),
                              lambda c: tokenizer.encode(c, max_len, public=True), device)
        return scores.argmax(axis=1) == self.es.labels[te]


def read_plan(size_dir: Path, p: dict, eps: float) -> dict:
    """The point's schedule and noise: B, T and σ as dp-train plans them (σ = 0 at ε = ∞)."""
    with inside(size_dir):
        n = read_json("data/shards/stats.json")["private"]["usable"]
    return schedule(p, n, eps)


def schedule(p: dict, n: int, eps: float) -> dict:
    """B, T, σ and the noise per released coordinate of the point at ε on n private examples."""
    from pipeline.privacy.plan import plan_mechanism

    dp = training.point_params(p, "pretrain", eps)["dp"]
    batch, steps = dp["expected_batch_size"], dp["steps"]
    plan = plan_mechanism(dp, n, p["privacy"]["adjacency"]) if math.isfinite(eps) else None
    sigma = plan.sigma if plan else 0.0
    # What decides utility: the noise std on one coordinate of the released averaged gradient. Per
    # example σ·C/B, falling with the batch; Dp-CLIP's clipped batch mean carries 2σC whatever B is.
    noise = plan.noise_std / plan.denominator if plan else 0.0
    # Where the noise stops (noise_edge.py): the training's ledger holds the plan's edge, or it is not resumed.
    return {"batch": batch, "steps": steps, "sigma": sigma, "sigma_over_b": sigma / batch,
            "noise_per_coordinate": noise, "epochs": round(batch * steps / n, 2),
            "noise_edge": plan.noise_edge if plan else None}


def summarise(outcomes: dict, refits: dict | None = None) -> dict:
    """{key: (seeds, examples) bool} -> {key: {"acc", "ci"}}, the interval over the probe's refits too
    where `refits` has the key's."""
    refits = refits or {}
    return {k: {"acc": float(np.mean(v)), "ci": accuracy_ci(v, refits=refits.get(k))} for k, v in outcomes.items()}


def paired_difference(probe: dict, refits: dict, a, b) -> dict:
    """Row a's accuracy minus row b's, paired by test image, seed and (where both have them) probe refit."""
    both = a in refits and b in refits
    return difference_ci(probe[a], probe[b], refits_a=refits[a] if both else None,
                         refits_b=refits[b] if both else None)


def check_targets(probe: dict, zero: dict, objectives, epsilons, refits: dict | None = None) -> dict:
    """The issue's targets, each with the paired interval it rests on (over the probes' refits too, with
    `refits`: {row key: (seeds, fits, examples)})."""
    targets, refits = {}, refits or {}

    def paired(a, b) -> dict:
        return paired_difference(probe, refits, a, b)

    for obj in objectives:
        if math.inf in epsilons:
            d = paired((obj, "synthetic", math.inf), (None, "random", None))
            targets[f"a_{obj}"] = {"passed": d["ci"][0] > 0, "diff": d}
        if 8.0 in epsilons:
            d = paired((obj, "synthetic", 8.0), (obj, "random", 8.0))
            targets[f"b_{obj}"] = {"passed": d["ci"][0] > 0, "diff": d}
        steps = [e for e in (1.0, 8.0, math.inf) if e in epsilons]
        for lo, hi in zip(steps, steps[1:]):
            d = paired((obj, "synthetic", hi), (obj, "synthetic", lo))
            targets[f"c_{obj}_{lo:g}_to_{hi:g}"] = {"passed": d["ci"][1] >= 0, "diff": d}
    best = max((k for k in probe if k[1] != "pixels"), key=lambda k: np.mean(probe[k]))
    d = paired(best, PIXELS)  # below the pixels only if the whole paired interval is
    targets["d_best_vs_pixels"] = {"passed": d["ci"][1] >= 0, "best": row_name(best), "diff": d}
    if ("caption", "synthetic", 8.0) in zero and ("caption", "synthetic", math.inf) in zero:
        chance = zero["chance"]
        dp_ci, np_ci = (accuracy_ci(zero["caption", "synthetic", e]) for e in (8.0, math.inf))
        targets["e_caption_zero_shot"] = {"passed": dp_ci[0] > chance or np_ci[0] <= chance, "dp_ci": dp_ci,
                                          "nonprivate_ci": np_ci, "chance": chance}
    return targets


def print_targets(benchmark: str, targets: dict) -> None:
    """One line per target: passed or not, and the paired difference (or the figures) it rests on."""
    print(f"\n{benchmark}: targets")
    for name, t in targets.items():
        detail = (f"{t['best'] + ': ' if 'best' in t else ''}diff {100 * t['diff']['diff']:+.1f} points (95% CI "
                  f"{100 * t['diff']['ci'][0]:+.1f} to {100 * t['diff']['ci'][1]:+.1f})" if "diff" in t else
                  ", ".join(f"{k} {v}" for k, v in t.items() if k != "passed"))
        print(f"  [{'ok' if t['passed'] else 'FAIL'}] {name}: {detail}")


def row_name(key) -> str:
    obj, init, eps = key
    return f"{obj or 'encoder'}/{init}" + ("" if eps is None else f"/ε={eps:g}")


def table_rows(probe: dict, refits: dict, zero: dict, noise: dict, n: int) -> list[dict]:
    """The JSON rows, pixels first: accuracy and interval; for trained rows the schedule's σ, B and σ/B;
    for every encoder the gain over synthetic-only, paired (same seeds, test images and probe resamples)."""
    summaries = summarise(probe, refits)
    zero_summaries = summarise({k: v for k, v in zero.items() if k != "chance"})
    synthetic = (None, "synthetic", None)
    rows = []
    for key in [PIXELS] + [k for k in summaries if k[1] != "pixels"]:
        obj, init, eps = key
        s = summaries[key]
        row = {"objective": obj, "init": init, "epsilon": None if eps is None else ("inf" if eps == math.inf else eps),
               "acc": round(s["acc"], 4), "ci": [round(x, 4) for x in s["ci"]],
               "seeds": len(probe[key]), "n": n}
        if key in noise:
            m = noise[key]
            row.update(sigma=round(m["sigma"], 4), batch=m["batch"], steps=m["steps"],
                       sigma_over_b=float(f"{m['sigma_over_b']:.3g}"),
                       noise_per_coordinate=float(f"{m['noise_per_coordinate']:.3g}"))
        if key != synthetic and init != "pixels":
            d = paired_difference(probe, refits, key, synthetic)
            row["gain_over_synthetic"] = {"diff": round(d["diff"], 4), "ci": [round(x, 4) for x in d["ci"]]}
        if key in zero_summaries:
            z = zero_summaries[key]
            row.update(zero_shot=round(z["acc"], 4), zero_shot_ci=[round(x, 4) for x in z["ci"]])
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    # σ/B, and the noise std on one coordinate of the released averaged gradient: σC/B, or Dp-CLIP's 2σC.
    print(f"  {'objective':<9} {'init':<10} {'ε':>5} {'σ':>6} {'σ/B':>8} {'noise':>8}  {'acc':>6}  {'95% CI':<11}"
          "  gain over synthetic-only")
    for r in rows:
        eps = "—" if r["epsilon"] is None else ("∞" if r["epsilon"] == "inf" else f"{r['epsilon']:g}")
        sigma, per_b, noise = ((f"{r['sigma']:.3f}", f"{r['sigma_over_b']:.2e}", f"{r['noise_per_coordinate']:.2e}")
                               if "sigma" in r else ("", "", ""))
        ci, gain = f"{100 * r['ci'][0]:.1f}–{100 * r['ci'][1]:.1f}", r.get("gain_over_synthetic")
        print(f"  {r['objective'] or '—':<9} {r['init']:<10} {eps:>5} {sigma:>6} {per_b:>8} {noise:>8}  {100 * r['acc']:5.1f}%  {ci:<11}"
              + (f"  {100 * gain['diff']:+.1f} ({100 * gain['ci'][0]:+.1f} to {100 * gain['ci'][1]:+.1f})" if gain else "")
              + (f"   zero-shot {100 * r['zero_shot']:.1f}%" if "zero_shot" in r else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="working directory (default: a temporary one)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epsilons", nargs="+", default=["1", "8", "inf"])
    ap.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override params.yaml (as `dpfm --set`)")
    ap.add_argument("--json", type=Path, metavar="PATH",
                    help="also write the JSON line here (benchmarks/utility_rows/digits.json holds README's run)")
    args = ap.parse_args()
    epsilons = sorted(parse_epsilon(e) for e in args.epsilons)
    params = load_params(str(ROOT / "params.yaml"), [*args.set, "run.device=cpu"])
    work = Path(args.dir or tempfile.mkdtemp(prefix="dpfm-utility-")).resolve()
    started = time.time()
    print(f"utility: working in {work}; seeds {args.seeds}, ε {epsilons}, objectives {args.objectives}", flush=True)
    with inside(work):
        for name in ("shards", "synthetic", "tokenizer"):  # public and seed-independent: once
            if not Path({"shards": "data/shards", "synthetic": "data/synthetic",
                         "tokenizer": "models/tokenizer"}[name]).exists():
                run_stage(name, params)
    from pipeline.data.tokenizer import Tokenizer

    tokenizer = Tokenizer(work / "models/tokenizer")
    n = read_json(work / "data/shards/stats.json")["private"]["usable"]
    probe, refits, zero, noise = {}, {}, {}, {}

    def add(table: dict, key, outcome: np.ndarray) -> None:
        table.setdefault(key, []).append(outcome)

    def score(key, encoder, seed: int) -> None:
        correct, refit = scorer.probe(encoder, seed)
        add(probe, key, correct)
        if refit is not None:
            add(refits, key, refit)

    scorer = None
    for seed in range(args.seeds):
        seed_dir = work / f"seed-{seed}"
        with inside(seed_dir):
            for shared in ("data", "models/tokenizer"):
                link = Path(shared)
                if not link.exists():
                    link.parent.mkdir(parents=True, exist_ok=True)
                    link.symlink_to(work / shared)
            # A known noise key per seed (reproducible rows): allowed on public data as a test run only.
            p = {**params, "run": {**params["run"], "seed": seed}, "dp": {**params["dp"], "noise_seed": 1000 + seed},
                 "privacy": {**params["privacy"], "testing": True}}
            if not Path("models/pretrain/checkpoint.pt").exists():
                run_stage("pretrain", p)
            warm = checkpoints.load("models/pretrain/checkpoint.pt")
            mcfg = warm.model_cfg
            scorer = scorer or Scorer(p, mcfg["img_size"])
            score((None, "synthetic", None), warm.build_encoder(), seed)
            torch.manual_seed(seed)
            score((None, "random", None), build_encoder(mcfg), seed)
            for obj in args.objectives:
                po = {**p, "dp": {**p["dp"], "objective": obj}}
                for init in ("pretrain", "random"):
                    for eps in epsilons:
                        t0 = time.time()
                        model, spent, _ = training.train_point(po, context("curve"), init, eps)
                        key = (obj, INIT_NAMES[init], eps)
                        if key not in noise:  # the same for every seed (a σ calibration, 0.3 s)
                            noise[key] = schedule(po, n, eps)
                        score(key, model.encoder, seed)
                        if obj in ZERO_SHOT_OBJECTIVES and init == "pretrain":
                            add(zero, key, scorer.zero_shot(model, obj, tokenizer, p["model"]["max_caption_len"]))
                        print(f"utility: seed {seed} {row_name(key):<24} probe {np.mean(probe[key][-1]):.3f}"
                              + (f" zero-shot {np.mean(zero[key][-1]):.3f}" if key in zero else "")
                              + f"  ({time.time() - t0:.0f} s, {time.time() - started:.0f} s in all)", flush=True)
    probe, refits, zero = ({k: np.stack(v) for k, v in table.items()} for table in (probe, refits, zero))
    te = scorer.split[1]
    pixels, pixel_refits = scorer.probe(None, 0)
    probe[PIXELS] = pixels[None]
    if pixel_refits is not None:
        refits[PIXELS] = pixel_refits[None]
    zero["chance"] = stats.chance(scorer.es.labels[te])
    targets = check_targets(probe, zero, args.objectives, epsilons, refits)
    rows = table_rows(probe, refits, zero, noise, n)
    print("\nutility: linear probe on", scorer.es.name, f"({len(te)} probe-test images, {args.seeds} seeds; "
          f"intervals over them{' and the probe refits' if refits else ''}); n = {n} private examples")
    print_rows(rows)
    print_targets("utility", targets)
    print(f"utility: {time.time() - started:.0f} s")
    line = json.dumps({"benchmark": "utility", "dataset": scorer.es.name, "n_probe_test": int(len(te)),
                       "probe_refits": scorer.cfg["probe_refits"], "pixels": rows[0],
                       "rows": rows[1:], "targets": {k: bool(t["passed"]) for k, t in targets.items()},
                       "seconds": round(time.time() - started)})
    if args.json:  # written whole or not at all
        with atomic_path(args.json) as tmp:
            tmp.write_text(line + "\n")
    print(line)
    sys.exit(0 if all(t["passed"] for t in targets.values()) else 1)


if __name__ == "__main__":
    main()
