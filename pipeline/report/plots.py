"""The report's figures (matplotlib, written as PNG): one colour per model across every figure."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pipeline.objectives import recipe_name  # noqa: E402
from pipeline.privacy.accounting import bound_text  # noqa: E402

MODEL_COLORS = {"dp": "#c8313e", "nonprivate": "#1f3a5f", "synthetic": "#0f8b8d", "random": "#9a9a9a",
                "pixels": "#d9a441"}
DPI = 150
STYLE = {"axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
         "font.size": 9, "axes.titlesize": 10, "axes.titleweight": "bold", "legend.frameon": False}


def _save(fig, path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, bbox_inches="tight")  # a legend placed outside the axes stays in the picture
    plt.close(fig)


def history_curve(history: dict, key: str) -> tuple[list, list]:
    pairs = [(s, m[key]) for s, m in zip(history["step"], history["metrics"]) if key in m]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_losses(pretrain_hist: dict, dp_hist: dict, path) -> None:
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
        axes[0].plot(*history_curve(pretrain_hist, "loss"), color=MODEL_COLORS["synthetic"])
        axes[0].set(title="Synthetic MAE pretraining (non-private)", xlabel="step", ylabel="training loss")
        axes[1].plot(*history_curve(dp_hist, "heldout_loss"), color=MODEL_COLORS["dp"], marker="o", ms=3)
        axes[1].set(title="DP training", xlabel="step", ylabel="loss on the held-out eval split")
        _save(fig, path)


def plot_epsilon(curves: dict, target: float | None, final: tuple[int, float], path,
                 not_private: str | None = None) -> None:
    """curves: {accountant: (steps, eps)}; the reported ε is marked at the last step. `not_private`: the
    words saying the run as a whole is not covered (its ε is the model's alone), on the picture itself,
    which travels without the report around it."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(4.6, 3.2))
        for i, (name, (steps, eps)) in enumerate(curves.items()):
            ax.plot(steps, eps, label=name.upper(), color=("#c8313e", "#1f3a5f", "#e0a030")[i % 3])
        if target is not None:
            ax.axhline(target, color="#555", ls=":", lw=1, label=f"target ε = {target:g}")
        ax.plot(*final, "o", color="black", ms=4)
        ax.annotate(f"ε = {bound_text(final[1], 2)}", final, textcoords="offset points", xytext=(-6, 6), ha="right")
        ax.set(title="ε spent against DP step", xlabel="step", ylabel="ε", ylim=(0, None))
        if not_private:
            ax.set_title(f"{not_private}\n", loc="left", color=MODEL_COLORS["dp"], fontsize=8, fontweight="bold")
        ax.legend(loc="lower right")
        _save(fig, path)


def plot_accuracy(columns: list[str], rows: list[dict], chance: float, path) -> None:
    """Grouped bars: one group per protocol (column), one bar per model; error bars: the 95% interval
    where there is one, else the std over few-shot subsets."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(max(4.6, 1.3 * len(columns) + 2), 3.2))
        width = 0.8 / max(1, len(rows))
        for i, row in enumerate(rows):
            xs = [j + (i - (len(rows) - 1) / 2) * width for j, c in enumerate(row["cells"]) if c is not None]
            ys = [100 * c[0] for c in row["cells"] if c is not None]
            err = np.array([[100 * (c[0] - c[2][0]), 100 * (c[2][1] - c[0])] if c[2] else [100 * (c[1] or 0)] * 2
                            for c in row["cells"] if c is not None]).T.reshape(2, -1).clip(min=0)  # as _interval_bar
            ax.bar(xs, ys, width * 0.92, yerr=err, capsize=2, label=row["label"],
                   color=MODEL_COLORS.get(row["name"], f"C{i}"), error_kw={"lw": 0.8})
        ax.axhline(100 * chance, color="#555", ls=":", lw=1, label=f"chance ({100 * chance:.0f}%)")
        ax.set_xticks(range(len(columns)), columns)
        ax.set(ylabel="accuracy (%)", ylim=(0, 100))
        ax.grid(axis="x", visible=False)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        _save(fig, path)


def _interval_bar(ax, x: float, accuracy: float, ci) -> None:
    """A 95% interval [lo, hi] (fractions) as an error bar at x, in %."""
    below, above = max(accuracy - ci[0], 0.0), max(ci[1] - accuracy, 0.0)  # a clipped end cannot go negative
    ax.errorbar(x, 100 * accuracy, yerr=[[100 * below], [100 * above]], fmt="none", ecolor=MODEL_COLORS["dp"],
                elinewidth=0.9, capsize=2, alpha=0.6, zorder=2)


def _baseline(ax, name: str, label: str, accuracy: float, ci, ls: str) -> None:
    """A baseline's accuracy as a horizontal line, its 95% interval [lo, hi] (when it has one) as a band."""
    ax.axhline(100 * accuracy, color=MODEL_COLORS[name], ls=ls, lw=1.1, label=label)
    if ci:
        ax.axhspan(100 * ci[0], 100 * ci[1], color=MODEL_COLORS[name], alpha=0.1, lw=0)


def plot_privacy_utility(points: list[dict], baselines: dict, path) -> None:
    """points: {epsilon, accuracy, ci ([lo, hi] or None), objective, current, private_as_a_whole} per DP
    model (hollow when its run was NOT PRIVATE as a whole: the model is DP at its ε, the run's other
    outputs are not); baselines: {name: (label, accuracy, 95% interval or None)}."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(5.0, 4.2))
        markers = {"mae": "o", "caption": "s", "clip": "^"}
        seen = set()
        for p in sorted(points, key=lambda p: p["current"]):
            obj, whole = p.get("objective") or "?", p.get("private_as_a_whole") is not False
            key = (obj, whole)
            label = None if key in seen else f"DP runs ({recipe_name(obj)}){'' if whole else ', run NOT PRIVATE'}"
            seen.add(key)
            if p.get("ci"):
                _interval_bar(ax, p["epsilon"], p["accuracy"], p["ci"])
            ax.scatter(p["epsilon"], 100 * p["accuracy"], marker=markers.get(obj, "D"), s=36, alpha=0.75,
                       color=MODEL_COLORS["dp"] if whole else "none", edgecolor="white" if whole else MODEL_COLORS["dp"],
                       lw=0.5 if whole else 1.2, label=label, zorder=3)
        current = [p for p in points if p["current"]]
        if current:
            c = current[-1]
            whole = c.get("private_as_a_whole") is not False
            ax.scatter(c["epsilon"], 100 * c["accuracy"], marker="*", s=220, color=MODEL_COLORS["dp"] if whole else "none",
                       edgecolor="black", lw=0.8, label="this run" + ("" if whole else " (NOT PRIVATE as a whole)"),
                       zorder=4)
        xmax = max([p["epsilon"] for p in points] + [1.0]) * 1.5
        if "synthetic" in baselines:  # no private data seen: ε = 0
            label, acc, ci = baselines["synthetic"]
            if ci:
                ax.errorbar(0, 100 * acc, yerr=[[100 * max(acc - ci[0], 0)], [100 * max(ci[1] - acc, 0)]], fmt="none",
                            ecolor=MODEL_COLORS["synthetic"], elinewidth=0.9, capsize=2, clip_on=False, zorder=2)
            ax.scatter(0, 100 * acc, marker="D", s=40, color=MODEL_COLORS["synthetic"], label=f"{label}, ε = 0",
                       zorder=3, clip_on=False)
        for name, ls in (("nonprivate", "--"), ("random", ":")):
            if name in baselines:
                label, acc, ci = baselines[name]
                suffix = " (ε = ∞)" if name == "nonprivate" and "ε = ∞" not in label else ""
                _baseline(ax, name, label + suffix, acc, ci, ls)
        accs = [p["accuracy"] for p in points] + [b[1] for b in baselines.values()] + \
            [end for p in points for end in p.get("ci") or ()] + [end for b in baselines.values() for end in b[2] or ()]
        lo = max(0.0, math.floor(min(accs) * 10 - 0.5) * 10) if accs else 0.0
        hi = min(100.0, math.ceil(max(accs) * 10 + 0.5) * 10) if accs else 100.0
        ax.set_xscale("symlog", linthresh=1.0)  # runs from ε = 0.5 to 64 apart; the warm start at ε = 0
        ticks = [t for t in (0, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256) if t <= xmax]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set(xlim=(0, xmax), ylim=(lo, hi), xlabel="ε (verified)", ylabel="linear-probe accuracy (%)",
               title="Privacy–utility across the experiment's runs")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8)
        _save(fig, path)


INIT_STYLE = {"pretrain": ("synthetic", "o", "DP from the synthetic warm start"),
              "random": ("random", "s", "DP from random init")}


def curve_x(epsilon) -> float:
    """ε on a log2 axis, ∞ one step beyond the largest finite ε plotted (its own tick)."""
    return np.inf if epsilon == "inf" else math.log2(epsilon)


def plot_curve(points: list[dict], baselines: dict, path) -> None:
    """The privacy–utility curve: linear probe (95% interval band) against ε per init; baselines:
    {name: (label, accuracy, 95% interval or None)} as horizontal lines, their intervals as bands."""
    finite = sorted({p["epsilon"] for p in points if p["epsilon"] != "inf"})
    inf_x = (math.log2(finite[-1]) + 1.0) if finite else 0.0
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(5.6, 3.6))
        for init, (color_key, marker, label) in INIT_STYLE.items():
            mine = sorted((p for p in points if p["init"] == init), key=lambda p: curve_x(p["epsilon"]))
            if not mine:
                continue
            xs = [inf_x if p["epsilon"] == "inf" else curve_x(p["epsilon"]) for p in mine]
            ys = [100 * p["linear_probe"] for p in mine]
            lo, hi = ([100 * p["linear_probe_ci"][i] for p in mine] for i in (0, 1))
            color = MODEL_COLORS[color_key] if init == "random" else MODEL_COLORS["dp"]
            ax.fill_between(xs, lo, hi, color=color, alpha=0.15, lw=0)
            ax.plot(xs, ys, marker=marker, color=color, label=label, ms=4)
        for name, ls, note in (("synthetic", "--", " (no private data)"), ("random", ":", " (untrained)"),
                               ("pixels", "-.", "")):
            if name in baselines:
                label, acc, ci = baselines[name]
                _baseline(ax, name, label + note, acc, ci, ls)
        ticks = [math.log2(e) for e in finite] + ([inf_x] if any(p["epsilon"] == "inf" for p in points) else [])
        ax.set_xticks(ticks, [f"{e:g}" for e in finite] + (["∞"] if len(ticks) > len(finite) else []))
        ax.set(xlabel="ε (log scale; ∞: the same recipe without DP)", ylabel="linear-probe accuracy (%)",
               title="Privacy–utility curve")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        _save(fig, path)
