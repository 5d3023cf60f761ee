"""Does the sample index hold at web scale? Memory per process and one sampling step's cost with a
233M-row index (pipeline/data/index_mmap.py).

    python -m benchmarks.index_scale [--rows 233000000] [--dir PATH] [--baseline-rows 10000000]

Fakes a usable index on disk in the mapped form (usable.idx beside an empty index.parquet: 1000
shards, sequential offsets, 8-character keys, two image formats; written in chunks, so the writer
stays flat in memory; ~13 GB at 233M rows), cached under --dir (or $DPFM_INDEX_SCALE_DIR; default a
folder in the temp dir), where later runs reuse it. Then, each in a fresh process: opens it through
ShardDataset and measures private memory (USS) after opening, and times sampling steps:
PoissonSampler(n, 98304/n).batch(t) plus the lookup of every sampled id's (shard_id, offset, size)
in the mapped arrays, once with the file evicted from the page cache and once with it read in.
Beside it, at --baseline-rows, the USS with the same rows copied into the process's own memory, as
read_index held them before usable.idx (the arrays alone: a lower bound, since the reader that built
them also kept allocator slack and peaked higher).

The file's pages a step touches are page cache: a process that maps them alone counts them in its
USS, processes that share them (ranks, DataLoader workers) do not, and the kernel can reclaim them
at any time; `step_anon_mb` is the private memory the steps really allocated. Targets: USS <= 1 GB
per process after opening, private memory the steps add <= 64 MB (a step's ids and lookups, not
the index), one step <= 1 s once the index is in the page cache (where every rank's reads keep it).
Prints tables, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pipeline.data.index import INDEX_NAME, index_writer  # noqa: E402
from pipeline.data.index_mmap import USABLE_NAME, derived_from, read_footer, source_id, usable_writer  # noqa: E402

TARGET_USS_MB = 1024.0
TARGET_STEP_S = 1.0
TARGET_STEP_ANON_MB = 64.0
BATCH = 98_304
SHARDS = 1000
KEY = 0x5EC12E7  # a benchmark key; real runs keep theirs secret
HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
STRIDE = 64 << 10  # bytes a fake sample takes in its shard: three headers and members, padded


def _fake_batch(ids: np.ndarray, per_shard: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """Rows `ids` of the fake index: the writer's columns, and keys as (offsets, bytes)."""
    base = (ids % per_shard) * STRIDE
    columns = {"shard_id": ids // per_shard, "image_ext": (ids % 3 == 0).astype(np.uint8),
               "image_offset": base + 512, "image_size": 20_000 + ids * 7919 % 30_000,
               "txt_offset": base + 51_712, "txt_size": 40 + ids % 50,
               "json_offset": base + 52_736, "json_size": np.full(len(ids), 20)}
    digits = (ids.astype(np.uint32)[:, None] >> np.arange(28, -1, -4, dtype=np.uint32)) & 15  # unique below 2^32
    return columns, np.arange(len(ids) + 1) * 8, HEX[digits].ravel()


