"""The shared training loop (pipeline/train.py): schedule, optimiser groups, autocast policy, atomic
checkpoints and exact resume of run_loop on a toy problem."""

from __future__ import annotations

import io
import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from pipeline import train
from pipeline.errors import Stopped
from pipeline.progress import untimed_bar


def test_lr_warms_up_linearly_then_decays_by_cosine_to_zero():
    base, warmup, total = 0.1, 5, 25
    lrs = [train.lr_at(s, base, warmup, total) for s in range(total + 1)]
    assert lrs[:warmup] == pytest.approx([base * (s + 1) / warmup for s in range(warmup)])
    assert lrs[warmup] == pytest.approx(base)
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))
    assert lrs[warmup + 10] == pytest.approx(base * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[total] == pytest.approx(0.0)
    assert train.lr_at(3, base, 0, 10) < base  # no warm-up: cosine from the first step


def test_adamw_betas_and_no_decay_on_norms_biases_and_tokens():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = train.make_optimizer(model, "adamw", 1e-3, 0.05)
    assert opt.defaults["betas"] == (0.9, 0.95)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.05 and [p.shape for p in decayed["params"]] == [torch.Size([3, 4])]
    assert plain["weight_decay"] == 0.0 and all(p.ndim == 1 for p in plain["params"]) and len(plain["params"]) == 3
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        train.make_optimizer(model, "adam", 1e-3, 0.05)


def test_each_step_runs_at_its_scheduled_rate_the_encoder_at_its_share_of_it(tmp_path):
    """What the optimizer holds while step s runs: lr_at(s) for the head, encoder_lr_scale times it for
    the encoder (and the right parameters in each), from step 0 of a fresh run; SGD with momentum."""

    class WithEncoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.head = torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)

    model = WithEncoder()
    for name in ("adamw", "sgd"):
        opt = train.make_optimizer(model, name, 0.01, 0.05, encoder_lr_scale=0.1)
        owners = {id(p): n.split(".")[0] for n, p in model.named_parameters()}
        assert {(owners[id(p)], g["lr_scale"]) for g in opt.param_groups for p in g["params"]} == {
            ("head", 1.0), ("encoder", 0.1)}
    assert opt.defaults["momentum"] == 0.9
    seen = []

    def step_fn(step):
        seen.append({owners[id(g["params"][0])]: g["lr"] for g in opt.param_groups})
        return {}

    schedule = train.Schedule(6, 0.01, 2, checkpoint_every=100)
    train.run_loop(train.TrainState(model, opt), schedule, step_fn, train.Checkpointer(tmp_path), desc="toy")
    rates = [train.lr_at(s, 0.01, 2, 6) for s in range(6)]
    assert seen == [{"head": pytest.approx(r), "encoder": pytest.approx(0.1 * r)} for r in rates]


