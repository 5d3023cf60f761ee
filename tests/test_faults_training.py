"""Faults of training: a real `kill -9` of pretrain and dp-train processes at exact points (after a step
is charged, after its update, half-way through a checkpoint write), SIGTERM as SLURM sends it (to the
process, to its process group with the decoding workers, to one torchrun rank; a second one), a second
`dpfm` on a running stage, a torn last ledger line, and a run resumed (or a rank run) where the accountant
rounds otherwise, as on another node. After each, a re-run finishes with what an
uninterrupted run gives, and the privacy ledger never counts fewer steps than were applied.

Stage processes run `dpfm` through tests/fault_hooks.py, which stops them at an exact point.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from fault_hooks import (BIN, MARKER, MISMATCH_ROWS, OOM_MIB, STEPS, UNREADABLE, check_same_as_uninterrupted, complete,
                         dp_outcome, dp_state, dpfm, dpfm_torchrun, kill_at_fault, log_tail, mlflow_runs,
                         start_dpfm_torchrun, with_sets)
from pretrain_project import make_project, micro_sets, saved
from ranks import on_two_ranks
from shard_data import write_set
from stage_runs import project, train

from pipeline.artifacts import artifact
from pipeline.config import load_params, sections_of
from pipeline.data.shards import ShardDataset
from pipeline.errors import RanksDisagree
from pipeline.privacy import training
from pipeline.privacy.ledger import Ledger, LedgerError
from pipeline.privacy.plan import Plan
from pipeline.stages import stage


# -- pretrain: kill -9 while a checkpoint is half written, SIGTERM to it and its decoding workers -----

def pretrain_args() -> list[str]:
    return with_sets("pretrain", micro_sets() + ["run.device=cpu", "pretrain.data_workers=2"])


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict:
    """The uninterrupted pretraining run's weights."""
    ref = make_project(tmp_path_factory.mktemp("pretrain-ref"))
    complete(dpfm(ref, pretrain_args()), ref)
    return saved(ref).model


def check_same_pretrained(work: Path, expected: dict) -> None:
    for name, value in expected.items():
        assert torch.equal(value, saved(work).model[name]), name


def test_kill_9_of_pretrain_mid_checkpoint_resumes_bit_for_bit(tmp_path, pretrained):
    work = make_project(tmp_path / "work")
    assert kill_at_fault(dpfm(work, pretrain_args(), fault="saving:2"), work) == "saving"  # 2nd checkpoint half on disk
    [state] = (work / ".dpfm/state").glob("pretrain-*")
    assert torch.load(state / "checkpoint.pt", weights_only=False)["step"] == 2  # the first one is intact
    complete(dpfm(work, pretrain_args()), work)
    assert "resuming at step 2" in log_tail(work)
    check_same_pretrained(work, pretrained)


def test_a_pretrain_job_that_fails_after_its_output_resumes_at_its_end(tmp_path, pretrained):
    """Killed as it logs its summary to MLflow (the model in place), the job fails and Snakemake deletes
    its output: the rerun resumes at the last step and trains none. The state was deleted before the
    logging, so the rerun trained every step again (a GPU job of up to 12 hours)."""
    work = make_project(tmp_path / "work")
    assert kill_at_fault(dpfm(work, pretrain_args(), fault="published:mean_images_per_s"), work) == "published"
    shutil.rmtree(work / artifact("pretrain"))  # as Snakemake removes a failed job's output
    complete(dpfm(work, pretrain_args()), work)
    assert "resuming at step 6" in log_tail(work) and "no steps run now" in log_tail(work)
    check_same_pretrained(work, pretrained)
    assert not list((work / ".dpfm/state").glob("pretrain-*"))


