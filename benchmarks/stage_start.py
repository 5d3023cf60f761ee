"""What a stage's start costs on a large private index: DVC's hash of data/shards, which every stage on
the private data (dp-train, curve, evaluate, report) puts on its MLflow run (tracking.input_tag).

    python -m benchmarks.stage_start [--gb 4] [--files 8] [--dir DIR]

Fills a project's data/shards with --gb GB of index-like files (random bytes, --files of them; a
233M-row index is ~13 GB of usable.idx beside its parquet table), then times input_tag as the first
stage meets it (every byte read) and as the next stages do (the owner's record of unchanged files),
both with the files in the page cache, and the same call with no record (every stage as it was).
Target: a later stage's start reads no file, under 1% of the first. Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile
import time
from pathlib import Path

TARGET_SHARE = 0.01
CHUNK = 64 << 20


def fill(shards: Path, gb: float, files: int) -> None:
    """--files files of gb/files GB each, kept across runs of the same size."""
    shards.mkdir(parents=True, exist_ok=True)
    size = int(gb * (1 << 30) / files)
    for stale in sorted(shards.glob("index-*.bin"))[files:]:  # an earlier run's, with more files
        stale.unlink()
    for i in range(files):
        path = shards / f"index-{i:03d}.bin"
        if path.exists() and path.stat().st_size == size:
            continue
        with open(path, "wb") as f:
            for start in range(0, size, CHUNK):
                f.write(os.urandom(min(CHUNK, size - start)))


def timed(fn) -> tuple[float, str]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "dpfm-stage-start")
    args = parser.parse_args()
    project = args.dir
    fill(project / "data/shards", args.gb, args.files)
    os.chdir(project)  # the owner zone and the names key are the benchmark project's own
    from pipeline import tracking
    from pipeline.privacy import owner

    for imported_by_every_stage in ("pipeline.stages", "pipeline.privacy.budget"):  # not timed
        importlib.import_module(imported_by_every_stage)

    owner.path(tracking.FILE_DIGESTS).unlink(missing_ok=True)
    tracking.dvc_hash("data/shards")  # the files into the page cache, as the shards stage leaves them
    plain_s, _ = timed(lambda: tracking.dvc_hash("data/shards"))
    first_s, tag = timed(lambda: tracking.input_tag("data/shards/"))
    later_s, again = timed(lambda: tracking.input_tag("data/shards/"))
    if tag != again:
        raise SystemExit(f"the recorded md5s gave another tag: {tag} against {again}")
    share = later_s / first_s
    print(f"{'input_tag on data/shards':<34}{'GB':>6}{'seconds':>10}{'GB/s':>8}")
    for name, s in [("every byte read (before)", plain_s), ("first stage", first_s), ("later stages", later_s)]:
        print(f"{name:<34}{args.gb:>6.1f}{s:>10.3f}{args.gb / s:>8.2f}")
    print(f"later stage / first: {share:.4f} (target <= {TARGET_SHARE})")
    print(json.dumps({"benchmark": "stage_start", "gb": args.gb, "files": args.files,
                      "plain_s": round(plain_s, 3), "first_s": round(first_s, 3), "later_s": round(later_s, 4),
                      "later_share": round(share, 5), "target_share": TARGET_SHARE,
                      "ok": share <= TARGET_SHARE}))


if __name__ == "__main__":
    main()
