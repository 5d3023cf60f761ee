"""Peak memory of a fresh process: what the memory benchmarks compare across data sizes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def peak_rss_mb(module: str, mode: str, directory: Path) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of `python -m benchmarks.<module> --child <mode> --dir <directory>`,
    run alone in its own process so nothing measured before counts."""
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", f"benchmarks.{module}", "--child", mode, "--dir", str(directory)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{module} {mode} on {directory} failed (exit {os.waitstatus_to_exitcode(status)})")
    return usage.ru_maxrss / 1024, time.time() - started  # Linux reports KiB
