"""Does the data path hold at web scale? The figures of the four scale benchmarks, in one run.

    python -m benchmarks.scale [--dir DIR] [--rows 233000000]

  index        benchmarks/index_scale.py     a 233M-row memory-mapped index: private memory (USS)
                                             of a process that maps it, one sampling step's time
  dp-train     benchmarks/dp_train_memory.py dp-train's peak private memory (and mapped file pages
                                             apart) at n, 10·n and 30·n private examples, and its
                                             slope per example between the two largest
  remote reads benchmarks/remote_reads.py    sampled examples/s from an HTTP server with 20 ms
                                             injected per request, in one process
  indexing     benchmarks/scan.py            shards scanned per second per core

Each runs in its own process (so one's memory does not count against another's) and ends with a
JSON line; this prints their tables as they go, a summary against the targets, and ONE JSON line
(the last line of stdout). `--dir` keeps the generated data for the next run (the 233M-row index
alone takes minutes to write, the 600k-example private set about 8). About 20 minutes on 2 cores
with a fresh --dir.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {  # key: (comparison, bound), from the web-scale issue
    "index_uss_mb": ("<=", 1024.0),
    "sample_step_s": ("<=", 1.0),
    "remote_examples_per_s": (">=", 2000.0),
}
PRIVATE_RATIO_TARGET = 1.1  # dp-train's private memory at 10·n against n


def run_benchmark(module: str, args: list[str]) -> dict:
    """Runs `python -m benchmarks.<module> args`, streaming its output; returns its last JSON line."""
    print(f"\n== {module} {' '.join(args)}", flush=True)
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", f"benchmarks.{module}", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    last = None
    for line in proc.stdout:
        print("   " + line, end="", flush=True)
        if line.startswith("{"):
            last = line
    if proc.wait() != 0 or last is None:
        raise SystemExit(f"benchmarks.{module} failed (exit {proc.returncode})")
    print(f"   ({time.time() - started:.0f} s)")
    return json.loads(last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "dpfm-scale",
                        help="generated data, kept for the next run (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=233_000_000, help="rows of the faked index")
    parser.add_argument("--small", type=int, default=20_000, help="dp-train's smaller private set")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)

    index = run_benchmark("index_scale", ["--rows", str(args.rows), "--dir", str(args.dir / "index")])
    memory = run_benchmark("dp_train_memory", ["--small", str(args.small), "--factor", "10",
                                               "--dir", str(args.dir / "dp-train")])
    remote = run_benchmark("remote_reads", [])
    scan = run_benchmark("scan", [])

    result = {"benchmark": "scale", "index_rows": index["index_rows"], "index_uss_mb": index["index_uss_mb"],
              "sample_step_s": index["sample_step_s"],
              **{k: memory[k] for k in ("dp_train_n_small", "dp_train_n_large", "dp_train_anon_mb_small",
                                        "dp_train_anon_mb_large", "dp_train_file_mb_small", "dp_train_file_mb_large",
                                        "dp_train_rss_mb_small", "dp_train_rss_mb_large", "dp_train_n_largest",
                                        "dp_train_anon_mb_largest", "anon_bytes_per_example")},
              "remote_latency_ms": remote["remote_latency_ms"], "remote_examples_per_s": remote["remote_examples_per_s"],
              "index_shards_per_s_per_core": scan["index_shards_per_s_per_core"]}
    print("\n== summary")
    for key, (op, bound) in TARGETS.items():
        ok = result[key] <= bound if op == "<=" else result[key] >= bound
        print(f"   {key:<28}{result[key]:>12.3f}  target {op} {bound:g}  {'ok' if ok else 'MISSED'}")
    ratio = result["dp_train_anon_mb_large"] / result["dp_train_anon_mb_small"]
    print(f"   {'dp-train private 10n / n':<28}{ratio:>12.3f}  target <= {PRIVATE_RATIO_TARGET}  "
          f"{'ok' if ratio <= PRIVATE_RATIO_TARGET else 'MISSED'}")
    ratio = result["dp_train_anon_mb_largest"] / result["dp_train_anon_mb_small"]
    print(f"   {'dp-train private 30n / n':<28}{ratio:>12.3f}  target <= {PRIVATE_RATIO_TARGET}  "
          f"{'ok' if ratio <= PRIVATE_RATIO_TARGET else 'MISSED'}  (slope 10n to 30n: "
          f"{result['anon_bytes_per_example']:+.1f} B per example)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