def test_sigterm_to_pretrain_and_its_decoding_workers_checkpoints_then_resumes_bit_for_bit(tmp_path, pretrained):
    """As SLURM does, the signal reaches the whole process group: the decoding workers keep serving
    the step in flight until the trainer has saved its checkpoint."""
    work = make_project(tmp_path / "work")
    proc = dpfm(work, pretrain_args(), fault="sigterm:2,group")
    assert proc.wait(timeout=300) == 128 + signal.SIGTERM, log_tail(work)
    assert "dpfm: pretrain stopped by SIGTERM after step 3 of 6;" in log_tail(work)
    [state] = (work / ".dpfm/state").glob("pretrain-*")
    assert torch.load(state / "checkpoint.pt", weights_only=False)["step"] == 3
    complete(dpfm(work, pretrain_args()), work)
    assert "resuming at step 3" in log_tail(work)
    check_same_pretrained(work, pretrained)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_decoding_workers_outlive_a_stop_signal_so_the_step_in_flight_can_finish(tmp_path, signum):
    """SLURM's SIGTERM and a Ctrl-C reach the whole process group: the training process decides when to
    stop, and its workers must keep serving the step in flight until then."""
    import psutil

    from pipeline.data.loader import BatchLoader

    write_set(tmp_path / "set", n=40, per_shard=10)
    before = {p.pid for p in psutil.Process().children()}
    batches = BatchLoader(ShardDataset(tmp_path / "set"), 8, workers=2, prefetch=1)(
        [np.arange(i, i + 2) for i in range(0, 40, 2)])
    got = [next(batches)[0]]
    workers = [p for p in psutil.Process().children() if p.pid not in before]
    assert len(workers) == 2
    for worker in workers:  # what the signal to the process group does to them
        worker.send_signal(signum)
    for worker in workers:  # no race with the next fetch: each signal has been acted on (or discarded)
        wait_until_handled(worker, signum)
    got += [indices for indices, _ in batches]
    assert np.array_equal(np.concatenate(got), np.arange(40))


def wait_until_handled(proc, signum: int, timeout: float = 60) -> None:
    """Until `signum` is no longer pending for `proc`: discarded when sent (ignored), delivered, or
    the process is gone. Then what the signal does has happened, whatever the machine's load."""
    bit = 1 << (signum - 1)
    deadline = time.time() + timeout
    while True:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except FileNotFoundError:
            return
        pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd", "ShdPnd"))]
        if not any(p & bit for p in pending):
            return
        assert time.time() < deadline, f"signal {signum} still pending for pid {proc.pid}"
        time.sleep(0.01)


# -- dp-train: kill -9 at every point of a step ----------------------------------------------------

@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    return train(project(data_dir, tmp_path_factory.mktemp("uninterrupted")))


def test_kill_9_mid_step_mid_checkpoint_and_after_an_update_resumes_to_the_uninterrupted_run(
        data_dir, tmp_path, uninterrupted):
    work = project(data_dir, tmp_path)
    # 1. Killed after step 2 was charged, before its update: the charge stays, the update is redone.
    assert kill_at_fault(dpfm(work, ["dp-train"], "charged:2"), work) == "charged"
    charged, ckpt = dp_state(work)
    assert charged == [0, 1, 2] and ckpt["step"] == 2
    # 2. Resumed, then killed half-way through writing the step-4 checkpoint.
    assert kill_at_fault(dpfm(work, ["dp-train"], "saving:1"), work) == "saving"
    charged, ckpt = dp_state(work)
    state = ckpt and next((work / ".dpfm/state").glob("dp-train-*"))
    assert list(state.glob(".checkpoint.pt.*.tmp")), "the kill did not land inside the checkpoint write"
    assert charged == [0, 1, 2, 3] and ckpt["step"] == 2  # the torn write is invisible: step 2 still holds
    # 3. Resumed, then killed after the update of step 4, which no checkpoint holds yet.
    assert kill_at_fault(dpfm(work, ["dp-train"], "updated:2"), work) == "updated"
    charged, ckpt = dp_state(work)
    assert charged == [0, 1, 2, 3, 4] and ckpt["step"] == 4
    assert not list(state.glob(".checkpoint.pt.*.tmp"))  # the torn temp file was reclaimed on resume
    # After every kill the ledger held at least the steps applied (the in-memory step 4 included).
    complete(dpfm(work, ["dp-train"]), work)
    check_same_as_uninterrupted(dp_outcome(work), uninterrupted)


