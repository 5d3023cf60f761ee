"""The dp-train stage end to end at micro scale: objectives, resume, ledger, DDP, precision."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipeline import dp_train
from pipeline.cli import StageContext
from pipeline.config import apply_overrides, load_params, sections_of
from pipeline.privacy.verify import verify
from pipeline.stages import stage
from pipeline.tracking import NullRun

ROOT = Path(__file__).resolve().parents[1]
MICRO = [
    "shards.image_size=16", "tokenizer.vocab_size=128", "model.size=micro", "model.img_size=16",
    "model.decoder_width=32", "model.decoder_depth=1", "model.decoder_heads=2", "model.text_width=32",
    "model.text_depth=1", "model.text_heads=2", "model.max_caption_len=12", "dp.init=random",
    "dp.steps=6", "dp.expected_batch_size=48", "dp.physical_batch_size=16", "dp.warmup_steps=1",
    "dp.eval_every=3", "dp.checkpoint_every=2", "dp.noise_seed=123",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Private/eval shards and a tokenizer, made once by the real stages."""
    work = tmp_path_factory.mktemp("dpdata")
    for item in ("schemas", "params.yaml"):
        (shutil.copytree if (ROOT / item).is_dir() else shutil.copy)(ROOT / item, work / item)
    params = apply_overrides(yaml.safe_load((work / "params.yaml").read_text()), MICRO)
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    cwd = os.getcwd()
    os.chdir(work)
    try:
        for name in ("shards", "tokenizer"):
            run_in_process(name, [])
    finally:
        os.chdir(cwd)
    return work


def run_in_process(name, overrides):
    st = stage(name)
    params = sections_of(load_params("params.yaml", overrides), st.sections)
    __import__(st.module, fromlist=["run"]).run(params, StageContext(st, NullRun(), 1, "cpu"))


def project(data_dir, tmp_path) -> Path:
    """A fresh project dir sharing the data (its own state and outputs)."""
    for item in ("schemas", "params.yaml", "data", "models"):
        (shutil.copytree if (data_dir / item).is_dir() else shutil.copy)(data_dir / item, tmp_path / item)
    return tmp_path


def train(workdir, overrides=()):
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        run_in_process("dp-train", list(overrides))
        ledger = yaml.safe_load((workdir / "models/dp/ledger.json").read_text())
        ckpt = torch.load(workdir / "models/dp/checkpoint.pt", weights_only=False)
        return ledger, ckpt
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_each_objective_trains_and_verifies(data_dir, tmp_path, objective):
    work = project(data_dir, tmp_path)
    ledger, ckpt = train(work, [f"dp.objective={objective}"])
    assert ledger["steps"] == ckpt["optimizer_steps"] == 6
    assert ledger["sensitivity"] == (2.0 if objective == "clip" else 1.0)
    dp = load_params(work / "params.yaml", [f"dp.objective={objective}"])["dp"]
    result = verify(ledger, ckpt["optimizer_steps"], dp, ["pld", "rdp"], 0.001)
    assert result["passed"], result["checks"]
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())


class Crash(RuntimeError):
    pass


def test_crash_after_charging_a_step_resumes_to_the_uninterrupted_result(data_dir, tmp_path, monkeypatch):
    ledger_ref, ref = train(project(data_dir, tmp_path / "a"))
    real, calls = dp_train.noisy_update, []

    def crashing(*args, **kw):  # dies between the ledger record and the update of the 6th step
        calls.append(1)
        if len(calls) == 6:
            raise Crash
        return real(*args, **kw)

    work = project(data_dir, tmp_path / "b")
    monkeypatch.setattr(dp_train, "noisy_update", crashing)
    with pytest.raises(Crash):
        train(work)
    charged = next((work / ".dpfm/state").glob("dp-train-*")) / "ledger.jsonl"
    assert len(charged.read_text().splitlines()) == 1 + 6  # header + every step begun, the crashed one too
    monkeypatch.setattr(dp_train, "noisy_update", real)
    ledger, got = train(work)
    assert ledger["steps"] == 6 and ledger["batch_sizes"] == ledger_ref["batch_sizes"]
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), k


def test_budget_guard_refuses_steps_beyond_the_accounted_ones(data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(dp_train, "run_loop", lambda **kw: kw["step_fn"](kw["total_steps"]))
    with pytest.raises(RuntimeError, match="refusing step 6"):
        train(project(data_dir, tmp_path))


def test_sigma_too_small_for_the_target_fails_before_training(data_dir, tmp_path):
    with pytest.raises(ValueError, match="above the target dp.epsilon=8.0"):
        train(project(data_dir, tmp_path), ["dp.sigma=0.1"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_runs_with_fp32_accounting(data_dir, tmp_path, precision):
    ledger, ckpt = train(project(data_dir, tmp_path), [f"dp.precision={precision}"])
    assert ledger["steps"] == 6 and ledger["nonfinite_examples"] == 0
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in ckpt["model"].values())


def test_loss_scaler_backs_off_on_overflow_and_grows_when_stable():
    s = dp_train.LossScaler(True, scale=1024.0, growth_interval=2)
    s.update(nonfinite=3)
    assert s.scale == 512.0
    s.update(0)
    s.update(0)
    assert s.scale == 1024.0
    assert dp_train.LossScaler(False).scale == 1.0


def test_nonprivate_baseline_is_saved_beside_the_dp_model(data_dir, tmp_path):
    work = project(data_dir, tmp_path)
    ledger, ckpt = train(work, ["dp.nonprivate_baseline=true"])
    base = torch.load(work / "models/dp/nonprivate.pt", weights_only=False)
    assert base["model"].keys() == ckpt["model"].keys()
    assert any(not torch.equal(base["model"][k], ckpt["model"][k]) for k in base["model"])
    assert ledger["steps"] == 6  # the baseline is not charged to the private ledger


def test_two_gloo_processes_give_the_one_process_update(data_dir, tmp_path):
    one, two = project(data_dir, tmp_path / "one"), project(data_dir, tmp_path / "two")
    _, ref = train(one, ["dp.objective=caption"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "pipeline.cli",
           "dp-train", "--threads", "1", *sum((["--set", o] for o in ["dp.objective=caption", "run.device=cpu"]), [])]
    proc = subprocess.run(cmd, cwd=two, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(two / "models/dp/checkpoint.pt", weights_only=False)
    assert got["optimizer_steps"] == ref["optimizer_steps"] == 6
    for k, v in ref["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=1e-5, atol=1e-6, msg=k)
