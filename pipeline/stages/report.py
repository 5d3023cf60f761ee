"""The `report` stage: one self-contained HTML page (opens offline in any browser) and Markdown.

Content: the params, ε with its accountant and the verification checks, the accuracy table
beside the baselines, loss curves, ε against step, privacy–utility across the MLflow
experiment's runs, and the synthetic contact sheet.
"""

from __future__ import annotations

import datetime
import math
import shutil
from pathlib import Path

from pipeline.eval import plots
from pipeline.eval.render import accuracy_table, params_yaml, render_html, render_markdown
from pipeline.io import atomic_dir, read_json, write_json
from pipeline.objectives import OBJECTIVES, recipe_title
from pipeline.privacy import accounting, budget, owner, release
from pipeline.privacy.plan import Plan

OUT_DIR = "results/report"
VERIFICATION, METRICS = "results/privacy/verification.json", "results/eval/metrics.json"
LEDGER = "models/dp/ledger.json"
SHARD_STATS = "data/shards/stats.json"


def data_card(stats: dict) -> tuple[str, str, str]:
    """Usable private examples (the n of the accounting, public). What the shard scan excluded, by
    reason, is a statistic of the private data: the card says where the owner finds it, not what it is."""
    private = stats["private"]
    unprotected = (f"; {stats['eval']['usable']} private examples held out for evaluation are NOT protected "
                   "(shards.eval_fraction)" if stats.get("eval_from_private") else "")
    return ("Private data", f"{private['usable']} usable",
            f"from {stats.get('source', '?')}; exclusions by reason are kept for the data owner only "
            f"({owner.path('shards')})" + unprotected)


# -- ε against step ---------------------------------------------------------------------------

def epsilon_curves(ver: dict, points: int = 20) -> dict:
    """{accountant: (steps, eps)}: verify's own curve when it wrote one, else recomputed."""
    given = ver.get("epsilon_curve")
    if given:
        return _curves_from(given)
    steps = ver["steps"]
    grid = sorted({max(1, round(steps * i / points)) for i in range(points + 1)})
    return {a: (grid, accounting.epsilon_curve(ver["sigma"], ver["sample_rate"], grid, ver["delta"], accountant=a))
            for a in ver["epsilon"]}


def _curves_from(given) -> dict:
    """Accepts {acc: [[step, eps], ...]}, {"steps": [...], acc: [...]} or [{"step": s, acc|"epsilon": e}, ...]."""
    if isinstance(given, dict) and "steps" in given:
        return {a: (given["steps"], v) for a, v in given.items() if a != "steps"}
    if isinstance(given, dict):
        return {a: ([p[0] for p in v], [p[1] for p in v]) for a, v in given.items()}
    names = sorted({k for p in given for k in p if k != "step"})
    return {("ε" if a == "epsilon" else a): ([p["step"] for p in given if a in p], [p[a] for p in given if a in p])
            for a in names}


# -- privacy-utility across the MLflow experiment ---------------------------------------------

def experiment_points(experiment: str, current_model_hash: str | None) -> tuple[list[dict], str]:
    """One point per DP model evaluated in the experiment: its verified ε and DP linear-probe accuracy.

    ε comes from the evaluate run itself (it logs the verified ε it evaluated) or, for runs that
    predate that, from the finished dp-train run of the same pipeline invocation. A model
    evaluated several times (same `dvc.input.models/dp` hash) counts once, at its latest run.
    """
    try:
        from mlflow.tracking import MlflowClient

        from pipeline.tracking import tracking_uri

        client = MlflowClient(tracking_uri())
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return [], f"MLflow experiment {experiment!r} not found: only this run is shown"

        def finished(stage: str):
            return client.search_runs([exp.experiment_id], max_results=5000, order_by=["attributes.start_time DESC"],
                                      filter_string=f"tags.`dpfm.stage` = '{stage}' and attributes.status = 'FINISHED'")

        dp_by_parent = {r.data.tags["mlflow.parentRunId"]: r for r in reversed(finished("dp-train"))
                        if r.data.tags.get("mlflow.parentRunId")}
        evaluate_runs = finished("evaluate")  # newest first
    except Exception as err:  # the report must still be written when the tracking store is unreachable
        return [], f"MLflow not readable ({type(err).__name__}): only this run is shown"
    points, seen = [], set()
    for run in evaluate_runs:
        m, tags = run.data.metrics, run.data.tags
        model = tags.get("dvc.input.models/dp", run.info.run_id)
        dp_run = dp_by_parent.get(tags.get("mlflow.parentRunId"))
        eps = m.get("epsilon", dp_run.data.metrics.get("epsilon") if dp_run else None)
        acc = m.get("dp_linear_probe_acc")
        if model in seen or eps is None or acc is None:
            continue
        seen.add(model)
        objective = tags.get("dpfm.objective") or (dp_run.data.params.get("dp.objective") if dp_run else None)
        points.append({"epsilon": eps, "accuracy": acc, "objective": objective, "current": model == current_model_hash})
    return points, f"{len(points)} DP model(s) evaluated in MLflow experiment {experiment!r}"