def test_a_full_disk_at_a_charge_names_the_ledger_and_a_rerun_resumes_to_the_uninterrupted_run(
        data_dir, tmp_path, uninterrupted):
    """A full disk is no failure of the private data: the stage says which file it could not append to
    (it said "No space left on device" alone, or sent the user to the owner's log), applies nothing of
    that step, and once there is room a re-run drops the torn half line and charges the step again."""
    work = project(data_dir, tmp_path)
    assert dpfm(work, ["dp-train"], "diskfull:2").wait(timeout=300) == 1
    last = log_tail(work).strip().splitlines()[-1]
    assert last.startswith("dpfm: No space left on device while appending to ") and "ledger.jsonl" in last, last
    assert "data owner" not in log_tail(work)
    [state] = (work / ".dpfm/state").glob("dp-train-*")
    *whole, torn = (state / "ledger.jsonl").read_text().split("\n")
    assert torn and [json.loads(line).get("step") for line in whole[1:]] == [0, 1]  # step 2's half line
    assert torch.load(state / "checkpoint.pt", weights_only=False)["step"] == 2  # nothing of step 2 applied
    complete(dpfm(work, ["dp-train"]), work)
    check_same_as_uninterrupted(dp_outcome(work), uninterrupted)


def test_sigterm_mid_step_finishes_the_step_checkpoints_and_resumes_to_the_uninterrupted_run(
        data_dir, tmp_path, uninterrupted):
    """SLURM's SIGTERM (time limit, preemption) costs no step: the one in flight ends, then a checkpoint."""
    work = project(data_dir, tmp_path)
    proc = dpfm(work, ["dp-train"], "sigterm:2")
    assert proc.wait(timeout=300) == 128 + signal.SIGTERM, log_tail(work)
    charged, ckpt = dp_state(work)
    assert charged == [0, 1, 2] and ckpt["step"] == 3  # checkpoint_every is 2: this one is the signal's
    assert "dpfm: dp-train stopped by SIGTERM after step 3 of 6;" in log_tail(work)
    [stopped] = mlflow_runs(work)
    assert stopped.info.status == "KILLED" and stopped.data.tags["dpfm.stage"] == "dp-train"
    complete(dpfm(work, ["dp-train"]), work)
    assert "resuming at step 3" in log_tail(work)
    check_same_as_uninterrupted(dp_outcome(work), uninterrupted)
    import mlflow  # the resumed run's MLflow curve is the whole run's, as pretrain's is: 0-2 went to the stopped one

    finished = [r for r in mlflow_runs(work) if r.info.status == "FINISHED"]
    client = mlflow.tracking.MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    steps = [sorted(m.step for m in client.get_metric_history(r.info.run_id, "lr")) for r in finished]
    assert steps == [list(range(6))], steps


def test_a_sigterm_in_the_last_step_stops_the_stage_before_its_next_training(data_dir, tmp_path):
    """Told during a training's last step, run_loop ended normally and the signal went with it: the stage's
    next training (here the ε = ∞ twin; the curve's next point, evaluate's next seed) ran on, as if nothing
    had been asked, until SLURM's KILL took its steps since the last checkpoint."""
    work = project(data_dir, tmp_path)
    twin = with_sets("dp-train", ["dp.nonprivate_baseline=true"])
    assert dpfm(work, twin, "sigterm:5").wait(timeout=300) == 128 + signal.SIGTERM, log_tail(work)
    charged, ckpt = dp_state(work)
    assert charged == [0, 1, 2, 3, 4, 5] and ckpt["step"] == 6
    assert "dpfm: dp-train stopped by SIGTERM after step 6 of 6;" in log_tail(work)
    [state] = (work / ".dpfm/state").glob("dp-train-*")
    assert not (state / "nonprivate").exists() and not (work / "models/dp").exists()  # the twin never started
    complete(dpfm(work, twin), work)
    assert "resuming at step 6" in log_tail(work) and (work / "models/dp/nonprivate.pt").is_file()


def test_a_second_sigterm_stops_at_once(data_dir, tmp_path):
    work = project(data_dir, tmp_path)
    proc = dpfm(work, ["dp-train"], "sigterm:2,times:2")
    assert proc.wait(timeout=300) == -signal.SIGTERM, log_tail(work)
    charged, ckpt = dp_state(work)
    assert charged == [0, 1, 2] and ckpt["step"] == 2  # step 2 is charged and will be redone


