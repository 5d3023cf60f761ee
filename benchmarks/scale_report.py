"""The scale benchmark's report (benchmarks/scale_utility.py): each row's interval and paired gain, the
targets (a)-(e), the printed table, the scaling figure and the ONE JSON line."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from benchmarks.utility import parse_epsilon, print_targets
from pipeline.eval.stats import accuracy_ci, difference_ci
from pipeline.io import atomic_path

FULL = "full"  # the whole private split (--sizes)


def probe_ci(row: dict) -> list[float]:
    return accuracy_ci(row["probe"], refits=row.get("refits"))


def paired_gain(row: dict, base: dict) -> dict:
    """row's probe accuracy minus base's, paired by test image, seed and (where both have them) probe resample."""
    both = row.get("refits") is not None and base.get("refits") is not None
    return difference_ci(row["probe"], base["probe"], refits_a=row["refits"] if both else None,
                         refits_b=base["refits"] if both else None)


def check_targets(table: dict, objectives, epsilons, chance: float) -> dict:
    targets = {}

    def paired(a: str, b: str) -> dict:
        return paired_gain(table[a], table[b])

    for obj in objectives:
        full = {eps: f"{obj}-n{FULL}-eps{eps:g}" for eps in epsilons}
        if 8.0 in full and obj in ("mae", "caption"):
            d = paired(full[8.0], "synthetic")
            targets[f"a_{obj}_eps8_above_synthetic"] = {"passed": d["ci"][0] > 0, "diff": d}
        if math.inf in full:
            d = paired(full[math.inf], "synthetic")
            targets[f"b_{obj}_eps_inf_above_synthetic"] = {"passed": d["ci"][0] > 0, "diff": d}
        if 8.0 in full and 1.0 in full:
            d = paired(full[8.0], full[1.0])
            targets[f"c_{obj}_eps8_not_below_eps1"] = {"passed": d["ci"][1] >= 0, "diff": d}
    def best_versus_pixels(rows: list[str]) -> dict:
        """The most accurate of `rows`, paired against the pixels: below them only if the whole interval is."""
        best = max(rows, key=lambda k: table[k]["probe"].mean())
        d = paired(best, "pixels")
        return {"passed": d["ci"][1] >= 0, "best": best, "diff": d}

    encoders = [k for k in table if k != "pixels"]
    targets["d_best_vs_pixels"] = best_versus_pixels(encoders)
    private = [k for k in encoders if "-eps" in k and not k.endswith("-epsinf")]
    if private:  # the no-DP twins are not private: what the DP encoders alone reach
        targets["d_best_dp_vs_pixels"] = best_versus_pixels(private)
    cap8 = f"caption-n{FULL}-eps8"
    if cap8 in table:
        ci = accuracy_ci(table[cap8]["zero"])
        targets["e_caption_zero_shot_3x_chance"] = {"passed": ci[0] >= 3 * chance, "ci": ci, "chance": chance}
    return targets


def report(table, args, epsilons, sizes, chance, n_test, work: Path, seconds: float, device: str, set_name: str,
           versus: dict):
    targets = check_targets(table, args.objectives, epsilons, chance)
    out_rows = []
    for name, row in table.items():
        obj, init, n, eps = None, name, None, None
        if "-n" in name:
            obj, rest = name.split("-n", 1)
            size, eps_text = rest.split("-eps")
            init, n, eps = "synthetic", row["meta"]["n"], parse_epsilon(eps_text)
        r = {"objective": obj, "init": init, "epsilon": None if eps is None else ("inf" if eps == math.inf else eps),
             "n": n, "acc": float(row["probe"].mean()), "ci": probe_ci(row), "seeds": int(len(row["probe"]))}
        if n is not None:
            m = row["meta"]
            r.update(batch=m["batch"], steps=m["steps"], sigma=round(m["sigma"], 4), sigma_over_b=m["sigma_over_b"],
                     noise_per_coordinate=m["noise_per_coordinate"],
                     noise_over_run=m["noise_per_coordinate"] / math.sqrt(m["steps"]),
                     epsilon_spent=m["epsilon_spent"], seconds=m["seconds"],
                     fp32_noise=eps != math.inf and "noise_edge" not in m)  # its ε does not hold at its δ
            if name != "synthetic":
                d = paired_gain(row, table["synthetic"])
                r["gain_over_synthetic"] = {"diff": d["diff"], "ci": d["ci"]}
            twin = name.replace(f"-eps{eps_text}", "-epsinf")
            if eps != math.inf and twin in table:  # what privacy costs at this n: the no-DP twin minus this row
                d = paired_gain(table[twin], row)
                r["price_of_privacy"] = {"diff": d["diff"], "ci": d["ci"]}
        if row.get("zero") is not None:
            r.update(zero_shot=float(row["zero"].mean()), zero_shot_ci=accuracy_ci(row["zero"]))
        out_rows.append(r)
    # A kept row may hold more seeds than this invocation asked for: each row says its own.
    print(f"\nscale_utility: linear probe on {set_name} ({n_test} test images, "
          f"{args.probe_refits} probe refits, {device})")
    print(f"  {'objective':<9} {'n':>6} {'ε':>4} {'B':>5} {'T':>4} {'σ':>6} {'σ/B':>8} {'noise':>8} {'/√T':>8} {'seeds':>5}  {'acc':>6}  "
          "95% CI       gain over synthetic")
    for r in out_rows:
        eps = "—" if r["epsilon"] is None else ("∞" if r["epsilon"] == "inf" else f"{r['epsilon']:g}")
        sched = (f"{r['n']:>6} {eps:>4} {r['batch']:>5} {r['steps']:>4} {r['sigma']:>6.3f} {r['sigma_over_b']:>8.2e}"
                 f" {r['noise_per_coordinate']:>8.2e} {r['noise_over_run']:>8.2e}"
                 if r["n"] else f"{'':>6} {eps:>4} {'':>5} {'':>4} {'':>6} {'':>8} {'':>8} {'':>8}")
        gain = r.get("gain_over_synthetic")
        print(f"  {(r['objective'] or r['init']):<9} {sched} {r['seeds']:>5}  {100 * r['acc']:5.1f}%  "
              f"{100 * r['ci'][0]:.1f}–{100 * r['ci'][1]:.1f}"
              + (f"   {100 * gain['diff']:+.1f} ({100 * gain['ci'][0]:+.1f} to {100 * gain['ci'][1]:+.1f})" if gain else "")
              + (f"   zero-shot {100 * r['zero_shot']:.1f}%" if "zero_shot" in r else "")
              + ("   fp32 noise: ε not at its δ" if r.get("fp32_noise") else ""))
    scaling = [r for r in out_rows if r["n"] and r["epsilon"] in (8.0, "inf")]
    if any(r["epsilon"] == 8.0 for r in scaling):
        plot_scaling(scaling, work / "scaling.png")
        print(f"\nscale_utility: scaling figure ({work / 'scaling.png'}): DP gain over synthetic-only at ε = 8"
              + (", its no-DP twin's and what privacy costs (twin − DP, paired)" if any(
                  "price_of_privacy" in r for r in scaling) else ""))
        for r in sorted(scaling, key=lambda r: (r["objective"], r["n"], r["epsilon"] == "inf")):
            g, p = r["gain_over_synthetic"], r.get("price_of_privacy")
            print(f"  {r['objective']:<8} n={r['n']:>6} {'ε=∞' if r['epsilon'] == 'inf' else 'ε=8':<4}"
                  f" B={r['batch']:>5} σ/B={r['sigma_over_b']:.2e} noise/coord={r['noise_per_coordinate']:.2e}  "
                  f"{100 * g['diff']:+.1f} points ({interval(g)})"
                  + (f"   privacy costs {100 * p['diff']:+.1f} ({interval(p)})" if p else ""))
    public_vs_batch = [(f"clip-public-n{FULL}-eps{e:g}", f"clip-n{FULL}-eps{e:g}") for e in epsilons]
    public_vs_batch = [(a, b) for a, b in public_vs_batch if a in table and b in table]
    if public_vs_batch:
        print("\nscale_utility: CLIP against public captions (per example) minus Dp-CLIP (per batch), paired")
        for a, b in public_vs_batch:
            d, z = paired_gain(table[a], table[b]), difference_ci(table[a]["zero"], table[b]["zero"])
            print(f"  {a:<24} − {b}: probe {100 * d['diff']:+.1f} ({100 * d['ci'][0]:+.1f} to {100 * d['ci'][1]:+.1f}), "
                  f"zero-shot {100 * z['diff']:+.1f} ({100 * z['ci'][0]:+.1f} to {100 * z['ci'][1]:+.1f})")
    if versus:
        print("\nscale_utility: against another recipe (this row minus the same row there, paired)")
        for name, d in versus.items():
            print(f"  {name:<22} − {d['against']}: {100 * d['diff']:+.1f} points "
                  f"(95% CI {100 * d['ci'][0]:+.1f} to {100 * d['ci'][1]:+.1f}{'' if d['refits'] else ', no refits'})")
    print_targets("scale_utility", targets)
    print(f"scale_utility: {seconds:.0f} s this invocation, on {device}")
    print(json.dumps({"benchmark": "scale_utility", "dataset": set_name, "n_probe_test": n_test, "device": device,
                      "chance": round(chance, 4), "probe_refits": args.probe_refits, "rows": rounded(out_rows),
                      "targets": {k: bool(t["passed"]) for k, t in targets.items()}, "seconds": round(seconds),
                      **({"against": versus} if versus else {})}))
    sys.exit(0 if all(t["passed"] for t in targets.values()) else 1)


def interval(d: dict) -> str:
    return f"95% CI {100 * d['ci'][0]:+.1f} to {100 * d['ci'][1]:+.1f}"


ROUNDED = ("acc", "ci", "zero_shot", "zero_shot_ci", "gain_over_synthetic", "price_of_privacy")


def rounded(rows: list[dict], places: int = 4) -> list[dict]:
    """The rows as the JSON line gives them: accuracies, intervals and gains to `places` decimals. The
    table and the figure read the unrounded ones (printed from 4-place values, a bound 0.009549 read
    +0.9 where its own rounding is +1.0)."""
    def r(x):
        return {k: r(v) for k, v in x.items()} if isinstance(x, dict) else \
            [r(v) for v in x] if isinstance(x, (list, tuple)) else round(float(x), places)
    return [{k: r(v) if k in ROUNDED else v for k, v in row.items()} for row in rows]


def combined_figure(outputs: list[Path], work: Path) -> None:
    """The scaling rows (ε = 8 and the no-DP twins, every n) of each output's JSON line, in one figure."""
    rows = []
    for path in outputs:
        lines = [line for line in path.read_text().splitlines() if line.startswith('{"benchmark": "scale_utility"')]
        if not lines:
            raise SystemExit(f"{path}: no scale_utility JSON line (the last line a finished run prints)")
        found = [r for r in json.loads(lines[-1])["rows"] if r["n"] and r["epsilon"] in (8.0, "inf")]
        if any("noise_per_coordinate" not in r for r in found):
            raise SystemExit(f"{path}: printed before the noise column existed; run its command again (rows are kept)")
        rows += found
    work.mkdir(parents=True, exist_ok=True)
    plot_scaling(rows, work / "scaling.png")
    print(f"scale_utility: {work / 'scaling.png'} from {len(rows)} rows of {len(outputs)} run(s)")