def test_autocast_is_bf16_only_when_asked_or_on_a_supporting_gpu():
    with train.autocast("cpu", "bf16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    for precision in ("auto", "fp32"):
        with train.autocast("cpu", precision):
            assert not torch.is_autocast_enabled("cpu")
    with train.autocast("cpu", "fp16"):
        assert torch.get_autocast_dtype("cpu") == torch.float16
    assert train.loss_scale("fp16") == 2.0 ** 12 and train.loss_scale("bf16") == 1.0
    assert train.uses_bf16("cpu", "auto") is False
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        train.uses_bf16("cpu", "fp8")


def test_step_generators_are_a_function_of_key_step_and_stream_alone():
    draw = lambda *a: torch.rand(4, generator=train.step_generator(*a))  # noqa: E731
    assert torch.equal(draw(7, 3, train.MASKS), draw(7, 3, train.MASKS))
    assert len({tuple(draw(*a).tolist()) for a in [(7, 3, 1), (7, 3, 2), (7, 4, 1), (8, 3, 1)]}) == 4


def test_state_dir_is_keyed_by_params():
    a = train.state_dir("pretrain", {"x": 1, "y": [1, 2]})
    assert a == train.state_dir("pretrain", {"y": [1, 2], "x": 1})  # key order does not matter
    assert a != train.state_dir("pretrain", {"x": 2, "y": [1, 2]})
    assert a != train.state_dir("dp-train", {"x": 1, "y": [1, 2]})
    assert a.parent == train.STATE_ROOT
    # What only names or schedules a run does not key the state: a renamed run resumes.
    run = {"seed": 0, "experiment": "a", "threads": 2, "device": "cpu"}
    assert train.state_dir("dp-train", {"run": run}) == train.state_dir(
        "dp-train", {"run": {**run, "experiment": "b", "threads": 8, "device": "cuda"}})
    assert train.state_dir("dp-train", {"run": run}) != train.state_dir("dp-train", {"run": {**run, "seed": 1}})


def test_a_run_keyed_before_a_knob_existed_is_found_while_the_knob_is_neutral(tmp_path, monkeypatch):
    from pipeline.config import ADDED_KNOBS

    monkeypatch.setattr(train, "STATE_ROOT", tmp_path)
    (s1, k1, n1), (s2, k2, n2) = ADDED_KNOBS[-2:]  # the two newest knobs, at their neutral values
    before_both = {"dp": {"lr": 0.1}, "model": {"size": "cpu"}}
    now = {section: dict(values) for section, values in before_both.items()}
    now[s1][k1], now[s2][k2] = n1, n2
    fresh = train.state_dir("dp-train", now)
    assert not fresh.exists()  # nothing there yet: the current key
    older = train.state_dir("dp-train", before_both)
    older.mkdir()
    assert train.state_dir("dp-train", now) == older  # the run from before both knobs is this run
    assert train.state_dir("dp-train", {**now, "dp": {**now["dp"], "lr": 0.2}}) != older  # another run
    assert train.state_dir("dp-train", {**now, s1: {**now[s1], k1: "set"}}) != older  # the knob set
    assert train.state_dir("pretrain", now) != older  # another stage
    fresh.mkdir()
    assert train.state_dir("dp-train", now) == fresh  # the current key wins where both exist


def test_a_warm_start_is_known_by_its_weights_and_a_run_keyed_by_its_files_keeps_its_state(tmp_path, monkeypatch):
    """A finished model input is known by its weights: saved again with another config, summary and
    history, and a later file time, it is the same input; one weight changed, another. A run keyed
    before (by the files' bytes and times) is still found, so it resumes rather than starts again."""
    import os

    from pipeline import checkpoints

    monkeypatch.setattr(train, "STATE_ROOT", tmp_path / "state")
    warm = tmp_path / "pretrain"
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    model.encoder = model[0]

    def write(config: dict, summary: str) -> str:
        checkpoints.save(warm / "checkpoint.pt", model, objective="mae", model_cfg={"size": "micro"}, steps=2,
                         private=False, config=config)
        (warm / "summary.json").write_text(summary)
        os.utime(warm / "checkpoint.pt", ns=(1, len(summary)))
        return train.input_digest(warm)

    warm.mkdir()
    first = write({"pretrain": {"log_every": 20}}, '{"images_per_s": 86.7}')
    older = train.state_dir("dp-train", {"dp": {"lr": 0.1}}, [warm])
    assert write({"pretrain": {"log_every": 1}}, '{"images_per_s": 101.1}') == first
    assert train.state_dir("dp-train", {"dp": {"lr": 0.1}}, [warm]) == older
    with torch.no_grad():
        model[0].weight[0, 0] += 1e-6
    assert write({"pretrain": {"log_every": 1}}, '{"images_per_s": 101.1}') != first
    # A run keyed by the files (as before 2026-12-04) is found; the weights' key wins where both exist.
    by_files = train.state_dir("dp-train", {"dp": {"lr": 0.2}}, [warm])
    monkeypatch.setattr(train, "input_digest", lambda p, by_weights=True, digest=train.input_digest: digest(p, False))
    legacy = train.state_dir("dp-train", {"dp": {"lr": 0.2}}, [warm])
    monkeypatch.undo()
    monkeypatch.setattr(train, "STATE_ROOT", tmp_path / "state")
    assert legacy != by_files
    legacy.mkdir(parents=True)
    assert train.state_dir("dp-train", {"dp": {"lr": 0.2}}, [warm]) == legacy
    by_files.mkdir()
    assert train.state_dir("dp-train", {"dp": {"lr": 0.2}}, [warm]) == by_files


def test_a_run_on_private_inputs_is_named_by_its_keyed_digest_and_keeps_a_plainly_named_state(tmp_path, monkeypatch):
    """dp-train's state directory names the run in the published ledger; its plain digest hashes the
    private index's bytes, so it is named through `name` (the owner's keyed name) instead."""
    monkeypatch.setattr(train, "STATE_ROOT", tmp_path)
    params, keyed = {"dp": {"lr": 0.1}}, lambda digest: f"k{digest[::-1]}"
    plain = train.state_dir("dp-train", params)
    named = train.state_dir("dp-train", params, name=keyed)
    assert named.name == f"dp-train-{keyed(plain.name.removeprefix('dp-train-'))}" and named != plain
    plain.mkdir()  # a run made before runs were named so: resumed, not started afresh
    assert train.state_dir("dp-train", params, name=keyed) == plain
    named.mkdir()
    assert train.state_dir("dp-train", params, name=keyed) == named


def test_state_is_keyed_by_the_index_not_the_usable_file_derived_from_it(tmp_path):
    (tmp_path / "index.parquet").write_bytes(b"rows")
    before = train.input_digest(tmp_path)
    (tmp_path / "usable.idx").write_bytes(b"derived on a first open")  # an index from before usable.idx
    assert train.input_digest(tmp_path) == before
    (tmp_path / "index.parquet").write_bytes(b"other rows")
    assert train.input_digest(tmp_path) != before


def test_checkpoint_round_trip(tmp_path):
    ckpt = train.Checkpointer(tmp_path / "run")
    assert ckpt.load() is None
    state = {"model": {"w": torch.randn(3, 4), "step": torch.tensor(7)}, "rng": torch.get_rng_state(),
             "history": {"step": [0, 10], "metrics": [{"loss": 1.5}, {"loss": 1.25}]}, "step": 11}
    ckpt.save(state)
    back = ckpt.load()
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and torch.equal(back["rng"], state["rng"])
    assert back["history"] == state["history"] and back["step"] == 11
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint.pt"]


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = train.Checkpointer(tmp_path)
    ckpt.save({"step": 1})
    real_save = torch.save

    def half_written(obj, f):  # Checkpointer saves through a file object
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[:10])  # the write fails part-way
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", half_written)
    with pytest.raises(OSError):
        ckpt.save({"step": 2})
    assert ckpt.load() == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temp file left behind