# One rank told to end; or every rank told twice, as SLURM's --signal delivers it under torchrun (to each
# process of the step, and the agent forwards its own copy), which a second-signal rule took for "stop at
# once": ranks died without their checkpoint.
@pytest.mark.parametrize("told", ["sigterm:2,rank:1", "sigterm:2,times:2"])
def test_sigterm_to_one_torchrun_rank_stops_every_rank_at_the_same_step(data_dir, tmp_path, told):
    work = project(data_dir, tmp_path)
    proc = dpfm_torchrun(work, ["dp-train"], told)
    assert proc.returncode != 0
    assert proc.stderr.count("dp-train stopped by SIGTERM after step 3 of 6;") == 2, proc.stderr[-3000:]
    charged, ckpt = dp_state(work)
    assert charged == [0, 1, 2] and ckpt["step"] == 3


def test_no_rank_leaves_a_stop_before_rank_0_has_saved_its_checkpoint(data_dir, tmp_path):
    """After the agreed stop only rank 0 writes the checkpoint, and the other ranks exited at once. On
    several nodes srun ends the whole step when the first task exits with an error (--kill-on-bad-exit),
    so rank 0 had SLURM's KillWait (30 s) for its save, not torchrun's 4 min. Rank 0's save is held
    here until the test lets it go; rank 1 must still be waiting."""
    work = project(data_dir, tmp_path)
    proc = start_dpfm_torchrun(work, ["dp-train"], "sigterm:2,holdstop")
    deadline = time.time() + 240
    while not (work / "holding").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    time.sleep(3)  # rank 1 agreed on the same stop: it raises at once unless it waits for the save
    left_early = (work / "stopped.1").exists()
    (work / "go").write_text("")
    _, err = proc.communicate(timeout=120)
    assert not left_early, "rank 1 left its stop while rank 0 was still saving"
    assert proc.returncode != 0 and err.count("dp-train stopped by SIGTERM after step 3 of 6;") == 2, err[-3000:]
    assert (work / "stopped.0").exists() and (work / "stopped.1").exists() and dp_state(work)[1]["step"] == 3


@pytest.mark.parametrize("seen", ["unseen", "otherweights"])
@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_ranks_that_would_resume_from_different_states_stop_before_any_step(data_dir, tmp_path, objective, seen):
    """A rank whose node does not see the run's state directory would start at step 0 beside a rank
    resuming at step 3: two batches in one sum (an example sampled in both counted twice against one
    charge) and diverging weights; one that finds another run's state at the same step, other weights.
    Every rank stops before a step, charging nothing; with the state seen again, the run resumes and
    finishes."""
    work, args = project(data_dir, tmp_path), with_sets("dp-train", [f"dp.objective={objective}"])
    stopped = dpfm_torchrun(work, args, "sigterm:2,rank:1")
    assert stopped.returncode != 0 and dp_state(work)[1]["step"] == 3, stopped.stderr[-3000:]
    refused = dpfm_torchrun(work, args, f"{seen}:1")
    assert refused.returncode != 0
    assert refused.stderr.count("the ranks would start from different states") == 2, refused.stderr[-3000:]
    charged, ckpt = dp_state(work)
    assert charged == [0, 1, 2] and ckpt["step"] == 3
    done = dpfm_torchrun(work, args)
    assert done.returncode == 0 and "resuming at step 3" in done.stdout, done.stderr[-3000:]
    assert dp_state(work)[0] == list(range(STEPS))


# A rank that sees other shards, as many (its node holds another build; or the same build, digest and all,
# listed in another order), draws
# its part of a step's sample from another population; one that read another micro-batch (its own copy
# of params.yaml: 16 here, 8 there) cuts its part by another rule, which put 58 of 288 sampled examples
# into both ranks' parts and 78 into neither. Either way one example could count 2C against C. One that
# read another dp.frozen would all-reduce another list of tensors than the other rank's.
RANKS_DISAGREE = {"otherdata:1": "the ranks see different private data",
                  "otherorder:1": "the ranks see different private data",
                  "othersplit:1": "the ranks were launched with other params (rank 1: dp.physical_batch_size=8)",
                  "otherfrozen:1": "the ranks were launched with other params (rank 1: dp.frozen=['encoder.blocks.0'])"}


