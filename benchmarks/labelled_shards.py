"""The shards stage's labelled-set writer, in one process and in several, side by side.

    python -m benchmarks.labelled_shards [--source fashion-mnist] [--workers 1 2]

Writes the whole set (Fashion-MNIST: 60,000 private and 10,000 eval images at shards.image_size, after
`make fashion-mnist`; digits: 1,797) the way the stage does, once per worker count, into a scratch
directory; checks that every count writes the same bytes; prints a table, then ONE JSON line with the
seconds, images/s and the speed-up over the first count. The set's decode is read once beforehand
(cached beside the package), so every count times the writing alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

from pipeline.config import load_params
from pipeline.data import labelled_sets
from pipeline.stages.shards import eval_fraction, write_labelled


def digest(directory: Path) -> str:
    """One sha256 over every file's path and bytes."""
    h = hashlib.sha256()
    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(directory)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="fashion-mnist", choices=sorted(labelled_sets.SETS))
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args(argv)
    cfg = {**load_params()["shards"], "source": args.source, "limit": None}
    # Fashion-MNIST: the scale benchmark's split, the official 10,000 test images held out
    cfg["eval_fraction"] = 1 / 7 if args.source == "fashion-mnist" else eval_fraction(cfg)
    labelled_sets.get(args.source).load(cfg["path"])  # decode once (and cache), outside the timings
    rows, first = [], None
    for workers in args.workers:
        with tempfile.TemporaryDirectory(prefix="labelled-shards-") as tmp:
            start = time.perf_counter()
            stats = write_labelled(cfg, 0, Path(tmp) / "shards", workers)
            seconds = time.perf_counter() - start
            images = stats["private"]["usable"] + stats["eval"]["usable"]
            rows.append({"workers": workers, "seconds": round(seconds, 2), "images_per_s": round(images / seconds),
                         "sha256": digest(Path(tmp) / "shards")})
        first = first or seconds
        rows[-1]["speedup"] = round(first / seconds, 2)
    print(f"{'workers':>8} {'seconds':>8} {'images/s':>9} {'speed-up':>9}")
    for r in rows:
        print(f"{r['workers']:>8} {r['seconds']:>8.1f} {r['images_per_s']:>9} {r['speedup']:>8.2f}x")
    same = len({r["sha256"] for r in rows}) == 1
    print(json.dumps({"source": args.source, "images": images, "same_bytes": same, "rows": rows}))
    if not same:
        raise SystemExit("the worker counts wrote different bytes")
    return rows


if __name__ == "__main__":
    main()