def _toy_run(directory, total, fail_at=None, log=None):
    """A tiny regression whose steps draw data and dropout from the global RNG: the resume has to
    restore it, as well as the model and the optimizer, to match."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    opt = train.make_optimizer(model, "adamw", 0.01, 0.1)

    def step_fn(step):
        if step == fail_at:
            raise KeyboardInterrupt
        x = torch.randn(16, 3)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return {"loss": loss.item()}

    state = train.TrainState(model, opt)
    train.run_loop(state, train.Schedule(total, 0.01, 2, checkpoint_every=3, log_every=1), step_fn,
                   train.Checkpointer(directory), desc="toy", log=(lambda s, m: log.append(s)) if log is not None else None)
    return model, state.history, [state.resumed_at]


def test_run_loop_resumes_exactly(tmp_path):
    torch.set_num_threads(1)
    straight, straight_history, _ = _toy_run(tmp_path / "a", 10)
    with pytest.raises(KeyboardInterrupt):
        _toy_run(tmp_path / "b", 10, fail_at=7)  # the last checkpoint is at step 6
    log = []
    resumed, history, starts = _toy_run(tmp_path / "b", 10, log=log)
    assert starts == [6] and log == [6, 7, 8, 9]
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()))
    assert [m["loss"] for m in history["metrics"]] == [m["loss"] for m in straight_history["metrics"]]
    assert [round(m["lr"], 12) for m in history["metrics"]] == [round(train.lr_at(s, 0.01, 2, 10), 12)
                                                                for s in range(10)]


def test_a_checkpoint_from_eight_gpus_resumes_on_one(tmp_path, monkeypatch):
    """Rank 0 of an 8-GPU dp-train saved the CUDA generator of every device it saw, and a resume set
    each on device i: on the curve's one GPU (it resumes the point dp-train trained) that is an
    IndexError at device 1, every retry. One GPU is simulated: torch's per-device setter, as torch
    reaches it, refuses a device the machine lacks."""
    import torch.cuda.random as cuda_random

    set_on = []

    def set_rng_state(state, device="cuda"):
        index = 0 if device == "cuda" else torch.device(device).index if isinstance(device, str) else device
        if index >= 1:  # what torch.cuda.default_generators[index] does on a one-GPU machine
            raise IndexError("tuple index out of range")
        set_on.append((index, state))

    for module in (torch.cuda, cuda_random):
        monkeypatch.setattr(module, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = torch.nn.Linear(2, 1)
    state = train.TrainState(model, train.make_optimizer(model, "adamw", 0.01, 0.0))
    saved = {"model": model.state_dict(), "optimizer": state.optimizer.state_dict(), "step": 4,
             "rng": torch.get_rng_state(), "history": {"step": [], "metrics": []}}
    eight = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]  # an old checkpoint: one per device
    state.restore({**saved, "cuda_rng": eight})
    assert state.step == 4 and len(set_on) == 1 and torch.equal(set_on[0][1], eight[0])  # rank 0's device's
    state.restore({**saved, "cuda_rng": eight[3]})  # a checkpoint now: this process's device's generator
    assert torch.equal(set_on[-1][1], eight[3])


def test_a_step_is_published_only_once_a_checkpoint_holds_it(tmp_path):
    """A crash after step 7 resumes from the checkpoint of step 5 and draws steps 6 and 7 again: their
    metrics (of iterates a resume on another device would redraw with other noise) must not have been
    published by the crashed run, so every step reaches `log` once."""
    crashed, resumed = [], []
    with pytest.raises(KeyboardInterrupt):
        _toy_run(tmp_path, 10, fail_at=8, log=crashed)  # checkpoints after steps 2 and 5; 6 and 7 run, unsaved
    _, _, starts = _toy_run(tmp_path, 10, log=resumed)
    assert starts == [6]
    assert crashed == [0, 1, 2, 3, 4, 5] and resumed == [6, 7, 8, 9]


def test_an_untimed_run_prints_the_same_bar_whatever_its_steps_take(tmp_path, progress_clock, capsys):
    """A private training's steps take time with their realised batch sizes: measured on a clock the
    test drives, two runs whose steps take other times print the same progress."""
    printed = []
    for i, durations in enumerate(([0.05] * 5 + [0.01] * 35, [0.01] * 35 + [0.3] * 5)):
        model = torch.nn.Linear(2, 1)
        state = train.TrainState(model, train.make_optimizer(model, "adamw", 0.01, 0.0))

        def step_fn(step, durations=durations):
            progress_clock.advance(durations[step])
            return {}

        capsys.readouterr()
        logged = []
        train.run_loop(state, train.Schedule(40, 0.01, 2, checkpoint_every=5, log_every=100), step_fn,
                       train.Checkpointer(tmp_path / str(i)), desc="private", timed=False,
                       log=lambda step, metrics: logged.append((step, metrics)))
        printed.append((capsys.readouterr(), logged))
    assert printed[0] == printed[1] and printed[0][0].err.count("/40 steps") > 2, printed


@pytest.mark.parametrize("steps, fail_at", [(40, 23), (1000, 537), (1000, 999)])
def test_an_untimed_run_that_fails_shows_no_count_past_its_last_checkpoint(tmp_path, capsys, steps, fail_at):
    """A failed step's number says when a private example (one that did not read, say) was sampled: the
    bar moves only when a checkpoint (every 10 steps here) holds the steps, so no count it prints passes
    the last checkpoint before the failure, whose step a re-run prints anyway ("resuming at step")."""
    model = torch.nn.Linear(2, 1)
    state = train.TrainState(model, train.make_optimizer(model, "adamw", 0.01, 0.0))

    def step_fn(step):
        if step == fail_at:
            raise RuntimeError("a private read failed")
        return {}

    with pytest.raises(RuntimeError):
        train.run_loop(state, train.Schedule(steps, 0.01, 2, checkpoint_every=10, log_every=10**6), step_fn,
                       train.Checkpointer(tmp_path), desc="private", timed=False)
    shown = capsys.readouterr().err
    counts = {int(n) for n in re.findall(rf" (\d+)/{steps} steps", shown)}
    assert max(counts) == fail_at // 10 * 10, shown[-300:]


REFAULTS = """
import resource, sys
import torch
from pipeline.train import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "kept" else False
faults = []
for _ in range(12):  # a step's worth of memory, freed and asked for again: 16 MB and 64 MB blocks
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(4 << 20), torch.ones(16 << 20)]
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del blocks
print(applied, min(faults[-4:]))  # the heap settles within a few steps; glibc's default never reuses
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_kept_heap_serves_the_next_step_without_faulting_its_pages_in_again():
    """What keep_freed_memory buys (benchmarks/dp_time_breakdown.py): glibc's defaults map blocks above
    32 MB afresh and fault their pages in on every step; with the heap kept, the next step reuses them."""
    out = {}
    for heap in ("default", "kept"):
        proc = subprocess.run([sys.executable, "-c", REFAULTS, heap], capture_output=True, text=True, check=True)
        applied, faults = proc.stdout.split()
        out[heap] = (applied == "True", int(faults))
    pages = (80 << 20) // 4096
    assert out["kept"][0]
    assert out["default"][1] > pages // 4  # the 64 MB block faulted in again
    assert out["kept"][1] < pages // 20


