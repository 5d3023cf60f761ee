"""Does the `download` source's memory stay flat as its (url, caption) table grows? (pipeline/data/sources.py)

    python -m benchmarks.url_table_memory [--small 500000] [--factor 8] [--dir DIR]

Writes two parquet tables of n and factor·n rows (a 60-character URL and a 50-character caption per
row, as in LAION's) and, in a fresh process per measurement, walks each the way `download` does:
the count pass, then the table in slices of one shard's rows (`url_table_slices`, 10,000 rows).
Beside it, the baseline: the table read whole and turned into two Python lists, as `download` did
before it streamed. Target: private (anonymous) memory at factor·n <= 1.25 x at n, measured from
/proc apart from mapped file pages (benchmarks/peak_memory.py). Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from benchmarks.peak_memory import growth_parser, measure_growth, print_growth

TARGET_RATIO = 1.25
SHARD_ROWS = 10_000


def write_table(path: Path, n: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.exists():
        return path
    chunk = 100_000
    with pq.ParquetWriter(path.with_suffix(".tmp"), pa.schema([("url", pa.string()), ("caption", pa.string())])) as w:
        for start in range(0, n, chunk):
            rows = range(start, min(n, start + chunk))
            w.write_table(pa.table({"url": [f"https://images.example.org/photos/{i:012d}/full-size.jpg" for i in rows],
                                    "caption": [f"a photograph of thing number {i:012d} on a table" for i in rows]}))
    path.with_suffix(".tmp").rename(path)
    return path


def child(mode: str, path: Path) -> None:
    """Runs in the measured process: every row of the table, as `download` reads it."""
    from pipeline.data import sources

    if mode == "streamed":
        total = sum(len(urls) for urls, _ in sources._url_table_batches(str(path), "url", "caption"))
        seen = sum(len(urls) for urls, _ in sources.url_table_slices(str(path), "url", "caption", SHARD_ROWS))
    else:  # what read_url_table did before it streamed
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        urls, captions = table.column("url").to_pylist(), table.column("caption").to_pylist()
        total, seen = len(urls), len(captions)
    assert total == seen


def main() -> None:
    args = growth_parser(__doc__, 500_000, 8, ["streamed", "whole"], "tables").parse_args()
    if args.child:
        child(args.child, args.dir)
        return
    directory = Path(args.dir or tempfile.mkdtemp(prefix="dpfm-url-table-"))
    directory.mkdir(parents=True, exist_ok=True)
    sizes = {"small": args.small, "large": args.small * args.factor}
    r = measure_growth("url_table_memory", ["streamed", "whole"],
                       {size: (n, write_table(directory / f"pairs-{n}.parquet", n)) for size, n in sizes.items()})
    print_growth(r, "reading the table", {"streamed": "in slices (now)", "whole": "whole, as lists (before)"})
    print(f"private-memory ratio large/small: in slices {r['streamed_ratio_large_vs_small']:.3f} (target <= "
          f"{TARGET_RATIO}), whole {r['whole_ratio_large_vs_small']:.2f}; per row whole: "
          f"{(r['whole_anon_mb_large'] - r['whole_anon_mb_small']) * 2**20 / (r['n_large'] - r['n_small']):.0f} B")
    print(json.dumps({"benchmark": "url_table_memory", **r, "target_ratio": TARGET_RATIO,
                      "ok": r["streamed_ratio_large_vs_small"] <= TARGET_RATIO}))


if __name__ == "__main__":
    main()
