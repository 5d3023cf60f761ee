"""Images/s and peak GPU memory of one clipped-gradient step against the non-private step, at 224 px.

    python -m benchmarks.gpu_throughput [--sizes tiny base] [--objectives mae caption clip] [--precision bf16]

For each ViT size (model.size: `tiny` has ViT-S/16's shape, width 384 and 12 blocks; `base` is
ViT-B/16's), each objective and each engine (non-private `plain`, our `bookkeeping` per-example
clipping; Dp-CLIP's per-batch clipping), the largest physical batch that fits is found by doubling
(up to --max-batch), then steps are timed with CUDA synchronisation and the median counts. A step
here is what the clipper does per micro-batch: forward, backward, per-example norms, clipping and the
sum; the noise, added once per logical step, is timed apart ("noise ms"), drawn on the device.
Runs on CPU as well (slowly: use --sizes micro --img 32 there). Ends with ONE JSON line.

`bookkeeping-fp32` is book-keeping with its Linear products upcast to fp32 first
(layer_rules.LOW_PRECISION_PRODUCTS off), the route before bf16 GEMMs with fp32 results, so the two
rows show what the tensor cores buy. `bookkeeping-one-block` forms each Gram product in one piece,
without the CPU-fitted blocks (the same numbers up to summation order): fewer kernels to launch.

--profile BATCH: instead, one step of each engine at that batch under torch.profiler, and the ops
that take the most device time (CPU time without a GPU), side by side: where the clipping's time goes.

--compile: also each engine with the model compiled (dp.compile: `model.compile()`, book-keeping
with compiled_records.py's records, as training does), at --max-batch without the search (each batch size compiles
anew); the ratios stay against the uncompiled non-private step, and each compiled step's sum is
compared with its eager twin's on the same inputs ("sum vs eager": the relative gap of the two vectors).

--launches: instead, the kernels one step of each engine dispatches (views and allocations left out),
counted without a GPU (the bf16 GEMMs emulated, one launch each) at batch 2: on the H200 the clipped
step at batch 256 was bound by its launches, so fewer of them is what it gains first.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import statistics
import time

import torch

from pipeline.models import ModelConfig, build_model
from pipeline.objectives import OBJECTIVES
from pipeline.privacy import layer_rules
from benchmarks.noise_draw import seconds_per_step as noise_seconds
from pipeline.privacy.engine import add_noise as engine_add_noise, make_clipper
from pipeline.train import autocast

ENGINES = ("plain", "bookkeeping", "bookkeeping-fp32", "bookkeeping-one-block")


@contextlib.contextmanager
def products_of(engine: str):
    """`bookkeeping-fp32`: book-keeping with its products upcast to fp32 first. `bookkeeping-one-block`:
    its Gram products as one (B, T, T) product per side, without the blocks and aligned columns fitted
    on 2 CPU cores (GRAM_BLOCK, GRAM_ALIGN), which on a GPU are more kernels to launch."""
    saved = layer_rules.LOW_PRECISION_PRODUCTS, layer_rules.GRAM_BLOCK, layer_rules.GRAM_ALIGN
    layer_rules.LOW_PRECISION_PRODUCTS = not engine.endswith("-fp32")
    if engine.endswith("-one-block"):
        layer_rules.GRAM_BLOCK, layer_rules.GRAM_ALIGN = 1 << 30, 1
    try:
        yield engine.removesuffix("-fp32").removesuffix("-one-block")
    finally:
        layer_rules.LOW_PRECISION_PRODUCTS, layer_rules.GRAM_BLOCK, layer_rules.GRAM_ALIGN = saved

TEXT = {"vocab_size": 1000, "text_width": 512, "text_depth": 6, "text_heads": 8, "max_len": 40}


def batch_for(objective: str, cfg: dict, n: int, device: str) -> tuple:
    batch = (torch.randn(n, 3, cfg["img_size"], cfg["img_size"], device=device),)
    if OBJECTIVES[objective].tokens:
        batch += (torch.randint(4, cfg["vocab_size"], (n, cfg["max_len"]), device=device),)
    if ModelConfig.of(cfg).reads_masks(objective):
        batch += (torch.rand(n, (cfg["img_size"] // cfg["patch_size"]) ** 2, device=device),)
    return batch


def release(device: str) -> None:
    """Frees what a measured step left: the clipper's hooks tie model and clipper in a reference cycle,
    which only the collector frees: on the H200 the tries of the batch search (about 1 GiB each, and
    an OOM'd try's activations) were still held when the next step was measured, and counted in its peak."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(objective: str, cfg: dict, engine: str, batch: int, device: str, precision: str, steps: int) -> dict:
    with products_of(engine.removesuffix("+compile")) as method:
        return _measure(objective, cfg, method, batch, device, precision, steps, engine.endswith("+compile"))


