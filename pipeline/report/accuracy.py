"""The report's accuracy sections: the protocol legend and the headline's plain-words verdicts, each
a paired 95% interval against a baseline."""

from __future__ import annotations

import math

from pipeline.objectives import OBJECTIVES
from pipeline.privacy.accounting import bound_text

def protocol_legend(protocol: dict, columns: list[str], objective: str | None) -> str:
    """How each column of the accuracy table was measured (only the columns present)."""
    seeds, refits = protocol.get("seeds", 1), protocol.get("probe_refits", 0)
    parts = ["Accuracy in % on the probe-test split, with its 95% bootstrap interval over the test images"
             + (f", over {refits} refits of the linear probe on resamples of probe-train (which images it is fit on)"
                if refits else "")
             + (f" and {seeds} training seeds (the DP, non-private and random-init rows are means over the seeds; "
                "the synthetic encoder and the pixels are one fixed artifact each; over so few seeds the interval "
                "reads narrower than 95% where they disagree by more than the test images resolve)." if seeds > 1 else
                " (one training seed).")
             ,
             f"Linear probe: {protocol['probe_solver']} on frozen {protocol['pool']}-pooled features of "
             + ("every block" if protocol["last_k_blocks"] == "all" else f"the last {protocol['last_k_blocks']} block(s)")
             + ", standardised."]
    if any(c.endswith("-shot") for c in columns):
        parts.append(f"K-shot: logistic regression on K examples per class, mean ± std over "
                     f"{protocol['fewshot']['repeats']} seeded class-balanced subsets"
                     + (", of the first training seed's model." if seeds > 1 else "."))
    if any(c.endswith("FT") for c in columns):
        parts.append(f"FT: the whole encoder and a linear head fine-tuned on K examples per class (AdamW), "
                     f"mean ± std over {protocol['finetune']['repeats']} subsets"
                     + (", of the first training seed's model." if seeds > 1 else "."))
    if "Zero-shot" in columns:
        how = {"caption_loss": "the class whose prompt captions have the lowest loss",
               "embedding": "the class whose prompt embedding is closest (cosine)"}[OBJECTIVES[objective].zero_shot]
        parts.append(f"Zero-shot: {how}, prompts averaged over templates; — where a model has no text tower.")
    return " ".join(parts + ["Bold: best in column."])


def signed(x: float) -> str:
    return f"{x:+.1f}".replace("-", "−")


def points_ci(d: dict) -> str:
    """A paired difference in points with its interval: `+2.1 points (95% CI +0.4 to +3.8)`."""
    return f"{signed(100 * d['diff'])} points (95% CI {signed(100 * d['ci'][0])} to {signed(100 * d['ci'][1])})"


def verdict(label: str, d: dict) -> str:
    """In plain words: better, worse, or not distinguishable at this test-set size."""
    if d["ci"][0] > 0:
        return f"it beats {label} by {points_ci(d)}"
    if d["ci"][1] < 0:
        return f"it is BELOW {label}: {points_ci(d)}"
    return f"it cannot be told apart from {label}: {points_ci(d)}, an interval that includes 0"


def headline_sentence(primary: str, set_metrics: dict, models: dict, mechanism: dict) -> str:
    """Plain sentences: the DP model's linear probe, then against each baseline with a paired 95%
    interval; when it does not beat its synthetic warm start, the likely reason."""
    results = set_metrics["results"]
    if "dp" not in results:
        return ""
    dp = results["dp"]
    text = f"On {primary}, the DP model's linear probe reaches {100 * dp['linear_probe']:.1f}%"
    ci = (f"95% CI {100 * dp['linear_probe_ci'][0]:.1f}–{100 * dp['linear_probe_ci'][1]:.1f}%; "
          if "linear_probe_ci" in dp else "")
    text += f" ({ci}{mechanism['scale']})"  # a DP accuracy is read beside its noise (each training's, over seeds)
    if "first_seed" in dp:  # a mean over evaluate.seeds trainings: the released checkpoint is the first
        first, composed = dp["first_seed"], mechanism["epsilon_composed"]
        text += (f", the mean of {dp['seeds']} DP trainings (with every DP run charged to the budget, ε = "
                 f"{'∞' if math.isinf(composed) else bound_text(composed, 2)}); the released checkpoint's own, at ε = "
                 f"{bound_text(mechanism['epsilon'], 2)}, is {100 * first['linear_probe']:.1f}% (95% CI "
                 f"{100 * first['linear_probe_ci'][0]:.1f}–{100 * first['linear_probe_ci'][1]:.1f}%)")
    versus = set_metrics.get("dp_versus", {})
    order = ("synthetic", "random", "pixels", "nonprivate")  # the warm start first: ViP's question
    parts = [verdict(models[name]["label"], versus[name]) for name in order if name in versus and name in models]
    text += (": " + "; ".join(parts) + "." if parts else ".")
    warm = versus.get("synthetic")
    if warm is not None and warm["ci"][0] <= 0:
        run = (f"n = {mechanism['n']} private examples, an expected batch of {mechanism['batch']:.0f} and "
               f"σ = {mechanism['sigma']:.2f} at ε = {bound_text(mechanism['epsilon'], 2)}")
        if mechanism["per_batch"]:  # the clipped quantity is the batch's mean: its noise is 2σC whatever the batch
            text += (f" DP training did not improve on its synthetic warm start here. Dp-CLIP clips the batch's mean "
                     f"gradient, so its noise std per coordinate is 2σ·C = {mechanism['noise']:.3g} however large the "
                     f"batch ({run}): only a larger σ's smaller ε buys less of it.")
        else:
            text += (f" DP training did not improve on its synthetic warm start here. The likely reason: DP-SGD's noise "
                     f"relative to the averaged gradient shrinks with the expected batch, and this run has {run} "
                     f"(noise std per averaged coordinate σ·C/batch = {mechanism['noise']:.3g}); ViP and DP-Cap use "
                     "batches of ~100k from hundreds of millions of examples.")
    return text
