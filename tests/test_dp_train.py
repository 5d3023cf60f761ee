"""The dp-train stage end to end at micro scale: objectives, resume, ledger, DDP, precision.

Each test trains in its own project (stage_runs.project) on the shards and tokenizer that the
session-wide `data_dir` fixture (conftest.py) makes once."""

import dataclasses
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from recording import RecordingTracker
from stage_runs import (charged_runs, flat, initial_model, initial_weights, inside, project, run_in_process, torchrun,
                        train)

from pipeline import checkpoints
from pipeline.artifacts import artifact
from pipeline.privacy import accounting, budget, training
from pipeline.privacy import engine
from pipeline.config import ParamsError, load_params, sections_of
from pipeline.data.tokenizer import Tokenizer
from pipeline.errors import InputError
from pipeline.models import ModelConfig
from pipeline.objectives import objective
from pipeline.privacy.run_checks import verify
from pipeline.stages import stage

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("objective", ["mae", "caption", "clip", "clip-public"])
def test_each_objective_trains_and_verifies(data_dir, tmp_path, monkeypatch, objective):
    work = project(data_dir, tmp_path)
    splits, split_loader, optimizers, make_optimizer = [], training.split_loader, [], training.make_optimizer
    monkeypatch.setattr(training, "split_loader", lambda split, *a, **k: splits.append(split)
                        or split_loader(split, *a, **k))
    monkeypatch.setattr(training, "make_optimizer", lambda *a: optimizers.append(a[1:]) or make_optimizer(*a))
    ledger, ckpt = train(work, [f"dp.objective={objective}"])
    assert sorted(splits) == ["eval", "private"]  # the steps read the private split, the held-out loss the eval one
    dp = load_params(work / "params.yaml")["dp"]  # from random weights the encoder trains at the full rate
    assert dp["init"] == "random" and optimizers == [(dp["optimizer"], dp["lr"], dp["weight_decay"], 1.0)]
    assert ledger["steps"] == ckpt.steps == 6
    assert ledger["sensitivity"] == (2.0 if objective == "clip" else 1.0)
    dp = load_params(work / "params.yaml", [f"dp.objective={objective}"])["dp"]
    result = verify(ledger, ckpt.steps, dp, ["pld", "rdp"], 0.001, "replace_one")
    assert result["passed"], result["checks"]
    assert all(torch.isfinite(v).all() for v in ckpt.model.values())
    # the run's state (its key, its ledger of realised batch sizes) is the owner's alone
    [state] = (work / ".dpfm/state").glob("dp-train-*")
    assert state.stat().st_mode & 0o077 == 0 and (state / "ledger.jsonl").is_file()


class Crash(BaseException):
    """The process dies inside a step (a kill, a lost node): no handler of the step's errors sees it."""


def train_until_crash(work, monkeypatch, step: int, more=()):
    """Train `work` until the process dies in step `step` (counted from 1), between its ledger record and
    its update: the step is charged, not applied."""
    real, calls = engine.add_noise, []

    def crashing(*args, **kw):
        calls.append(1)
        if len(calls) == step:
            raise Crash
        return real(*args, **kw)

    with monkeypatch.context() as m:
        m.setattr(engine, "add_noise", crashing)
        with pytest.raises(Crash):
            train(work, list(more))


@pytest.mark.parametrize("more", [[], ["dp.ema_decay=0.6"]], ids=["last-iterate", "weight-average"])
def test_crash_after_charging_a_step_resumes_to_the_uninterrupted_result(data_dir, tmp_path, monkeypatch, more):
    """The resumed run restores the weights' moving average too (dp.ema_decay), from the step-4 checkpoint."""
    ledger_ref, ref = train(project(data_dir, tmp_path / "a"), more)
    work = project(data_dir, tmp_path / "b")
    train_until_crash(work, monkeypatch, 6, more)
    charged = next((work / ".dpfm/state").glob("dp-train-*")) / "ledger.jsonl"
    assert len(charged.read_text().splitlines()) == 1 + 6  # header + every step begun, the crashed one too
    ledger, got = train(work, more)
    assert ledger["steps"] == 6 and ledger["batch_sizes"] == ledger_ref["batch_sizes"]
    for k, v in ref.model.items():
        assert torch.equal(v, got.model[k]), k


@pytest.mark.parametrize("objective_name", ["mae", "caption", "clip", "clip-public"])
def test_a_run_resumed_under_another_micro_batch_or_schedule_of_checkpoints_is_the_same_run(data_dir, tmp_path,
                                                                                              monkeypatch, objective_name):
    """An out-of-memory stop advises a smaller dp.physical_batch_size: the run must resume under it (and
    under other checkpoint_every, eval_every), with its batches and noise, charged once, not start again
    under a fresh key and charge the budget twice. A run keyed with those knobs, before they left the
    key, resumes as well; so does the finished run on 2 ranks. So with a model key its objective never reads
    changed (the MAE's text tower, the others' MAE decoder): keyed by it, the same model trained and was charged
    again."""
    obj = [f"dp.objective={objective_name}"]
    unread = {"mae": "model.text_width=128", "clip": "model.caption_mask_ratio=0.5"}.get(objective_name,
                                                                                       "model.decoder_width=128")
    ref_ledger, ref = train(project(data_dir, tmp_path / "ref"), obj)
    finished = None
    for name, keyed_before in (("smaller", False), ("keyed-before", True)):
        work = project(data_dir, tmp_path / name)
        with monkeypatch.context() as m:
            if keyed_before:
                m.setattr(training, "HOW_IT_RUNS", ())
                m.setattr(training, "model_params_read", lambda model, objective: model)
            train_until_crash(work, monkeypatch, 6, obj)
        resumed = obj + ([] if keyed_before else ["dp.physical_batch_size=2", "dp.checkpoint_every=2",
                                                  "dp.eval_every=3", unread])
        ledger, got = train(work, resumed)
        assert [r["run"] for r in charged_runs(work)] == [ledger["run"]], name  # charged once
        assert ledger["steps"] == 6 and ledger["batch_sizes"] == ref_ledger["batch_sizes"], name
        for k, v in ref.model.items():  # the same step, summed in other micro-batches: rounding apart
            assert torch.allclose(v, got.model[k], rtol=1e-4, atol=1e-6), (name, k)
        if not keyed_before:
            finished = (work, ledger["run"])
    # The finished run (keyed the new way), started again on 2 ranks under yet another micro-batch: the same
    # run, not charged again.
    work, run = finished
    torchrun(work, "dp-train", obj + ["dp.physical_batch_size=3", unread])
    assert json.loads((work / "models/dp/ledger.json").read_text())["run"] == run
    assert [r["run"] for r in charged_runs(work)] == [run]


