"""DP-SGD overhead: seconds per step and peak memory of one clipped-gradient step, side by side for
non-private training, our book-keeping engine, and Opacus's hooks and ghost modes.

Time: all engines of a model run in one process on identical copies of the model, in interleaved
rounds, and the median round counts, so a change of machine load hits every engine alike; freed
memory stays in the heap as in training (`pipeline.train.keep_freed_memory`).
Memory: each (model, engine) pair runs in a fresh subprocess, so its peak is its own: the peak
resident memory of one step (the kernel's high-water mark, reset before it) minus the resident memory
before it (model built, one warm-up step done), with every block above 64 KB mapped on its own so that
resident memory follows the live tensors. Ends with one JSON line of the ratios to non-private.

    python benchmarks/dp_overhead.py [--rounds 5] [--threads 2] [--quick] [--models mae-tiny,...] [--compile]

--compile compiles the model of each of our engines as `dp.compile` does (book-keeping with the records
of compiled_records.py; round 0, untimed, compiles); Opacus, which backpropagates twice, is left out.

Rows: the three objectives at 32 px (ViT width 384, patch 4, batch 32), the CPU recipe's captioner
(width 96, batch 256; also dropping half its image patches, `model.caption_mask_ratio: 0.5`) and MAE
(width 96, batch 256), and at 224 px with a ViT-S/16 (width 384, 12 blocks, 6 heads: the project's
`tiny` size; batch 8 on a CPU). Opacus beside the MAE at 32 px. Target: every book-keeping ratio <= 1.1,
time and memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
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
    # The CPU recipe's captioner (params.yaml, benchmarks/scale_utility.py) at its physical batch.
    "captioner-cpu": ("caption", {"size": "cpu", "img_size": 32, "patch_size": 4, "vocab_size": 512,
                                  "max_len": 14}, 256),
    # The CPU recipe's MAE (params.yaml, benchmarks/scale_utility.py) at its physical batch.
    "mae-cpu": ("mae", {"size": "cpu", "img_size": 32, "patch_size": 4}, 256),
    # The same captioner, dropping half the image patches in training (model.caption_mask_ratio: 0.5).
    "captioner-cpu-masked": ("caption", {"size": "cpu", "img_size": 32, "patch_size": 4, "vocab_size": 512,
                                         "max_len": 14, "mask_ratio": 0.5}, 256),
    # ViT-S/16 at 224 px: 196 patches, the papers' resolution.
    "mae-s16-224": ("mae", {"size": "tiny", "img_size": 224, "patch_size": 16}, 8),
    "captioner-s16-224": ("caption", {"size": "tiny", "img_size": 224, "patch_size": 16, "vocab_size": 1000,
                                      "text_width": 384, "text_depth": 4, "text_heads": 6, "max_len": 16}, 8),
    "clip-s16-224": ("clip", {"size": "tiny", "img_size": 224, "patch_size": 16, "vocab_size": 1000,
                              "text_width": 384, "text_depth": 4, "text_heads": 6, "max_len": 16}, 8),
}
TARGET = 1.1  # book-keeping against non-private, time and memory
ENGINES = ["nonprivate", "bookkeeping", "opacus-hooks", "opacus-ghost"]


def rss_mb() -> float:
    import os

    from benchmarks.peak_memory import status_kib

    return status_kib(os.getpid(), ("VmRSS",)).get("VmRSS", float("nan")) / 1024


def _setup(model_name: str, engines: list[str], threads: int, compile: bool = False):
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    from pipeline.models import ModelConfig, build_model
    from pipeline.objectives import OBJECTIVES
    from pipeline.privacy.engine import make_clipper

    objective, cfg, batch_size = MODELS[model_name]
    torch.manual_seed(0)
    batch = (torch.randn(batch_size, 3, cfg["img_size"], cfg["img_size"]),)
    if OBJECTIVES[objective].tokens:
        batch += (torch.randint(4, cfg["vocab_size"], (batch_size, cfg["max_len"])),)
    if ModelConfig.of(cfg).reads_masks(objective):
        batch += (torch.rand(batch_size, (cfg["img_size"] // cfg["patch_size"]) ** 2),)
    clippers = {}
    for engine in engines:
        torch.manual_seed(0)
        model = build_model(objective, cfg)
        clippers[engine] = make_clipper(OBJECTIVES[objective].clipping, model, 1.0,
                                        "plain" if engine == "nonprivate" else engine, compiled=compile)
        if compile:
            model.compile()
    return clippers, batch


def _step(clipper, batch) -> None:
    clipper.reset()
    clipper.accumulate(*batch)


def time_engines(model_name: str, engines: list[str], rounds: int, threads: int, compile: bool = False) -> dict:
    """Runs inside a subprocess: median seconds per step of each engine, interleaved rounds, with the
    heap kept as training keeps it."""
    from pipeline.train import keep_freed_memory

    keep_freed_memory()
    clippers, batch = _setup(model_name, engines, threads, compile)
    times = {e: [] for e in engines}
    for r in range(rounds + 1):  # round 0 warms up
        for e, c in clippers.items():
            t0 = time.perf_counter()
            _step(c, batch)
            if r:
                times[e].append(time.perf_counter() - t0)
    return {e: {"s_per_step": statistics.median(t), "mode": clippers[e].mode} for e, t in times.items()}


def peak_memory(model_name: str, engine: str, threads: int, compile: bool = False) -> dict:
    """Runs inside a subprocess: peak resident MB of one step above the resident MB before it. Every
    block above 64 KB gets its own mapping, returned when freed, so resident memory follows the live
    tensors (glibc's adaptive defaults made the same figure move by ±30% from run to run, and a heap
    kept as training keeps it would hold the warm-up step's peak before the step)."""
    from pipeline.train import heap_policy

    heap_policy(64 << 10, 0)
    clippers, batch = _setup(model_name, [engine], threads, compile)
    _step(clippers[engine], batch)
    base = rss_mb()
    peak = step_peak_rss_mb(lambda: _step(clippers[engine], batch))
    return {"peak_mb": max(0.0, peak - base)}


def step_peak_rss_mb(step) -> float:
    """Peak resident MB while `step()` runs: the kernel's high-water mark reset just before it (a process's
    lifetime peak, ru_maxrss, can be a compile's, not the step's); the lifetime peak where the reset is
    refused."""
    import os

    from benchmarks.peak_memory import status_kib

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
    except OSError:
        step()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    step()
    return status_kib(os.getpid(), ("VmHWM",))["VmHWM"] / 1024


def in_subprocess(call: str, module: str = "benchmarks.dp_overhead") -> dict:
    """`call` (Python, a function of `module`) in a fresh interpreter: its JSON-able result."""
    code = f"import json,sys; sys.path.insert(0, '.'); from {module} import *; print(json.dumps({call}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"
        raise RuntimeError(last[:160])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def engines_for(model_name: str) -> list[str]:
    objective = MODELS[model_name][0]
    if objective == "clip":  # batch-coupled loss: one per-batch clipping engine, whatever the method
        return ["nonprivate", "bookkeeping"]
    if objective == "caption":  # Opacus has no per-sample rule for a LayerNorm without bias (DP-Cap's)
        return ["nonprivate", "bookkeeping"]
    if model_name != "mae-tiny":  # the Opacus baselines once, where they fit in memory and time
        return ["nonprivate", "bookkeeping"]
    return ENGINES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="only the MAE row, 2 rounds")
    ap.add_argument("--compile", action="store_true", help="torch.compile every engine's model (dp.compile)")
    ap.add_argument("--models", help=f"comma-separated subset of {', '.join(MODELS)}")
    args = ap.parse_args()
    models = ["mae-tiny"] if args.quick else args.models.split(",") if args.models else list(MODELS)
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown} (known: {', '.join(MODELS)})")
    rounds = 2 if args.quick else args.rounds
    width = max(map(len, models)) + 2
    print(f"{'model':<{width}}{'engine':<14}{'s/step':>9}{'x time':>8}{'peak MB':>9}{'x mem':>7}")
    ratios = {}
    for m in models:
        engines = [e for e in engines_for(m) if not (args.compile and e.startswith("opacus"))]  # Opacus
        # backpropagates twice through a graph, which a compiled backward refuses
        timed = in_subprocess(f"time_engines({m!r}, {engines!r}, {rounds}, {args.threads}, {args.compile})")
        memory = {e: in_subprocess(f"peak_memory({m!r}, {e!r}, {args.threads}, {args.compile})")["peak_mb"] for e in engines}
        base_t, base_m = timed["nonprivate"]["s_per_step"], memory["nonprivate"]
        for e in engines:
            tx = timed[e]["s_per_step"] / base_t
            mx = memory[e] / base_m if base_m > 0 else float("nan")
            note = " (per-batch clipping)" if timed[e]["mode"] == "per_batch" else ""
            if e == "bookkeeping":
                note += "" if tx <= TARGET and mx <= TARGET else f"  MISSED (target <= {TARGET})"
            print(f"{m:<{width}}{e:<14}{timed[e]['s_per_step']:>9.3f}{tx:>8.2f}{memory[e]:>9.0f}{mx:>7.2f}{note}")
            if e != "nonprivate":
                ratios[f"{m}/{e}"] = {"time": round(tx, 3), "memory": round(mx, 3)}
    print(json.dumps({"benchmark": "dp_overhead", "threads": args.threads, "rounds": rounds, "compile": args.compile,
                      "targets": {"bookkeeping_time": TARGET, "bookkeeping_memory": TARGET}, "ratios": ratios}))


if __name__ == "__main__":
    main()