def plot_scaling(rows: list[dict], path: Path) -> None:
    """The papers' message in one figure: the DP gain over the warm start as n (and B) grow, with the
    no-DP twins' gain dashed where they were trained at more than one n (the gap between the two is
    what privacy costs), beside the noise on the released averaged gradient that explains it
    (σ·C/B per example; Dp-CLIP's per-batch 2σC does not shrink with B)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (gain_ax, noise_ax) = plt.subplots(1, 2, figsize=(11, 4))
    twins = [r for r in rows if r["epsilon"] == "inf"]
    rows = [r for r in rows if r["epsilon"] != "inf"]
    dashed = False
    for obj in sorted({r["objective"] for r in rows}):
        rs = sorted((r for r in rows if r["objective"] == obj), key=lambda r: r["n"])
        n = np.array([r["n"] for r in rs])
        g = np.array([[r["gain_over_synthetic"]["diff"], *r["gain_over_synthetic"]["ci"]] for r in rs]) * 100
        label = f"{obj} (B = {rs[-1]['batch']:,} × {rs[-1]['steps']} steps at n = {rs[-1]['n']:,})"
        line = gain_ax.errorbar(n, g[:, 0], yerr=[g[:, 0] - g[:, 1], g[:, 2] - g[:, 0]], marker="o", capsize=3,
                                label=label)
        fp32 = np.array([bool(r.get("fp32_noise")) for r in rs])
        if fp32.any():  # hollow: drawn with fp32 noise, whose ε does not hold at its δ
            gain_ax.plot(n[fp32], g[fp32, 0], "o", color=line[0].get_color(), mfc="white", zorder=3)
        noise_ax.plot(n, [r["noise_per_coordinate"] for r in rs], marker="o", label=label)
        ts = sorted((r for r in twins if r["objective"] == obj), key=lambda r: r["n"])
        if len(ts) > 1:
            gain_ax.plot([r["n"] for r in ts], [100 * r["gain_over_synthetic"]["diff"] for r in ts], "s--",
                         color=line[0].get_color(), alpha=0.6, ms=4)
            dashed = True
    if dashed:
        gain_ax.plot([], [], "s--", color="grey", ms=4, label="dashed: its no-DP twin (ε = ∞, same schedule)")
    if any(r.get("fp32_noise") for r in rows):
        gain_ax.plot([], [], "o", color="grey", mfc="white", label="hollow: fp32 noise (its ε not at its δ)")
    gain_ax.axhline(0, color="grey", lw=0.8)
    sizes = sorted({r["n"] for r in rows})  # one labelled tick per size: log-scale minor labels collide
    for ax in (gain_ax, noise_ax):
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("private examples n (expected batch B = q·n, q and steps fixed)")
        ax.legend(fontsize=7)
    gain_ax.set_ylabel("linear probe: trained − synthetic-only (points)")
    gain_ax.set_title("Gain over the synthetic warm start: DP at ε = 8 (95% CI)" + (", no DP dashed" if dashed else ""),
                      fontsize=10)
    noise_ax.set_yscale("log")
    noise_ax.set_ylabel("noise std per coordinate of the released mean")
    noise_ax.set_title("per example σC/B falls with n; per batch (clip) 2σC stays")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
