"""The `pretrain` stage: an interrupted-and-resumed run equals an uninterrupted one bit for bit, the
saved encoder initialises every DP objective, bf16 autocast runs on CPU, and curves reach MLflow."""

from __future__ import annotations

import json
import gc
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pretrain_project import IMAGES, make_project, micro_sets, saved
from recording import RecordingTracker

from pipeline import train
from pipeline.artifacts import artifact
from pipeline.stages import pretrain, stage
from pipeline.config import load_params, sections_of
from pipeline.models import ModelConfig, build_model


def stage_params(**pretrain_overrides) -> dict:
    return sections_of(load_params("params.yaml", micro_sets(**pretrain_overrides)), ("run", "model", "pretrain"))


def run_stage(project: Path, monkeypatch, **pretrain_overrides) -> RecordingTracker:
    ctx = SimpleNamespace(stage=stage("pretrain"), tracker=RecordingTracker(), threads=1, device="cpu")
    with monkeypatch.context() as m:
        m.chdir(project)
        pretrain.run(stage_params(**pretrain_overrides), ctx)
    return ctx.tracker


def state_files(project: Path) -> list[Path]:
    return sorted((project / ".dpfm/state").glob("pretrain-*/checkpoint.pt"))


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-exact comparisons need the same reduction order in every run
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    project = make_project(tmp_path_factory.mktemp("uninterrupted"))
    with pytest.MonkeyPatch.context() as m:
        torch.set_num_threads(1)
        tracker = run_stage(project, m)
    return project, tracker


def crash_at(monkeypatch, step_to_fail: int) -> None:
    """Make step_fn raise when it reaches `step_to_fail` (a checkpoint was written before it)."""
    real = pretrain.run_loop

    def run_loop(state, schedule, step_fn, *args, **kw):
        def failing(step):
            if step == step_to_fail:
                raise KeyboardInterrupt(f"simulated kill at step {step}")
            return step_fn(step)

        return real(state, schedule, failing, *args, **kw)

    monkeypatch.setattr(pretrain, "run_loop", run_loop)


def interrupted_then_resumed(tmp_path, monkeypatch, break_resume=None, **resumed_with) -> tuple[Path, RecordingTracker]:
    project = make_project(tmp_path / "project")
    with monkeypatch.context() as m:
        crash_at(m, 5)  # after the checkpoint of step 4, with step 4 done but not saved
        with pytest.raises(KeyboardInterrupt):
            run_stage(project, m)
    assert not (project / artifact("pretrain")).exists()
    [checkpoint] = state_files(project)
    assert torch.load(checkpoint, weights_only=False)["step"] == 4
    with monkeypatch.context() as m:
        if break_resume:
            break_resume(m)
        tracker = run_stage(project, m, **resumed_with)
    return project, tracker


def params_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_interrupted_run_resumes_bit_for_bit(uninterrupted, tmp_path, monkeypatch):
    ref, ref_tracker = uninterrupted
    project, tracker = interrupted_then_resumed(tmp_path, monkeypatch)
    assert params_equal(saved(project).model, saved(ref).model)
    history, ref_history = (json.loads((p / artifact("pretrain") / "history.json").read_text()) for p in (project, ref))
    assert history["step"] == ref_history["step"] == list(range(6))
    assert [m["loss"] for m in history["metrics"]] == [m["loss"] for m in ref_history["metrics"]]
    assert json.loads((project / artifact("pretrain") / "summary.json").read_text())["resumed_at"] == 4
    # The resumed run's MLflow curve is whole: live points from step 4, the earlier ones as a series.
    assert tracker.curve("loss") == ref_tracker.curve("loss") and sorted(tracker.curve("loss")) == list(range(6))
    assert state_files(project) == []  # the spent state is removed once the output is written


def test_a_run_resumes_under_other_decoding_workers_and_checkpoint_cadence(uninterrupted, tmp_path, monkeypatch):
    """Fewer decoding workers is what a worker out of memory calls for: the run restarted from step 0
    (its state was keyed by them), up to 720 minutes of pretraining lost. They change nothing it computes."""
    ref, _ = uninterrupted
    project, _ = interrupted_then_resumed(tmp_path, monkeypatch, data_workers=1, checkpoint_every=3)
    assert json.loads((project / artifact("pretrain") / "summary.json").read_text())["resumed_at"] == 4
    assert params_equal(saved(project).model, saved(ref).model) and state_files(project) == []
    # A run interrupted while they were in the key resumes under its old values.
    keyed_by_all = lambda params, images: train.state_dir("pretrain", params, inputs=[images])  # noqa: E731
    project = make_project(tmp_path / "before")
    with monkeypatch.context() as m:
        crash_at(m, 5)
        m.setattr(pretrain, "resumable_state", keyed_by_all)
        with pytest.raises(KeyboardInterrupt):
            run_stage(project, m)
    run_stage(project, monkeypatch)
    assert json.loads((project / artifact("pretrain") / "summary.json").read_text())["resumed_at"] == 4


