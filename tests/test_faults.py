"""Faults: real `kill -9` of real stage processes (and of a whole Snakemake run, as a preemption),
bad images, contradictory params, a full disk and two Snakemake invocations on one workdir. After each, a re-run finishes with what an uninterrupted
run gives, and the privacy ledger never counts fewer steps than were applied.

Stage processes run `dpfm` through FAULT_HOOKS below, which can stop a process at an exact point
(after a step is charged, after its update, half-way through a checkpoint write, after some
synthetic shards) so the kill lands there and not at a random moment. The hooks live here, in the
test, never in the pipeline.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_dp_train import data_dir, project, run_in_process, train  # noqa: F401 (data_dir is a fixture)
from test_shards import excluded, good, index, raw_tar
from test_sources import serve  # noqa: F401 (a fixture)

from pipeline import cli
from pipeline.data import synthetic_stage
from pipeline.data.shards import ShardDataset
from pipeline.data.transforms import decode_image, encode_jpeg
from pipeline.io import atomic_dir, read_json
from pipeline.privacy.ledger import Ledger

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MARKER = "fault.reached"
STEPS = 6  # test_dp_train's MICRO: 6 steps, a checkpoint every 2

FAULT_HOOKS = r"""
import os, signal, sys, time
from pathlib import Path

def hang(what):
    Path(os.environ["DPFM_FAULT_MARKER"]).write_text(what)  # the test kills us now
    while True:
        time.sleep(60)

import torch
import pipeline.dp_train as dp_train
from pipeline.data import synthetic_stage
from pipeline.privacy.ledger import Ledger

faults = dict(f.partition(":")[::2] for f in os.environ.get("DPFM_FAULT", "").split(",") if f)
if "charged" in faults:  # step k is in the ledger (fsynced), its update not yet applied
    real_record = Ledger.record_step
    def record_step(self, step, batch_size):
        real_record(self, step, batch_size)
        if step == int(faults["charged"]):
            hang("charged")
    Ledger.record_step = record_step
if "updated" in faults:  # step k's update is applied, no checkpoint holds it yet
    real_make = dp_train.make_optimizer
    def make_optimizer(*args, **kw):
        opt, seen = real_make(*args, **kw), [0]
        def after(*_):
            seen[0] += 1
            if seen[0] > int(faults["updated"]):
                hang("updated")
        opt.register_step_post_hook(after)
        return opt
    dp_train.make_optimizer = make_optimizer
if "saving" in faults:  # half of the k-th checkpoint of this process is on disk
    real_save, saves = torch.save, [0]
    def save(obj, f, *args, **kw):
        saves[0] += 1
        if saves[0] < int(faults["saving"]):
            return real_save(obj, f, *args, **kw)
        import io
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        f.flush()
        os.fsync(f.fileno())
        hang("saving")
    torch.save = save
if "sigterm" in faults and os.environ.get("RANK", "0") == faults.get("rank", os.environ.get("RANK", "0")):
    # In training step k, before its update, the job is told to end: SIGTERM to this process (once,
    # or twice), or with "group" to its whole process group, as SLURM does.
    import pipeline.pretrain as pretrain
    def told_to_end(module):
        real = module.make_optimizer
        def make_optimizer(*args, **kw):
            opt, seen = real(*args, **kw), [0]
            def before(*_):
                seen[0] += 1
                if seen[0] == int(faults["sigterm"]) + 1:
                    for _ in range(int(faults.get("times", "1"))):
                        os.killpg(0, signal.SIGTERM) if "group" in faults else os.kill(os.getpid(), signal.SIGTERM)
            opt.register_step_pre_hook(before)
            return opt
        module.make_optimizer = make_optimizer
    told_to_end(dp_train)
    told_to_end(pretrain)
if "lazy-ledger" in faults:  # BROKEN on purpose: steps kept in memory, not on disk before the update
    real_append = Ledger._append
    Ledger._append = lambda self, rec: real_append(self, rec) if "header" in rec else None
if "shards" in faults:  # the parent has collected k synthetic shards; the workers go on rendering
    real_build = synthetic_stage.build_shards
    def build_shards(*args, **kw):
        for i, record in enumerate(real_build(*args, **kw)):
            yield record
            if i + 1 == int(faults["shards"]):
                hang("shards")
    synthetic_stage.build_shards = build_shards

