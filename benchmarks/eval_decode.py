"""How fast does an eval set decode? (pipeline/eval/images.py: threads decode each batch)

    python -m benchmarks.eval_decode [--n 2000] [--threads 1 2 8] [--dir DIR]

Writes a folder eval set (`class/*.jpg`, 10 classes) of n 320x256 JPEGs and reads the whole set the
way every evaluation protocol and the pre-training check read it: `load_eval_set` at 224 px, batch by
batch. Each thread count is timed on the same files, with the serial decode (1 thread, what every
protocol did before) as the baseline; every run must give the same pixels. Evaluate decodes a set
once per model and protocol, so this rate bounds how long the GPU waits between forward passes.
Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

IMAGE_SIZE, CLASSES, BATCH = 224, 10, 256


def write_folder(directory: Path, n: int) -> Path:
    """n smooth, slightly noisy 320x256 JPEGs in CLASSES class folders (kept for later runs)."""
    from PIL import Image

    done = directory / f"complete-{n}"
    if done.exists():
        return directory
    rng = np.random.default_rng(n)
    y, x = np.mgrid[0:256, 0:320]
    for i in range(n):
        base = (np.stack([x, y, x + y], -1) * rng.uniform(0.5, 2, 3) + rng.uniform(0, 255, 3)) % 256
        image = (base + rng.normal(0, 6, base.shape)).clip(0, 255).astype(np.uint8)
        (directory / f"class{i % CLASSES}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(directory / f"class{i % CLASSES}" / f"{i:07d}.jpg", quality=90)
    done.touch()
    return directory


def read_all(directory: Path, threads: int) -> tuple[float, np.ndarray]:
    """(seconds, a checksum per image) for one pass over the set with `threads` decoding threads."""
    from pipeline.eval import images
    from pipeline.eval.evalsets import load_eval_set

    images.DECODE_THREADS = threads
    es = load_eval_set({"name": "bench", "source": "folder", "path": str(directory)}, IMAGE_SIZE)
    sums = []
    t0 = time.perf_counter()
    for start in range(0, len(es.images), BATCH):
        sums.append(es.images[start:start + BATCH].reshape(-1, IMAGE_SIZE * IMAGE_SIZE * 3).sum(1))
    return time.perf_counter() - t0, np.concatenate(sums)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, 2, min(8, os.cpu_count() or 1)}))
    parser.add_argument("--dir", type=Path, help="keep the image folder here (reused by later runs)")
    args = parser.parse_args()
    directory = write_folder(Path(args.dir or tempfile.mkdtemp(prefix="dpfm-eval-decode-")), args.n)
    read_all(directory, 1)  # warm the page cache: every timed pass reads the files from memory
    base_s, base_sums = read_all(directory, 1)
    rows = {}
    for threads in args.threads:
        seconds, sums = (base_s, base_sums) if threads == 1 else read_all(directory, threads)
        if not np.array_equal(sums, base_sums):
            raise SystemExit(f"eval_decode: {threads} threads decoded other pixels than 1 thread")
        rows[threads] = {"s": round(seconds, 3), "images_per_s": round(args.n / seconds, 1),
                         "speedup": round(base_s / seconds, 2)}
    print(f"{'decode threads':<16}{'s':>8}{'images/s':>10}{'vs 1 thread':>13}   ({args.n} JPEGs to {IMAGE_SIZE} px, "
          f"{os.cpu_count()} cores)")
    for threads, r in rows.items():
        print(f"{threads:<16}{r['s']:>8.2f}{r['images_per_s']:>10.0f}{r['speedup']:>12.2f}x")
    print(json.dumps({"benchmark": "eval_decode", "n": args.n, "image_size": IMAGE_SIZE, "cores": os.cpu_count(),
                      "threads": {str(t): r for t, r in rows.items()}}))


if __name__ == "__main__":
    main()
