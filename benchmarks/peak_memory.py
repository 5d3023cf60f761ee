"""Peak memory of a fresh process, split the way that matters at 233M examples: private
(anonymous) memory, which is what grows with n if anything is held per example, apart from mapped
file pages (shards, the memory-mapped index), which the kernel drops under pressure. Peak RSS alone
mixes the two, so it cannot tell a leak from a well-used page cache."""

from __future__ import annotations

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


def peak_memory(module: str, mode: str, directory: Path) -> Peak:
    """Peak memory of `python -m benchmarks.<module> --child <mode> --dir <directory>`, run alone in its
    own process so nothing measured before counts; /proc is sampled every 10 ms until it exits."""
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", f"benchmarks.{module}", "--child", mode, "--dir", str(directory)],
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