if "fetching" in faults:  # a download worker is fetching image k; the shard holding it is half written
    from pipeline.data import sources
    real_fetch = sources._fetch_row
    def fetch_row(url, *args):
        if url.endswith(f"/img{faults['fetching']}.png"):
            hang("fetching")
        return real_fetch(url, *args)
    sources._fetch_row = fetch_row

from pipeline.cli import main
sys.exit(main(sys.argv[1:]))
"""


def dpfm(work: Path, args: list[str], fault: str = "") -> subprocess.Popen:
    """Start `dpfm <args>` in `work` (its own session, so a kill reaches its workers too, as a preemption)."""
    env = {**os.environ, "DPFM_FAULT": fault, "DPFM_FAULT_MARKER": str(work / MARKER), "OMP_NUM_THREADS": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    (work / MARKER).unlink(missing_ok=True)
    log = open(work / "dpfm.log", "a")
    return subprocess.Popen([sys.executable, "-c", FAULT_HOOKS, *args, "--threads", "1"], cwd=work, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill_at_fault(proc: subprocess.Popen, work: Path, timeout: float = 120) -> str:
    """Wait until the process reaches its fault point, then SIGKILL its whole process group."""
    deadline = time.time() + timeout
    while not (work / MARKER).exists():
        assert proc.poll() is None, f"exited ({proc.returncode}) before its fault point:\n{log_tail(work)}"
        assert time.time() < deadline, "fault point not reached in time"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    return (work / MARKER).read_text()


def complete(proc: subprocess.Popen, work: Path) -> None:
    assert proc.wait(timeout=300) == 0, log_tail(work)


def log_tail(work: Path) -> str:
    return (work / "dpfm.log").read_text()[-3000:]


def bare_project(work: Path) -> Path:
    """A project folder with the default params and their schema (stages run with `--set` overrides)."""
    shutil.copytree(ROOT / "schemas", work / "schemas")
    shutil.copy(ROOT / "params.yaml", work / "params.yaml")
    return work


def with_sets(stage: str, sets: list[str]) -> list[str]:
    return [stage, *sum((["--set", s] for s in sets), [])]


# -- shards: kill -9 in the middle of a download -----------------------------------------------------

def test_kill_9_during_a_download_resumes_without_fetching_finished_shards_again(tmp_path, serve):
    rng = np.random.default_rng(0)
    (tmp_path / "www").mkdir()
    for i in range(12):
        picture = Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8))
        (tmp_path / "www" / f"img{i}.png").write_bytes(encoded(picture, "PNG"))
    server = serve(tmp_path / "www")
    table = tmp_path / "pairs.csv"
    table.write_text("url,caption\n" + "".join(f"{server.url}/img{i}.png,picture {i}\n" for i in range(12)))
    args = with_sets("shards", ["shards.source=download", f"shards.path={table}", "shards.image_size=16",
                                "shards.samples_per_shard=4", "shards.eval_fraction=0.25", "shards.workers=1",
                                "shards.download.threads=2"])
    ref, work = bare_project(tmp_path / "ref"), bare_project(tmp_path / "work")
    complete(dpfm(ref, args), ref)

    before = server.requests.copy()
    assert kill_at_fault(dpfm(work, args, "fetching:6"), work) == "fetching"  # row 6 is in shard 1 (rows 4-7)
    cache = work / "data/cache/download"
    assert sorted(p.name for p in cache.glob("pairs-*")) == ["pairs-000000.json", "pairs-000000.tar"]
    assert list(cache.glob(".pairs-000001.tar.*.tmp")), "the kill did not land inside shard 1's write"
    assert not (work / "data/shards").exists()
    killed_run = server.requests - before
    complete(dpfm(work, args), work)
    resumed_run = server.requests - before - killed_run
    assert all(resumed_run[f"/img{i}.png"] == 0 for i in range(4)), "a finished shard was downloaded again"
    assert all(resumed_run[f"/img{i}.png"] == 1 for i in range(4, 12))
    assert not list(cache.glob(".*.tmp"))  # the torn shard was reclaimed

    # The same shard bytes, dataset and stats as the uninterrupted run (but for the reuse count).
    for tar in (ref / "data/cache/download").glob("*.tar"):
        assert (cache / tar.name).read_bytes() == tar.read_bytes(), tar.name
    stats, ref_stats = (read_json(d / "data/shards/stats.json") for d in (work, ref))
    assert (stats["download"].pop("reused_shards"), ref_stats["download"].pop("reused_shards")) == (1, 0)
    assert stats == ref_stats and stats["private"]["usable"] + stats["eval"]["usable"] == 12
    for split in ("private", "eval"):
        got, expected = (ShardDataset(d / "data/shards" / split) for d in (work, ref))
        assert got.index["key"] == expected.index["key"]
        for i in range(len(got)):
            assert got.caption(i) == expected.caption(i) and np.array_equal(got.image(i), expected.image(i))


# -- pretrain: kill -9 while a checkpoint is half written ------------------------------------------

def pretrain_args() -> list[str]:
    from test_pretrain import MICRO_MODEL, SHORT

    sets = [f"model.{k}={json.dumps(v)}" for k, v in MICRO_MODEL.items()]
    sets += [f"pretrain.{k}={json.dumps(v)}" for k, v in SHORT.items()] + ["run.device=cpu", "pretrain.data_workers=2"]
    return with_sets("pretrain", sets)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict:
    """The uninterrupted pretraining run's weights."""
    from test_pretrain import make_project, saved

    ref = make_project(tmp_path_factory.mktemp("pretrain-ref"))
    complete(dpfm(ref, pretrain_args()), ref)
    return saved(ref)["model"]


