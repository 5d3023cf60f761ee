"""The whole DAG as a Snakemake project: the workflow's files copied into a folder
(`snakemake_project`), the MICRO params profile written into its params.yaml (`set_params`), and the
rules Snakemake plans, read from its output (`planned_rules`)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ("Snakefile", "rules", "schemas", "envs", "profiles", "params.yaml")
MICRO = {
    "shards": {"image_size": 16},
    "synthetic": {"num_programs": 24, "frames_per_program": 2, "resolution": 16, "samples_per_shard": 20},
    "tokenizer": {"vocab_size": 128},
    "model": {"size": "micro", "img_size": 16, "patch_size": 4, "decoder_width": 32, "decoder_depth": 1,
              "decoder_heads": 2, "text_width": 32, "text_depth": 1, "text_heads": 2, "max_caption_len": 12},
    "pretrain": {"steps": 6, "batch_size": 16, "warmup_steps": 2, "checkpoint_every": 3, "log_every": 2},
    "dp": {"steps": 4, "expected_batch_size": 32, "physical_batch_size": 16, "warmup_steps": 1,
           "eval_every": 2, "checkpoint_every": 2},
    "curve": {"epsilons": [2, float("inf")], "inits": ["pretrain"]},  # one DP and one non-private point
    # The DAG's runs draw secret keys, so at α = 0.001 verify's batch-size test fails a correct run once
    # in ~1,000 by design (measured 0.001-0.0025 at these sizes): a flaky suite. Its power against
    # broken samplers is tested with the default α in tests/test_verify.py and tests/test_sampling.py.
    "verify": {"batch_size_alpha": 1e-9},
}


def snakemake_project(work: Path, *extra: str) -> Path:
    """The repository's WORKFLOW files (and `extra` ones, such as dvc.yaml) copied into `work`."""
    work.mkdir(exist_ok=True)
    for item in (*WORKFLOW, *extra):
        (shutil.copytree if (ROOT / item).is_dir() else shutil.copy)(ROOT / item, work / item)
    return work


def planned_rules(output: str) -> set[str]:
    return set(re.findall(r"^(?:local)?rule (\w+):", output, flags=re.M)) - {"all"}


def set_params(workdir: Path, edits: dict) -> None:
    params = yaml.safe_load((workdir / "params.yaml").read_text())
    for section, values in edits.items():
        params[section].update(values)
    (workdir / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
