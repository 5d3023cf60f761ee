"""DP-SGD overhead: seconds per step and peak memory of one clipped-gradient step, side by side for
non-private training, our book-keeping engine, and Opacus's hooks and ghost modes.

Each (model, engine) pair runs in a fresh subprocess so peak memory is its own: the figure is the
peak resident memory during the timed steps minus the resident memory before them (model built,
one warm-up step done). Ends with one JSON line of the ratios to non-private.

    python benchmarks/dp_overhead.py [--steps 5] [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

MODELS = {
    # The reference: ViT-Tiny MAE, 32 px, patch 4, batch 32.
    "mae-tiny": ("mae", {"size": "tiny", "img_size": 32, "patch_size": 4}, 32),
    "captioner-tiny": ("caption", {"size": "tiny", "img_size": 32, "patch_size": 4, "vocab_size": 1000,
                                   "text_width": 384, "text_depth": 4, "text_heads": 6, "max_len": 16}, 32),
    "clip-tiny": ("clip", {"size": "tiny", "img_size": 32, "patch_size": 4, "vocab_size": 1000,
                           "text_width": 384, "text_depth": 4, "text_heads": 6, "max_len": 16}, 32),
}
ENGINES = ["nonprivate", "bookkeeping", "opacus-hooks", "opacus-ghost"]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(model_name: str, engine: str, steps: int, threads: int) -> dict:
    """Runs inside the subprocess."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    from pipeline.models import build_model
    from pipeline.privacy.clipping import PlainSum
    from pipeline.privacy.engine import make_clipper

    objective, cfg, batch_size = MODELS[model_name]
    model = build_model(objective, cfg)
    imgs = torch.randn(batch_size, 3, cfg["img_size"], cfg["img_size"])
    if objective == "mae":
        batch = (imgs, torch.rand(batch_size, (cfg["img_size"] // cfg["patch_size"]) ** 2))
    else:
        batch = (imgs, torch.randint(4, cfg["vocab_size"], (batch_size, cfg["max_len"])))
    clipper = PlainSum(model) if engine == "nonprivate" else make_clipper(objective, model, 1.0, engine)

    def step():
        clipper.reset()
        clipper.accumulate(*batch)

    step()  # warm-up: allocator caches, lazy init
    base = rss_mb()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - t0) / steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"s_per_step": seconds, "peak_mb": max(0.0, peak - base), "mode": clipper.mode}


def run_one(model_name, engine, steps, threads) -> dict:
    code = (f"import json,sys; sys.path.insert(0, '.'); from benchmarks.dp_overhead import measure; "
            f"print(json.dumps(measure({model_name!r}, {engine!r}, {steps}, {threads})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"
        return {"error": reason[:120]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="only the MAE row, 2 steps")
    args = ap.parse_args()
    models = ["mae-tiny"] if args.quick else list(MODELS)
    steps = 2 if args.quick else args.steps
    results = {m: {e: run_one(m, e, steps, args.threads) for e in ENGINES} for m in models}

    print(f"{'model':<16}{'engine':<14}{'s/step':>9}{'x time':>8}{'peak MB':>9}{'x mem':>7}")
    ratios = {}
    for m, row in results.items():
        base = row["nonprivate"]
        for e, r in row.items():
            if "error" in r:
                print(f"{m:<16}{e:<14}  n/a: {r['error']}")
                continue
            tx = r["s_per_step"] / base["s_per_step"]
            mx = r["peak_mb"] / base["peak_mb"] if base["peak_mb"] > 0 else float("nan")
            note = " (per-batch clipping)" if r["mode"] == "per_batch" else ""
            print(f"{m:<16}{e:<14}{r['s_per_step']:>9.3f}{tx:>8.2f}{r['peak_mb']:>9.0f}{mx:>7.2f}{note}")
            if e != "nonprivate":
                ratios[f"{m}/{e}"] = {"time": round(tx, 3), "memory": round(mx, 3)}
    print(json.dumps({"benchmark": "dp_overhead", "threads": args.threads, "steps": steps,
                      "targets": {"bookkeeping_time": 1.3, "bookkeeping_memory": 1.2}, "ratios": ratios}))


if __name__ == "__main__":
    main()