# -- content ----------------------------------------------------------------------------------

def protocol_legend(protocol: dict, columns: list[str], objective: str | None) -> str:
    """How each column of the accuracy table was measured (only the columns present)."""
    seeds = protocol.get("seeds", 1)
    parts = ["Accuracy in % on the probe-test split, with its 95% bootstrap interval over the test images"
             + (f" and {seeds} training seeds (the DP, non-private and random-init rows are means over the seeds; "
                "the synthetic encoder and the pixels are one fixed artifact each)." if seeds > 1 else
                " (one training seed).")
             ,
             f"Linear probe: {protocol['probe_solver']} on frozen {protocol['pool']}-pooled features of "
             + ("every block" if protocol["last_k_blocks"] == "all" else f"the last {protocol['last_k_blocks']} block(s)")
             + ", standardised."]
    if any(c.endswith("-shot") for c in columns):
        parts.append(f"K-shot: logistic regression on K examples per class, mean ± std over "
                     f"{protocol['fewshot']['repeats']} seeded class-balanced subsets.")
    if any(c.endswith("FT") for c in columns):
        parts.append(f"FT: the whole encoder and a linear head fine-tuned on K examples per class (AdamW), "
                     f"mean ± std over {protocol['finetune']['repeats']} subsets.")
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
    if "linear_probe_ci" in dp:
        text += f" (95% CI {100 * dp['linear_probe_ci'][0]:.1f}–{100 * dp['linear_probe_ci'][1]:.1f}%)"
    versus = set_metrics.get("dp_versus", {})
    order = ("synthetic", "random", "pixels", "nonprivate")  # the warm start first: ViP's question
    parts = [verdict(models[name]["label"], versus[name]) for name in order if name in versus and name in models]
    text += (": " + "; ".join(parts) + "." if parts else ".")
    warm = versus.get("synthetic")
    if warm is not None and warm["ci"][0] <= 0:
        text += (f" DP training did not improve on its synthetic warm start here. The likely reason: DP-SGD's noise "
                 f"relative to the averaged gradient shrinks with the expected batch, and this run has "
                 f"n = {mechanism['n']} private examples, an expected batch of {mechanism['batch']:.0f} and "
                 f"σ = {mechanism['sigma']:.2f} at ε = {mechanism['epsilon']:.2f} (noise std per averaged "
                 f"coordinate ≈ σ·C/batch = {mechanism['sigma'] * mechanism['clip'] / mechanism['batch']:.3g}); "
                 "ViP and DP-Cap use batches of ~100k from hundreds of millions of examples.")
    return text


def noise_text(ver: dict, plan: Plan) -> str:
    """σ, the noise std, and what decides utility: the noise on one coordinate of the averaged gradient.
    Per example it is std/B and falls as the batch grows; per batch (Dp-CLIP) the released clipped
    mean carries the whole std whatever the batch."""
    std = plan.noise_std
    batch = ver["sample_rate"] * ver["n"]
    if plan.clipping == "per_batch":
        per = f"on the clipped batch mean {std:.3g}, whatever the batch"
    else:
        per = f"per averaged coordinate std/B = {std / batch:.3g} (σ/B = {ver['sigma'] / batch:.3g})"
    return f"σ = {ver['sigma']:.4f} (std {std:.4f}); {per}"


INIT_LABELS = {"pretrain": "DP from the synthetic warm start", "random": "DP from random init"}


def curve_order(epsilon) -> float:
    return float("inf") if epsilon == "inf" else float(epsilon)