@pytest.mark.parametrize("fault", list(RANKS_DISAGREE))
@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_ranks_that_would_draw_or_cut_the_sample_differently_stop_before_anything_is_charged(data_dir, tmp_path,
                                                                                           objective, fault):
    """Both ranks stop, each with the line that says why, before the budget is charged or a step taken;
    the same data and params on both, the run trains."""
    work, args = project(data_dir, tmp_path), with_sets("dp-train", [f"dp.objective={objective}"])
    refused = dpfm_torchrun(work, args, fault)
    assert refused.returncode != 0
    assert refused.stderr.count(RANKS_DISAGREE[fault].split(" (rank")[0]) == 2, refused.stderr[-3000:]
    assert RANKS_DISAGREE[fault] in refused.stderr  # the rank that differs names what it read
    assert not (work / "data/budget/runs.jsonl").exists() or not (work / "data/budget/runs.jsonl").read_text()
    done = dpfm_torchrun(work, args)
    assert done.returncode == 0 and dp_state(work)[0] == list(range(STEPS)), done.stderr[-3000:]


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_ranks_that_draw_different_noise_stop_before_the_update(data_dir, tmp_path, objective):
    """A rank whose GPU draws other noise from the same generator (another kind of GPU) would add noise
    of its own to the same sum: both ranks stop at the first step, before its update is applied or
    anything is published; on ranks that draw alike the run resumes at that step, charged once."""
    work, args = project(data_dir, tmp_path), with_sets("dp-train", [f"dp.objective={objective}"])
    refused = dpfm_torchrun(work, args, "othernoise:1")
    assert refused.returncode != 0
    assert refused.stderr.count("the ranks drew different noise for one step") == 2, refused.stderr[-3000:]
    charged, ckpt = dp_state(work)
    assert charged == [0] and ckpt is None and not (work / "models/dp").exists()
    done = dpfm_torchrun(work, args)
    assert done.returncode == 0 and dp_state(work)[0] == list(range(STEPS)), done.stderr[-3000:]


# What fails, the line the stage stops with, and what the failure's own message names: a read names
# what the step sampled (its key, its bytes); an allocator the size it was asked for, and any other
# error a tensor's shape, both of which follow the micro-batch and so the realised batch size.
FAILURES = {"unreadable:3": ("reading the sampled private examples failed (ShardReadError)", (UNREADABLE, "4096")),
            "oom:3": ("out of memory in the DP step", (OOM_MIB,)),
            "mismatch:3": ("the DP step failed (RuntimeError)", (f"tensor a ({MISMATCH_ROWS})",))}


# Every objective at 1 and 2 ranks, and every failure at 1 and 2 ranks: the six pairs, each failure with
# two objectives (the one handler, training.kept_for_owner, wraps every objective's step alike).
FAILURE_CASES = [("unreadable:3", "mae", 1), ("oom:3", "mae", 2), ("mismatch:3", "caption", 1),
                 ("unreadable:3", "caption", 2), ("oom:3", "clip", 1), ("mismatch:3", "clip", 2)]


@pytest.mark.parametrize("fault, objective, ranks", FAILURE_CASES)
def test_a_step_that_fails_on_private_data_names_what_failed_to_the_data_owner_only(data_dir, tmp_path, objective,
                                                                                   ranks, fault):
    """A step that fails on the private data (a read, memory, a tensor's shape) would name private facts:
    printed, its message and traceback would reach logs/dp-train.log. The stage stops with a message
    that says where the details are."""
    work, args = project(data_dir, tmp_path), with_sets("dp-train", [f"dp.objective={objective}"])
    line, named = FAILURES[fault]
    if ranks == 1:
        proc = dpfm(work, args, fault)
        assert proc.wait(timeout=300) == 1
        shown = (work / "dpfm.log").read_text()
    else:
        done = dpfm_torchrun(work, args, fault)
        assert done.returncode != 0
        shown = done.stdout + done.stderr
    assert line in shown, shown[-3000:]
    assert not [n for n in named if n in shown], shown[-3000:]
    kept = work / ".dpfm/owner/dp-train.log"
    assert named[0] in kept.read_text() and kept.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_read_that_fails_in_a_decoding_worker_stops_the_run_and_its_workers(data_dir, tmp_path, ranks):
    """With dp.data_workers the failing read is a worker's: the stage printed its line, then waited for
    ever at exit on workers that ignore the stop signals, holding its lock and its GPU."""
    work, args = project(data_dir, tmp_path), with_sets("dp-train", ["dp.data_workers=2"])
    if ranks == 1:
        proc = dpfm(work, args, "unreadable:3")
        assert proc.wait(timeout=300) == 1  # the wait is the failure's detector: broken, it never returns
        shown = (work / "dpfm.log").read_text()
    else:
        done = dpfm_torchrun(work, args, "unreadable:3")
        assert done.returncode != 0
        shown = done.stdout + done.stderr
    assert FAILURES["unreadable:3"][0] in shown, shown[-3000:]