def check_same_pretrained(work: Path, expected: dict) -> None:
    from test_pretrain import saved

    for name, value in expected.items():
        assert torch.equal(value, saved(work)["model"][name]), name


def test_kill_9_of_pretrain_mid_checkpoint_resumes_bit_for_bit(tmp_path, pretrained):
    from test_pretrain import make_project

    work = make_project(tmp_path / "work")
    assert kill_at_fault(dpfm(work, pretrain_args(), fault="saving:2"), work) == "saving"  # 2nd checkpoint half on disk
    [state] = (work / ".dpfm/state").glob("pretrain-*")
    assert torch.load(state / "checkpoint.pt", weights_only=False)["step"] == 2  # the first one is intact
    complete(dpfm(work, pretrain_args()), work)
    assert "resuming at step 2" in log_tail(work)
    check_same_pretrained(work, pretrained)


def test_sigterm_to_pretrain_and_its_decoding_workers_checkpoints_then_resumes_bit_for_bit(tmp_path, pretrained):
    """As SLURM does, the signal reaches the whole process group: the decoding workers keep serving
    the step in flight until the trainer has saved its checkpoint."""
    from test_pretrain import make_project

    work = make_project(tmp_path / "work")
    proc = dpfm(work, pretrain_args(), fault="sigterm:2,group")
    assert proc.wait(timeout=300) == 128 + signal.SIGTERM, log_tail(work)
    assert "dpfm: pretrain stopped by SIGTERM after step 3 of 6;" in log_tail(work)
    [state] = (work / ".dpfm/state").glob("pretrain-*")
    assert torch.load(state / "checkpoint.pt", weights_only=False)["step"] == 3
    complete(dpfm(work, pretrain_args()), work)
    assert "resuming at step 3" in log_tail(work)
    check_same_pretrained(work, pretrained)


def test_decoding_workers_outlive_a_sigterm_so_the_step_in_flight_can_finish(tmp_path):
    import psutil
    from test_sources import write_set

    from pipeline.data.loader import BatchLoader

    write_set(tmp_path / "set", n=40, per_shard=10)
    before = {p.pid for p in psutil.Process().children()}
    batches = BatchLoader(ShardDataset(tmp_path / "set"), 8, workers=2, prefetch=1)(
        [np.arange(i, i + 2) for i in range(0, 40, 2)])
    got = [next(batches)[0]]
    workers = [p for p in psutil.Process().children() if p.pid not in before]
    assert len(workers) == 2
    for worker in workers:  # what SLURM's SIGTERM to the process group does to them
        worker.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    got += [indices for indices, _ in batches]
    assert np.array_equal(np.concatenate(got), np.arange(40))


