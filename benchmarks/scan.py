"""Throughput of the shard scan that builds the index (pipeline/data/index.py: scan_shards).

    python -m benchmarks.scan [--shards N] [--samples S] [--px P] [--repeats R]

Writes N local tar shards of S photo-like JPEGs (P px) with ShardWriter, then times scan_shards on
them, as a scan job runs it: every image decoded once at P px, each shard's scan written to a fresh
cache. With 1 worker (in process: the per-core figure the scan jobs are sized by) and with 2
worker processes; then once more over the full cache (what the `shards` gather does after the scan
jobs). Prints a table, then ONE JSON line with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm is imported: no progress bars in the timings

import numpy as np  # noqa: E402

from pipeline.data.index import scan_shards  # noqa: E402
from pipeline.data.shards import ShardWriter  # noqa: E402
from pipeline.data.transforms import encode_jpeg  # noqa: E402


def photo_like(rng, px: int) -> np.ndarray:
    """Smooth colour fields plus texture, so JPEG sizes and decode times are like photos', unlike noise."""
    y, x = np.mgrid[0:px, 0:px] / px
    base = np.stack([np.sin(2 * np.pi * (rng.random() * 3 * x + rng.random() * 2 * y + rng.random()))
                     for _ in range(3)], -1)
    return np.clip(127 + 80 * base + rng.normal(0, 18, (px, px, 3)), 0, 255).astype(np.uint8)


def write_shards(directory: Path, shards: int, samples: int, px: int) -> list[str]:
    rng = np.random.default_rng(0)
    with ShardWriter(directory, prefix="bench", samples_per_shard=samples) as w:
        for i in range(shards * samples):
            w.write(f"img{i:07d}", encode_jpeg(photo_like(rng, px), quality=90), f"a photo of thing {i}", {},
                    image_ext="jpg")
    return [str(p) for p in sorted(directory.glob("*.tar"))]


def time_scan(urls: list[str], cache_dir: Path, workers: int, px: int) -> float:
    """Seconds for one scan of `urls` into `cache_dir`."""
    t0 = time.perf_counter()
    results = scan_shards(urls, cache_dir, workers, check_size=px)
    seconds = time.perf_counter() - t0
    assert all(piece is not None for piece, _ in results)
    return seconds


def best_fresh_scan(urls: list[str], root: Path, workers: int, px: int, repeats: int) -> float:
    """Best-of-`repeats` seconds (the machine may be shared), each into an empty cache."""
    return min(time_scan(urls, root / f"cache-{workers}-{r}", workers, px) for r in range(repeats))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=32)
    ap.add_argument("--samples", type=int, default=300, help="samples per shard")
    ap.add_argument("--px", type=int, default=64, help="image side in pixels (also the size the scan decodes at)")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per case (best is kept)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        urls = write_shards(root / "shards", args.shards, args.samples, args.px)
        megabytes = sum(os.path.getsize(u) for u in urls) / 1e6
        seconds = {w: best_fresh_scan(urls, root, w, args.px, args.repeats) for w in (1, 2)}
        cached = time_scan(urls, root / "cache-1-0", 1, args.px)  # every scan found in the cache

    rate = {w: args.shards / s for w, s in seconds.items()}
    print(f"{len(urls)} shards x {args.samples} JPEGs of {args.px} px ({megabytes:.1f} MB), best of {args.repeats}")
    print(f"{'workers':>8}{'seconds':>10}{'shards/s':>10}{'images/s':>10}")
    for w, s in seconds.items():
        print(f"{w:>8}{s:>10.2f}{rate[w]:>10.2f}{rate[w] * args.samples:>10.0f}")
    print(f"{'cached':>8}{cached:>10.2f}{args.shards / cached:>10.1f}")

    result = {
        "index_shards_per_s_per_core": round(rate[1], 3),
        "scaling_2_vs_1": round(rate[2] / rate[1], 2),
        "index_images_per_s_per_core": round(rate[1] * args.samples),
        "shards_per_s_2_workers": round(rate[2], 3),
        "cached_shards_per_s": round(args.shards / cached, 1),
        "shards": args.shards,
        "samples_per_shard": args.samples,
        "px": args.px,
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