def _measure(objective: str, cfg: dict, engine: str, batch: int, device: str, precision: str, steps: int,
             compiled: bool = False) -> dict:
    torch.manual_seed(0)
    model = build_model(objective, cfg).to(device)
    clipper = make_clipper(OBJECTIVES[objective].clipping, model, 1.0, engine,
                           autocast=lambda: autocast(device, precision), compiled=compiled)
    if compiled:  # as training's dp.compile (book-keeping's records: compiled_records.py)
        model.compile()
    inputs = batch_for(objective, cfg, batch, device)
    release(device)  # an earlier measure's leftovers must not count in this one's peak
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 2):  # two warm-up steps
        sync(device)
        t0 = time.perf_counter()
        clipper.reset()
        clipper.accumulate(*inputs)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")  # the step's, not the noise's
    params = [p for p in model.parameters() if p.requires_grad]
    noise_ms = noise_seconds(engine_add_noise, model, device, 5) * 1000  # one logical step's, on the device
    # the last step's sum, one vector on the host: a compiled engine is checked against its eager twin
    summed = torch.cat([v.detach().float().flatten().cpu() for v in clipper.sum.values()])
    del clipper, model, inputs
    release(device)
    return {"batch": batch, "s_per_step": s, "images_per_s": batch / s, "peak_gib": peak, "noise_ms": noise_ms,
            "params_m": sum(p.numel() for p in params) / 1e6, "sum": summed}