# -- dp-train: kill -9 at every point of a step ----------------------------------------------------

def dp_state(work: Path) -> tuple[list[int], dict | None]:
    """(charged steps in the ledger, the last checkpoint) of the run's resumable state."""
    [state] = (work / ".dpfm/state").glob("dp-train-*")
    lines = [json.loads(line) for line in (state / "ledger.jsonl").read_text().splitlines()]
    ckpt = torch.load(state / "checkpoint.pt", weights_only=False) if (state / "checkpoint.pt").exists() else None
    return [rec["step"] for rec in lines[1:]], ckpt


def dp_outcome(work: Path) -> tuple[dict, dict]:
    ledger = json.loads((work / "models/dp/ledger.json").read_text())
    return ledger, torch.load(work / "models/dp/checkpoint.pt", weights_only=False)


def check_same_as_uninterrupted(got: tuple[dict, dict], ref: tuple[dict, dict], steps: int = STEPS) -> None:
    """The privacy check of a resumed run: every applied step charged once, the same batches and model."""
    (ledger, ckpt), (ref_ledger, ref_ckpt) = got, ref
    assert ledger["steps"] == ckpt["optimizer_steps"] == steps, "ledger and optimizer disagree on the steps"
    assert ledger["batch_sizes"] == ref_ledger["batch_sizes"], "the resumed run drew other batches"
    for name, value in ref_ckpt["model"].items():
        assert torch.equal(value, ckpt["model"][name]), f"{name} differs from the uninterrupted run"


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):  # noqa: F811
    return train(project(data_dir, tmp_path_factory.mktemp("uninterrupted")))


def test_kill_9_mid_step_mid_checkpoint_and_after_an_update_resumes_to_the_uninterrupted_run(
        data_dir, tmp_path, uninterrupted):  # noqa: F811
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


def test_sigterm_mid_step_finishes_the_step_checkpoints_and_resumes_to_the_uninterrupted_run(
        data_dir, tmp_path, uninterrupted):  # noqa: F811
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


def test_a_second_sigterm_stops_at_once(data_dir, tmp_path):  # noqa: F811
    work = project(data_dir, tmp_path)
    proc = dpfm(work, ["dp-train"], "sigterm:2,times:2")
    assert proc.wait(timeout=300) == -signal.SIGTERM, log_tail(work)
    charged, ckpt = dp_state(work)
    assert charged == [0, 1, 2] and ckpt["step"] == 2  # step 2 is charged and will be redone


def test_sigterm_to_one_torchrun_rank_stops_every_rank_at_the_same_step(data_dir, tmp_path):  # noqa: F811
    work = project(data_dir, tmp_path)
    (work / "hooks.py").write_text(FAULT_HOOKS)
    env = {**os.environ, "DPFM_FAULT": "sigterm:2,rank:1", "DPFM_FAULT_MARKER": str(work / MARKER),
           "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "hooks.py",
           "dp-train", "--threads", "1", "--set", "run.device=cpu"]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.count("dp-train stopped by SIGTERM after step 3 of 6;") == 2, proc.stderr[-3000:]
    charged, ckpt = dp_state(work)
    assert charged == [0, 1, 2] and ckpt["step"] == 3


def test_a_second_dpfm_on_a_running_stage_is_refused_and_a_killed_holder_leaves_no_lock(data_dir, tmp_path):  # noqa: F811
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


def test_the_resume_check_catches_a_ledger_not_written_before_the_update(data_dir, tmp_path, uninterrupted):  # noqa: F811
    """Against a deliberately broken ledger (records kept in memory), the same kill and check fail."""
    work = project(data_dir, tmp_path)
    kill_at_fault(dpfm(work, ["dp-train"], "lazy-ledger,charged:3"), work)
    charged, ckpt = dp_state(work)
    assert len(charged) < ckpt["step"]  # applied updates that nobody charged
    complete(dpfm(work, ["dp-train"], "lazy-ledger"), work)
    with pytest.raises(AssertionError, match="ledger and optimizer disagree"):
        check_same_as_uninterrupted(dp_outcome(work), uninterrupted)


