"""Throughput of the Shaders21k-style generator (the pipeline/data/synthetic/ package).

    python benchmarks/synthetic.py [--quick] [--repeats N]

Renders the way the `synthetic` stage does (render_items over a block of
programs x frames) at 64x64 and 224x224: on CPU with one thread (the per-core
figure the pipeline plans with) and, where torch.cuda.is_available(), on the
GPU. Then the stage's other per-image cost, the PNG it stores each image as, at
the stage's zlib level beside pillow's usual 6, on the 224 px images. Prints a
table, then ONE JSON line with the figures and target ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline.data import synthetic as S  # noqa: E402
from pipeline.data.shards import encode_png  # noqa: E402
from pipeline.stages.synthetic import PNG_LEVEL  # noqa: E402

TARGET_CPU_224_PER_CORE = 50.0   # images/s on one core
TARGET_CUDA_224 = 5000.0         # images/s on one GPU
BASE_SEED = 0


def _items(programs: int, frames: int, first: int = 1000) -> list[tuple[int, int]]:
    # Consecutive frames of each program, as the stage lays items out.
    return [(p, f) for p in range(first, first + programs) for f in range(frames)]


def _warm_up(device) -> None:
    """First calls of each kernel and the noise bank are one-off costs: pay them
    on programs (ids 0..63, every block kind) outside the timed workloads."""
    S.render_items(_items(64, 1, first=0), 32, base_seed=BASE_SEED, device=device)


def _png_ms(images, level: int, repeats: int) -> tuple[float, float]:
    """Best-of-`repeats` ms per image to encode `images` at zlib `level`, and KiB per image."""
    best, size = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        size = sum(len(encode_png(im, level)) for im in images)
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best / len(images), size / len(images) / 1024


def _time(items, resolution, device, repeats) -> tuple[float, float]:
    """Best-of-`repeats` wall time (the machine may be shared) -> (seconds, images/s)."""
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = S.render_items(items, resolution, base_seed=BASE_SEED, device=device)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
        assert out.shape == (len(items), resolution, resolution, 3)
    return best, len(items) / best


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small workloads (a few seconds)")
    ap.add_argument("--repeats", type=int, default=None, help="timed passes per case (best is kept)")
    args = ap.parse_args(argv)
    repeats = args.repeats or 2

    # (resolution, programs, frames per program) for each device
    # Enough programs per case that the mix of cheap and expensive shaders is typical.
    cpu_cases = [(64, 24, 8), (224, 12, 2)] if args.quick else [(64, 64, 16), (224, 40, 5)]
    cuda_cases = [(64, 16, 64), (224, 16, 32)] if args.quick else [(64, 64, 64), (224, 64, 32)]

    rows, fig = [], {}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _warm_up("cpu")
        for res, progs, frames in cpu_cases:
            secs, ips = _time(_items(progs, frames), res, "cpu", repeats)
            fig[f"cpu_{res}_per_core"] = round(ips, 1)
            rows.append(("cpu x1 thread", res, progs * frames, secs, ips))
        images = S.render_items(_items(*cpu_cases[-1][1:]), 224, base_seed=BASE_SEED).numpy()
        png = {level: _png_ms(images, level, repeats) for level in (6, PNG_LEVEL)}
    finally:
        torch.set_num_threads(threads_before)

    if torch.cuda.is_available():
        _warm_up("cuda")
        for res, progs, frames in cuda_cases:
            secs, ips = _time(_items(progs, frames), res, "cuda", repeats)
            fig[f"cuda_{res}"] = round(ips, 1)
            rows.append((torch.cuda.get_device_name(0)[:24], res, progs * frames, secs, ips))

    print(f"{'device':<26}{'res':>6}{'images':>8}{'seconds':>10}{'images/s':>11}")
    for dev, res, n, secs, ips in rows:
        print(f"{dev:<26}{res:>6}{n:>8}{secs:>10.2f}{ips:>11.1f}")
    print(f"(best of {repeats}; targets: {TARGET_CPU_224_PER_CORE:.0f}/s per core at 224, "
          f"{TARGET_CUDA_224:.0f}/s per GPU at 224)")
    render_ms = 1e3 / fig["cpu_224_per_core"]
    stage = {level: render_ms + ms for level, (ms, _) in png.items()}
    for level, (ms, kib) in png.items():
        print(f"224 px PNG at zlib level {level}: {ms:.1f} ms and {kib:.0f} KiB an image; rendered and stored: "
              f"{stage[level]:.1f} ms an image on one core")
    print(f"the stage's level {PNG_LEVEL} against 6: {stage[6] / stage[PNG_LEVEL]:.2f}x the images per core, "
          f"{png[PNG_LEVEL][1] / png[6][1]:.2f}x the bytes")

    result = {
        **fig,
        "target_cpu_224_per_core": TARGET_CPU_224_PER_CORE,
        "cpu_224_ratio": round(fig["cpu_224_per_core"] / TARGET_CPU_224_PER_CORE, 2),
        "cuda_224": fig.get("cuda_224"),
        "target_cuda_224": TARGET_CUDA_224,
        "cuda_224_ratio": round(fig["cuda_224"] / TARGET_CUDA_224, 2) if "cuda_224" in fig else None,
        "png_224_ms": {str(level): round(ms, 2) for level, (ms, _) in png.items()},
        "png_224_kib": {str(level): round(kib, 1) for level, (_, kib) in png.items()},
        "stage_224_speedup_over_level_6": round(stage[6] / stage[PNG_LEVEL], 2),
        "quick": args.quick,
        "repeats": repeats,
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