def test_decoding_workers_change_nothing(uninterrupted, tmp_path, monkeypatch):
    ref, _ = uninterrupted
    project = make_project(tmp_path)
    run_stage(project, monkeypatch, data_workers=2)
    assert params_equal(saved(project).model, saved(ref).model)


def _lose_optimizer_state(m):
    m.setattr(torch.optim.AdamW, "load_state_dict", lambda self, state: None)


def _masks_from_a_process_stream(m):
    stream = torch.Generator().manual_seed(0)
    m.setattr(pretrain, "step_generator", lambda seed, step, stream_id: stream)


def _restart_the_data(m):
    real = pretrain.step_batches
    m.setattr(pretrain, "step_batches", lambda loader, seed, start, *rest: real(loader, seed, 0, *rest))


@pytest.mark.parametrize("break_resume", [_lose_optimizer_state, _masks_from_a_process_stream, _restart_the_data])
def test_the_resume_check_catches_a_broken_resume(uninterrupted, tmp_path, monkeypatch, break_resume):
    ref, _ = uninterrupted
    project, _ = interrupted_then_resumed(tmp_path, monkeypatch, break_resume)
    assert not params_equal(saved(project).model, saved(ref).model)


def test_the_saved_encoder_initialises_every_objective(uninterrupted, monkeypatch):
    ref, _ = uninterrupted
    checkpoint = saved(ref)
    assert checkpoint.objective == "mae" and checkpoint.steps == 6
    monkeypatch.chdir(ref)
    model_params = stage_params()["model"]
    for objective in ("mae", "caption", "clip"):
        model = build_model(objective, ModelConfig.from_params(model_params, objective, vocab_size=64))
        model.encoder.load_state_dict(checkpoint.encoder)  # strict: every key and shape matches
        assert params_equal(model.encoder.state_dict(), checkpoint.encoder)
    mae = build_model("mae", checkpoint.model_cfg)
    mae.load_state_dict(checkpoint.model)
    assert params_equal(mae.encoder.state_dict(), checkpoint.encoder)
    # The decoder's head count changes no tensor's shape, but another split of its weights is another model:
    # refused for an MAE warm start (the whole model), not for an encoder one.
    cfg = ModelConfig.from_params({**model_params, "decoder_heads": 4}, "mae")
    with pytest.raises(ValueError, match="model.decoder_heads: 2 there, 4 here"):
        checkpoint.check_fits(build_model("mae", cfg), "mae", cfg.to_dict())
    cfg = ModelConfig.from_params({**model_params, "decoder_heads": 4}, "caption", vocab_size=64)
    checkpoint.check_fits(build_model("caption", cfg), "caption", cfg.to_dict())


def test_loss_lr_and_throughput_reach_mlflow(uninterrupted):
    project, tracker = uninterrupted
    for name in ("loss", "lr", "images_per_s", "grad_norm"):
        assert sorted(tracker.curve(name)) == list(range(6)), name
    assert all(np.isfinite(v) for v in tracker.curve("loss").values())
    assert tracker.metrics["mean_images_per_s"] > 0 and tracker.metrics["images"] == IMAGES
    summary = json.loads((project / artifact("pretrain") / "summary.json").read_text())
    loss = tracker.curve("loss")
    assert summary["final_loss"] == tracker.metrics["final_loss"] == loss[5] != loss[0]


def test_each_step_masks_its_own_patches(tmp_path, monkeypatch):
    """A mask drawn once and reused would have the MAE reconstruct the same patches at every step; a
    resumed run reuses it alike, so the resume tests cannot see it."""
    masks, real_step = [], pretrain.mae_step
    monkeypatch.setattr(pretrain, "mae_step", lambda model, opt, images, noise, *a: masks.append(noise.argsort(1))
                        or real_step(model, opt, images, noise, *a))
    run_stage(make_project(tmp_path), monkeypatch)
    assert len(masks) == 6 and len({m.numpy().tobytes() for m in masks}) == 6