def test_a_second_dpfm_on_a_running_stage_is_refused_and_a_killed_holder_leaves_no_lock(data_dir, tmp_path):
    """Snakemake's lock does not cover `dpfm <stage>` run by hand beside it; the stage lock does."""
    work = project(data_dir, tmp_path)
    first = dpfm(work, ["dp-train"], "charged:1")
    deadline = time.time() + 120
    while not (work / MARKER).exists():  # the first holds the lock, inside step 1
        assert first.poll() is None and time.time() < deadline, log_tail(work)
        time.sleep(0.05)
    second = subprocess.run([BIN / "dpfm", "dp-train", "--threads", "1"], cwd=work, capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, timeout=120)
    assert second.returncode == 1
    assert second.stderr.strip() == (f"dpfm: dp-train is already running in this directory (pid {first.pid} on "
                                     f"{socket.gethostname()}, .dpfm/locks/dp-train.lock): wait for it to end, or "
                                     "stop it, then re-run")
    assert dp_state(work)[0] == [0, 1]  # the second charged nothing
    kill_at_fault(first, work)
    complete(dpfm(work, ["dp-train"]), work)  # no stale lock after a kill -9
    assert dp_outcome(work)[0]["steps"] == STEPS


def test_the_resume_check_catches_a_ledger_not_written_before_the_update(data_dir, tmp_path, uninterrupted):
    """Against a deliberately broken ledger (records kept in memory), the same kill and resume fail: the
    resumed run's first charge follows no charged step, and it stops before any update."""
    work = project(data_dir, tmp_path)
    kill_at_fault(dpfm(work, ["dp-train"], "lazy-ledger,charged:3"), work)
    charged, ckpt = dp_state(work)
    assert len(charged) < ckpt["step"]  # applied updates that nobody charged
    assert dpfm(work, ["dp-train"], "lazy-ledger").wait(timeout=300) != 0
    assert f"step {ckpt['step']} follows no charged step" in log_tail(work)
    assert dp_state(work)[1]["step"] == ckpt["step"] and not (work / "models/dp").exists()


def test_a_checkpoint_that_outlived_its_ledger_is_refused_before_any_step(data_dir, tmp_path):
    """The ledger deleted (or a partial copy of the state directory) while the checkpoint at step 3 survived:
    the resumed run charged only the steps it redrew and printed ε for 3 of 6 updates."""
    work = project(data_dir, tmp_path)
    proc = dpfm(work, ["dp-train"], "sigterm:2")
    assert proc.wait(timeout=300) == 128 + signal.SIGTERM, log_tail(work)
    [state] = (work / ".dpfm/state").glob("dp-train-*")
    (state / "ledger.jsonl").unlink()
    assert dpfm(work, ["dp-train"]).wait(timeout=300) != 0
    assert "follows no charged step 2" in log_tail(work) and not (work / "models/dp").exists()
    assert json.loads((state / "ledger.jsonl").read_text().splitlines()[-1]).keys() == {"header"}


def test_a_torn_last_ledger_line_is_dropped_and_charged_again(tmp_path):
    """A kill inside the ledger's own append leaves half a line: the ledger still opens, loses no step."""
    path = tmp_path / "ledger.jsonl"
    header = Plan(objective="mae", clipping="per_sample", n=10, sample_rate=0.3, sigma=1.0, clip_norm=1.0, steps=3,
                  delta=1e-3, accountant="pld", adjacency="replace_one", target_epsilon=8.0, epsilon=7.5)
    ledger = Ledger(path, header)
    for step, size in [(0, 3), (1, 4)]:
        ledger.record_step(step, size)
    with open(path, "a") as f:
        f.write('{"batch_size": 5, "st')  # step 2's record, cut mid-write: its update never ran
    ledger = Ledger(path, header)
    assert ledger.steps == 2
    ledger.record_step(2, 5)  # charged again when re-run
    assert Ledger(path, header).to_dict()["batch_sizes"] == [3, 4, 5]
    path.write_text('{"header": {"n"')  # killed while writing the header itself
    assert Ledger(path, header).steps == 0 and json.loads(path.read_text()) == {"header": header.header()}