def test_a_finished_untimed_bar_shows_its_whole_count_whatever_its_redraw_step(capsys):
    """301 pieces redraw every third: the last, 301, falls between redraws, and the closed bar must still
    read 301/301, not stop at 300."""
    with untimed_bar(301, "shards", unit="shards") as bar:
        for _ in range(301):
            bar.update()
    assert capsys.readouterr().err.rstrip().endswith("301/301 shards"), "bar stopped short of its total"


def test_a_resumed_untimed_bar_counts_on_from_its_start_every_hundredth_of_what_is_left(capsys):
    with untimed_bar(1000, "private", initial=990, unit="steps") as bar:
        for _ in range(10):
            bar.update()
    counts = sorted({int(n) for n in re.findall(r" (\d+)/1000 steps", capsys.readouterr().err)})
    assert counts == list(range(990, 1001)), counts


def test_an_untimed_bar_cut_short_shows_no_count_past_its_last_redraw(capsys):
    """The shards stage's bar moves a piece at a time and redraws every tenth of 1000: a failure at piece 537
    must not print 537, which names the failing piece; the closed bar stays at its last redraw, 530."""
    with pytest.raises(RuntimeError), untimed_bar(1000, "shards", unit="shards") as bar:
        for piece in range(1000):
            if piece == 537:
                raise RuntimeError("a private shard did not read")
            bar.update()
    counts = {int(n) for n in re.findall(r" (\d+)/1000 shards", capsys.readouterr().err)}
    assert max(counts) == 530, sorted(counts)[-3:]