def profile(objective: str, cfg: dict, batch: int, device: str, precision: str, top: int = 15) -> None:
    """The ops of one step that take the most time, plain against book-keeping, after a warm-up step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    for engine in ENGINES:
        torch.manual_seed(0)
        model = build_model(objective, cfg).to(device)
        with products_of(engine) as method:
            clipper = make_clipper(OBJECTIVES[objective].clipping, model, 1.0, method,
                                   autocast=lambda: autocast(device, precision))
        inputs = batch_for(objective, cfg, batch, device)
        for _ in range(2):  # the second step is the one kept: the first warms up
            with torch_profile(activities=activities) as prof, products_of(engine):
                clipper.reset()
                clipper.accumulate(*inputs)
                sync(device)
        print(f"== {objective} {cfg['size']} {engine}, batch {batch}: top {top} ops by self {key.split('_')[1]} time")
        print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60), flush=True)
        del clipper, model, inputs
        release(device)


NOT_LAUNCHED = {"view", "_unsafe_view", "t", "transpose", "permute", "select", "slice", "detach", "expand",
                "unsqueeze", "squeeze", "as_strided", "alias", "unbind", "split", "narrow", "empty", "empty_like"}


def launches(objective: str, cfg: dict, engine: str, precision: str) -> collections.Counter:
    """The kernels one step dispatches, by op (the second step's: the first warms up)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipeline.privacy.tools import emulated_bf16_gemm

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.inside_gemm = collections.Counter(), False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not self.inside_gemm and name not in NOT_LAUNCHED:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    count = Count()

    def gemm(x, y):  # the emulation's upcasts and product stand for one CUDA kernel
        count.ops["bf16 gemm"] += 1
        count.inside_gemm = True
        try:
            return emulated_bf16_gemm.emulated_low_gemm(x, y)
        finally:
            count.inside_gemm = False

    saved = layer_rules.low_gemm_applies, layer_rules.low_gemm
    emulated_bf16_gemm.enable()
    layer_rules.low_gemm = gemm
    try:
        with products_of(engine) as method:
            torch.manual_seed(0)
            model = build_model(objective, cfg)
            clipper = make_clipper(OBJECTIVES[objective].clipping, model, 1.0, method,
                                   autocast=lambda: autocast("cpu", precision))
            inputs = batch_for(objective, cfg, 2, "cpu")
            for step in range(2):
                clipper.reset()
                count.ops.clear()  # the warm-up's GEMMs were counted outside the mode
                with count if step else contextlib.nullcontext():
                    clipper.accumulate(*inputs)
    finally:
        layer_rules.low_gemm_applies, layer_rules.low_gemm = saved
    return count.ops


def largest_batch(objective, cfg, engine, device, precision, start: int, cap: int) -> int:
    """Doubling until out of memory (or the cap): the largest physical batch that ran a step."""
    best, b = 0, start
    while b <= cap:
        try:
            measure(objective, cfg, engine, b, device, precision, steps=1)
            best, b = b, b * 2
        except torch.OutOfMemoryError:
            break
        finally:
            release(device)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "base"])
    ap.add_argument("--objectives", nargs="+", default=list(OBJECTIVES))
    ap.add_argument("--img", type=int, default=224)
    ap.add_argument("--patch", type=int, default=16)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", type=int, metavar="BATCH", help="profile one step per engine at this batch")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES),
                    help="`plain` always runs: the ratios are against it")
    ap.add_argument("--compile", action="store_true", help="also each engine compiled, at --max-batch")
    ap.add_argument("--launches", action="store_true", help="count each engine's kernels per step (no GPU needed)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.launches:
        return print_launches(args)
    if args.profile:
        for size in args.sizes:
            for objective in args.objectives:
                cfg = {"size": size, "img_size": args.img, "patch_size": args.patch, **TEXT}
                profile(objective, cfg, args.profile, device, args.precision)
        return
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"gpu_throughput on {name}, {args.img} px, patch {args.patch}, {args.precision}")
    print(f"{'size':<6}{'objective':<9}{'engine':<22}{'batch':>6}{'img/s':>9}{'x time':>8}{'peak GiB':>10}"
          f"{'x mem':>7}{'noise ms':>10}")
    rows = []
    for size in args.sizes:
        for objective in args.objectives:
            cfg = {"size": size, "img_size": args.img, "patch_size": args.patch, **TEXT}
            chosen = ENGINES if OBJECTIVES[objective].clipping == "per_sample" else ENGINES[:2]
            engines = dict.fromkeys(e for e in chosen if e == "plain" or e in args.engines)
            if args.compile:  # each new batch size would compile again: no search
                engines = dict.fromkeys(e + suffix for suffix in ("", "+compile") for e in list(engines)[:2])
                batch = args.max_batch
            else:  # both at the largest batch the DP engine fits, so the ratios compare like with like
                batch = largest_batch(objective, cfg, "bookkeeping", device, args.precision, 8, args.max_batch)
                # and the non-private step must fit at that batch too
                batch = largest_batch(objective, cfg, "plain", device, args.precision, batch, batch) or batch // 2
            for engine in engines:
                engines[engine] = measure(objective, cfg, engine, batch, device, args.precision, args.steps)
            base = engines["plain"]
            sums = {engine: r.pop("sum") for engine, r in engines.items()}
            for engine, r in engines.items():
                tx, mx = r["s_per_step"] / base["s_per_step"], r["peak_gib"] / base["peak_gib"]
                twin = sums[engine.removesuffix("+compile")]  # the same step uncompiled, on the same inputs
                gap = float((sums[engine] - twin).norm() / twin.norm()) if engine.endswith("+compile") else None
                print(f"{size:<6}{objective:<9}{engine:<22}{batch:>6}{r['images_per_s']:>9.0f}{tx:>8.2f}"
                      f"{r['peak_gib']:>10.2f}{mx:>7.2f}{r['noise_ms']:>10.2f}"
                      f"{'' if gap is None else f'  sum vs eager {gap:.1e}'}", flush=True)
                rows.append({"size": size, "objective": objective, "engine": engine, **r,
                             "time_ratio": round(tx, 3), "memory_ratio": round(mx, 3), "sum_gap_to_eager": gap})
    print(json.dumps({"benchmark": "gpu_throughput", "device": name, "img": args.img, "patch": args.patch,
                      "precision": args.precision, "rows": rows}))


def print_launches(args) -> None:
    print(f"gpu_throughput --launches: kernels per step, {args.img} px, patch {args.patch}, {args.precision} "
          "(bf16 GEMMs emulated)")
    rows = []
    for size in args.sizes:
        for objective in args.objectives:
            cfg = {"size": size, "img_size": args.img, "patch_size": args.patch, **TEXT}
            engines = ENGINES[:2] if OBJECTIVES[objective].clipping == "per_sample" else ENGINES[:1]
            counts = {engine: launches(objective, cfg, engine, args.precision) for engine in engines}
            base = sum(counts["plain"].values())
            for engine, ops in counts.items():
                total = sum(ops.values())
                top = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
                print(f"{size:<6}{objective:<9}{engine:<14}{total:>7}{total / base:>7.2f}x   {top}", flush=True)
                rows.append({"size": size, "objective": objective, "engine": engine, "kernels": total,
                             "ratio": round(total / base, 3), "by_op": dict(ops)})
    print(json.dumps({"benchmark": "gpu_throughput_launches", "img": args.img, "patch": args.patch,
                      "precision": args.precision, "rows": rows}))


if __name__ == "__main__":
    main()
