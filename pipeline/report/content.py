"""The report's content, section by section: what render.py turns into HTML and Markdown. Figures
are written into the output directory as the sections are built."""

from __future__ import annotations

import datetime
import math
import shutil
from pathlib import Path

from pipeline.eval.stats import released
from pipeline.objectives import recipe_title
from pipeline.privacy.accounting import bound_text
from pipeline.privacy.plan import Plan
from pipeline.report import plots
from pipeline.report.accuracy import headline_sentence, points_ci, protocol_legend, signed
from pipeline.report.curves import curve_section
from pipeline.report.privacy import (adjacency_text, data_card, delta_text, epsilon_curves, noise_scale_text,
                                     noise_text)
from pipeline.report.render import accuracy_table, params_yaml


def accuracy_sets(metrics: dict, objective: str, out: Path, noise: str) -> list[dict]:
    """One table, figure and legend per eval set; the DP row labelled with its `noise` (σ/B) in both."""
    sets = []
    for name, s in metrics["sets"].items():
        columns, rows = accuracy_table(s, metrics["models"], metrics.get("model_order"))
        for row in (r for r in rows if r["name"] == "dp"):  # beside its noise (over seeds: each one's)
            row["label"] += f" ({noise})"
        fig = out / f"accuracy_{name}.png"
        plots.plot_accuracy(columns, rows, s["chance"], fig)
        sets.append({
            "name": name, "columns": columns, "rows": rows, "figure": fig,
            "note": (f"{len(s['classes'])} classes; the public held-out set is split into {s['n_probe_train']} "
                     f"probe-train / {s['n_probe_test']} probe-test images; chance {100 * s['chance']:.1f}%; in "
                     f"parentheses: 95% bootstrap intervals (what they cover: below the table)"
                     + ("; raw pixels: the same probe on the input pixels (at most 32 px)." if "pixels" in s["results"]
                        else ".")),
            "legend": protocol_legend(metrics["protocol"], columns, objective),
        })
    return sets


def summary_cards(ver: dict, dp: dict, stats: dict | None, lp: dict, lp_ci: dict, models: dict, versus: dict,
                  primary: str, privacy: dict, noise: str) -> list:
    """The cards at the top: ε, the data, and each model's linear probe (its 95% interval where there is
    one) against the DP model's. The ε is what everything the report releases composes to: with the
    curve's points or evaluate's extra seeds (a row's mean over k DP trainings), more than the released
    model's own."""
    mechanism = (f"δ = {delta_text(ver['delta'], dp.get('delta'))} ({ver['accountant'].upper()}); "
                 f"{ver['steps']} DP steps on n = {ver['n']}")
    if privacy["private"] and privacy["runs"] == 1:
        cards = [("Privacy", f"ε = {bound_text(ver['epsilon_reported'], 2)}", mechanism)]
    else:
        composed = privacy["epsilon_composed"]
        cards = [("Privacy", "ε = ∞" if math.isinf(composed) else f"ε = {bound_text(composed, 2)}",
                  f"all this report releases ({privacy['runs']} DP run{'s' if privacy['runs'] > 1 else ''} charged to "
                  f"data/budget{'' if privacy['private'] else '; NOT PRIVATE as a whole'}); the released model alone: "
                  f"ε = {bound_text(ver['epsilon_reported'], 2)}, {mechanism}")]
    cards.append(data_card(stats) if stats is not None else ("Data", "n/a", "no shard stats"))
    for name in lp:
        diff = (f"linear probe on {primary}; σ = {ver['sigma']:.3g}, {noise}" if name == "dp" else
                f"DP model {points_ci(versus[name]) if name in versus else signed(100 * (lp['dp'] - lp[name])) + ' points'}")
        ci = lp_ci.get(name)
        cards.append((models[name]["label"], f"{100 * lp[name]:.1f}%",
                      (f"95% CI {100 * ci[0]:.1f}–{100 * ci[1]:.1f}%; " if ci else "") + diff))
    return cards


def point_plan(params: dict, ver: dict, epsilon: float) -> Plan:
    """The mechanism the curve trained its point at `epsilon` with: the recipe's, σ calibrated to it
    (the same from either init)."""
    from pipeline.privacy.plan import plan_mechanism
    from pipeline.privacy.training import point_params

    return plan_mechanism(point_params(params, "pretrain", epsilon)["dp"], ver["n"], ver.get("adjacency", "add_remove"))