def _told_to_stop_run(directory, total, told_at, signum, log):
    """_toy_run, its job told `signum` inside step `told_at` (after that step's update)."""
    real = train.run_loop

    def run_loop(state, schedule, step_fn, *args, **kw):
        def step(s):
            metrics = step_fn(s)
            if s == told_at:
                signal.raise_signal(signum)
            return metrics
        return real(state, schedule, step, *args, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "run_loop", run_loop)
        return _toy_run(directory, total, log=log)


def test_a_stop_signal_ends_the_run_after_its_step_with_a_checkpoint_that_resumes_exactly(tmp_path):
    """Told to stop in step 3 (the checkpoints fall after steps 2, 5, 8), the run finishes that step,
    saves it, publishes it and raises Stopped naming it; the re-run resumes there, to the straight run."""
    torch.set_num_threads(1)
    straight, straight_history, _ = _toy_run(tmp_path / "a", 10)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    told = []
    with pytest.raises(Stopped, match=r"^toy stopped by SIGTERM after step 4 of 10; ") as stopped:
        _told_to_stop_run(tmp_path / "b", 10, told_at=3, signum=signal.SIGTERM, log=told)
    assert stopped.value.signum == signal.SIGTERM and told == [0, 1, 2, 3]
    assert torch.load(tmp_path / "b/checkpoint.pt", weights_only=False)["step"] == 4
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    resumed_log = []
    resumed, history, starts = _toy_run(tmp_path / "b", 10, log=resumed_log)
    assert starts == [4] and resumed_log == [4, 5, 6, 7, 8, 9]
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()))
    assert [m["loss"] for m in history["metrics"]] == [m["loss"] for m in straight_history["metrics"]]


