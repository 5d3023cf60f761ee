"""Does a pass over the index stay flat in memory as n grows? (the budget's content digests,
`privacy/budget.examples_identity`, which every DP training runs before its first step)

    python -m benchmarks.index_pass_memory [--small 80000] [--factor 100] [--dir DIR]

Writes two indexes of n and factor·n rows (content digests and status, in the index's row groups)
and runs the pass over each in a fresh process, measuring its peak private (anonymous) memory from
/proc (benchmarks/peak_memory.py). Beside it, the pass as it was: pyarrow's default reader, which
keeps every column chunk it has read until the file closes. Target: private memory at factor·n
<= 1.1 x at n. Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np

from benchmarks.peak_memory import peak_memory

TARGET_RATIO = 1.1
MODULE = "index_pass_memory"


def write_index(directory: Path, n: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data.index import INDEX_NAME, ROW_GROUP_ROWS
    from pipeline.io import atomic_path, remove_stale_temps

    path = directory / INDEX_NAME
    if path.exists():  # only ever whole: written under a temporary name, then renamed
        return directory
    remove_stale_temps(directory, INDEX_NAME)  # a run killed while writing
    rng = np.random.default_rng(n)
    with atomic_path(path) as tmp:
        writer = None
        for start in range(0, n, 1 << 20):
            rows = min(1 << 20, n - start)
            table = pa.table({"content_hash": pa.array(rng.integers(0, 2**63, rows, dtype=np.uint64)),
                              "status": pa.array(["ok"] * rows)})
            writer = writer or pq.ParquetWriter(tmp, table.schema)
            writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
        writer.close()
    return directory


def child(mode: str, directory: Path) -> None:
    import pyarrow.parquet as pq

    from pipeline.privacy import budget

    budget.BUDGET_DIR = directory / "budget"  # the identity's key: the benchmark's own, not a project's
    if mode == "now":
        budget.examples_identity(directory)
        return
    with mock.patch.object(budget, "open_index", lambda path: pq.ParquetFile(path)):  # the reader before
        budget.examples_identity(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=80_000)
    parser.add_argument("--factor", type=int, default=100)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "dpfm-index-pass")
    parser.add_argument("--child", choices=["now", "before"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.dir)
        return
    sizes = {"small": args.small, "large": args.small * args.factor}
    r = {}
    print(f"{'private MiB of one pass':<28}{'n':>12}{'now':>8}{'before':>8}")
    for name, n in sizes.items():
        folder = write_index(args.dir / f"n{n}", n)
        for mode in ("now", "before"):
            r[f"{mode}_anon_mb_{name}"] = peak_memory(MODULE, mode, folder).anon_mb
        print(f"{'':<28}{n:>12}{r[f'now_anon_mb_{name}']:>8.0f}{r[f'before_anon_mb_{name}']:>8.0f}")
    for mode in ("now", "before"):
        r[f"{mode}_ratio"] = r[f"{mode}_anon_mb_large"] / r[f"{mode}_anon_mb_small"]
    print(f"private memory {sizes['large']}/{sizes['small']} rows: now {r['now_ratio']:.3f} "
          f"(target <= {TARGET_RATIO}), before {r['before_ratio']:.3f}")
    print(json.dumps({"benchmark": MODULE, **sizes, **{k: round(v, 3) for k, v in r.items()},
                      "target_ratio": TARGET_RATIO}))


if __name__ == "__main__":
    main()