def test_the_secret_key_is_owner_only_from_its_first_byte_and_kept(tmp_path, monkeypatch):
    """Written and then chmod'ed, the key was world-readable for a moment (under a permissive
    umask): every file holding it must already be 0600 before any chmod, and whole when it appears."""
    import stat

    from pipeline.privacy.plan import secret_key

    before_chmod, real_chmod = [], os.chmod
    monkeypatch.setattr(os, "chmod", lambda path, mode, *a, **k: (
        before_chmod.append(stat.S_IMODE(os.stat(path).st_mode)), real_chmod(path, mode, *a, **k))[1])
    umask = os.umask(0)  # the most permissive: an ordinary write would make the key 0666
    try:
        key = secret_key(tmp_path / "run", None)
    finally:
        os.umask(umask)
    path = tmp_path / "run/secret.key"
    assert before_chmod and all(m == 0o600 for m in before_chmod), [oct(m) for m in before_chmod]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert secret_key(tmp_path / "run", None) == key == int(path.read_text())  # reused on resume
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["secret.key"]  # no temporary left
    assert secret_key(tmp_path / "other", 5) == 5 and not (tmp_path / "other").exists()


def test_budget_guard_refuses_steps_beyond_the_accounted_ones(data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(training, "run_loop", lambda state, schedule, step_fn, *a, **k: step_fn(schedule.steps))
    with pytest.raises(RuntimeError, match="refusing step 6"):
        train(project(data_dir, tmp_path))


def test_sigma_too_small_for_the_target_fails_before_training(data_dir, tmp_path):
    with pytest.raises(ValueError, match="above the target dp.epsilon=8.0"):
        train(project(data_dir, tmp_path), ["dp.sigma=0.1"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_runs_with_fp32_accounting(data_dir, tmp_path, precision):
    ledger, ckpt = train(project(data_dir, tmp_path), [f"dp.precision={precision}"])
    assert ledger["steps"] == 6 and ledger["nonfinite_examples"] == 0
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in ckpt.model.values())


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_nonprivate_baseline_is_saved_beside_the_dp_model_and_never_pushed(data_dir, tmp_path, objective):
    """The twin is read where dp-train wrote it, but models/dp is a pushed DVC output: DVC must ignore
    the twin (its hash, cache and remote hold the DP model alone), and dvc_hash, which tags MLflow runs
    with DVC's hashes, must agree. Neither file holds the run's known noise seed (stage_runs: 123)."""
    work = project(data_dir, tmp_path)
    ledger, ckpt = train(work, [f"dp.objective={objective}", "dp.nonprivate_baseline=true"])
    base = checkpoints.load(work / "models/dp/nonprivate.pt")
    assert base.model.keys() == ckpt.model.keys()
    assert any(not torch.equal(base.model[k], ckpt.model[k]) for k in base.model)
    assert ledger["steps"] == 6  # the baseline is not charged to the private ledger
    assert ckpt.config["dp"]["noise_seed"] != 123 and base.config["dp"]["noise_seed"] != 123

    from pipeline.tracking import dvc_hash

    dvc = [str(Path(sys.executable).parent / "dvc")]
    shutil.copy(ROOT / ".dvcignore", work / ".dvcignore")
    subprocess.run([*dvc, "init", "-q", "--no-scm"], cwd=work, check=True)
    subprocess.run([*dvc, "add", "-q", "models/dp"], cwd=work, check=True)
    [out] = yaml.safe_load((work / "models/dp.dvc").read_text())["outs"]
    cached = {e["relpath"] for e in json.loads((work / ".dvc/cache/files/md5" / out["md5"][:2] /
                                                out["md5"][2:]).read_text())}
    assert "checkpoint.pt" in cached and "nonprivate.pt" not in cached, cached
    assert out["md5"] == dvc_hash(work / "models/dp")


@pytest.mark.parametrize("objective", ["mae", "caption", "clip", "clip-public"])
def test_a_clipped_twin_goes_through_the_dp_runs_clipper_without_noise(data_dir, tmp_path, objective):
    """dp.nonprivate_clipped: one plain-SGD step of the twin moves the weights by lr × its clipped sum
    / (q·n), so by at most lr·C/q (lr·C per batch for clip) however large the gradients; the unclipped
    twin's same step moves them far more. Its state is its own: neither twin resumes the other."""
    work = project(data_dir, tmp_path)
    lr, clip_norm = 0.05, 1e-4
    sets = [f"dp.objective={objective}", "dp.nonprivate_baseline=true", "dp.init=random", "dp.optimizer=sgd",
            "dp.weight_decay=0", f"dp.lr={lr}", f"dp.clip_norm={clip_norm}", "dp.nonprivate.steps=1",
            "dp.nonprivate.warmup_steps=0"]
    start = flat(initial_weights(work, sets))
    moved = {}
    for clipped in ("false", "true", "false"):
        ledger, _ = train(work, [*sets, f"dp.nonprivate_clipped={clipped}"])
        twin = flat(checkpoints.load(work / "models/dp/nonprivate.pt").model)
        moved.setdefault(clipped, []).append(float((twin - start).norm()))
    bound = lr * clip_norm / ledger["sample_rate"]
    assert 0 < moved["true"][0] <= bound * (1 + 1e-4) < moved["false"][0] / 10
    assert moved["false"][1] == moved["false"][0]  # the plain twin again: its own state, resumed as it was
    assert len(list((work / ".dpfm/state").glob("dp-train-*/nonprivate*/checkpoint.pt"))) == 2
    from pipeline.privacy import budget

    with inside(work):  # each twin is its own release without DP, recorded under its own name
        outside = [e["run"] for e in budget.runs(budget.examples_identity("data/shards/private")[0])
                   if e.get("outside_dp") == "a training without DP on them"]
    assert sorted(name.rsplit("-", 1)[-1] for name in outside) == ["clipped", "nonprivate"]


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("objective_name", ["mae", "caption", "clip"])
def test_dp_train_says_not_private_when_its_held_out_loss_reads_an_eval_split_of_the_private_source(
        data_dir, tmp_path, capsys, objective_name, ranks):
    """shards.eval_fraction on a web source carves the eval split out of the private data, and dp-train's
    held-out loss (MLflow, history.json) is computed on it without noise. dp-train printed its ε and
    nothing else: it read no stats for what it released itself."""
    work = project(data_dir, tmp_path)
    stats = json.loads((work / "data/shards/stats.json").read_text())
    (work / "data/shards/stats.json").write_text(json.dumps({**stats, "eval_from_private": True}))
    clean = [f"dp.objective={objective_name}", "dp.noise_seed=null", "privacy.testing=false"]
    if ranks == 1:
        train(work, clean)
        printed = capsys.readouterr().out
    else:
        printed = torchrun(work, "dp-train", clean).stdout
    assert "dp-train: NOT PRIVATE as a whole: the eval split is carved out of the private data" in printed, printed[-2000:]
    assert printed.count("NOT PRIVATE") == 1


@pytest.mark.parametrize("objective_name", ["mae", "caption", "clip"])
def test_the_non_finite_count_is_released_only_when_opted_in_and_a_test_runs_model_is_not_private(
        data_dir, tmp_path, objective_name):
    """The count of non-finite (dropped) examples is a statistic of the private data released without
    noise: it reaches MLflow under dp.log_private_stats alone, which tags the run NOT PRIVATE. A test run's
    noise key is known: its checkpoint says not private (evaluate and the registry read that flag)."""
    logged = {}
    for name, overrides in (("test", []), ("opted", ["dp.noise_seed=null", "privacy.testing=false",
                                                     "dp.log_private_stats=true"])):
        work, logged[name] = project(data_dir, tmp_path / name), RecordingTracker()
        with inside(work):
            run_in_process("dp-train", [f"dp.objective={objective_name}", *overrides], tracker=logged[name])
        logged[name].private = checkpoints.load(work / "models/dp/checkpoint.pt").private
    test, opted = logged["test"], logged["opted"]
    assert "epsilon" in test.metrics and not any("nonfinite" in k for k in test.metrics), test.metrics
    assert "a test run" in test.tags["dpfm.not_private"] and test.private is False
    assert opted.metrics["private_nonfinite_examples"] == 0 and opted.private is True
    assert "dp.log_private_stats" in opted.tags["dpfm.not_private"]


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("objective_name", ["mae", "caption", "clip"])
def test_a_twin_trained_without_dp_leaves_every_later_run_on_the_examples_not_private(data_dir, tmp_path, capsys,
                                                                                      objective_name, ranks):
    """dp-train says NOT PRIVATE beside the ε it prints when it trains a twin. The twin's release stays made
    when the flag is turned off: the run resumes (the same finished run), and its composition, read from
    the budget, is ∞ with the twin named, whatever the params now say."""
    from pipeline.privacy import budget, release

    work = project(data_dir, tmp_path)
    clean = [f"dp.objective={objective_name}", "dp.noise_seed=null", "privacy.testing=false",
             "privacy.nonprivate_on_private_data=true"]
    if ranks == 1:
        train(work, clean + ["dp.nonprivate_baseline=true"])
        printed = capsys.readouterr().out
    else:
        printed = torchrun(work, "dp-train", clean + ["dp.nonprivate_baseline=true"]).stdout
    assert "dp-train: NOT PRIVATE as a whole: dp.nonprivate_baseline trains without DP" in printed, printed[-2000:]
    ledger, _ = train(work, clean)  # the flag off: resumed, nothing trained again
    assert "NOT PRIVATE" not in capsys.readouterr().out  # its own params release nothing outside ε; the budget:
    with inside(work):
        c = budget.composition(ledger, ledger["delta"])
        params = load_params(work / "params.yaml", clean + ["curve.epsilons=[8]"])
    assert c["outside_dp"] == ["a training without DP on them"] and c["epsilon"] == float("inf")
    assert c["runs"] == 1 and c["epsilon_dp_runs"] < float("inf")
    assert ledger["public_set"] == "digits"  # so its twin leaves no run on other data NOT PRIVATE (test_budget.py)
    assert release.not_private_reasons(params, {}) == [] and release.not_private_reasons(params, {}, c)


FROZEN = "dp.frozen=[encoder.blocks.0]"  # the micro encoder's one block
COMPILE = "dp.compile=true"
TRACED = "dp.compile_backend=aot_eager"  # the same graphs, records and sums without Inductor's kernels: seconds a
                                         # model, where Inductor takes minutes on 2 cores (mae keeps Inductor)


@pytest.mark.parametrize("name, more", [("mae", []), ("caption", []), ("caption", ["model.caption_mask_ratio=0.5"]),
                                        ("clip", []), ("mae", ["dp.mask_views=3"]),
                                        ("caption", ["model.caption_mask_ratio=0.5", "dp.mask_views=3"]),
                                        ("mae", ["dp.ema_decay=0.6"]), ("caption", ["dp.ema_decay=0.6"]),
                                        ("clip", ["dp.ema_decay=0.6"]), ("mae", [FROZEN]), ("caption", [FROZEN]),
                                        ("clip", [FROZEN]), ("mae", [COMPILE]), ("caption", [COMPILE, TRACED]),
                                        ("clip", [COMPILE, TRACED]), ("clip-public", [COMPILE, TRACED])],
                         ids=["mae", "caption", "caption-masked", "clip", "mae-mask-views", "caption-mask-views",
                              "mae-weight-average", "caption-weight-average", "clip-weight-average", "mae-frozen",
                              "caption-frozen", "clip-frozen", "mae-compiled", "caption-compiled", "clip-compiled",
                              "clip-public-compiled"])
def test_two_gloo_processes_give_the_one_process_update(data_dir, tmp_path, monkeypatch, name, more):
    """The real stage under torchrun with the same secret key: each example enters the sum once and
    the noise is added once, so the update (weights after - before) is one process's. Plain SGD keeps
    the update linear in the gradient; σ is small enough that the noise does not drown the signal.
    A captioner that drops patches masks each example alike on 1 and 2 ranks (masks per logical batch),
    and so do dp.mask_views' K masks per example. The iterates' moving average (dp.ema_decay) is
    linear in the updates too, and every rank keeps the same one. Frozen modules (dp.frozen) stay out of
    every rank's clipping and noise alike. A compiled model (dp.compile; book-keeping's records then
    come from compiled_records.py) gives the same update, Poisson-sized micro-batches included."""
    sets = [f"dp.objective={name}", "dp.sigma=0.3", "dp.epsilon=100", "dp.optimizer=sgd", "dp.lr=0.05", *more]
    one, two = project(data_dir, tmp_path / "one"), project(data_dir, tmp_path / "two")
    shared = tmp_path / "shared-cache"  # where Inductor would cache (its default: a world-readable /tmp)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    ref_ledger, ref = train(one, sets)
    torchrun(two, "dp-train", sets)
    if COMPILE in more:  # a traced micro-batch's size stays in the run's owner-only state
        assert not any(shared.rglob("*")), sorted(shared.rglob("*"))[:5]
        for work in (one, two):
            [cache] = (work / ".dpfm/state").glob("dp-train-*/compile-cache")
            assert cache.stat().st_mode & 0o077 == 0 and (TRACED in more or any(cache.rglob("*.py")))
    got = checkpoints.load(two / "models/dp/checkpoint.pt")
    # At 2 ranks too, the published ledger holds no private statistic; rank 0 keeps them owner-only.
    published = json.loads((two / "models/dp/ledger.json").read_text())
    assert "batch_sizes" not in published and "nonfinite_examples" not in published
    owner = json.loads((two / ".dpfm/owner/runs" / f"{published['run']}.json").read_text())
    assert owner["batch_sizes"] == ref_ledger["batch_sizes"]
    assert got.steps == ref.steps == 6
    start = flat(initial_weights(one, sets))
    want = flat(ref.model) - start
    assert float(want.norm()) > 0
    assert float((flat(got.model) - start - want).norm() / want.norm()) <= 1e-4


@pytest.mark.parametrize("name", ["mae", "caption", "clip", "clip-public"])
def test_the_released_average_is_computed_from_the_accounted_iterates_alone(data_dir, tmp_path, monkeypatch, name):
    """dp.ema_decay releases a moving average of the weights. ε covers the iterates (each step's weights
    after its noisy update), so the release must be a function of them alone: recompute it from the
    iterates each step left behind, and it is the released model to rounding. An average fed anything
    else (the weights before the noise, a gradient, a stale copy), or not released, does not match."""
    real, iterates = training.run_loop, []

    def recording(state, schedule, step_fn, *args, **kw):
        def step(s):
            metrics = step_fn(s)
            iterates.append({k: v.detach().clone() for k, v in state.model.state_dict().items()})
            return metrics
        return real(state, schedule, step, *args, **kw)

    monkeypatch.setattr(training, "run_loop", recording)
    sets, decay = [f"dp.objective={name}", "dp.ema_decay=0.6"], 0.6
    work = project(data_dir, tmp_path)
    _, got = train(work, sets)
    want = start = initial_weights(work, sets)
    assert len(iterates) == got.steps == 6
    for weights in iterates:
        want = {k: w + (1 - decay) * (weights[k] - w) if w.is_floating_point() else weights[k] for k, w in want.items()}
    assert float((flat(got.model) - flat(want)).norm()) <= 1e-5 * float(flat(want).norm())
    # the release is the average, not the last iterate: it lags the run's path by a good part of its length
    lag, path = (float((flat(got.model) - flat(iterates[-1])).norm()), float((flat(iterates[-1]) - flat(start)).norm()))
    assert lag > 0.1 * path


@pytest.mark.parametrize("name", ["mae", "caption", "clip", "clip-public"])
def test_frozen_modules_are_released_as_they_started_and_every_other_parameter_trains(data_dir, tmp_path, name):
    """dp.frozen keeps modules at the weights they start from (public: the warm start, here a seeded
    init), released bit for bit as they were, so they are a function of no private example; every
    other parameter takes the DP updates (their noise moves each one). Frozen weights that took an
    update, or trainable ones left out of it, fail."""
    sets = [f"dp.objective={name}", FROZEN]
    work = project(data_dir, tmp_path)
    _, got = train(work, sets)
    start = initial_model(work, sets)
    names = {k for k, _ in start.named_parameters()}
    # clip-public's model keeps its text tower at its seeded init itself
    frozen = {k for k, p in start.named_parameters() if k.startswith("encoder.blocks.0.") or not p.requires_grad}
    weights = start.state_dict()
    assert frozen and all(torch.equal(got.model[k], weights[k]) for k in frozen)
    assert {k for k in names if not torch.equal(got.model[k], weights[k])} == names - frozen


def test_runs_on_the_same_private_data_compose(data_dir, tmp_path, monkeypatch):
    from pipeline.privacy.budget import composition

    work = project(data_dir, tmp_path)
    first, _ = train(work, ["dp.objective=mae"])
    train(work, ["dp.objective=mae"])  # the same run again (it resumes): charged once
    second, _ = train(work, ["dp.objective=caption"])
    third, _ = train(work, ["dp.objective=clip"])  # per-batch clipping: its σ is relative to 2C, as accounted
    monkeypatch.chdir(work)
    assert composition(first, first["delta"])["runs"] == 3
    every = composition(third, third["delta"])
    assert every["runs"] == 3 and [r["objective"] for r in every["by_run"]] == ["mae", "caption", "clip"]
    assert every["epsilon_dp_runs"] > 1.2 * max(first["epsilon"], second["epsilon"], third["epsilon"])
    assert len({first["data_identity"], second["data_identity"], third["data_identity"]}) == 1
    assert len({first["run"], second["run"], third["run"]}) == 3
    # Three runs of one (σ, q, T): their composition is one mechanism of 3T steps, by the independent accountant.
    assert {(r["sigma"], r["sample_rate"], r["steps"]) for r in (first, second, third)} == {
        (first["sigma"], first["sample_rate"], first["steps"])}
    assert every["epsilon_dp_runs"] == pytest.approx(accounting.epsilon(
        first["sigma"], first["sample_rate"], 3 * first["steps"], every["delta"], adjacency=first["adjacency"]),
        rel=1e-3)


PUBLIC_WARM_START = ["synthetic.num_programs=4", "synthetic.frames_per_program=4", "synthetic.resolution=16",
                     "pretrain.steps=2", "pretrain.batch_size=8", "pretrain.warmup_steps=1"]


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("objective_name", ["mae", "caption", "clip"])
def test_pretrain_run_again_to_the_same_weights_resumes_the_dp_run_and_charges_it_once(data_dir, tmp_path, monkeypatch,
                                                                                      objective_name, ranks):
    """A DP run is keyed by its warm start. pretrain run again to the same weights (here another log_every,
    which only schedules) writes another file time, summary (its images/s) and history (its steps/s):
    keyed by those files, the DP run started again under a new key and was charged a second time.
    Keyed by the weights, it resumes; a warm start with other weights is another run, charged."""

    work, sets = project(data_dir, tmp_path), [f"dp.objective={objective_name}", "dp.init=pretrain", "dp.noise_seed=null"]

    def warm_start(*more):
        with inside(work):
            shutil.rmtree("models/pretrain", ignore_errors=True)
            run_in_process("pretrain", PUBLIC_WARM_START + list(more))

    def dp_train():
        train(work, sets) if ranks == 1 else torchrun(work, "dp-train", sets)
        return json.loads((work / "models/dp/ledger.json").read_text())

    with inside(work):
        run_in_process("synthetic", PUBLIC_WARM_START)
    warm_start()
    scales, make_optimizer = [], training.make_optimizer
    monkeypatch.setattr(training, "make_optimizer", lambda *a: scales.append(a[-1]) or make_optimizer(*a))
    first = dp_train()
    # Warm-started: the encoder moves at dp.encoder_lr_scale of the rate (on one rank, where it is seen).
    assert scales == ([load_params(work / "params.yaml")["dp"]["encoder_lr_scale"]] if ranks == 1 else [])
    weights = checkpoints.load(work / "models/pretrain/checkpoint.pt").model
    warm_start("pretrain.log_every=1")
    again = checkpoints.load(work / "models/pretrain/checkpoint.pt").model
    assert all(torch.equal(weights[k], again[k]) for k in weights)  # the same warm start, written again
    assert dp_train()["run"] == first["run"] and len(charged_runs(work)) == 1
    warm_start("pretrain.steps=3")
    assert dp_train()["run"] != first["run"] and len(charged_runs(work)) == 2


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("objective_name, edit, named", [
    ("mae", "model.decoder_width=64", "model.decoder_width: 32 there, 64 here"),  # the whole MAE
    ("caption", "model.patch_size=8", "model.patch_size: 4 there, 8 here"),       # its encoder
    ("clip", "model.size=pico", "model.size: 'micro' there, 'pico' here"),
    ("caption", "model.img_size=32", "model.img_size: 16 there, 32 here")])  # the same shapes, another grid
def test_a_warm_start_pretrained_with_other_model_settings_is_refused_before_anything_is_charged(
        data_dir, tmp_path, objective_name, edit, named, ranks):
    """pretrain run by hand, then the model section edited: dp-train charged the budget and then stopped
    on a size mismatch loading the warm start. It is refused first, naming the settings that differ."""

    work, sets = project(data_dir, tmp_path), [f"dp.objective={objective_name}", "dp.init=pretrain"]
    with inside(work):
        run_in_process("synthetic", PUBLIC_WARM_START)
        run_in_process("pretrain", PUBLIC_WARM_START)
    if ranks == 1:
        with pytest.raises(ParamsError, match=re.escape(named)):
            train(work, [*sets, edit])
    else:
        refused = torchrun(work, "dp-train", [*sets, edit], check=False)
        assert refused.returncode != 0 and refused.stderr.count(named) == 2, refused.stderr[-3000:]  # each rank, exit 2
    assert charged_runs(work) == []
    train(work, sets) if ranks == 1 else torchrun(work, "dp-train", sets)  # the settings it was pretrained with
    assert len(charged_runs(work)) == 1


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("objective_name", ["mae", "caption", "clip"])
def test_a_diverged_warm_start_is_refused_before_anything_is_charged(data_dir, tmp_path, objective_name, ranks):
    """A warm start holding a NaN weight (a pretrain that diverged, saved by a version that did not stop):
    dp-train charged the run, and every example's gradient, non-finite, was dropped. It is refused first."""

    work, sets = project(data_dir, tmp_path), [f"dp.objective={objective_name}", "dp.init=pretrain"]
    with inside(work):
        run_in_process("synthetic", PUBLIC_WARM_START)
        run_in_process("pretrain", PUBLIC_WARM_START)
    path = work / artifact("pretrain") / "checkpoint.pt"
    raw = torch.load(path, weights_only=False)
    for part in ("model", "encoder"):
        raw[part][("" if part == "encoder" else "encoder.") + "patch_embed.weight"][0] = math.nan
    torch.save(raw, path)
    named = "patch_embed.weight): pretrain diverged"  # the first weight that is not finite
    if ranks == 1:
        with pytest.raises(ParamsError, match=re.escape(named)):
            train(work, sets)
    else:
        refused = torchrun(work, "dp-train", sets, check=False)
        assert refused.returncode != 0 and refused.stderr.count(named) == 2, refused.stderr[-3000:]
    assert charged_runs(work) == []


@pytest.mark.parametrize("objective_name", ["clip", "clip-public"])
def test_the_clip_scale_is_held_within_clips_clamp_after_each_step(data_dir, tmp_path, monkeypatch, objective_name):
    """A log scale past ln 100 (here its start, ln 200) got no gradient through the forward pass's clamp
    and stayed there, moved by noise alone; it is put back within [0, ln 100] after each step."""
    from pipeline.models import clip, layers

    monkeypatch.setattr(clip, "LogitScale", lambda temperature: layers.LogitScale(1 / 200))
    _, ckpt = train(project(data_dir, tmp_path), [f"dp.objective={objective_name}", "dp.steps=2"])
    ln_100 = torch.tensor(math.log(100.0)).item()  # the clamp's bound as the fp32 parameter holds it
    assert 4.6 < float(ckpt.model["logit_scale.weight"]) <= ln_100


def test_resharding_keeps_the_budget_and_make_clean_keeps_it_too(data_dir, tmp_path, monkeypatch):
    """Re-sharding the same digits (another shards.samples_per_shard) once started a new, empty budget:
    verify printed one run's ε while three runs had trained on the same examples."""
    import shutil

    from pipeline.privacy.budget import composition

    work = project(data_dir, tmp_path)
    first, _ = train(work, ["dp.objective=mae"])
    with inside(work):  # the same examples, re-sharded: other shard files, another index
        run_in_process("shards", ["shards.samples_per_shard=100"])
        shutil.rmtree(".dpfm")  # the runs' state gone (`make clean` deletes it; it keeps data/budget)
    assert len(list((work / "data/shards/private").glob("*.tar"))) != len(list((data_dir / "data/shards/private").glob("*.tar")))
    second, _ = train(work, ["dp.objective=clip"])
    third, _ = train(work, ["dp.objective=mae", "dp.epsilon=2"])
    monkeypatch.chdir(work)
    assert first["data_identity"] == second["data_identity"] == third["data_identity"]
    c = composition(third, third["delta"])
    assert c["runs"] == 3 and [r["objective"] for r in c["by_run"]] == ["mae", "clip", "mae"]
    assert c["epsilon_dp_runs"] > 1.2 * max(first["epsilon"], second["epsilon"], third["epsilon"])
    from pipeline.privacy.budget import composed_epsilon, runs

    entries = [e for e in runs(third["data_identity"]) if "outside_dp" not in e]  # the test's known noise key
    assert composed_epsilon(entries[:2], third["delta"], "replace_one") < c["epsilon_dp_runs"]  # the third counts too


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("objective_name", ["mae", "caption", "clip"])
def test_a_run_started_again_without_its_state_is_charged_again(data_dir, tmp_path, objective_name, ranks):
    """A run's name is a digest of its params and inputs, its secret key lives in its state directory.
    Started again without that directory (`.dpfm/` deleted by hand), the same run once found its charge
    on record and was not charged: a new key, so new batches and new noise, a second release for free."""

    work, sets = project(data_dir, tmp_path), [f"dp.objective={objective_name}", "dp.noise_seed=null"]

    def dp_train():
        train(work, sets) if ranks == 1 else torchrun(work, "dp-train", sets)
        return json.loads((work / "models/dp/ledger.json").read_text())

    first = dp_train()
    dp_train()  # resumed with its key: the same release, charged once
    assert len(charged_runs(work)) == 1
    older = (work / "data/budget/runs.jsonl").read_text()
    shutil.rmtree(work / ".dpfm/state")
    again = dp_train()
    runs = charged_runs(work)
    assert again["run"] == first["run"] and [r["run"] for r in runs] == [first["run"]] * 2
    assert len({r["key"] for r in runs}) == 2
    # The older budget put back over this one (as `dvc checkout` does, unasked): the charges kept in the
    # owner's zone (budget.CHARGES), which the training process made, add the second run back at once.
    (work / "data/budget/runs.jsonl").write_text(older)
    assert charged_runs(work) == runs


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("objective_name", ["mae", "caption", "clip"])
def test_streamed_batches_are_the_in_memory_batches(data_dir, objective_name, world_size, workers):
    """Every micro-batch dp_step asks for, on every rank, decoded ahead by the workers: the same
    tensors as indexing the whole split decoded in memory (the old path) with the same ids. No piece
    the loader decodes holds more than the physical batch (CLIP's per-batch part is joined after)."""
    from pipeline.privacy.sampling import PoissonSampler
    from pipeline.data.shards import ShardDataset
    from pipeline.data.transforms import to_tensor
    from pipeline.distributed import World

    mcfg = ModelConfig.from_params({**load_params(data_dir / "params.yaml")["model"]}, objective_name, 128)
    tokenizer = Tokenizer(data_dir / "models/tokenizer") if objective(objective_name).tokens else None
    split = data_dir / "data/shards/private"
    ds = ShardDataset(split)
    whole = (to_tensor(ds.load_images(mcfg.img_size)),)
    if tokenizer:
        captions = [ds.caption(i) for i in range(len(ds))]
        whole += (tokenizer.encode(captions, mcfg.max_len),)  # as the loader
    sampler = PoissonSampler(len(ds), 40 / len(ds), key=7)
    mode = objective(objective_name).clipping
    decoded_sizes = []

    class Recording(training.BatchLoader):
        def __call__(self, batches):
            return super().__call__(b for b in batches if decoded_sizes.append(len(b)) or True)

    for rank in range(world_size):
        world = World(rank, world_size)
        loader = Recording(ShardDataset(split), mcfg.img_size, tokenizer=tokenizer,
                           max_len=mcfg.max_len if tokenizer else None, workers=workers)
        stream = training.StreamedBatches(loader, sampler, mode, 16, world, steps=5)
        seen = 0
        try:
            for step in range(1, 5):  # starts past step 0, as after a resume
                indices = sampler.batch(step)
                for positions in engine.micro_batches(indices, sampler, mode, 16, world):
                    got = stream(step, indices, positions)
                    assert len(got) == len(whole)
                    for g, w in zip(got, whole):
                        assert torch.equal(g, w[indices[positions]])
                    seen += len(positions)
        finally:
            stream.close()
        assert seen > 0
    assert max(decoded_sizes) <= 16


def test_a_step_asking_for_other_examples_than_planned_is_refused(data_dir):
    from pipeline.privacy.sampling import PoissonSampler
    from pipeline.data.shards import ShardDataset
    from pipeline.distributed import World

    ds = ShardDataset(data_dir / "data/shards/private")
    sampler = PoissonSampler(len(ds), 0.2, key=7)
    stream = training.StreamedBatches(training.BatchLoader(ds, 16), sampler, "per_sample", 16, World(), steps=3)
    indices = sampler.batch(0)
    with pytest.raises(RuntimeError, match="other examples"):
        stream(0, indices[::-1].copy(), np.arange(min(16, len(indices))))
    stream.close()


@pytest.mark.parametrize("objective_name", ["mae", "caption", "clip"])
def test_private_images_of_any_size_and_shape_train(data_dir, tmp_path, objective_name):
    """28-px, 64-px, non-square and greyscale images in one private split: each is centre-cropped
    and resized to the model's 16 px by the loader, and dp-train runs on them."""
    from PIL import Image

    from pipeline.data.shards import ShardWriter, encode_png
    from pipeline.data.transforms import encode_jpeg
    from pipeline.io import read_json, write_json

    work = project(data_dir, tmp_path)
    private = work / "data/shards/private"
    shutil.rmtree(private)
    rng = np.random.default_rng(0)
    shapes = [(28, 28), (64, 64), (40, 24), (17, 50)]
    with ShardWriter(private, prefix="private", samples_per_shard=16) as w:
        for i in range(96):
            h, wd = shapes[i % len(shapes)]
            pixels = rng.integers(0, 256, (h, wd, 3), dtype=np.uint8)
            if i % 5 == 0:  # a greyscale PNG
                buf = io.BytesIO()
                Image.fromarray(pixels[..., 0]).save(buf, format="PNG")
                data, ext = buf.getvalue(), "png"
            else:
                data, ext = (encode_jpeg(pixels), "jpg") if i % 2 else (encode_png(pixels), "png")
            w.write(f"p{i:04d}", data, f"a photo of thing {i % 7}", {}, image_ext=ext)
    stats = read_json(work / "data/shards/stats.json")
    stats["private"].update(usable=96, rows=96)
    write_json(work / "data/shards/stats.json", stats)
    ledger, ckpt = train(work, [f"dp.objective={objective_name}", "dp.expected_batch_size=24"])
    assert ledger["steps"] == 6 and all(torch.isfinite(v).all() for v in ckpt.model.values())


def test_img2dataset_output_at_64_px_trains_verifies_and_evaluates_with_a_32_px_model(data_dir, tmp_path):
    """img2dataset's own folder layout, 64-px JPEGs, used where it is: every usable example is
    private (no eval split carved out), dp-train resizes to the 32-px model, and evaluate runs on
    the public digits (the default set follows the source)."""
    from shard_data import img2dataset_folder

    from pipeline.io import read_json

    work = project(data_dir, tmp_path)
    shutil.rmtree(work / "data/shards")
    img2dataset_folder(work / "laion", np.random.default_rng(0), counts=(40, 40, 40, 5), shape=(64, 64))
    px32 = ["model.img_size=32", "model.patch_size=8", "shards.source=img2dataset", f"shards.path={work / 'laion'}",
            "shards.workers=1", "shards.image_size=32", "evaluate.baselines=[random]", "evaluate.fewshot.shots=[]"]
    cwd = os.getcwd()
    os.chdir(work)
    try:
        run_in_process("shards", px32)
        stats = read_json("data/shards/stats.json")
        assert stats["private"]["usable"] == 120 and stats["eval"]["usable"] == 0 and not stats["eval_from_private"]
        run_in_process("dp-train", px32)
        run_in_process("verify", px32)
        run_in_process("evaluate", px32)
        metrics = read_json("results/eval/metrics.json")
    finally:
        os.chdir(cwd)
    digits = metrics["sets"]["digits"]
    assert digits["n_probe_train"] + digits["n_probe_test"] == 1797  # all of the public digits
    assert 0.0 <= digits["results"]["dp"]["linear_probe"] <= 1.0


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("objective_name", ["mae", "caption", "clip", "clip-public"])
def test_a_run_made_before_a_knob_existed_resumes_at_its_neutral_value_and_is_charged_once(
        data_dir, tmp_path, monkeypatch, objective_name, ranks):
    """An upgrade adds a knob to params.yaml (here dp.frozen, the newest): the finished run, keyed by
    the params without it, is the same run while the knob is at its neutral value. It must not train
    again (a fresh noise key) nor be charged twice; set otherwise, it is another mechanism, charged anew.
    The upgraded dpfm runs on `ranks` processes."""

    from pipeline import train as train_module

    work, obj = project(data_dir, tmp_path), f"dp.objective={objective_name}"

    def before_the_knob(stage, params, inputs=(), name=None):  # how the version before dp.frozen (and the
        # later model.public_negatives, and the runs' keyed names) keyed the run
        model = {k: v for k, v in params["model"].items() if k != "public_negatives"}
        return train_module.state_dir(stage, {**params, "model": model,
                                              "dp": {k: v for k, v in params["dp"].items() if k != "frozen"}}, inputs)

    with monkeypatch.context() as m:
        m.setattr(training, "state_dir", before_the_knob)
        old_ledger, old = train(work, [obj])
    real, noised = engine.add_noise, []
    monkeypatch.setattr(engine, "add_noise", lambda *a, **kw: noised.append(1) or real(*a, **kw))

    def upgraded(sets):  # (published ledger, checkpoint) of dp-train on `ranks` processes
        if ranks == 1:
            return train(work, sets)
        torchrun(work, "dp-train", sets)
        return (json.loads((work / "models/dp/ledger.json").read_text()),
                checkpoints.load(work / "models/dp/checkpoint.pt"))

    ledger, got = upgraded([obj])  # dp.frozen at its neutral value []
    assert noised == [] and ledger["run"] == old_ledger["run"]  # resumed the finished run
    assert all(torch.equal(v, got.model[k]) for k, v in old.model.items())  # no step taken, no fresh noise
    assert [r["run"] for r in charged_runs(work)] == [old_ledger["run"]]
    frozen = {"mae": "decoder_pred", "caption": "head", "clip": "text", "clip-public": "image_proj"}[objective_name]
    other, moved = upgraded([obj, f"dp.frozen=[{frozen}]"])  # another mechanism: trained and charged
    assert other["run"] != old_ledger["run"] and not all(torch.equal(v, moved.model[k]) for k, v in old.model.items())
    assert [r["run"] for r in charged_runs(work)] == [old_ledger["run"], other["run"]]


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("objective_name", ["mae", "caption", "clip", "clip-public"])
def test_a_run_another_process_holds_is_not_charged_or_touched_until_it_is_released(data_dir, tmp_path, objective_name,
                                                                                     ranks):
    """Two processes on one run (the curve's point that repeats dp-train, started beside it; a command
    started twice) would interleave its ledger and checkpoints. While another process holds the run,
    dp-train neither charges the budget nor writes the run's state: one process waits, saying so, and
    trains once the run is released (charged once); under torchrun it stops at once, naming the holder."""
    import subprocess
    import sys


    from pipeline.config import sections_of
    from pipeline.locking import training_lock
    from pipeline.stages import stage

    work, sets = project(data_dir, tmp_path), [f"dp.objective={objective_name}"]
    with inside(work):  # the run's state directory, as dp-train will name it
        p = sections_of(load_params("params.yaml", sets), stage("dp-train").sections)
        state = training.work_dir(p, training.setup(p, "cpu"))

    def untouched():
        assert not (work / state).exists() or not any((work / state).iterdir())
        assert charged_runs(work) == []

    busy = f"a training in {state} is already running (pid {os.getpid()} on "
    with inside(work), training_lock(state, state.name, wait=False):
        if ranks == 2:
            proc = torchrun(work, "dp-train", sets, check=False)
            assert proc.returncode != 0 and busy in proc.stderr
            untouched()
            return
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "pipeline.cli", "dp-train", "--threads", "1",
               *sum((["--set", o] for o in [*sets, "run.device=cpu"]), [])]
        waiter = subprocess.Popen(cmd, cwd=work, env=env, stderr=subprocess.PIPE, text=True)
        for line in waiter.stderr:  # up to the line it prints before it blocks on the lock
            if "waiting for it to end" in line:
                break
        assert busy in line
        untouched()
    _, err = waiter.communicate(timeout=300)  # released: it trains
    assert waiter.returncode == 0, err[-3000:]
    ledger = json.loads((work / "models/dp/ledger.json").read_text())
    assert ledger["run"] == state.name and [r["run"] for r in charged_runs(work)] == [state.name]


def test_a_failed_step_names_its_step_and_details_to_the_owner_alone(tmp_path, monkeypatch):
    """The line printed for a failed DP step names neither the failure's own message (a tensor's shape, the
    bytes an allocator was asked for: they follow the realised batch size) nor the step; the owner's log
    holds both. The CPU allocator's failure is told as out of memory, with its advice."""
    monkeypatch.chdir(tmp_path)
    shape = RuntimeError("The size of tensor a (37) must match the size of tensor b (16) at dimension 0")
    oom = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123456 bytes.")
    for step, e, line in ((4, shape, "the DP step failed (RuntimeError)"), (5, oom, "out of memory in the DP step")):
        shown = str(training.kept_for_owner(step, e))
        assert line in shown and "(37)" not in shown and "123456" not in shown, shown
        assert f"step {step}" not in shown
    kept = (tmp_path / ".dpfm/owner/dp-train.log").read_text()
    assert "step 4: " in kept and "tensor a (37)" in kept and "step 5: " in kept and "123456 bytes" in kept


def test_the_owner_only_non_finite_count_adds_up_every_steps(data_dir, tmp_path, monkeypatch):
    """The owner's record keeps the run's non-finite count (verify and dp.log_private_stats read it): the
    sum of every step's, not the last step's, nor nothing. Each step here reports step + 1 dropped."""
    real = training.dp_step
    monkeypatch.setattr(training, "dp_step",
                        lambda step, **kw: dataclasses.replace(real(step, **kw), nonfinite=step + 1))
    ledger, _ = train(project(data_dir, tmp_path))
    assert ledger["nonfinite_examples"] == sum(range(1, 6 + 1))


def test_the_held_out_loss_is_published_every_eval_step_and_at_the_last_and_the_twins_apart(data_dir, tmp_path):
    """dp.eval_every=3 over 6 steps: the held-out loss at steps 0, 3 and the last (5), each once, as
    history.json has it; the ε = ∞ twin's own loss goes under nonprivate_*, never over the DP run's curve."""
    work, logged = project(data_dir, tmp_path), RecordingTracker()
    with inside(work):
        run_in_process("dp-train", ["dp.nonprivate_baseline=true"], tracker=logged)
    points = sorted((s, v) for k, s, v in logged.points if k == "heldout_loss")
    history = json.loads((work / "models/dp/history.json").read_text())
    kept = [(s, m["heldout_loss"]) for s, m in zip(history["step"], history["metrics"]) if "heldout_loss" in m]
    assert [s for s, _ in points] == [0, 3, 5] and points == kept
    assert logged.curve("nonprivate_heldout_loss")


def test_the_runs_state_follows_its_adjacency_and_not_what_is_reported_beside_it(data_dir, tmp_path):
    """σ is calibrated to the adjacency: under another one the same dp params are another mechanism, so
    another run (key, ledger, charge). Keys that change only what is reported beside the run
    (the twins, dp.log_private_stats), or only its history's points (dp.eval_every), must resume it, not train
    and charge the same model again."""
    work = project(data_dir, tmp_path)
    with inside(work):
        p = sections_of(load_params("params.yaml"), stage("dp-train").sections)
        trainer = training.setup(p, "cpu")
        run = training.work_dir(p, trainer)
        other = {**p, "privacy": {**p["privacy"], "adjacency": "add_remove"}}
        assert p["privacy"]["adjacency"] == "replace_one" and training.work_dir(other, trainer) != run
        for key in ("nonprivate_baseline", "nonprivate_clipped", "log_private_stats"):
            assert training.work_dir({**p, "dp": {**p["dp"], key: not p["dp"][key]}}, trainer) == run, key
        assert training.work_dir({**p, "dp": {**p["dp"], "eval_every": p["dp"]["eval_every"] + 1}}, trainer) == run


def test_a_private_index_that_disagrees_with_the_shards_stats_stops_before_anything_is_charged(data_dir, tmp_path):
    """stats.json's usable count is what the shards stage published; an index holding another n (a shard
    rewritten since) would plan q on one population and sample another: refused before any charge."""
    work = project(data_dir, tmp_path)
    stats = json.loads((work / "data/shards/stats.json").read_text())
    stats["private"]["usable"] += 1
    (work / "data/shards/stats.json").write_text(json.dumps(stats))
    with pytest.raises(InputError, match="re-run the shards stage"):
        train(work)
    assert charged_runs(work) == []


def test_what_a_run_releases_without_dp_is_charged_once_for_each_reason(data_dir, tmp_path):
    """A known noise key, dp.log_private_stats' count, a training without DP (the ε = ∞ twin) and a held-out
    loss on an eval split carved from the private source are each a release outside ε: each is charged to
    the examples it touches (the private set, or the carved split), under the run's name; a DP run with none
    of them charges nothing outside DP. The twin's release is its training's, whatever its dp flags."""
    work = project(data_dir, tmp_path)
    with inside(work):
        p = sections_of(load_params("params.yaml"), stage("dp-train").sections)
        data_id, sketch = budget.examples_identity("data/shards/private")

        def charged(run, identity=data_id, twin=False, **dp):
            training.record_outside_dp({**p, "dp": {**p["dp"], **dp}}, run, data_id, sketch, None, twin)
            return [e["outside_dp"] for e in budget.runs(identity) if e["run"] == run]

        assert charged("clean", noise_seed=None, log_private_stats=False) == []
        assert charged("seeded", noise_seed=5, log_private_stats=False) == ["a known noise key (dp.noise_seed)"]
        assert charged("counted", noise_seed=None, log_private_stats=True) == [
            "dp.log_private_stats published a count without noise"]
        assert charged("twin", twin=True, noise_seed=5, log_private_stats=True) == ["a training without DP on them"]
        stats = json.loads(Path("data/shards/stats.json").read_text())
        Path("data/shards/stats.json").write_text(json.dumps({**stats, "eval_from_private": True}))
        eval_id, _ = budget.examples_identity("data/shards/eval")
        carved = ["the eval split carved out of the source (shards.eval_fraction)"]
        assert charged("carved", eval_id, noise_seed=None, log_private_stats=False) == carved
        assert charged("carved-twin", eval_id, twin=True) == carved


def test_the_curves_infinite_epsilon_point_charges_the_eval_split_its_held_out_loss_reads(data_dir, tmp_path):
    """The curve's ε = ∞ point trains through train_nonprivate alone: it publishes the held-out loss of an
    eval split carved from the private source, and charges that split as a DP run does, and its training set."""
    work = project(data_dir, tmp_path)
    stats = json.loads((work / "data/shards/stats.json").read_text())
    (work / "data/shards/stats.json").write_text(json.dumps({**stats, "eval_from_private": True}))
    with inside(work):
        p = sections_of(load_params("params.yaml"), stage("dp-train").sections)
        trainer = training.setup(p, "cpu")
        training.train_nonprivate(p, trainer, types.SimpleNamespace(tracker=RecordingTracker()))
        charges = {name: [e["outside_dp"] for e in budget.runs(budget.examples_identity(f"data/shards/{name}")[0])]
                   for name in ("private", "eval")}
    assert charges == {"private": ["a training without DP on them"],
                       "eval": ["the eval split carved out of the source (shards.eval_fraction)"]}


def test_an_infinite_epsilon_twin_on_a_web_source_is_refused_before_it_is_charged_or_trained(data_dir, tmp_path):
    """The curve's ε = ∞ point trains through train_nonprivate alone (dp.nonprivate_baseline is off, so
    setup checks nothing): on a web source it is refused there, before its release is recorded."""
    work = project(data_dir, tmp_path)
    with inside(work):
        p = sections_of(load_params("params.yaml"), stage("dp-train").sections)
        trainer = training.setup(p, "cpu")
        trainer.source = "img2dataset"
        with pytest.raises(ParamsError, match="the ε = ∞ twin trains WITHOUT differential privacy"):
            training.train_nonprivate(p, trainer, types.SimpleNamespace(tracker=RecordingTracker()))
        assert budget.runs(budget.examples_identity("data/shards/private")[0]) == []
    assert not list((work / ".dpfm/state").glob("dp-train-*/nonprivate*"))


def test_a_run_with_a_known_noise_key_is_charged_outside_dp_under_its_name(data_dir, tmp_path):
    """A known noise key (dp.noise_seed, a test run's: stage_runs.MICRO) lets anyone subtract the noise: the run
    charges that release to its examples, so the composition that counts it is ∞ whatever later params say."""
    work = project(data_dir, tmp_path)
    ledger, _ = train(work)
    with inside(work):
        outside = [(e["run"], e["outside_dp"]) for e in budget.runs(ledger["data_identity"]) if "outside_dp" in e]
        composed = budget.composition(ledger, ledger["delta"])
    assert outside == [(ledger["run"], "a known noise key (dp.noise_seed)")]
    assert composed["epsilon"] == float("inf") and composed["epsilon_dp_runs"] < float("inf")


def test_a_run_resumed_where_the_accountant_rounds_otherwise_adds_the_noise_its_ledger_began_with(data_dir, tmp_path,
                                                                                               monkeypatch):
    """Requeued on a node whose accountant rounds otherwise (every ε 1e-11 off), σ calibrates a hair apart: the
    ledger keeps its header's σ, and every resumed step must add that noise, not this node's calibration."""
    work, real = project(data_dir, tmp_path), engine.add_noise
    train_until_crash(work, monkeypatch, 3)
    for name in ("_eps_noise", "_pld_eps_at"):
        off = lambda *a, real=getattr(accounting, name), **k: real(*a, **k) * (1 + 1e-11)  # noqa: E731
        monkeypatch.setattr(accounting, name, off)
    added = []
    monkeypatch.setattr(engine, "add_noise", lambda clipper, std, *a: added.append(std) or real(clipper, std, *a))
    ledger, _ = train(work)
    assert len(added) == 4 and set(added) == {ledger["noise_std"]}, (added, ledger["noise_std"])


def test_a_resumed_run_publishes_the_whole_held_out_curve_to_its_own_stage_run(data_dir, tmp_path, monkeypatch):
    """The points logged before a crash went to the interrupted stage's MLflow run: the resumed stage's run
    gets the whole curve (steps 0, 3 and the last, 5), the earlier points from the checkpoint's history."""
    work = project(data_dir, tmp_path)
    train_until_crash(work, monkeypatch, 6)  # the step-4 checkpoint holds the points of steps 0 and 3
    logged = RecordingTracker()
    with inside(work):
        run_in_process("dp-train", [], tracker=logged)
    assert sorted(logged.curve("heldout_loss")) == [0, 3, 5]