def test_a_torn_last_ledger_line_is_dropped_and_charged_again(tmp_path):
    """A kill inside the ledger's own append leaves half a line: the ledger still opens, loses no step."""
    path, header = tmp_path / "ledger.jsonl", {"n": 10, "sigma": 1.0}
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
    assert Ledger(path, header).steps == 0 and json.loads(path.read_text()) == {"header": header}


# -- dp-train: contradictory params and a full disk --------------------------------------------------

@pytest.fixture
def no_tracking(monkeypatch):
    """In-process `dpfm` calls without an MLflow store (these tests are about the stage, not tracking)."""
    from contextlib import contextmanager

    from pipeline.tracking import NullRun

    monkeypatch.setattr("pipeline.tracking.stage_run", contextmanager(lambda *a, **kw: (yield NullRun())))


@pytest.mark.parametrize("override, message", [
    ("dp.epsilon=0.000001", "unreachable"),
    ("dp.delta=0.01", ">= 1/n"),
    ("dp.expected_batch_size=5000", "exceeds the 1258 usable private examples"),
    ("dp.sigma=0.1", "above the target dp.epsilon=8.0"),
])
def test_contradictory_dp_params_stop_dpfm_before_any_work(data_dir, tmp_path, monkeypatch, capsys, no_tracking,
                                                          override, message):  # noqa: F811
    work = project(data_dir, tmp_path)
    monkeypatch.chdir(work)
    decoded = []
    monkeypatch.setattr("pipeline.dp_train.load_split", lambda *a: decoded.append(a))
    assert cli.main(["dp-train", "--set", override, "--set", "dp.noise_seed=null"]) == 2
    err = capsys.readouterr().err
    assert "dpfm: dp params (n=1258 usable private examples) is invalid:\n  - " in err and message in err
    assert "Traceback" not in err and not decoded  # no image decoded
    assert not (work / "models/dp").exists() and not (work / ".dpfm/state").exists()  # no state, no secret key


def test_disk_full_during_a_checkpoint_write_keeps_the_previous_one_and_says_so(data_dir, tmp_path, monkeypatch,
                                                                                capsys, no_tracking):  # noqa: F811
    work = project(data_dir, tmp_path)
    monkeypatch.chdir(work)
    real_save, saves = torch.save, []

    def full_disk(obj, f, *args, **kw):  # the second checkpoint meets a full disk half-way
        saves.append(1)
        if len(saves) == 2:
            f.write(b"\0" * 1000)
            with open("/dev/full", "wb") as full:  # a real ENOSPC from the kernel
                real_save(obj, full)
        return real_save(obj, f, *args, **kw)

    monkeypatch.setattr(torch, "save", full_disk)
    assert cli.main(["dp-train"]) == 1
    last_line = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    [state] = (work / ".dpfm/state").glob("dp-train-*")
    assert last_line == (f"dpfm: No space left on device while writing {state.relative_to(work)}/checkpoint.pt; "
                         "any previous checkpoint.pt is intact: free space and re-run")
    assert torch.load(state / "checkpoint.pt", weights_only=False)["step"] == 2
    assert sorted(p.name for p in state.iterdir()) == ["checkpoint.pt", "ledger.jsonl"]  # no temp file left


def test_a_full_disk_under_plain_torch_save_would_be_unreadable():
    """Why Checkpointer writes through a file object: torch.save(path) hides ENOSPC."""
    with pytest.raises(RuntimeError, match="unexpected pos"):
        torch.save({"x": torch.zeros(1000)}, "/dev/full")
    with pytest.raises(OSError) as e, open("/dev/full", "wb") as f:
        torch.save({"x": torch.zeros(1000)}, f)
    assert e.value.errno == errno.ENOSPC


# -- synthetic: kill -9 of the parent and its worker processes -------------------------------------------