def test_a_ledger_with_a_step_lost_or_edited_is_refused(tmp_path):
    """Only the last line can be torn by a kill. A step's line gone from the middle (its step was charged:
    counted, the run would record the next and publish one step fewer), edited, moved or garbled is a
    damaged ledger: refused, naming the line and never a batch size."""
    path = tmp_path / "ledger.jsonl"
    plan = Plan(objective="clip", clipping="per_batch", n=10, sample_rate=0.3, sigma=1.0, clip_norm=1.0, steps=9,
                delta=1e-3, accountant="pld", adjacency="replace_one", target_epsilon=8.0, epsilon=7.5)
    ledger = Ledger(path, plan)
    for step, size in enumerate([3, 4, 5, 6, 7]):
        ledger.record_step(step, size)
    good = path.read_text().splitlines(keepends=True)
    damaged = {"a step's line deleted": (good[:3] + good[4:], 4),
               "two steps swapped": (good[:3] + [good[4], good[3]] + good[5:], 4),
               "a step renumbered": (good[:5] + [good[5].replace('"step": 4', '"step": 7')], 6),
               "a line garbled": (good[:2] + ['{"batch_size": 4, "st\n'] + good[3:], 3),
               "a batch size made negative": (good[:2] + [good[2].replace('"batch_size": 4', '"batch_size": -4')]
                                              + good[3:], 3)}
    for what, (lines, number) in damaged.items():
        path.write_text("".join(lines))
        with pytest.raises(LedgerError, match=rf"ledger.jsonl line {number} is not .*damaged or edited") as e:
            Ledger(path, plan)
        assert "batch_size" not in str(e.value) and lines[number - 1].strip() not in str(e.value), what
    path.write_text("".join(good))
    assert Ledger(path, plan).steps == 5


# -- a run resumed where the accountant rounds otherwise: another node, another library build --------

