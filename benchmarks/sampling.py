"""Cost of one Poisson-sampling step draw at web scale (pipeline/privacy/sampling.py).

    python benchmarks/sampling.py [--n 233000000] [--batch 98304] [--draws 20]

Times PoissonSampler.batch(t) (Binomial size, then a uniform subset, sorted) plus the split into
8 data-parallel ranks of 256-example micro-batches (by index range, as dp-train cuts a per-example
sum: sampling.split_by_index), and measures the peak memory of one draw with
tracemalloc (numpy reports its buffers to it). Beside it, the baseline that needs no cleverness:
one Bernoulli(q) coin per example, streamed in 16M-example chunks (O(n) time, bounded memory).
Prints a table, then ONE JSON line with the figures and the ratios to targets and baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline.privacy.sampling import PoissonSampler, split_by_index  # noqa: E402

TARGET_SECONDS = 1.0
TARGET_MB = 200.0
KEY = 0x5EC12E7  # a benchmark key; real runs keep theirs secret


def bernoulli_stream(n: int, q: float, step: int, chunk: int = 1 << 24) -> np.ndarray:
    """The baseline: a coin per example, chunk by chunk."""
    rng = np.random.default_rng([KEY, step])
    parts = [start + np.flatnonzero(rng.random(min(chunk, n - start)) < q) for start in range(0, n, chunk)]
    return np.concatenate(parts)


def timed(fn, draws: int) -> tuple[float, float, int]:
    """(mean seconds, max seconds, mean batch size) over `draws` steps."""
    times, sizes = [], []
    for t in range(draws):
        t0 = time.perf_counter()
        batch = fn(t)
        times.append(time.perf_counter() - t0)
        sizes.append(len(batch))
    return float(np.mean(times)), float(np.max(times)), int(np.mean(sizes))


def peak_mb(fn) -> float:
    tracemalloc.start()
    try:
        fn(10_000)
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=233_000_000, help="usable examples")
    ap.add_argument("--batch", type=int, default=98_304, help="expected batch size q·n")
    ap.add_argument("--draws", type=int, default=20, help="steps drawn per method")
    ap.add_argument("--baseline-draws", type=int, default=3)
    args = ap.parse_args(argv)
    q = args.batch / args.n
    sampler = PoissonSampler(args.n, q, KEY)

    def draw_and_split(step):
        batch = sampler.batch(step)
        for rank in range(8):
            split_by_index(batch, args.n, args.batch, 256, rank, 8)
        return batch

    draw_and_split(0)  # warm-up
    mean_s, max_s, size = timed(draw_and_split, args.draws)
    mem = peak_mb(draw_and_split)
    base_mean, base_max, base_size = timed(lambda t: bernoulli_stream(args.n, q, t), args.baseline_draws)
    base_mem = peak_mb(lambda t: bernoulli_stream(args.n, q, t))

    print(f"n = {args.n:,}, q = {q:.3e} (expected batch {args.batch:,})")
    print(f"{'method':<34}{'mean s':>9}{'max s':>9}{'peak MB':>10}{'batch':>9}")
    print(f"{'PoissonSampler.batch + split':<34}{mean_s:>9.4f}{max_s:>9.4f}{mem:>10.1f}{size:>9,}")
    print(f"{'baseline: streamed Bernoulli coins':<34}{base_mean:>9.4f}{base_max:>9.4f}{base_mem:>10.1f}{base_size:>9,}")
    ok = max_s <= TARGET_SECONDS and mem <= TARGET_MB
    print(f"targets: <= {TARGET_SECONDS} s and <= {TARGET_MB:.0f} MB per draw: {'met' if ok else 'MISSED'}; "
          f"{base_mean / mean_s:.0f}x faster than the baseline (timings on a shared machine are noisy)")
    result = {
        "n": args.n, "expected_batch": args.batch, "draws": args.draws,
        "seconds_per_draw": round(mean_s, 5), "max_seconds_per_draw": round(max_s, 5),
        "peak_mb": round(mem, 2), "mean_batch": size,
        "target_seconds": TARGET_SECONDS, "target_mb": TARGET_MB,
        "seconds_ratio_to_target": round(max_s / TARGET_SECONDS, 4), "mb_ratio_to_target": round(mem / TARGET_MB, 4),
        "baseline_seconds_per_draw": round(base_mean, 4), "baseline_peak_mb": round(base_mem, 1),
        "speedup_vs_baseline": round(base_mean / mean_s, 1), "targets_met": ok, "numpy": np.__version__,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