def twin_text(dp: dict) -> str:
    """What the ε = ∞ point is: the DP recipe without clipping or noise, on its own schedule if set."""
    own = {k: v for k, v in dp.get("nonprivate", {}).items() if v is not None and v != dp.get(k)}
    if not own:
        return "∞ is the same recipe without clipping or noise"
    return ("∞ is the recipe without clipping or noise, on a schedule of its own (dp.nonprivate: "
            + ", ".join(f"{k} {v:g}" for k, v in own.items()) + f"; the DP points: steps {dp['steps']}, lr {dp['lr']:g})")


def curve_section(curve: dict | None, baselines: dict, path: Path, dp: dict) -> dict | None:
    """The privacy–utility curve's figure, table (one row per init, one column per ε) and sentence."""
    if not curve or not curve.get("points"):
        return None
    points = curve["points"]
    plots.plot_curve(points, baselines, path)
    epsilons = sorted({p["epsilon"] for p in points}, key=curve_order)
    by = {(p["init"], p["epsilon"]): p for p in points}
    rows = [{"label": INIT_LABELS.get(init, init),
             "cells": [(by[init, e]["linear_probe"], None, by[init, e]["linear_probe_ci"]) if (init, e) in by else None
                       for e in epsilons]}
            for init in INIT_LABELS if any(p["init"] == init for p in points)]

    def path_text(init: str) -> str:
        return " → ".join(f"{100 * by[init, e]['linear_probe']:.1f}% at ε = {'∞' if e == 'inf' else f'{e:g}'}"
                          for e in epsilons if (init, e) in by)

    sentence = "Privacy–utility curve: " + "; ".join(f"{INIT_LABELS[i].replace('DP from', 'from')}, {path_text(i)}"
                                                     for i in INIT_LABELS if any(p["init"] == i for p in points))
    if "synthetic" in baselines:
        sentence += f" (synthetic only, no DP training: {100 * baselines['synthetic'][1]:.1f}%)"
    spent = [p["epsilon_spent"] for p in points if p.get("epsilon_spent")]
    seeds = curve.get("seeds", 1)
    over = f"over {seeds} training seeds and the test images" if seeds > 1 else "over the test images, one seed"
    caption = (f"Linear probe on {curve['set']} ({curve['n_probe_test']} probe-test images; band: 95% bootstrap "
               f"interval {over}) of the {recipe_title(curve['objective'])} recipe retrained at each ε, from each init; "
               f"{twin_text(dp)}. {len(spent)} of the points are DP trainings on the "
               "private data: what all DP runs on it compose to is in the mechanism table.")
    return {"figure": path, "columns": ["ε = ∞" if e == "inf" else f"ε = {e:g}" for e in epsilons], "rows": rows,
            "caption": caption, "sentence": sentence + "."}


def delta_text(delta: float, param) -> str:
    named = f" = {param}" if isinstance(param, str) else ""
    return f"{delta:.2e}{named}"