def clipping_options_text(dp: dict) -> str:
    """What the clipping row adds for clip groups and mask views (nothing at their defaults)."""
    share, views = dp.get("encoder_clip_share"), dp.get("mask_views", 1)
    text = "" if share is None else (f"; image encoder's part clipped to C·√{share:g}, the rest to "
                                     f"C·√{1 - share:g} (the whole within C)")
    return text + (f"; each example's gradient the mean over {views} masked views, clipped once" if views > 1 else "")


def released_weights_text(dp: dict) -> str:
    """What the steps row adds when the released model is the iterates' moving average, or keeps modules
    at their starting weights (nothing otherwise)."""
    decay, frozen = dp.get("ema_decay", 0.0), dp.get("frozen", [])
    text = f"; the model released is the moving average of the iterates (decay {decay:g}), the same ε" if decay else ""
    return text + (f"; not trained, released as they started (no ε): {', '.join(frozen)}" if frozen else "")


def mechanism_rows(ver: dict, plan: Plan, dp: dict, privacy: dict) -> list[tuple[str, str]]:
    """The mechanism table: what was run, what ε it has, and what every DP run charged to the budget composes to."""
    rows = [
        ("recipe", recipe_title(plan.objective)),
        ("private examples n", f"{ver['n']}"),
        ("sampling", f"{plan.sampler}, rate q = {ver['sample_rate']:.5g} "
                     f"(expected batch {ver['sample_rate'] * ver['n']:.0f})"),
        ("clipping", f"C = {plan.clip_norm}, sensitivity {plan.sensitivity:g}·C ({plan.clipping.replace('_', ' ')})"
                     + clipping_options_text(dp)),
        ("noise", noise_text(ver, plan)),
        ("steps", f"{ver['steps']} (planned {plan.steps})" + released_weights_text(dp)),
        ("δ", delta_text(ver["delta"], dp.get("delta"))),
        ("ε", ", ".join(f"{a.upper()} {bound_text(v, 4)}" for a, v in ver["epsilon"].items())
         + f" (target {plan.target_epsilon})"),
        ("adjacency", adjacency_text(ver)),
    ]
    runs = f"{privacy['runs']} DP run{'s' if privacy['runs'] > 1 else ''} ({', '.join(privacy['objectives'])})"
    if privacy["private"]:  # several models trained on one dataset release more than any one
        rows.append(("ε over all DP runs charged to data/budget",
                     f"{bound_text(privacy['epsilon_composed'], 4)} at δ = "
                     f"{bound_text(privacy['delta_composed'], 2, exponent=True)} (the smallest of theirs), {runs}"))
    else:
        rows.append(("ε of this run's outputs", f"∞: NOT PRIVATE as a whole ({'; '.join(privacy['not_private'])}); "
                     f"its {runs} compose to {bound_text(privacy['epsilon_dp_runs'], 4)}"))
    if dp.get("log_private_stats"):
        rows.append(("released outside ε", "counts of dropped non-finite private examples "
                     "(dp.log_private_stats: true): not covered by the ε above"))
    return rows