def test_a_ledger_reopened_with_sigma_calibrated_elsewhere_keeps_its_own_and_refuses_another(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the owner's log
    path = tmp_path / "ledger.jsonl"
    plan = Plan(objective="caption", clipping="per_sample", n=10, sample_rate=0.3, sigma=0.6387335711696435,
                clip_norm=1.0, steps=3, delta=1e-3, accountant="pld", adjacency="replace_one", target_epsilon=8.0,
                epsilon=7.991)
    Ledger(path, plan).record_step(0, 3)
    # The same target calibrated on another machine: σ and ε in their last digits (6e-12 measured).
    elsewhere = dataclasses.replace(plan, sigma=0.6387335711734857, epsilon=7.991 * (1 + 1e-11))
    reopened = Ledger(path, elsewhere)
    assert reopened.plan == plan and reopened.steps == 1  # the noise the charged step was drawn with
    assert reopened.public() == {**plan.header(), "steps": 1}
    changed = {"sigma": plan.sigma * (1 + 1e-6), "n": 11, "objective": "mae", "delta": plan.delta / 2, "clip_norm": 2.0,
               "sample_rate": 0.31, "steps": 4, "adjacency": "add_remove", "accountant": "rdp"}
    for field, value in changed.items():
        with pytest.raises(LedgerError, match="different mechanism"):
            Ledger(path, dataclasses.replace(plan, **{field: value}))
    # A step drawn again (after a resume) must draw the batch it was charged for: the sampler is deterministic.
    reopened.record_step(0, 3)
    with pytest.raises(LedgerError, match="step 0 redrew a batch of another size") as refused:
        reopened.record_step(0, 4)
    assert "4" not in str(refused.value).split("(")[0]  # the sizes go to the owner's log only
    assert "step 0 redrew a batch of 4, the ledger has 3" in (tmp_path / ".dpfm/owner/dp-train.log").read_text()


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_a_run_resumed_where_the_accountant_rounds_otherwise_keeps_its_mechanism(data_dir, tmp_path, objective):
    """A preempted job requeued on another node calibrates σ again, and its last digits differ: the run
    resumes with the σ its ledger began with, to the uninterrupted run; a real change is still refused."""
    sets = [f"dp.objective={objective}"]
    (tmp_path / "uninterrupted").mkdir()
    (tmp_path / "resumed").mkdir()
    # The reference runs as the resumed one does (its own process, one thread): an in-process run took the
    # test process's thread count, which other tests change, and CLIP's batch sums rounded otherwise.
    reference = project(data_dir, tmp_path / "uninterrupted")
    complete(dpfm(reference, with_sets("dp-train", sets)), reference)
    uninterrupted = dp_outcome(reference)
    work = project(data_dir, tmp_path / "resumed")
    assert kill_at_fault(dpfm(work, with_sets("dp-train", sets), "charged:2"), work) == "charged"
    changed = dpfm(work, with_sets("dp-train", sets), "accountant:1e-6")  # ε 1e-6 off: σ ~7e-7, another mechanism
    assert changed.wait(timeout=300) != 0 and "written for a different mechanism" in log_tail(work)
    assert dp_state(work)[0] == [0, 1, 2]  # it charged nothing
    complete(dpfm(work, with_sets("dp-train", sets), "accountant:1e-11"), work)
    ledger, _ = dp_outcome(work)
    assert ledger["sigma"] == uninterrupted[0]["sigma"] and ledger["noise_std"] == uninterrupted[0]["noise_std"]
    check_same_as_uninterrupted(dp_outcome(work), uninterrupted)


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_every_rank_adds_the_main_ranks_noise_where_its_own_accountant_rounds_otherwise(data_dir, tmp_path,
                                                                                       objective):
    """Two ranks on nodes whose accountants differ (rank 1's ε off by 1e-3, so its own σ by ~7e-4): both
    add the noise the ledger records, at every step. Rank 0 alone writes the checkpoints and the model."""
    work = project(data_dir, tmp_path)
    proc = dpfm_torchrun(work, with_sets("dp-train", [f"dp.objective={objective}"]),
                         "accountant:1e-3,rank:1,noise-std,moves")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ledger, _ = dp_outcome(work)
    added = [(work / f"noise_std.{rank}").read_text().split() for rank in (0, 1)]
    assert added[0] == added[1] == [repr(ledger["noise_std"])] * STEPS
    moved = (work / "moved.0").read_text().splitlines()
    assert "models/dp" in moved and any(m.endswith("/checkpoint.pt") for m in moved), moved
    assert not (work / "moved.1").exists(), (work / "moved.1").read_text()


def _disagreements(workdir, world):
    """What check_same_params and check_same_data say on this rank, for rank 1 launched otherwise: None where
    the ranks may train together, else the refusal's line."""
    os.chdir(workdir)
    p = sections_of(load_params("params.yaml"), stage("dp-train").sections)
    n = len(ShardDataset(artifact("shards") / "private"))

    def said(check, *args):
        try:
            check(*args, world)
        except RanksDisagree as e:
            return str(e)

    def rank_1(section, key, value):
        return p if world.rank == 0 else {**p, section: {**p[section], key: value}}

    def plan(**other):
        mine = {"n": n, "sample_rate": 0.1, "steps": 6}
        return types.SimpleNamespace(**{**mine, **(other if world.rank == 1 else {})})

    return {"data_workers": said(training.check_same_params, rank_1("dp", "data_workers", 3)),
            "text_width": said(training.check_same_params, rank_1("model", "text_width", 64)),
            "same plan": said(training.check_same_data, plan()),
            "steps": said(training.check_same_data, plan(steps=7)),
            "sample_rate": said(training.check_same_data, plan(sample_rate=0.2))}


def test_ranks_may_run_other_loader_workers_but_no_other_model_or_plan(data_dir, tmp_path):
    """dp.data_workers is per node (each runs its own loaders); a model key (another set of tensors, or
    shapes), another T or q (another mechanism than the one charged) on one rank stops every rank."""
    said = on_two_ranks(tmp_path, _disagreements, str(project(data_dir, tmp_path / "work")))
    assert said["data_workers"] is None and said["same plan"] is None, said
    assert "other params (rank 0: model.text_width=32)" in str(said["text_width"]), said
    assert all("different private data" in str(said[k]) for k in ("steps", "sample_rate")), said