def gather(params: dict, ver: dict, plan: Plan, metrics: dict, out: Path, mlflow_points: tuple[list, str],
           privacy: dict) -> dict:
    """Everything the renderers need; writes the figures into `out`."""
    primary = metrics["primary_set"]
    models = metrics["models"]
    objective = plan.objective
    dp = params.get("dp", {})
    figures = {"losses": out / "losses.png", "epsilon": out / "epsilon.png",
               "privacy_utility": out / "privacy_utility.png", "contact_sheet": out / "contact_sheet.png"}
    sets = []
    for name, s in metrics["sets"].items():
        columns, rows = accuracy_table(s, models, metrics.get("model_order"))
        fig = out / f"accuracy_{name}.png"
        plots.plot_accuracy(columns, rows, s["chance"], fig)
        sets.append({
            "name": name, "columns": columns, "rows": rows, "figure": fig,
            "note": (f"{len(s['classes'])} classes; the public held-out set is split into {s['n_probe_train']} "
                     f"probe-train / {s['n_probe_test']} probe-test images; chance {100 * s['chance']:.1f}%; in "
                     f"parentheses: 95% bootstrap intervals over those test images"
                     + ("; raw pixels: the same probe on the input pixels (at most 32 px)." if "pixels" in s["results"]
                        else ".")),
            "legend": protocol_legend(metrics["protocol"], columns, objective),
        })
    primary_rows = {row["name"]: row for row in next(s for s in sets if s["name"] == primary)["rows"]}
    lp = {name: row["cells"][0][0] for name, row in primary_rows.items()}

    curves = epsilon_curves(ver)
    final = (ver["steps"], ver["epsilon_reported"])
    plots.plot_epsilon(curves, plan.target_epsilon, final, figures["epsilon"])
    plots.plot_losses(read_json("models/pretrain/history.json"), read_json("models/dp/history.json"), figures["losses"])
    shutil.copyfile("data/synthetic/contact_sheet.png", figures["contact_sheet"])

    points, source = mlflow_points
    if not any(p["current"] for p in points):
        points = points + [{"epsilon": ver["epsilon_reported"], "accuracy": lp["dp"], "objective": objective,
                            "current": True}]
    baselines = {n: (models[n]["label"], lp[n]) for n in ("synthetic", "nonprivate", "random") if n in lp}
    plots.plot_privacy_utility(points, baselines, figures["privacy_utility"])
    curve = curve_section(metrics.get("privacy_utility"),
                          {n: (models[n]["label"], lp[n]) for n in ("synthetic", "random", "pixels") if n in lp},
                          out / "privacy_utility_curve.png", dp)

    primary_set = metrics["sets"][primary]
    headline = headline_sentence(primary, primary_set, models, {
        "n": ver["n"], "batch": ver["sample_rate"] * ver["n"], "sigma": ver["sigma"],
        "epsilon": ver["epsilon_reported"], "clip": plan.clip_norm})
    cards = [("Privacy", f"ε = {ver['epsilon_reported']:.2f}",
              f"δ = {delta_text(ver['delta'], dp.get('delta'))} ({ver['accountant'].upper()}); "
              f"{ver['steps']} DP steps on n = {ver['n']}")]
    cards.append(data_card(read_json(SHARD_STATS)) if Path(SHARD_STATS).exists() else ("Data", "n/a", "no shard stats"))
    versus = primary_set.get("dp_versus", {})
    for name in lp:
        diff = (f"linear probe on {primary}" if name == "dp" else
                f"DP model {points_ci(versus[name]) if name in versus else signed(100 * (lp['dp'] - lp[name])) + ' points'}")
        cards.append((models[name]["label"], f"{100 * lp[name]:.1f}%", diff))
    model = params.get("model", {})
    mechanism = [
        ("recipe", recipe_title(objective)),
        ("private examples n", f"{ver['n']}"),
        ("sampling", f"{plan.sampler}, rate q = {ver['sample_rate']:.5g} "
                     f"(expected batch {ver['sample_rate'] * ver['n']:.0f})"),
        ("clipping", f"C = {plan.clip_norm}, sensitivity {plan.sensitivity:g}·C ({plan.clipping.replace('_', ' ')})"),
        ("noise", noise_text(ver, plan)),
        ("steps", f"{ver['steps']} (planned {plan.steps})"),
        ("δ", delta_text(ver["delta"], dp.get("delta"))),
        ("ε", ", ".join(f"{a.upper()} {v:.4f}" for a, v in ver["epsilon"].items())
         + f" (target {plan.target_epsilon})"),
        ("adjacency", adjacency_text(ver)),
    ]
    runs = f"{privacy['runs']} DP run{'s' if privacy['runs'] > 1 else ''} ({', '.join(privacy['objectives'])})"
    if privacy["private"]:  # several models trained on one dataset release more than any one
        mechanism.append(("ε over all DP runs on this data", f"{privacy['epsilon_composed']:.4f} at the same δ, {runs}"))
    else:
        mechanism.append(("ε of this run's outputs", f"∞: NOT PRIVATE as a whole ({'; '.join(privacy['not_private'])}); "
                          f"its {runs} compose to {privacy['epsilon_dp_runs']:.4f}"))
        headline = f"NOT PRIVATE as a whole: {'; '.join(privacy['not_private'])}. " + headline
    if dp.get("log_private_stats"):
        mechanism.append(("released outside ε", "counts of dropped non-finite private examples "
                          "(dp.log_private_stats: true): not covered by the ε above"))
    from pipeline.tracking import git_commit

    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    subtitle = (f"{recipe_title(objective)} · ViT-{model.get('size', '?')} at {model.get('img_size', '?')} px "
                f"· generated {when} · commit {git_commit()[:12]}")
    return {
        "title": params["report"]["title"], "subtitle": subtitle, "verification": ver, "curve": curve,
        "headline": headline + (" " + curve["sentence"] if curve else ""),
        "cards": cards,
        "delta_text": delta_text(ver["delta"], dp.get("delta")), "sets": sets, "figures": figures,
        "mechanism": mechanism, "colors": plots.MODEL_COLORS, "params_yaml": params_yaml(params),
        "pu_caption": (f"Linear-probe accuracy on {primary} against verified ε. {source}. Star: this run. "
                       f"Baselines from this run: synthetic-only (no private data, ε = 0), non-private (ε = ∞, "
                       f"when trained) and random init. Each point keeps the eval protocol of its own run."),
        "eps_caption": (f"ε after each DP step at δ = {ver['delta']:.2e}, per accountant "
                        f"({ver['accountant'].upper()} is reported; the others are independent upper bounds)."),
        "loss_caption": ("Left: MAE loss on synthetic images (non-private). Right: the DP model's loss on the public "
                         "held-out split; the training loss on private data is never shown (it is not DP)."),
        "sheet_caption": "A sample of the procedural (Shaders21k-style) images the encoder was pretrained on.",
        "footer": (f"dpfm report · inputs: {VERIFICATION}, {METRICS}, {LEDGER}, models/*/history.json · "
                   f"open report.html offline in any browser; report.md has the same content."),
    }


