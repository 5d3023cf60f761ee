"""The `curve` stage: the privacy–utility curve, linear-probe accuracy against ε.

For each init in `curve.inits` (the synthetic warm start, random weights) and each ε in
`curve.epsilons`, the dp-train recipe is trained again at that ε (σ calibrated to it; every other
setting as in params.yaml) and its encoder probed on the first eval set with the `evaluate`
protocol. ε = ∞ is the recipe's non-private twin (same sampling, no clipping or noise; the DP
recipe's steps and learning rate unless `dp.nonprivate` gives it a schedule of its own).

With `curve.seeds` > 1 each point is trained once per training seed (run.seed + k) and its
interval covers the seeds as well as the test images (and, as evaluate's do, with
`evaluate.probe_refits`, which images the probe is fit on). Every private training is a DP training on
the private data, charged to its budget like dp-train (privacy/budget.py): the report shows what
all of them compose to. The point that repeats dp-train
(same ε, same init) is the same run (same state directory) and is not charged twice. Each point's
ε is checked by the verify stage's own checks before it is shown.
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.eval.protocols import checked_eval_sets
from pipeline.eval.probe import features, probe_outcomes
from pipeline.eval.stats import accuracy_ci
from pipeline.io import read_json, write_json
from pipeline.models import VIT_SIZES, ModelConfig
from pipeline.privacy import budget, release
from pipeline.privacy.training import check_point_plans, train_point


def run(params: dict, ctx) -> None:
    cfg, ev, seed = params["curve"], params["evaluate"], params["run"]["seed"]
    stats = read_json(ctx.stage.input("shards") / "stats.json")
    if release.curve_trains_nonprivate(cfg):  # refused before any DP point spends budget
        release.check_nonprivate(params["privacy"], stats.get("source"), "curve.epsilons' ε = ∞ point")
    if cfg["inits"]:  # a point dp-train would refuse (its σ, the noise edge) stops the stage before one is charged
        check_point_plans(params, stats["private"]["usable"])
    # The curve probes the first eval set, split as evaluate splits it. Every set is checked against
    # evaluate's protocol, and every image decoded, before any point is charged: evaluate runs after
    # these trainings, and what it would refuse must stop them.
    mcfg = ModelConfig.from_params(params["model"], params["dp"]["objective"])
    es, split = checked_eval_sets(ev["sets"], ev, seed, mcfg.img_size, VIT_SIZES[mcfg.size]["depth"],
                                  decode=True)[0] if cfg["epsilons"] and cfg["inits"] else (None, None)
    points, is_main = [], True
    for init in cfg["inits"]:
        for epsilon in sorted(cfg["epsilons"]):
            rows, refits, spent = [], [], []
            for k in range(cfg["seeds"]):  # training seed seed + k: its own init, masks, key and budget entry
                p = {**params, "run": {**params["run"], "seed": seed + k}}
                model, eps, is_main = train_point(p, ctx, init, epsilon, f"curve.{init}.eps_{epsilon}.seed_{seed + k}.")
                x = features(model.encoder, es.images, ev, ctx.device, what=f"the curve's {init} ε={epsilon} model")
                # evaluate's protocol, its probe seed too: only the training seed varies, as in evaluate's rows
                outcomes, refit = probe_outcomes(x, es.labels, split, ev, seed, ctx.device)
                rows.append(outcomes)
                if refit is not None:  # the interval covers which images the probe is fit on, as evaluate's does
                    refits.append(refit)
                spent.append(eps)
            correct = np.stack(rows)  # (seeds, test examples): the interval covers both (eval/stats.py)
            ci = accuracy_ci(correct, seed, refits=np.stack(refits) if refits else None)
            point = {"init": init, "epsilon": epsilon if math.isfinite(epsilon) else "inf",
                     "epsilon_spent": None if spent[0] is None else max(spent), "seeds": cfg["seeds"],
                     "linear_probe": float(correct.mean()), "linear_probe_ci": ci}
            points.append(point)
            lo, hi = point["linear_probe_ci"]
            print(f"curve: {init:<8} ε={epsilon:<5} linear probe {point['linear_probe']:.3f} (95% CI {lo:.3f}-{hi:.3f}"
                  f"{f', {len(rows)} seeds' if len(rows) > 1 else ''})")
            name = f"curve.{init}.eps_{epsilon}.linear_probe"  # with its interval, as evaluate logs its rows
            ctx.tracker.log_metrics({name: point["linear_probe"], f"{name}_ci_lo": lo, f"{name}_ci_hi": hi})
    if not is_main:
        return
    # The ε = ∞ points, a known noise key, an earlier release outside DP on the budget (dp-train's twin, ...):
    # labelled on the curve's own run, as the other stages label theirs.
    dp_ledger = ctx.stage.input("dp") / "ledger.json"  # the data's identity (absent: a curve run by hand first)
    ledger = read_json(dp_ledger) if dp_ledger.is_file() else None
    composed = budget.composition(ledger, ledger["delta"]) if ledger else None
    ctx.tracker.set_tags(release.not_private_tags(release.not_private_reasons(params, stats, composed)))
    write_json(ctx.stage.output("curve"), {"run": ledger and ledger["run"],  # evaluate checks it is made for this run
                     "objective": params["dp"]["objective"], "set": ev["sets"][0]["name"] if es else None,
                     "n_probe_test": int(len(split[1])) if split else 0, "seeds": cfg["seeds"],
                     "probe_refits": ev["probe_refits"], "points": points})
    ctx.tracker.log_artifact(str(ctx.stage.output("curve")))
