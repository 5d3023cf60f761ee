"""The report's privacy–utility sections: this run's curve (the recipe retrained at each ε) and the
points of every DP model evaluated in the MLflow experiment."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.objectives import recipe_title
from pipeline.report import plots

def experiment_points(experiment: str, current_model_hash: str | None, primary_set: str,
                      adjacency: str = "replace_one") -> tuple[list[dict], str]:
    """One point per DP model evaluated in the experiment on `primary_set` (the first eval set; a run
    evaluated on another is another axis) under `adjacency` (an ε of the other neighbour relation is
    another axis too: add/remove's is about half replace-one's for one mechanism): its verified ε, DP
    linear-probe accuracy and whether its pipeline run was private as a whole (None: not known yet).

    ε comes from the evaluate run itself (it logs the verified ε it evaluated) or, for runs that
    predate that, from the finished dp-train run of the same pipeline invocation. A model
    evaluated several times (same `dvc.input.models/dp` hash) counts once, at its latest run. A test
    run's model (`privacy.testing`: its noise key is known) is not a DP model and is left out.
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
        whole = {r.info.run_id: r.data.tags.get("dpfm.private") for r in client.search_runs(
            [exp.experiment_id], max_results=5000, filter_string="tags.`dpfm.pipeline` = 'true'")}
        evaluate_runs = finished("evaluate")  # newest first
    except Exception as err:  # the report must still be written when the tracking store is unreachable
        return [], f"MLflow not readable ({type(err).__name__}): only this run is shown"
    points, seen, other = [], set(), 0
    for run in evaluate_runs:
        m, tags = run.data.metrics, run.data.tags
        model = tags.get("dvc.input.models/dp", run.info.run_id)
        dp_run = dp_by_parent.get(tags.get("mlflow.parentRunId"))
        eps = m.get("epsilon", dp_run.data.metrics.get("epsilon") if dp_run else None)
        acc = m.get("dp_linear_probe_acc")
        if model in seen or eps is None or acc is None or tags.get("dpfm.model_private") == "false":
            continue
        if evaluated_on(run) != primary_set:
            continue
        if adjacency_of(run) != adjacency:
            other += 1
            continue
        seen.add(model)
        objective = tags.get("dpfm.objective") or (dp_run.data.params.get("dp.objective") if dp_run else None)
        private = {"true": True, "false": False}.get(whole.get(tags.get("mlflow.parentRunId")))
        # The point is the released model's (over seeds, the first's): so is its interval, not the seeds' mean's.
        names = (f"{primary_set}.dp.first_seed_linear_probe_ci", f"{primary_set}.dp.linear_probe_ci")
        ci = next(([m[f"{n}_lo"], m[f"{n}_hi"]] for n in names if f"{n}_lo" in m and f"{n}_hi" in m), None)
        points.append({"epsilon": eps, "accuracy": acc, "objective": objective, "current": model == current_model_hash,
                       "private_as_a_whole": private, "ci": ci})
    source = f"{len(points)} DP model(s) evaluated on {primary_set} in MLflow experiment {experiment!r}"
    return points, source + (f" ({other} evaluation(s) under the other adjacency left out)" if other else "")


def adjacency_of(run) -> str:
    """The neighbour relation an evaluate run's ε is for: its tag, or the params it logged; add/remove
    for runs from before the choice existed."""
    return run.data.tags.get("dpfm.adjacency") or run.data.params.get("privacy.adjacency") or "add_remove"


def evaluated_on(run) -> str | None:
    """The first eval set of an evaluate run: its tag, or (runs before the tag) its logged evaluate.sets."""
    if "dpfm.primary_set" in run.data.tags:
        return run.data.tags["dpfm.primary_set"]
    try:
        return json.loads(run.data.params["evaluate.sets"])[0]["name"]
    except (KeyError, IndexError, TypeError, ValueError):
        return None


INIT_LABELS = {"pretrain": "DP from the synthetic warm start", "random": "DP from random init"}


def curve_order(epsilon) -> float:
    return float("inf") if epsilon == "inf" else float(epsilon)


def twin_text(dp: dict) -> str:
    """What the ε = ∞ point is: the DP recipe without noise (and without clipping unless
    `dp.nonprivate_clipped`), on its own schedule if set."""
    without = "without noise, clipped as the DP points are" if dp.get("nonprivate_clipped") else "without clipping or noise"
    own = {k: v for k, v in dp.get("nonprivate", {}).items() if v is not None and v != dp.get(k)}
    if not own:
        return f"∞ is the same recipe {without}"
    return (f"∞ is the recipe {without}, on a schedule of its own (dp.nonprivate: "
            + ", ".join(f"{k} {v:g}" for k, v in own.items()) + f"; the DP points: steps {dp['steps']}, lr {dp['lr']:g})")


def curve_section(curve: dict | None, baselines: dict, path: Path, dp: dict, noise_at=None) -> dict | None:
    """The privacy–utility curve's figure, table (one row per init, one column per ε, headed by the
    noise `noise_at(ε)` its points were trained with) and sentence; `baselines`: {name: (label,
    accuracy, its 95% interval or None)}."""
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

    def point_text(init: str, e) -> str:  # its interval, and for a DP point the noise it trained with
        acc, (lo, hi) = by[init, e]["linear_probe"], by[init, e]["linear_probe_ci"]
        noise = f", {noise_at(e)}" if noise_at and e != "inf" else ""
        return f"{100 * acc:.1f}% ({100 * lo:.1f}–{100 * hi:.1f}) at ε = {'∞' if e == 'inf' else f'{e:g}'}{noise}"

    def path_text(init: str) -> str:
        return " → ".join(point_text(init, e) for e in epsilons if (init, e) in by)

    sentence = "Privacy–utility curve: " + "; ".join(f"{INIT_LABELS[i].replace('DP from', 'from')}, {path_text(i)}"
                                                     for i in INIT_LABELS if any(p["init"] == i for p in points))
    if "synthetic" in baselines:
        _, acc, ci = baselines["synthetic"]
        sentence += (f" (synthetic only, no DP training: {100 * acc:.1f}%"
                     + (f" ({100 * ci[0]:.1f}–{100 * ci[1]:.1f})" if ci else "") + ")")
    spent = [p["epsilon_spent"] for p in points if p.get("epsilon_spent")]
    seeds = curve.get("seeds", 1)
    sentence += "; in parentheses, 95% intervals" + (f", each point the mean of {seeds} DP trainings at its ε, which "
                                                     "together compose to more" if seeds > 1 else "")
    over = (f"over {seeds} training seeds and the test images; a point's ε is one training's, and its mean pools "
            f"{seeds}, which together compose to more" if seeds > 1 else "over the test images, one seed")
    if curve.get("probe_refits"):
        over += f", and {curve['probe_refits']} refits of the probe on resamples of probe-train"
    caption = (f"Linear probe on {curve['set']} ({curve['n_probe_test']} probe-test images; band: 95% bootstrap "
               f"interval {over}) of the {recipe_title(curve['objective'])} recipe retrained at each ε, from each init; "
               f"{twin_text(dp)}. {len(spent)} of the points are DP trainings on the "
               "private data: what all DP runs charged to the budget compose to is in the mechanism table.")
    columns = ["ε = ∞" if e == "inf" else f"ε = {e:g}" + (f" ({noise_at(e)})" if noise_at else "") for e in epsilons]
    return {"figure": path, "columns": columns, "rows": rows,
            "caption": caption, "sentence": sentence + "."}