def fake_index(directory: Path, rows: int, chunk: int = 1 << 21) -> float:
    """Write a `rows`-row usable index in `directory` unless one is there; the seconds it took."""
    stamp = directory / "fake.json"
    if stamp.exists() and derived_from(directory / USABLE_NAME, directory / INDEX_NAME) \
            and read_footer(directory / USABLE_NAME)[0]["rows"] == rows:
        return json.loads(stamp.read_text())["build_s"]
    t0 = time.perf_counter()
    # An empty index.parquet, so ShardDataset opens the fake as it opens a real index: shards of no
    # stated size are not checked on disk, and the rows come from usable.idx.
    shards = [{"url": f"fake-{j:06d}.tar", "size": None} for j in range(SHARDS)]
    with index_writer(directory / INDEX_NAME, shards):
        pass
    per_shard = -(-rows // SHARDS)
    with usable_writer(directory / USABLE_NAME, rows) as writer:
        for start in range(0, rows, chunk):
            writer.append(*_fake_batch(np.arange(start, min(start + chunk, rows)), per_shard))
        writer.finish(exts=["jpg", "png"], counts={"ok": rows}, shards=shards,
                      source=source_id(directory / INDEX_NAME))
    build_s = time.perf_counter() - t0
    stamp.write_text(json.dumps({"build_s": build_s}))
    return build_s


# -- measured in a fresh process each ------------------------------------------------------------------

def _memory_mb() -> dict:
    """USS (psutil) and anonymous memory (smaps_rollup) of this process, in MB."""
    import psutil

    with open("/proc/self/smaps_rollup") as f:
        anon_kb = next(int(line.split()[1]) for line in f if line.startswith("Anonymous:"))
    return {"uss": psutil.Process().memory_full_info().uss / 2**20, "anon": anon_kb / 1024}


def measure(directory: str, mode: str, steps: int) -> dict:
    """Open the index through ShardDataset; `mapped`: then time sampling steps; `in_ram`: then copy
    its rows into this process's memory, as read_index held them before usable.idx."""
    from pipeline.privacy.sampling import PoissonSampler
    from pipeline.data.shards import ShardDataset

    before = _memory_mb()
    t0 = time.perf_counter()
    ds = ShardDataset(directory)
    out = {"rows": len(ds), "open_s": time.perf_counter() - t0, "pickle_bytes": len(pickle.dumps(ds))}
    opened = _memory_mb()
    out.update(uss_mb=opened["uss"], uss_added_mb=opened["uss"] - before["uss"])
    rows = ds._rows  # the arrays ShardDataset.read_sample indexes
    if mode == "in_ram":
        held = [np.array(a) for a in (rows.shard_id, rows.image_ext, *rows.offsets.values(), *rows.sizes.values(),
                                      rows.keys._offsets, rows.keys._data)]
        del ds, rows  # unmapped: the file's pages the copy read no longer count
        uss = _memory_mb()["uss"]
        out.update(uss_mb=uss, uss_added_mb=uss - before["uss"], held_mb=sum(a.nbytes for a in held) / 2**20)
        return out
    sampler = PoissonSampler(len(ds), BATCH / len(ds), KEY)
    times, sizes = [], []
    for t in range(steps):
        t0 = time.perf_counter()
        ids = sampler.batch(t)
        where = rows.shard_id[ids], rows.offsets["image"][ids], rows.sizes["image"][ids]
        times.append(time.perf_counter() - t0)
        sizes.append(len(where[0]))
    stepped = _memory_mb()
    out.update(step_s=statistics.median(times), first_step_s=times[0], max_step_s=max(times),
               batch=int(np.mean(sizes)), step_uss_mb=stepped["uss"], step_anon_mb=stepped["anon"] - opened["anon"])
    return out


def in_fresh_process(directory: Path, mode: str, steps: int = 10) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.index_scale", "--measure", str(directory), mode, str(steps)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def page_cache(path: Path, warm: bool) -> None:
    """Evict this one file from the page cache (as after a reboot), or read it all in (as on a node
    whose training has been running a while)."""
    with open(path, "rb") as f:
        if warm:
            buf = bytearray(1 << 24)
            while f.readinto(buf):
                pass
        else:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=233_000_000, help="usable rows of the fake index")
    ap.add_argument("--baseline-rows", type=int, default=10_000_000, help="rows where in-RAM and mapped are compared")
    ap.add_argument("--dir", default=os.environ.get("DPFM_INDEX_SCALE_DIR",
                                                    os.path.join(tempfile.gettempdir(), "dpfm-index-scale")),
                    help="where the fake indexes are kept between runs")
    ap.add_argument("--steps", type=int, default=10, help="sampling steps timed")
    ap.add_argument("--measure", nargs=3, metavar=("DIR", "MODE", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        result = measure(args.measure[0], args.measure[1], int(args.measure[2]))
        print(json.dumps(result))
        return result

    cache = Path(args.dir)
    small, large = cache / f"rows-{args.baseline_rows}", cache / f"rows-{args.rows}"
    fake_index(small, args.baseline_rows)
    build_s = fake_index(large, args.rows)
    in_ram, mapped_small = in_fresh_process(small, "in_ram"), in_fresh_process(small, "mapped", 1)
    page_cache(large / USABLE_NAME, warm=False)
    cold = in_fresh_process(large, "mapped", args.steps)
    page_cache(large / USABLE_NAME, warm=True)
    warm = in_fresh_process(large, "mapped", args.steps)
    per_row = (in_ram["uss_mb"] - mapped_small["uss_mb"]) / args.baseline_rows
    disk_gb = (large / USABLE_NAME).stat().st_size / 1e9

    print(f"{'index, opened by ShardDataset':<32}{'rows':>13}{'USS MB':>10}{'of it, index MB':>17}{'open s':>9}")
    for name, rows, fig in (("in RAM (before usable.idx)", args.baseline_rows, in_ram),
                            ("mapped usable.idx", args.baseline_rows, mapped_small),
                            ("mapped usable.idx", args.rows, cold)):
        print(f"{name:<32}{rows:>13,}{fig['uss_mb']:>10.0f}{fig['uss_added_mb']:>17.0f}{fig['open_s']:>9.2f}")
    print(f"{'in RAM, extrapolated':<32}{args.rows:>13,}{cold['uss_mb'] + per_row * args.rows:>10.0f}"
          f"{per_row * args.rows:>17.0f}")
    step = f"sampling step (~{warm['batch']:,} ids + lookup)"
    print(f"\n{step:<40}{'first s':>9}{'median s':>10}{'max s':>8}{'USS after, MB':>15}")
    for name, fig in (("page cache cold", cold), ("page cache warm", warm)):
        print(f"{name:<40}{fig['first_step_s']:>9.3f}{fig['step_s']:>10.3f}{fig['max_step_s']:>8.3f}"
              f"{fig['step_uss_mb']:>15.0f}")
    print(f"(USS after steps counts the file's pages this lone process touched: shared page cache, not private "
          f"memory, which grew {warm['step_anon_mb']:.0f} MB)")
    ok = (cold["uss_mb"] <= TARGET_USS_MB and warm["max_step_s"] <= TARGET_STEP_S
          and max(cold["step_anon_mb"], warm["step_anon_mb"]) <= TARGET_STEP_ANON_MB)
    print(f"fake index: {disk_gb:.1f} GB, built in {build_s:.0f} s (cached in {large}); targets: USS <= "
          f"{TARGET_USS_MB:.0f} MB, private memory added by the steps <= {TARGET_STEP_ANON_MB:.0f} MB, "
          f"a step <= {TARGET_STEP_S} s with the index in the page cache: "
          f"{'met' if ok else 'MISSED'} (timings on a shared machine are noisy)")
    result = {
        "index_rows": args.rows, "index_uss_mb": round(cold["uss_mb"], 1), "sample_step_s": round(warm["step_s"], 4),
        "index_build_s": round(build_s, 1), "index_uss_added_mb": round(cold["uss_added_mb"], 1),
        "open_s": round(cold["open_s"], 3), "pickle_bytes": cold["pickle_bytes"], "index_disk_gb": round(disk_gb, 2),
        "warm_first_step_s": round(warm["first_step_s"], 4), "warm_max_step_s": round(warm["max_step_s"], 4),
        "cold_first_step_s": round(cold["first_step_s"], 4), "cold_step_s": round(cold["step_s"], 4),
        "step_uss_mb": round(warm["step_uss_mb"], 1), "step_anon_mb": round(warm["step_anon_mb"], 1),
        "baseline_rows": args.baseline_rows, "baseline_in_ram_uss_mb": round(in_ram["uss_mb"], 1),
        "baseline_mapped_uss_mb": round(mapped_small["uss_mb"], 1),
        "in_ram_to_mapped_uss_ratio": round(in_ram["uss_mb"] / mapped_small["uss_mb"], 2),
        "in_ram_bytes_per_row": round(per_row * 2**20, 1),
        "in_ram_uss_mb_extrapolated": round(cold["uss_mb"] + per_row * args.rows, 0),
        "target_uss_mb": TARGET_USS_MB, "target_step_s": TARGET_STEP_S, "target_step_anon_mb": TARGET_STEP_ANON_MB,
        "targets_met": ok,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