def test_steps_are_not_published_when_the_checkpoint_meant_to_hold_them_fails_to_save(tmp_path, monkeypatch):
    """The second checkpoint (steps 3 to 5) hits a full disk: those steps were never saved, a re-run
    draws them again, so they must not have reached `log`."""
    real_save, saves = train.Checkpointer.save, []

    def full_on_second(self, state):
        saves.append(state["step"])
        if len(saves) == 2:
            raise OSError(28, "No space left on device")
        real_save(self, state)

    monkeypatch.setattr(train.Checkpointer, "save", full_on_second)
    logged = []
    with pytest.raises(OSError, match="No space left"):
        _toy_run(tmp_path, 10, log=logged)
    assert saves == [3, 6] and logged == [0, 1, 2]


def test_the_last_step_is_in_the_history_whatever_log_every(tmp_path):
    model = torch.nn.Linear(2, 1)
    state = train.TrainState(model, train.make_optimizer(model, "adamw", 0.01, 0.0))
    train.run_loop(state, train.Schedule(8, 0.01, 2, checkpoint_every=100, log_every=3), lambda step: {},
                   train.Checkpointer(tmp_path), desc="toy")
    assert state.history["step"] == [0, 3, 6, 7]


def test_the_callers_counters_resume_with_the_run(tmp_path):
    """TrainState.counters (dp-train's running figures) are saved with each checkpoint and restored."""

    def run(fail_at=None):
        model = torch.nn.Linear(2, 1)
        state = train.TrainState(model, train.make_optimizer(model, "adamw", 0.01, 0.0), counters={"seen": 0})

        def step_fn(step):
            if step == fail_at:
                raise KeyboardInterrupt
            state.counters["seen"] += step
            return {}

        train.run_loop(state, train.Schedule(10, 0.01, 2, checkpoint_every=3), step_fn, train.Checkpointer(tmp_path),
                       desc="toy")
        return state.counters

    with pytest.raises(KeyboardInterrupt):
        run(fail_at=7)
    assert run() == {"seen": sum(range(10))}


def test_a_resumed_run_sends_the_tracker_only_the_points_logged_before_it_resumed():
    """Steps from `resumed_at` on were redone by this process (and logged by it): log_earlier gives the
    new MLflow run the earlier points only, each once."""
    sent = []

    class Tracker:
        def log_series(self, key, values, steps):
            sent.append((key, values, steps))

    history = {"step": [0, 3, 6, 9], "metrics": [{"loss": 4.0, "lr": 0.1}, {"loss": 3.0}, {"loss": 2.0}, {"loss": 1.0}]}
    state = train.TrainState(None, None, step=10, resumed_at=6, history=history)
    train.log_earlier(state, Tracker(), ("loss", "lr"), prefix="dp/")
    assert sent == [("dp/loss", [4.0, 3.0], [0, 3]), ("dp/lr", [0.1], [0])]


