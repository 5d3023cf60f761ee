"""The report's privacy sections: the data card, ε against step, the noise, δ and adjacency texts,
and the run's privacy as released (composed over every DP run charged to the budget)."""

from __future__ import annotations

import math

from pipeline.privacy import budget, owner, release, run_checks
from pipeline.privacy.accounting import bound_text
from pipeline.privacy.plan import Plan

def data_card(stats: dict) -> tuple[str, str, str]:
    """Usable private examples (the n of the accounting, public). What the shard scan excluded, by
    reason, is a statistic of the private data: the card says where the owner finds it, not what it is."""
    private = stats["private"]
    unprotected = (f"; {stats['eval']['usable']} private examples held out for evaluation are NOT protected "
                   "(shards.eval_fraction)" if stats.get("eval_from_private") else "")
    return ("Private data", f"{private['usable']} usable",
            f"from {stats.get('source', '?')}; exclusions by reason are kept for the data owner only "
            f"({owner.path('shards')})" + unprotected)


def epsilon_curves(ver: dict) -> dict:
    """{accountant: (steps, eps)}: verify's own curve when it wrote one, else recomputed as verify does,
    for the run's adjacency (an older verification.json)."""
    given = ver.get("epsilon_curve")
    if not given:
        adjacency = ver.get("adjacency", "add_remove")
        given = run_checks.epsilon_curves(ver["sigma"], ver["sample_rate"], ver["steps"], ver["delta"],
                                          run_checks.supporting(list(ver["epsilon"]), adjacency), adjacency)
    return _curves_from(given)


def _curves_from(given) -> dict:
    """Accepts {acc: [[step, eps], ...]}, {"steps": [...], acc: [...]} or [{"step": s, acc|"epsilon": e}, ...]."""
    if isinstance(given, dict) and "steps" in given:
        return {a: (given["steps"], v) for a, v in given.items() if a != "steps"}
    if isinstance(given, dict):
        return {a: ([p[0] for p in v], [p[1] for p in v]) for a, v in given.items()}
    names = sorted({k for p in given for k in p if k != "step"})
    return {("ε" if a == "epsilon" else a): ([p["step"] for p in given if a in p], [p[a] for p in given if a in p])
            for a in names}


def noise_text(ver: dict, plan: Plan) -> str:
    """σ, the noise std, and what decides utility: the noise on one coordinate of the averaged gradient.
    Per example it is std/B and falls as the batch grows; per batch (Dp-CLIP) the released clipped
    mean carries the whole std whatever the batch. Beside it, the noise on the mean of all T steps'
    gradients (÷√T): what compares schedules, since past σ ~1.5 only n and ε move it."""
    std = plan.noise_std
    batch = ver["sample_rate"] * ver["n"]
    if plan.clipping == "per_batch":
        per = (f"on the clipped batch mean {std:.3g}, whatever the batch; over its {plan.steps} steps "
               f"std/√T = {std / math.sqrt(plan.steps):.3g}")
    else:
        per = (f"per averaged coordinate std/B = {std / batch:.3g} ({noise_scale_text(plan)}); "
               f"over its {plan.steps} steps std/(B·√T) = {std / batch / math.sqrt(plan.steps):.3g}")
    # Where the draws stop (privacy/noise_edge.py): 12.12 std now, 5.77 for a ledger from fp32 noise.
    return f"σ = {ver['sigma']:.4f} (std {std:.4f}, drawn to {plan.noise_edge:.2f} std); {per}"


def noise_scale_text(plan: Plan) -> str:
    """What a DP accuracy is read beside: the noise on one coordinate of the averaged gradient, σ/B
    (per example: it falls as the batch grows), or Dp-CLIP's 2σC on the batch's clipped mean (per
    batch: whatever B)."""
    if plan.clipping == "per_batch":
        return f"2σC = {plan.noise_std:.3g}, whatever B"
    return f"σ/B = {plan.sigma / plan.denominator:.3g}"


def delta_text(delta: float, param) -> str:
    named = f" = {param}" if isinstance(param, str) else ""
    return f"{bound_text(delta, 2, exponent=True)}{named}"


def adjacency_text(ver: dict) -> str:
    """Which neighbours the ε is for, whether it covers the released n, and the other adjacency's ε."""
    other = ver.get("epsilon_add_remove", {})
    if ver.get("adjacency", "add_remove") == "replace_one":
        return ("replace-one (neighbours differ in one example, replaced; n is the same on both sides, so releasing "
                "it is covered); add/remove, as the literature states it: "
                + ", ".join(f"{a.upper()} ε = {bound_text(v, 4)}" for a, v in other.items()))
    return ("add/remove (one example added or removed, as the literature states it): this ε does NOT cover "
            f"releasing n = {ver['n']}, which this report does; privacy.adjacency: replace_one covers it")


def final_privacy(params: dict, ledger: dict, ver: dict, stats: dict) -> dict:
    """The run's privacy as released: this model's ε, what every DP run charged to the budget composes to
    (recomputed now, after the curve's and the seeds' trainings), and, when something ran outside
    DP (privacy/release.py), composed ε = ∞ with the reasons."""
    c = budget.composition(ledger, ver["delta"])
    reasons = release.not_private_reasons(params, stats, c)
    return {"epsilon_run": ver["epsilon_reported"], "epsilon_dp_runs": c["epsilon_dp_runs"],
            "epsilon_composed": math.inf if reasons else c["epsilon"], "private": not reasons,
            "not_private": reasons, "runs": c["runs"], "objectives": [r["objective"] for r in c["by_run"]],
            "delta": ver["delta"], "delta_composed": c["delta"], "accountant": ver["accountant"]}
