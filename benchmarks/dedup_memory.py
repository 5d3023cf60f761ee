"""Does the shards stage's merge (duplicate keys and contents over every shard) stay flat in memory as
n grows? (`data/index.build_index`, with the duplicates found in buckets on disk: `data/dedup.py`)

    python -m benchmarks.dedup_memory [--small 500000] [--factor 32] [--piece-rows 10000]
                                      [--bucket-rows 65536] [--dir DIR]

Writes n and factor·n scanned rows (status, key and content digests, as the scan cache holds them) in
pieces of `--piece-rows` (one shard's scan each; a web shard holds about 10k) and runs build_index's
merge and write over each in a fresh process (the scan itself and usable.idx left out), measuring
its peak private (anonymous) memory from /proc (benchmarks/peak_memory.py). Beside it, the merge as it was: each digest column of all n rows
sorted at once. Buckets of `--bucket-rows` (the stage's are 2^20 rows: one bucket up to 1M rows, its
sort ~40 MB) so that both sizes hold many, as 233M rows do. Target: from n to factor·n, the merge's
private memory grows by <= 4 bytes a row (1 GB at 233M rows; two bits a row are what it holds by
design); before, about 50. Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np

from benchmarks.peak_memory import peak_memory

TARGET_BYTES_PER_ROW = 4.0
MODULE = "dedup_memory"


def write_pieces(directory: Path, n: int, piece_rows: int) -> list[Path]:
    """Scan-cache parquet files of `piece_rows` rows, n in all, a tenth of the keys and contents repeated."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data.index import SCAN_SCHEMA
    from pipeline.io import atomic_path

    pieces = -(-n // piece_rows)
    paths = [directory / f"{i:05d}.parquet" for i in range(pieces)]
    rng = np.random.default_rng(n)
    for i, path in enumerate(paths):
        if path.exists():  # only ever whole: written under a temporary name, then renamed
            continue
        rows = n * (i + 1) // pieces - n * i // pieces
        digests = rng.integers(0, 2**63, (2, rows), dtype=np.uint64)
        digests[:, rng.random(rows) < 0.1] = rng.integers(0, 1000, 2, dtype=np.uint64)[:, None]
        columns = {f.name: pa.nulls(rows, f.type) for f in SCAN_SCHEMA}
        columns.update(status=pa.array(["ok"] * rows), key_hash=pa.array(digests[0]), content_hash=pa.array(digests[1]),
                       shard_id=pa.array(np.zeros(rows, np.int32)))
        with atomic_path(path) as tmp:
            pq.write_table(pa.table(columns, schema=SCAN_SCHEMA), tmp)
    return paths


def child(mode: str, directory: Path, bucket_rows: int) -> None:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from pipeline.data import dedup, index
    from pipeline.data.dedup import duplicate_mask

    dedup.BUCKET_ROWS = bucket_rows

    pieces = sorted(directory.glob("*.parquet"))
    if mode == "before":  # every row's digests at once, sorted whole (what build_index held until now)
        usable = np.concatenate([pc.equal(pq.read_table(p, columns=["status"]).column("status"), "ok")
                                 .to_numpy(zero_copy_only=False) for p in pieces])
        keys = np.concatenate([pq.read_table(p, columns=["key_hash"]).column("key_hash").to_numpy() for p in pieces])
        dup = duplicate_mask(keys, usable)
        del keys
        contents = np.concatenate([pq.read_table(p, columns=["content_hash"]).column("content_hash").to_numpy()
                                   for p in pieces])
        duplicate_mask(contents, usable & ~dup)
        return
    good = [(str(p), {"url": f"/bench/{p.stem}.tar", "size": 1, "cached": True}) for p in pieces]
    with tempfile.TemporaryDirectory(dir=directory.parent) as out, \
            mock.patch.object(index, "scan_shards", lambda *a, **kw: good), \
            mock.patch.object(index.owner, "note", lambda *a, **kw: None), \
            mock.patch.object(index, "write_usable", lambda path: None):
        index.build_index([info["url"] for _, info in good], out, eval_fraction=0.1, seed=0, cache_dir=out,
                          workers=1, check_size=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=500_000)
    parser.add_argument("--factor", type=int, default=32)
    parser.add_argument("--piece-rows", type=int, default=10_000)
    parser.add_argument("--bucket-rows", type=int, default=1 << 16)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "dpfm-dedup-memory")
    parser.add_argument("--child", choices=["now", "before"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.dir, args.bucket_rows)
        return
    sizes = {"small": args.small, "large": args.small * args.factor}
    r = {}
    print(f"{'private MiB of the merge':<28}{'n':>12}{'now':>8}{'before':>8}")
    for name, n in sizes.items():
        folder = args.dir / f"n{n}-r{args.piece_rows}"
        folder.mkdir(parents=True, exist_ok=True)
        write_pieces(folder, n, args.piece_rows)
        for mode in ("now", "before"):
            peak = peak_memory(MODULE, mode, folder, "--bucket-rows", str(args.bucket_rows))
            r[f"{mode}_anon_mb_{name}"] = peak.anon_mb
        print(f"{'':<28}{n:>12}{r[f'now_anon_mb_{name}']:>8.0f}{r[f'before_anon_mb_{name}']:>8.0f}")
    for mode in ("now", "before"):  # what the extra rows cost, a row: the fixed cost (imports) cancels
        r[f"{mode}_bytes_per_row"] = ((r[f"{mode}_anon_mb_large"] - r[f"{mode}_anon_mb_small"]) * 2**20
                                      / (sizes["large"] - sizes["small"]))
    print(f"private bytes a row, from {sizes['small']} to {sizes['large']} rows: now {r['now_bytes_per_row']:.1f} "
          f"(target <= {TARGET_BYTES_PER_ROW}), before {r['before_bytes_per_row']:.1f}; "
          f"at 233M rows: now {r['now_bytes_per_row'] * 233e6 / 2**30:.1f} GiB, "
          f"before {r['before_bytes_per_row'] * 233e6 / 2**30:.1f} GiB")
    print(json.dumps({"benchmark": MODULE, **sizes, "piece_rows": args.piece_rows, "bucket_rows": args.bucket_rows,
                      **{k: round(v, 3) for k, v in r.items()},
                      "target_bytes_per_row": TARGET_BYTES_PER_ROW}))


if __name__ == "__main__":
    main()