def test_only_the_writing_rank_saves_or_reclaims_a_stale_temp(tmp_path):
    """A non-main rank neither writes the shared checkpoint nor deletes a temp file next to it (rank 0
    may be writing it now); the writing rank reclaims one a kill -9 left behind."""
    stale = tmp_path / ".checkpoint.pt.x1y2.tmp"
    stale.write_bytes(b"half a checkpoint")
    reader = train.Checkpointer(tmp_path, write=False)
    reader.save({"step": 1})
    assert reader.load() is None and stale.exists()
    assert train.Checkpointer(tmp_path).load() is None and not stale.exists()


def test_a_weight_average_moves_its_share_of_the_way_and_resumes_only_with_its_own_decay():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    average = train.WeightAverage(model, 0.75)
    with torch.no_grad():
        model.weight.fill_(4.0)
    average.update()
    assert torch.equal(average.weights["weight"], torch.full((1, 2), 1.0))  # 0 + (1 - 0.75)(4 - 0)
    for decay in (0.0, 1.0):  # the last iterate, or the start released whatever the run learnt
        with pytest.raises(ValueError, match="must lie in"):
            train.WeightAverage(model, decay)
    with pytest.raises(ValueError, match="has decay 0.75, this run 0.5"):
        train.WeightAverage(model, 0.5).load_state_dict(average.state_dict())


def test_a_run_that_averages_its_weights_resumes_to_the_same_average(tmp_path):
    def run(directory, fail_at=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = train.make_optimizer(model, "sgd", 0.1, 0.0)
        state = train.TrainState(model, opt, average=train.WeightAverage(model, 0.5))

        def step_fn(step):
            if step == fail_at:
                raise KeyboardInterrupt
            x = torch.randn(8, 3)
            opt.zero_grad()
            ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
            opt.step()
            state.average.update()
            return {}

        train.run_loop(state, train.Schedule(10, 0.1, 2, checkpoint_every=3), step_fn, train.Checkpointer(directory),
                       desc="toy")
        return state.average.weights

    straight = run(tmp_path / "a")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", fail_at=7)
    resumed = run(tmp_path / "b")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_small_input_file_is_known_by_its_bytes_not_its_time(tmp_path):
    """An index written again with the same bytes (a shards stage re-run) keeps the run's key, so the
    run resumes instead of training, and being charged, again."""
    (tmp_path / "index.parquet").write_bytes(b"rows")
    before = train.input_digest(tmp_path)
    os.utime(tmp_path / "index.parquet", ns=(1, 1))
    assert train.input_digest(tmp_path) == before


def test_freezing_an_unknown_module_or_every_parameter_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    with pytest.raises(ValueError, match=r"dp.frozen names \['2'\], which are not modules of the Sequential"):
        train.freeze(model, ["0", "2"])
    with pytest.raises(ValueError, match="freezes every parameter of the Sequential: nothing would train"):
        train.freeze(model, ["0", "1"])


def test_a_stop_told_while_the_last_checkpoint_is_written_still_stops_the_stage(tmp_path, monkeypatch):
    """The last step's stop check is behind it: a SIGTERM during the final save (or its logging) must still
    raise Stopped, or the stage's next training runs on until SLURM kills it."""
    real_save = train.Checkpointer.save

    def told_while_saving(self, state):
        real_save(self, state)
        if state["step"] == 10:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(train.Checkpointer, "save", told_while_saving)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with pytest.raises(Stopped, match=r"^toy stopped by SIGTERM after step 10 of 10; "):
        _toy_run(tmp_path, 10)
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"] == 10
