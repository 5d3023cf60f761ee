"""The `report` stage: one self-contained HTML file (images inlined, no network) and Markdown."""

from __future__ import annotations

import base64
import html
import shutil

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pipeline.io import atomic_dir, read_json  # noqa: E402
from pipeline.privacy import accounting  # noqa: E402

OUT_DIR = "results/report"


def _curve(history: dict, key: str) -> tuple[list, list]:
    pairs = [(s, m[key]) for s, m in zip(history["step"], history["metrics"]) if key in m]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_losses(pretrain_hist: dict, dp_hist: dict, path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    axes[0].plot(*_curve(pretrain_hist, "loss"))
    axes[0].set(title="Synthetic MAE pretraining (non-private)", xlabel="step", ylabel="training loss")
    axes[1].plot(*_curve(dp_hist, "heldout_loss"), color="C1")
    axes[1].set(title="DP training", xlabel="step", ylabel="held-out loss (public eval split)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_epsilon(ver: dict, accountants: list[str], path) -> None:
    steps = ver["steps"]
    grid = sorted({max(1, round(steps * i / 40)) for i in range(41)})
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for a in accountants:
        ax.plot(grid, accounting.epsilon_curve(ver["sigma"], ver["sample_rate"], grid, ver["delta"], accountant=a),
                label=a.upper())
    ax.set(title=f"ε against step (δ={ver['delta']:.1e})", xlabel="step", ylabel="ε")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _img(path) -> str:
    return f'<img alt="{path.name}" src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}">'


def render(title: str, ver: dict, metrics: dict, figures: dict) -> tuple[str, str]:
    rows = [(name, r["linear_probe_acc"]) for name, r in metrics["encoders"].items()]
    eps_line = (f"ε = {ver['epsilon_reported']:.3f} ({ver['accountant'].upper()}), δ = {ver['delta']:.2e}, "
                f"{ver['steps']} steps, σ = {ver['sigma']:.4f}, q = {ver['sample_rate']:.4g}, n = {ver['n']}")
    status = "passed" if ver["passed"] else "FAILED"
    md = [f"# {title}", "", f"**Privacy**: {eps_line}. Verification: **{status}** "
          f"({', '.join(f'{a.upper()} ε = {e:.3f}' for a, e in ver['epsilon'].items())}).", "",
          f"## Linear probe on {metrics['eval_set']} ({metrics['probe_train']} train / {metrics['probe_test']} test)",
          "", "| encoder | accuracy |", "| --- | --- |"]
    md += [f"| {name} | {acc:.3f} |" for name, acc in rows]
    md += ["", "## Figures", ""] + [f"![{k}]({p.name})" for k, p in figures.items()]
    table = "".join(f"<tr><td>{html.escape(n)}</td><td>{a:.3f}</td></tr>" for n, a in rows)
    checks = "".join(f"<li>{'✔' if c['passed'] else '✘'} {html.escape(c['name'])}: {html.escape(c['detail'])}</li>"
                     for c in ver["checks"])
    figs = "".join(f"<figure>{_img(p)}<figcaption>{html.escape(k)}</figcaption></figure>" for k, p in figures.items())
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 12px}}img{{max-width:100%}}</style></head><body>
<h1>{html.escape(title)}</h1><p><b>Privacy</b>: {html.escape(eps_line)}. Verification: <b>{status}</b></p>
<ul>{checks}</ul><h2>Linear probe on {html.escape(metrics['eval_set'])}</h2>
<table id="accuracy"><tr><th>encoder</th><th>accuracy</th></tr>{table}</table><h2>Figures</h2>{figs}</body></html>
"""
    return "\n".join(md) + "\n", page


def run(params: dict, ctx) -> None:
    ver = read_json("results/privacy/verification.json")
    metrics = read_json("results/eval/metrics.json")
    with atomic_dir(OUT_DIR) as out:
        figures = {"losses": out / "losses.png", "epsilon": out / "epsilon.png",
                   "synthetic images": out / "contact_sheet.png"}
        plot_losses(read_json("models/pretrain/history.json"), read_json("models/dp/history.json"), figures["losses"])
        plot_epsilon(ver, list(ver["epsilon"]), figures["epsilon"])
        shutil.copy("data/synthetic/contact_sheet.png", figures["synthetic images"])
        md, page = render(params["report"]["title"], ver, metrics, figures)
        (out / "report.md").write_text(md)
        (out / "report.html").write_text(page)
    ctx.tracker.log_artifact(OUT_DIR, "report")
    print(f"report: {OUT_DIR}/report.html")