def test_fp16s_loss_scale_is_taken_out_before_the_clip_and_the_step(tmp_path, monkeypatch):
    """fp16 multiplies the loss by a fixed scale so that small gradients survive; what the clip, the
    logged norm and AdamW see is the true gradient, as in fp32 (up to fp16's rounding)."""
    monkeypatch.chdir(make_project(tmp_path))
    cfg = ModelConfig.from_params(stage_params()["model"], "mae")
    images = torch.rand(8, 3, cfg.img_size, cfg.img_size)
    noise = torch.rand(8, (cfg.img_size // cfg.patch_size) ** 2)
    norms = {}
    for precision in ("fp32", "fp16"):
        torch.manual_seed(0)
        model = build_model("mae", cfg)
        optimizer = train.make_optimizer(model, "adamw", 1e-3, 0.0)
        norms[precision] = pretrain.mae_step(model, optimizer, images, noise, "cpu", precision, 1e9)["grad_norm"]
    assert train.loss_scale("fp16") > 1 and norms["fp16"] == pytest.approx(norms["fp32"], rel=0.02)


def test_a_global_batch_that_does_not_divide_over_the_ranks_is_refused(tmp_path, monkeypatch):
    from pipeline.distributed import World

    monkeypatch.setattr(pretrain, "init_world", lambda device: World(0, 3))
    with pytest.raises(ValueError, match="batch_size=8 must divide evenly over the 3 torchrun ranks"):
        run_stage(make_project(tmp_path), monkeypatch)


def test_pretraining_clips_decays_and_warms_up_as_its_params_say(tmp_path, monkeypatch):
    """Every AdamW step applies a gradient within pretrain.grad_clip (the raw norm, logged, is above it
    here), decays by pretrain.weight_decay, and runs at the rate lr_at gives its step."""
    project = make_project(tmp_path)
    with monkeypatch.context() as m:
        m.chdir(project)
        cfg = stage_params()["pretrain"]
    applied, decays, make_optimizer = [], [], pretrain.make_optimizer

    def recording(model, name, lr, weight_decay, *a):
        opt = make_optimizer(model, name, lr, weight_decay, *a)
        decays.append(weight_decay)
        grads = lambda o: [p.grad for g in o.param_groups for p in g["params"] if p.grad is not None]  # noqa: E731
        opt.register_step_pre_hook(lambda o, *_: applied.append(float(torch.nn.utils.get_total_norm(grads(o)))))
        return opt

    monkeypatch.setattr(pretrain, "make_optimizer", recording)
    tracker = run_stage(project, monkeypatch)
    assert decays == [cfg["weight_decay"]] and cfg["weight_decay"] > 0
    assert max(tracker.curve("grad_norm").values()) > cfg["grad_clip"] > 0  # the clip had work to do
    assert len(applied) == cfg["steps"] and max(applied) <= cfg["grad_clip"] * (1 + 1e-4)
    assert cfg["warmup_steps"] > 0 and tracker.curve("lr") == pytest.approx(
        {s: train.lr_at(s, cfg["lr"], cfg["warmup_steps"], cfg["steps"]) for s in range(cfg["steps"])})


def test_bf16_autocast_runs_on_cpu(tmp_path, monkeypatch):
    project = make_project(tmp_path)
    dtypes = {}
    real_build = pretrain.build_model

    def recording_build(objective, cfg):
        model = real_build(objective, cfg)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda mod, args, out: dtypes.update({out.dtype: True}))
        return model

    monkeypatch.setattr(pretrain, "build_model", recording_build)
    tracker = run_stage(project, monkeypatch, precision="bf16", steps=2)
    assert torch.bfloat16 in dtypes
    assert all(np.isfinite(v) for v in tracker.curve("loss").values())
    assert json.loads((project / artifact("pretrain") / "summary.json").read_text())["bf16"] is True
    assert {v.dtype for v in saved(project).model.values()} == {torch.float32}  # weights stay fp32

    dtypes.clear()
    run_stage(project, monkeypatch, precision="auto", steps=1)  # auto is fp32 on a CPU
    assert set(dtypes) == {torch.float32}


def test_a_checkpoint_from_other_data_is_not_resumed(tmp_path, monkeypatch):
    project = make_project(tmp_path / "a")
    with monkeypatch.context() as m:
        crash_at(m, 3)
        with pytest.raises(KeyboardInterrupt):
            run_stage(project, m)
    assert len(state_files(project)) == 1
    make_project(tmp_path / "a", image_seed=1)  # the synthetic images changed, the params did not
    run_stage(project, monkeypatch)
    assert json.loads((project / artifact("pretrain") / "summary.json").read_text())["resumed_at"] == 0


def test_batches_cover_each_epoch_once_and_depend_only_on_the_step():
    n, batch = 10, 4
    order = np.concatenate([pretrain.batch_indices(3, s, batch, n) for s in range(5)])  # 2 epochs
    assert sorted(order[:10]) == sorted(order[10:20]) == list(range(10))
    assert not np.array_equal(order[:10], order[10:20])  # each epoch is shuffled anew
    pretrain.epoch_order.cache_clear()
    assert np.array_equal(pretrain.batch_indices(3, 3, batch, n), order[12:16])
    assert not np.array_equal(pretrain.batch_indices(4, 0, batch, n), order[:4])


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision"):
        train.autocast("cpu", "fp8")


def test_two_gloo_ranks_train_the_one_process_model(uninterrupted, tmp_path):
    """Under torchrun each rank takes half of every global batch and DDP averages the gradients; rank 0
    alone writes the checkpoints and the output, and reports (two writers of one file on a shared file
    system race)."""
    from fault_hooks import dpfm_torchrun, with_sets

    project = make_project(tmp_path / "ddp")
    proc = dpfm_torchrun(project, with_sets("pretrain", micro_sets()), "moves")
    assert proc.returncode == 0, proc.stderr[-3000:]
    moved = (project / "moved.0").read_text().splitlines()
    assert str(artifact("pretrain")) in moved and any(m.endswith("/checkpoint.pt") for m in moved), moved
    assert not (project / "moved.1").exists() and proc.stdout.count("pretrain: ") == 1, proc.stdout
    ref, got = saved(uninterrupted[0]), saved(project)
    for k, v in ref.model.items():
        g = got.model[k]
        if k.endswith("qkv.bias"):
            # The key bias cancels in the softmax: its true gradient is 0, and AdamW turns float
            # round-off there into full-size steps. Compare the query and value parts only.
            d = v.shape[0] // 3
            v, g = torch.cat([v[:d], v[2 * d:]]), torch.cat([g[:d], g[2 * d:]])
        torch.testing.assert_close(g, v, rtol=1e-4, atol=1e-5, msg=k)


def test_a_diverged_run_stops_and_saves_no_warm_start(tmp_path, monkeypatch):
    """The third step's activations overflow (a fault put there): that step meets a non-finite gradient
    and stops the stage before the optimiser applies it. Saved, the NaN model passed every check, and
    dp-train charged a run that dropped every example as non-finite and trained nothing."""
    from pipeline.errors import Diverged

    project, real_build, calls = make_project(tmp_path), pretrain.build_model, []

    def overflowing_build(objective, cfg):
        model = real_build(objective, cfg)
        first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        first.register_forward_hook(
            lambda mod, args, out: calls.append(1) or (out * math.inf if len(calls) == 3 else out))
        return model

    monkeypatch.setattr(pretrain, "build_model", overflowing_build)
    with pytest.raises(Diverged, match="non-finite gradient"):
        run_stage(project, monkeypatch, steps=6)
    assert len(calls) == 3 and not (project / artifact("pretrain")).exists()


def test_a_grad_clip_of_zero_disables_clipping(tmp_path, monkeypatch):
    """pretrain.grad_clip: 0 means no clipping (params.yaml); clipped to a norm of 0 the gradients would
    vanish and AdamW would step on nothing."""
    monkeypatch.chdir(make_project(tmp_path))
    cfg = ModelConfig.from_params(stage_params()["model"], "mae")
    images = torch.rand(4, 3, cfg.img_size, cfg.img_size, generator=torch.Generator().manual_seed(1))
    noise = torch.rand(4, (cfg.img_size // cfg.patch_size) ** 2, generator=torch.Generator().manual_seed(2))
    stepped = {}
    for grad_clip in (0.0, 1e9):
        torch.manual_seed(0)
        model = build_model("mae", cfg)
        optimizer = train.make_optimizer(model, "adamw", 1e-3, 0.0)
        pretrain.mae_step(model, optimizer, images, noise, "cpu", "fp32", grad_clip)
        stepped[grad_clip] = model.state_dict()
    assert params_equal(stepped[0.0], stepped[1e9])


def test_an_infinite_gradient_norm_stops_before_the_step(tmp_path, monkeypatch):
    """Gradients too large for a float32 norm (finite each, infinite together) make the clip scale every
    gradient to 0 or NaN: the step must stop there, as for a NaN, with the weights untouched."""
    from pipeline.errors import Diverged

    monkeypatch.chdir(make_project(tmp_path))
    cfg = ModelConfig.from_params(stage_params()["model"], "mae")
    torch.manual_seed(0)
    model = build_model("mae", cfg)
    first = next(p for p in model.parameters() if p.requires_grad)
    first.register_hook(lambda g: torch.full_like(g, 1e30))  # finite, but its square overflows
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = train.make_optimizer(model, "adamw", 1e-3, 0.0)
    images, noise = torch.rand(2, 3, cfg.img_size, cfg.img_size), torch.rand(2, (cfg.img_size // cfg.patch_size) ** 2)
    for grad_clip in (0.0, 1.0):
        with pytest.raises(Diverged, match="non-finite gradient"):
            pretrain.mae_step(model, optimizer, images, noise, "cpu", "fp32", grad_clip)
        assert params_equal(model.state_dict(), before)


def test_a_synthetic_set_without_images_is_refused_by_name(tmp_path, monkeypatch):
    """An empty synthetic set (every program failed) must say so and what to run, not fail on a division
    by zero in the epoch shuffle."""
    import shutil

    from pipeline.data.shards import ShardWriter

    project = make_project(tmp_path)
    shutil.rmtree(project / artifact("synthetic"))
    with ShardWriter(project / artifact("synthetic"), prefix="synthetic", samples_per_shard=8):
        pass
    with pytest.raises(ValueError, match="has no usable images: run the synthetic stage"):
        run_stage(project, monkeypatch)


def test_the_images_per_second_curve_is_the_steps_per_second_curve_times_the_batch(uninterrupted):
    """MLflow's throughput curve counts images (what the data path must sustain), not steps."""
    _, tracker = uninterrupted
    steps, images = tracker.curve("steps_per_s"), tracker.curve("images_per_s")
    assert sorted(images) == sorted(steps) == list(range(6))
    assert all(images[s] == pytest.approx(steps[s] * stage_params()["pretrain"]["batch_size"]) for s in steps)


def test_a_resumed_runs_throughput_counts_only_the_steps_it_ran(tmp_path, monkeypatch):
    """Resumed at step 4 of 6, the run trains 2 steps: its mean images/s divides 2 batches by its time,
    not all 6 (which would report 3x the real throughput)."""
    clock = SimpleNamespace(time=iter([100.0, 110.0]).__next__)  # the run's start and end: 10 s apart
    project, tracker = interrupted_then_resumed(tmp_path, monkeypatch, lambda m: m.setattr(pretrain, "time", clock))
    summary = json.loads((project / artifact("pretrain") / "summary.json").read_text())
    assert summary["resumed_at"] == 4
    assert summary["images_per_s"] == pytest.approx(2 * stage_params()["pretrain"]["batch_size"] / 10)


def test_a_failed_pretrain_stops_its_decoding_workers_while_the_error_is_held(tmp_path, monkeypatch):
    """A step that fails hands its error up with a traceback holding the stage's frames, the batch stream
    among them: the stage stops its decoding workers itself, or they outlive the error."""
    import psutil

    project = make_project(tmp_path)
    before = {p.pid for p in psutil.Process().children()}
    with monkeypatch.context() as m:
        crash_at(m, 3)
        with pytest.raises(KeyboardInterrupt) as held:
            run_stage(project, m, data_workers=2)
    assert held.value is not None
    left = [p.pid for p in psutil.Process().children() if p.pid not in before]
    del held  # let go, so that workers left running here stop and do not hang the session's exit
    gc.collect()
    assert left == []


def test_a_pretrain_output_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A failure while the output is written (a full disk at summary.json) leaves no output: a checkpoint
    and history without their summary would pass for a finished run, and the state is gone after it."""
    project, real_write = make_project(tmp_path), pretrain.write_json

    def full_disk(path, value):
        if path.name == "summary.json":
            raise OSError(28, "No space left on device")
        return real_write(path, value)

    monkeypatch.setattr(pretrain, "write_json", full_disk)
    with pytest.raises(OSError, match="No space left"):
        run_stage(project, monkeypatch)
    assert not (project / artifact("pretrain")).exists()
