"""What a stage's process loads before it trains. Every Snakemake job and every torchrun rank is a fresh
Python: a rank other than 0 tracks nothing (cli.run_stage gives it a NullRun), so dp-train's ranks
load neither MLflow nor SciPy, about 1-3 s of a CPU each that the other ranks' work would wait on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What cli.run_stage imports on a rank other than 0, then the stage itself.
RANK_IMPORTS = """
import sys
from pipeline import cli
from pipeline.distributed import process_rank
from pipeline.locking import stage_lock
from pipeline.tracking import NullRun, stage_run
cli.runner("dp-train")
print(sorted(m for m in ("mlflow", "scipy", "sklearn") if m in sys.modules))
"""


def test_a_dp_train_rank_loads_neither_mlflow_nor_scipy():
    proc = subprocess.run([sys.executable, "-c", RANK_IMPORTS], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == "[]", proc.stdout