def test_kill_9_during_synthetic_generation_resumes_to_the_same_bytes(tmp_path):
    sets = ["synthetic.num_programs=24", "synthetic.frames_per_program=2", "synthetic.resolution=16",
            "synthetic.samples_per_shard=4", "synthetic.workers=2"]
    ref, work = bare_project(tmp_path / "ref"), bare_project(tmp_path / "killed")
    cwd = os.getcwd()
    os.chdir(ref)
    try:
        run_in_process("synthetic", sets[:-1] + ["synthetic.workers=1"])
    finally:
        os.chdir(cwd)
    args = with_sets("synthetic", sets)
    kill_at_fault(dpfm(work, args, "shards:3"), work)
    [staging] = (work / ".dpfm/state").glob("synthetic-*")
    assert 3 <= len(list(staging.glob("*.json"))) < 12 and not (work / "data/synthetic").exists()
    complete(dpfm(work, args), work)
    assert "resuming" in log_tail(work)
    out, expected = work / synthetic_stage.OUT_DIR, ref / synthetic_stage.OUT_DIR
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in expected.iterdir())
    for p in expected.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name


# -- any stage output: the temporary copy a killed writer leaves is reclaimed --------------------------

def test_the_next_write_reclaims_what_a_killed_writer_left(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", (
        "import os, time\n"
        "from pipeline.io import atomic_dir\n"
        "with atomic_dir('shards') as out:\n"
        "    (out / 'private.tar').write_bytes(os.urandom(4096))\n"
        "    open('fault.reached', 'w').close()\n"
        "    time.sleep(600)\n")], cwd=tmp_path, start_new_session=True)
    kill_at_fault(writer, tmp_path)
    [stale] = tmp_path.glob(".shards.*.tmp")  # kill -9 skips atomic_dir's clean-up
    unrelated = tmp_path / ".synthetic.x1y2z3.tmp"
    unrelated.mkdir()
    with atomic_dir(tmp_path / "shards") as out:
        (out / "private.tar").write_text("whole")
    assert not stale.exists() and unrelated.exists()
    assert [p.name for p in (tmp_path / "shards").iterdir()] == ["private.tar"]


# -- bad images: every mode decodes to the same RGB, bombs and empty files are excluded and counted -----------

def encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def test_grey_rgba_cmyk_and_16_bit_images_decode_to_what_they_show():
    grey = np.arange(64, dtype=np.uint8).reshape(8, 8) * 4
    as_rgb = np.repeat(grey[..., None], 3, axis=-1)
    assert np.array_equal(decode_image(encoded(Image.fromarray(grey), "PNG")), as_rgb)
    rgba = Image.fromarray(as_rgb).convert("RGBA")
    assert np.array_equal(decode_image(encoded(rgba, "PNG")), as_rgb)
    # 16-bit grey: scaled to 8 bits, not clipped (convert("RGB") alone turns everything above 255 white).
    assert np.array_equal(decode_image(encoded(Image.fromarray(grey.astype(np.uint16) * 257), "PNG")), as_rgb)
    cmyk = decode_image(encoded(Image.fromarray(as_rgb).convert("CMYK"), "JPEG"))
    assert cmyk.shape == (8, 8, 3) and np.abs(cmyk.astype(int) - as_rgb).max() < 40