def adjacency_text(ver: dict) -> str:
    """Which neighbours the ε is for, whether it covers the released n, and the other adjacency's ε."""
    other = ver.get("epsilon_add_remove", {})
    if ver.get("adjacency", "add_remove") == "replace_one":
        return ("replace-one (neighbours differ in one example, replaced; n is the same on both sides, so releasing "
                "it is covered); add/remove, as the literature states it: "
                + ", ".join(f"{a.upper()} ε = {v:.4f}" for a, v in other.items()))
    return ("add/remove (one example added or removed, as the literature states it): this ε does NOT cover "
            f"releasing n = {ver['n']}, which this report does; privacy.adjacency: replace_one covers it")


def final_privacy(params: dict, ledger: dict, ver: dict) -> dict:
    """The run's privacy as released: this model's ε, what every DP run on the data composes to
    (recomputed now, after the curve's and the seeds' trainings), and, when something ran outside
    DP (privacy/release.py), composed ε = ∞ with the reasons."""
    c = budget.composition(ledger, ver["delta"])
    stats = read_json(SHARD_STATS) if Path(SHARD_STATS).exists() else {}
    reasons = release.not_private_reasons(params, stats)
    return {"epsilon_run": ver["epsilon_reported"], "epsilon_dp_runs": c["epsilon"],
            "epsilon_composed": math.inf if reasons else c["epsilon"], "private": not reasons,
            "not_private": reasons, "runs": c["runs"], "objectives": [r["objective"] for r in c["by_run"]],
            "delta": ver["delta"], "accountant": ver["accountant"]}


def run(params: dict, ctx) -> None:
    ver, metrics, ledger = read_json(VERIFICATION), read_json(METRICS), read_json(LEDGER)
    from pipeline.tracking import dvc_hash

    model_hash = dvc_hash("models/dp") if Path("models/dp").exists() else None
    points = experiment_points(params["run"]["experiment"], model_hash)
    final = final_privacy(params, ledger, ver)
    with atomic_dir(OUT_DIR) as out:
        content = gather(params, ver, Plan.from_header(ledger), metrics, out, points, final)
        (out / "report.md").write_text(render_markdown(content))
        (out / "report.html").write_text(render_html(content))
        write_json(out / "privacy.json", {**final, "epsilon_composed": str(final["epsilon_composed"])
                                          if not final["private"] else final["epsilon_composed"]})
    # The last stage: every DP training of this run (dp-train, the curve, the seeds) is charged by now.
    ctx.tracker.log_metrics({"epsilon_dp_runs": final["epsilon_dp_runs"], "dp_runs_on_data": final["runs"]}
                            | ({"epsilon_composed": final["epsilon_composed"]} if final["private"] else {}))
    ctx.tracker.set_tags({"dpfm.private": str(final["private"]).lower()})
    ctx.tracker.tag_dp_models({"epsilon": f"{final['epsilon_composed']:.4f}" if final["private"] else "inf",
                               "dp_runs_on_data": final["runs"], "private": str(final["private"]).lower()}
                              | ({} if final["private"] else {"not_private": "; ".join(final["not_private"])}))
    ctx.tracker.log_artifact(OUT_DIR, "report")
    print(f"report: {OUT_DIR}/report.html")
