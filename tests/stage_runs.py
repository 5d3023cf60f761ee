"""dp-train at micro scale, in this process: the MICRO overrides, a fresh project sharing the data
made once (the `data_dir` fixture), and stages run the way `dpfm <stage>` runs them, without MLflow."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from pipeline import checkpoints
from pipeline.cli import StageContext, runner
from pipeline.config import load_params, sections_of
from pipeline.data.tokenizer import Tokenizer
from pipeline.models import ModelConfig, build_model
from pipeline.objectives import objective
from pipeline.stages import stage
from pipeline.tracking import NullRun, stage_run

MICRO = [
    "shards.image_size=16", "tokenizer.vocab_size=128", "model.size=micro", "model.img_size=16",
    "model.decoder_width=32", "model.decoder_depth=1", "model.decoder_heads=2", "model.text_width=32",
    "model.text_depth=1", "model.text_heads=2", "model.max_caption_len=12", "dp.init=random",
    "dp.steps=6", "dp.expected_batch_size=48", "dp.physical_batch_size=16", "dp.warmup_steps=1",
    "dp.eval_every=3", "dp.checkpoint_every=2", "dp.noise_seed=123",
    "privacy.testing=true",  # the known noise key makes runs reproducible, and NOT PRIVATE
]


def run_in_process(name, overrides, tracked: bool = False, tracker=None):
    """The stage in this process; `tracked`: in its MLflow run (the store of the working directory), as
    the `dpfm` command runs it; `tracker` (tests/recording.py): records what the stage logs."""
    st = stage(name)
    params = sections_of(load_params("params.yaml", overrides), st.sections)
    with (stage_run(st, params, "dpfm") if tracked else contextlib.nullcontext(tracker or NullRun())) as tracker:
        runner(name)(params, StageContext(st, tracker, 1, "cpu"))


def project(data_dir, tmp_path) -> Path:
    """A fresh project dir sharing the data (its own state and outputs) and an empty MLflow store."""
    for item in ("schemas", "params.yaml", "data", "models", "mlflow.db"):
        (shutil.copytree if (data_dir / item).is_dir() else shutil.copy)(data_dir / item, tmp_path / item)
    return tmp_path


@contextlib.contextmanager
def inside(workdir):
    """Stages read and write paths relative to the working directory: run them in `workdir`."""
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        yield
    finally:
        os.chdir(cwd)


def train(workdir, overrides=()):
    """(the ledger as the data owner sees it: the published one with the run's owner-only batch sizes
    and non-finite count, checkpoint) of a dp-train run in `workdir`."""
    with inside(workdir):
        run_in_process("dp-train", list(overrides))
    ledger = yaml.safe_load((workdir / "models/dp/ledger.json").read_text())
    assert "batch_sizes" not in ledger and "nonfinite_examples" not in ledger  # published: no private statistic
    owner = yaml.safe_load((workdir / ".dpfm/owner/runs" / f"{ledger['run']}.json").read_text())
    ckpt = checkpoints.load(workdir / "models/dp/checkpoint.pt")
    return {**ledger, **owner}, ckpt


def charged_runs(workdir) -> list[dict]:
    """The DP runs charged to the budget of `workdir`'s private data."""
    from pipeline.privacy import budget

    with inside(workdir):
        return [e for e in budget.runs(budget.examples_identity("data/shards/private")[0]) if "outside_dp" not in e]


def torchrun(workdir, name, overrides=(), check=True) -> subprocess.CompletedProcess:
    """`dpfm <name>` under torchrun with two CPU (gloo) ranks, as on a two-GPU node (check: that it succeeds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "pipeline.cli",
           name, "--threads", "1", *sum((["--set", o] for o in [*overrides, "run.device=cpu"]), [])]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 or not check, proc.stderr[-3000:]
    return proc


def initial_model(workdir, overrides):
    """The model dp-train starts from (dp.init=random: built after seeding run.seed)."""
    params = load_params(workdir / "params.yaml", overrides)
    name = params["dp"]["objective"]
    tokenizer = Tokenizer(workdir / "models/tokenizer") if objective(name).tokens else None
    torch.manual_seed(params["run"]["seed"])
    cfg = ModelConfig.from_params(params["model"], name, tokenizer.vocab_size if tokenizer else None)
    model = build_model(name, cfg)
    if getattr(model, "per_sample", False):  # clip-public: the public captions dp-train sets
        from pipeline.privacy.training import public_negative_tokens

        model.set_public_negatives(public_negative_tokens(tokenizer, cfg))
    return model


def initial_weights(workdir, overrides):
    """The weights dp-train starts from."""
    return initial_model(workdir, overrides).state_dict()


def flat(state):
    return torch.cat([v.flatten().float() for v in state.values()])
