"""Peak memory of a fresh process, split the way that matters at 233M examples: private
(anonymous) memory, which is what grows with n if anything is held per example, apart from mapped
file pages (shards, the memory-mapped index), which the kernel drops under pressure. Peak RSS alone
mixes the two, so it cannot tell a leak from a well-used page cache."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_EVERY_S = 0.01


@dataclass
class Peak:
    rss_mb: float      # the kernel's peak resident set of the process (ru_maxrss): anon + file + shmem
    anon_mb: float     # peak private anonymous memory of the process and its children (sampled)
    file_mb: float     # peak mapped file pages, same processes (sampled)
    shmem_mb: float    # peak shared memory (e.g. tensors passed between loader workers)
    seconds: float


def _children(pid: int) -> list[int]:
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return kids


def status_kib(pid: int, keys=("RssAnon", "RssFile", "RssShmem")) -> dict[str, int]:
    """Fields of /proc/<pid>/status in KiB (by default the resident memory by kind)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    out[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def tree_memory_kib(root: int) -> dict[str, int]:
    """RssAnon, RssFile, RssShmem summed over `root` and its descendants (loader workers count)."""
    total = {"RssAnon": 0, "RssFile": 0, "RssShmem": 0}
    pending = [root]
    while pending:
        pid = pending.pop()
        for key, value in status_kib(pid).items():
            total[key] += value
        pending += _children(pid)
    return total


def peak_memory(module: str, mode: str, directory: Path, *options: str) -> Peak:
    """Peak memory of `python -m benchmarks.<module> --child <mode> --dir <directory> [options]`, run alone
    in its own process so nothing measured before counts; /proc is sampled every 10 ms until it exits."""
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", f"benchmarks.{module}", "--child", mode, "--dir", str(directory),
                             *options],
                            cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    peak = {"RssAnon": 0, "RssFile": 0, "RssShmem": 0}
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        for key, value in tree_memory_kib(proc.pid).items():
            peak[key] = max(peak[key], value)
        time.sleep(SAMPLE_EVERY_S)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{module} {mode} on {directory} failed (exit {proc.returncode})")
    return Peak(rss_mb=usage.ru_maxrss / 1024, anon_mb=peak["RssAnon"] / 1024, file_mb=peak["RssFile"] / 1024,
                shmem_mb=peak["RssShmem"] / 1024, seconds=time.time() - started)


def growth_parser(doc: str, small: int, factor: int, modes: list[str], kept: str) -> argparse.ArgumentParser:
    """The command line of a benchmark that measures each of `modes` at n (`--small`) and factor·n,
    each in a fresh process (`--child MODE`, run by `peak_memory`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--small", type=int, default=small)
    parser.add_argument("--factor", type=int, default=factor)
    parser.add_argument("--dir", type=Path, help=f"keep the {kept} here (reused by later runs)")
    parser.add_argument("--child", choices=modes, help=argparse.SUPPRESS)
    return parser


def measure_growth(module: str, modes: list[str], inputs: dict[str, tuple[int, Path]]) -> dict:
    """`peak_memory` of each mode on each size's (n, input): `n_<size>`, `<mode>_{anon_mb,rss_mb,s}_<size>`
    and, for sizes small and large, `<mode>_ratio_large_vs_small` of the private memory."""
    out = {}
    for size, (n, path) in inputs.items():
        out[f"n_{size}"] = n
        for mode in modes:
            peak = peak_memory(module, mode, path)
            out[f"{mode}_anon_mb_{size}"], out[f"{mode}_rss_mb_{size}"], out[f"{mode}_s_{size}"] = (
                round(peak.anon_mb, 1), round(peak.rss_mb, 1), round(peak.seconds, 1))
    for mode in modes:
        out[f"{mode}_ratio_large_vs_small"] = round(out[f"{mode}_anon_mb_large"] / out[f"{mode}_anon_mb_small"], 3)
    return out


def print_growth(r: dict, title: str, labels: dict[str, str]) -> None:
    """The table of `measure_growth`: each mode (by its label) at n and factor·n."""
    print(f"{title:<26}{'n':>11}{'private MiB':>13}{'peak RSS MiB':>14}{'s':>8}")
    for mode, label in labels.items():
        for size in ("small", "large"):
            print(f"{label:<26}{r[f'n_{size}']:>11,}{r[f'{mode}_anon_mb_{size}']:>13.0f}"
                  f"{r[f'{mode}_rss_mb_{size}']:>14.0f}{r[f'{mode}_s_{size}']:>8.1f}")