def build(params: dict, ver: dict, plan: Plan, metrics: dict, out: Path, mlflow_points: tuple[list, str],
          privacy: dict, histories: tuple[dict, dict], contact_sheet: Path, stats: dict | None) -> dict:
    """Everything the renderers need: `histories` are pretrain's and dp-train's (held-out loss),
    `stats` the shards' public stats.json (None when absent)."""
    primary, models, dp = metrics["primary_set"], metrics["models"], params.get("dp", {})
    figures = {"losses": out / "losses.png", "epsilon": out / "epsilon.png",
               "privacy_utility": out / "privacy_utility.png", "contact_sheet": out / "contact_sheet.png"}
    sets = accuracy_sets(metrics, plan.objective, out, noise_scale_text(plan))
    primary_rows = {row["name"]: row for row in next(s for s in sets if s["name"] == primary)["rows"]}
    lp = {name: row["cells"][0][0] for name, row in primary_rows.items()}
    lp_ci = {name: row["cells"][0][2] for name, row in primary_rows.items()}

    plots.plot_epsilon(epsilon_curves(ver), plan.target_epsilon, (ver["steps"], ver["epsilon_reported"]),
                       figures["epsilon"], None if privacy["private"] else "NOT PRIVATE as a whole: ε = ∞ for the "
                       "run's outputs (this ε is the model's)")
    plots.plot_losses(*histories, figures["losses"])
    shutil.copyfile(contact_sheet, figures["contact_sheet"])
    points, source = mlflow_points
    drawable = [p for p in points if math.isfinite(p["epsilon"]) and math.isfinite(p["accuracy"])]
    if len(drawable) < len(points):  # a run logged with a NaN accuracy or no finite ε has no place on the axes
        source += f"; {len(points) - len(drawable)} logged without a finite ε and accuracy, not drawn"
        points = drawable
    # The star is the released model at its ε (over seeds, the first is it) as this evaluation scored it: an
    # MLflow run of the same model may have scored it with another protocol, or be an older one.
    dp_row = metrics["sets"][primary]["results"]["dp"]
    points = [p for p in points if not p["current"]] + [
        {"epsilon": ver["epsilon_reported"], "accuracy": released(dp_row)["linear_probe"],
         "ci": released(dp_row).get("linear_probe_ci"), "objective": plan.objective, "current": True}]
    # This run's verdict is the report's own (its parent is tagged after it ends).
    points = [p | {"private_as_a_whole": privacy["private"]} if p["current"] else p for p in points]
    plots.plot_privacy_utility(points, {n: (models[n]["label"], lp[n], lp_ci.get(n))
                                        for n in ("synthetic", "nonprivate", "random") if n in lp},
                               figures["privacy_utility"])
    curve = curve_section(metrics.get("privacy_utility"),
                          {n: (models[n]["label"], lp[n], lp_ci.get(n)) for n in ("synthetic", "random", "pixels")
                           if n in lp},
                          out / "privacy_utility_curve.png", dp, lambda e: noise_scale_text(point_plan(params, ver, e)))

    primary_set = metrics["sets"][primary]
    headline = headline_sentence(primary, primary_set, models, {
        "n": ver["n"], "batch": ver["sample_rate"] * ver["n"], "sigma": ver["sigma"],
        "epsilon": ver["epsilon_reported"], "noise": plan.noise_std / plan.denominator,  # per averaged coordinate
        "per_batch": plan.clipping == "per_batch", "epsilon_composed": privacy["epsilon_composed"],
        "scale": noise_scale_text(plan)})
    if not privacy["private"]:
        headline = f"NOT PRIVATE as a whole: {'; '.join(privacy['not_private'])}. " + headline
    from pipeline.tracking import git_commit

    model = params.get("model", {})
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return {
        "title": params["report"]["title"], "verification": ver, "privacy": privacy, "curve": curve, "sets": sets,
        "figures": figures,
        "subtitle": (f"{recipe_title(plan.objective)} · ViT-{model.get('size', '?')} at {model.get('img_size', '?')} px "
                     f"· generated {when} · commit {git_commit()[:12]}"),
        "headline": headline + (" " + curve["sentence"] if curve else ""),
        "cards": summary_cards(ver, dp, stats, lp, lp_ci, models, primary_set.get("dp_versus", {}), primary, privacy,
                               noise_scale_text(plan)),
        "delta_text": delta_text(ver["delta"], dp.get("delta")),
        "mechanism": mechanism_rows(ver, plan, dp, privacy), "colors": plots.MODEL_COLORS,
        "params_yaml": params_yaml(params),
        "pu_caption": (f"Linear-probe accuracy on {primary} against verified ε (linear up to 1, logarithmic "
                       f"beyond), with its 95% interval where the run logged one. {source}. Star: this run. "
                       f"Baselines from this run: synthetic-only (no private data, ε = 0), non-private (ε = ∞, "
                       f"when trained) and random init. Each point keeps the eval protocol of its own run."
                       + (" A hollow point is a model DP at its ε from a run NOT PRIVATE as a whole (its other "
                          "outputs are not covered)." if any(p.get("private_as_a_whole") is False for p in points)
                          else "")),
        "eps_caption": (f"ε after each DP step at δ = {bound_text(ver['delta'], 2, exponent=True)}, per accountant "
                        f"({ver['accountant'].upper()} is reported; the others are independent upper bounds)."),
        "loss_caption": ("Left: MAE loss on synthetic images (non-private). Right: the DP model's loss on the "
                         + ("held-out split (where it came from is recorded in the shards' stats.json, absent here)"
                            if stats is None else
                            "held-out split carved out of the private data (shards.eval_fraction: NOT covered by ε)"
                            if stats.get("eval_from_private") else "public held-out split")
                         + "; the training loss on private data is never shown (it is not DP)."),
        "sheet_caption": "A sample of the procedural (Shaders21k-style) images the encoder was pretrained on.",
        "footer": ("dpfm report · inputs: the verification, the evaluation metrics, the DP model's ledger and the "
                   "training histories · open report.html offline in any browser; report.md has the same content."),
    }