def test_image_modes_are_kept_and_bombs_and_empty_files_counted(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    picture = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow refuses above 2x this: a 64x64 image is a bomb
    members = (good("a", rng)
               + [("b.png", encoded(Image.fromarray(picture[..., 0]), "PNG")), ("b.txt", b"grey")]
               + [("c.png", encoded(Image.fromarray(picture).convert("RGBA"), "PNG")), ("c.txt", b"rgba")]
               + [("d.png", encoded(Image.fromarray(picture[..., 0].astype(np.uint16) * 257), "PNG")),
                  ("d.txt", b"16 bit")]
               + [("e.jpg", encoded(Image.fromarray(picture).convert("CMYK"), "JPEG")), ("e.txt", b"cmyk")]
               + [("f.png", encoded(Image.new("L", (64, 64)), "PNG")), ("f.txt", b"a bomb")]
               + [("g.jpg", b""), ("g.txt", b"zero bytes")]
               + [("h.jpg", encode_jpeg(picture)), ("h.txt", b"")])
    raw_tar(tmp_path / "modes.tar", members)
    stats, ds = index([tmp_path / "modes.tar"], tmp_path)
    assert ds.index["key"] == ["a", "b", "c", "d", "e"]
    assert excluded(stats) == {"corrupt_image": 2, "missing_caption": 1}
    assert stats["private"]["rows"] == 8


# -- Snakemake: two invocations on one workdir, and a kill -9 of the whole run -------------------------------------

def snakemake_project(work: Path) -> Path:
    work.mkdir(exist_ok=True)
    for item in ("Snakefile", "rules", "schemas", "envs", "profiles", "params.yaml"):
        (shutil.copytree if (ROOT / item).is_dir() else shutil.copy)(ROOT / item, work / item)
    return work


def snakemake(work: Path, *args: str, path: str = f"{BIN}{os.pathsep}{os.environ['PATH']}", **env) -> subprocess.Popen:
    env = {**os.environ, "PATH": path, **env}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.Popen([str(BIN / "snakemake"), "--cores", "1", *args], cwd=work, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.1)


@pytest.mark.e2e
def test_a_second_snakemake_on_the_same_workdir_is_locked_out(tmp_path):
    work = snakemake_project(tmp_path)
    first = snakemake(work, "models/tokenizer")
    wait_for(lambda: (work / "logs/tokenizer.log").exists(), first)  # the first is inside a job
    second = snakemake(work, "models/tokenizer")
    out2 = second.communicate(timeout=120)[0]
    out1 = first.communicate(timeout=300)[0]
    assert second.returncode != 0 and "cannot be locked" in out2, out2[-3000:]
    assert first.returncode == 0, out1[-3000:]
    assert (work / "models/tokenizer/spm.model").is_file()
    # The locked-out run opened no MLflow run (so it could not mark the live one killed).
    [parent] = [r for r in mlflow_runs(work) if r.data.tags.get("dpfm.pipeline") == "true"]
    assert parent.info.status == "FINISHED"


@pytest.fixture
def local_mlflow(tmp_path, monkeypatch):
    """The default SQLite store in tmp_path; mlflow's process-wide URI is reset for the next tests."""
    import mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield
    mlflow.set_tracking_uri(None)  # tracking._mlflow set it for the whole process (and its environment)


def test_only_this_workdirs_dead_pipeline_runs_are_marked_killed(local_mlflow):
    from pipeline import tracking

    finished = tracking.start_parent("dpfm")
    tracking.end_parent("dpfm", finished, ok=True)
    dead = tracking.start_parent("dpfm")  # then kill -9: never ended
    client = tracking._mlflow("dpfm").tracking.MlflowClient()
    exp_id = client.get_experiment_by_name("dpfm").experiment_id
    dead_stage = client.create_run(exp_id, tags={"mlflow.parentRunId": dead, "dpfm.stage": "dp-train"}).info.run_id
    elsewhere = client.create_run(exp_id, tags={"dpfm.pipeline": "true", "dpfm.workdir": "/another/project"}).info.run_id
    standalone = client.create_run(exp_id, tags={"dpfm.stage": "evaluate"}).info.run_id  # `dpfm evaluate` by hand
    new = tracking.start_parent("dpfm")
    status = {run_id: client.get_run(run_id).info.status for run_id in (finished, dead, dead_stage, elsewhere,
                                                                           standalone, new)}
    assert status == {finished: "FINISHED", dead: "KILLED", dead_stage: "KILLED", elsewhere: "RUNNING",
                      standalone: "RUNNING", new: "RUNNING"}


@pytest.mark.e2e
def test_after_kill_9_of_snakemake_unlock_and_rerun_completes(tmp_path):
    work = snakemake_project(tmp_path)
    run = snakemake(work, "models/tokenizer")
    wait_for(lambda: (work / "logs/tokenizer.log").exists(), run)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait(timeout=30)
    rerun = snakemake(work, "models/tokenizer")
    out = rerun.communicate(timeout=120)[0]
    assert rerun.returncode != 0 and "--unlock" in out  # the dead run's lock stays until removed
    assert snakemake(work, "--unlock").wait(timeout=120) == 0
    rerun = snakemake(work, "models/tokenizer")
    out = rerun.communicate(timeout=300)[0]
    assert rerun.returncode == 0, out[-3000:]
    assert (work / "models/tokenizer/spm.model").is_file()


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and every descendant at once, as a preempted SLURM job's cgroup is killed."""
    import psutil

    root = psutil.Process(proc.pid)
    family = [root, *root.children(recursive=True)]
    for p in family:
        p.kill()
    psutil.wait_procs(family, timeout=30)
    proc.wait(timeout=30)


def mlflow_runs(work: Path) -> list:
    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    return client.search_runs([client.get_experiment_by_name("dpfm").experiment_id], max_results=100)


@pytest.mark.e2e
def test_preempted_whole_dag_run_resumes_dp_train_to_the_uninterrupted_result(tmp_path):
    """The whole pipeline killed -9 mid dp-train (after step 2 is charged); then what a user does:
    `snakemake --unlock; snakemake`. Only the killed stage and those after it run; dp-train resumes
    from its checkpoint with the same secret key, and ends where an uninterrupted run ends."""
    from test_e2e import MICRO, planned_rules, set_params

    work = snakemake_project(tmp_path / "project")
    set_params(work, MICRO)
    dp_steps = MICRO["dp"]["steps"]
    shim = tmp_path / "shim"  # `dpfm` as the rules call it, with the fault hooks loaded
    shim.mkdir()
    (shim / "hooks.py").write_text(FAULT_HOOKS)
    (shim / "dpfm").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{shim / "hooks.py"}" "$@"\n')
    (shim / "dpfm").chmod(0o755)
    run = snakemake(work, path=f"{shim}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
                    DPFM_FAULT="charged:2", DPFM_FAULT_MARKER=str(work / MARKER))
    wait_for(lambda: (work / MARKER).exists(), run, timeout=400)
    kill_tree(run)
    charged, ckpt = dp_state(work)
    assert charged == [0, 1, 2] and ckpt["step"] == 2 and not (work / "models/dp/ledger.json").exists()
    [killed_parent] = [r for r in mlflow_runs(work) if r.data.tags.get("dpfm.pipeline") == "true"]
    assert killed_parent.info.status == "RUNNING"  # nobody was left alive to end it

    out = snakemake(work).communicate(timeout=120)[0]
    assert "--unlock" in out, out[-3000:]
    assert snakemake(work, "--unlock").wait(timeout=120) == 0
    rerun = snakemake(work)
    out = rerun.communicate(timeout=600)[0]
    assert rerun.returncode == 0, out[-3000:]
    assert planned_rules(out) == {"dp_train", "verify", "evaluate", "report"}
    assert "resuming at step 2" in (work / "logs/dp-train.log").read_text()
    assert json.loads((work / "results/privacy/verification.json").read_text())["passed"]
    runs = {r.info.run_id: r for r in mlflow_runs(work)}
    assert runs[killed_parent.info.run_id].info.status == "KILLED"
    killed_children = [r for r in runs.values() if r.data.tags.get("mlflow.parentRunId") == killed_parent.info.run_id]
    assert {r.data.tags["dpfm.stage"]: r.info.status for r in killed_children}["dp-train"] == "KILLED"
    assert not [r for r in runs.values() if r.info.status == "RUNNING"]

    # The uninterrupted reference: dp-train again from a fresh state holding only the same secret key.
    [state] = (work / ".dpfm/state").glob("dp-train-*")
    state.rename(tmp_path / "resumed-state")
    state.mkdir()
    shutil.copy(tmp_path / "resumed-state/secret.key", state / "secret.key")
    resumed = dp_outcome(work)
    shutil.rmtree(work / "models/dp")
    complete(dpfm(work, ["dp-train"]), work)
    check_same_as_uninterrupted(resumed, dp_outcome(work), steps=dp_steps)


def test_a_file_system_without_locks_warns_and_runs(tmp_path, monkeypatch, capsys):
    import fcntl

    from pipeline.locking import stage_lock

    def unsupported(*args):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fcntl, "flock", unsupported)
    ran = []
    with stage_lock("dp-train"):
        ran.append(1)
    assert ran and "WARNING cannot lock .dpfm/locks/dp-train.lock (Function not implemented)" in capsys.readouterr().err
