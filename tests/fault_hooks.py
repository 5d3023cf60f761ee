"""Stage processes under test control: `dpfm()` runs `dpfm` through FAULT_HOOKS below, which can stop
a process at an exact point (after a step is charged, after its update, half-way through a checkpoint
write, after some synthetic shards, while an image is being fetched) so the kill lands there and not
at a random moment, or have SIGTERM reach it inside a step. The hooks live here, in the tests, never
in the pipeline.

Also what the fault tests read back: dp-train's resumable state and finished outcome, the check that
a resumed run equals the uninterrupted one, and the MLflow runs of a project.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from pipeline import checkpoints

BIN = Path(sys.executable).parent
MARKER = "fault.reached"
STEPS = 6  # stage_runs.MICRO: 6 steps, a checkpoint every 2

FAULT_HOOKS = r"""
import os, signal, sys, time
from pathlib import Path

def hang(what):
    marker = Path(os.environ["DPFM_FAULT_MARKER"])
    staged = marker.with_name(f"{marker.name}.{os.getpid()}")
    staged.write_text(what)
    # Renamed into place: the test, polling for the marker, must never read it before it holds `what`.
    os.replace(staged, marker)  # the test kills us now
    while True:
        time.sleep(60)

import torch
import pipeline.privacy.training as dp_train
from pipeline.stages import synthetic as synthetic_stage
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
    import pipeline.stages.pretrain as pretrain
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
if "holdstop" in faults:
    # Rank 0 writes the stop's checkpoint (off the every-2-steps schedule) until the test says it is on
    # disk; every rank leaves a file when it raises Stopped, so the test sees which left before it was.
    import pipeline.train as train_module
    real_train_save, rank = train_module.TrainState.save, os.environ.get("RANK", "0")
    def save(self, checkpointer):
        real_train_save(self, checkpointer)
        if rank == "0" and self.step % 2:
            Path(f"holding.{os.getpid()}").write_text("")
            os.replace(f"holding.{os.getpid()}", "holding")
            while not Path("go").exists():
                time.sleep(0.02)
    train_module.TrainState.save = save
    real_stop = train_module.stop
    def stop(*args, **kw):
        Path(f"stopped.{rank}").write_text("")
        return real_stop(*args, **kw)
    train_module.stop = stop
if "accountant" in faults and os.environ.get("RANK", "0") == faults.get("rank", os.environ.get("RANK", "0")):
    # This process's accountant rounds as another machine's may: every ε it computes is off by the given
    # relative amount (FFTs on another CPU or library build differ by about 1e-11).
    import pipeline.privacy.accounting as accounting
    off = 1 + float(faults["accountant"])
    for name in ("_eps_noise", "_pld_eps_at"):
        setattr(accounting, name, lambda *a, real=getattr(accounting, name), **k: real(*a, **k) * off)
if "noise-std" in faults:  # each rank writes the noise std it adds at every step, for the test to read
    import pipeline.privacy.engine as engine
    real_add_noise = engine.add_noise
    def add_noise(clipper, noise_std, *args):
        with open(f"noise_std.{os.environ.get('RANK', '0')}", "a") as f:
            f.write(f"{noise_std!r}\n")
        return real_add_noise(clipper, noise_std, *args)
    engine.add_noise = add_noise
if "moves" in faults:  # every file and folder this rank moves into place (atomic_path, atomic_dir), listed
    real_replace, rank = os.replace, os.environ.get("RANK", "0")
    def replace(src, dst, *args, **kw):
        with open(f"moved.{rank}", "a") as f:
            f.write(f"{dst}\n")
        return real_replace(src, dst, *args, **kw)
    os.replace = replace
if "diskfull" in faults:  # the disk fills while step k's charge is written: half its line lands
    import errno
    real_write, full_at = os.write, b'"step": %d}' % int(faults["diskfull"])
    def write(fd, data):
        if full_at in data:
            real_write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)
    os.write = write
if "lazy-ledger" in faults:  # BROKEN on purpose: steps kept in memory, not on disk before the update
    real_append = Ledger._append
    Ledger._append = lambda self, rec: real_append(self, rec) if "header" in rec else None
if "shards" in faults:  # exactly k synthetic shards are staged and collected; the others never start
    from concurrent.futures import Future, ProcessPoolExecutor
    real_submit = ProcessPoolExecutor.submit
    def submit(self, fn, *args, **kw):  # args: (staging, shard, cfg, seed)
        if fn is synthetic_stage.build_shard and args[1] >= int(faults["shards"]):
            return Future()  # never scheduled: the workers fall idle after shard k-1
        return real_submit(self, fn, *args, **kw)
    ProcessPoolExecutor.submit = submit
    real_build = synthetic_stage.build_shards
    def build_shards(*args, **kw):
        for i, record in enumerate(real_build(*args, **kw)):
            yield record
            if i + 1 == int(faults["shards"]):
                hang("shards")
    synthetic_stage.build_shards = build_shards

if "published" in faults:  # the stage's output is in place; it fails as it logs the metric named
    import pipeline.tracking as tracking
    real_log_metrics = tracking.StageRun.log_metrics
    def log_metrics(self, metrics, *args, **kw):
        if faults["published"] in metrics:
            hang("published")
        return real_log_metrics(self, metrics, *args, **kw)
    tracking.StageRun.log_metrics = log_metrics

if "unseen" in faults and os.environ.get("RANK", "0") == faults["unseen"]:
    # This rank's node does not see the run's state directory (not on the shared file system): it finds
    # no checkpoint where the other ranks resume from one.
    from pipeline.train import Checkpointer
    Checkpointer.load = lambda self: None
if "otherweights" in faults and os.environ.get("RANK", "0") == faults["otherweights"]:
    # This rank finds a checkpoint at the same step with other weights (another run's state directory
    # under the same name, as a node with its own data/budget/ key could make): one weight is moved.
    from pipeline.train import Checkpointer
    real_load = Checkpointer.load
    def load(self):
        saved = real_load(self)
        if saved is not None:
            first = next(iter(saved["model"]))
            saved["model"][first] = saved["model"][first] + 1e-3
        return saved
    Checkpointer.load = load
if "otherdata" in faults and os.environ.get("RANK", "0") == faults["otherdata"]:
    # This rank's node holds another build of the shards, of as many examples (n, q and T the same): its
    # indices name other examples, so its part of a step's sample is drawn from another population. Its
    # shards' digest is another build's.
    import pipeline.privacy.training as training
    real_artifact = training.artifact
    def artifact(name):
        if name != "shards_digest":
            return real_artifact(name)
        other = Path(f"other-build.{os.environ.get('RANK', '0')}.digest")
        other.write_text("another build of the shards\n")
        return other
    training.artifact = artifact
if "otherorder" in faults and os.environ.get("RANK", "0") == faults["otherorder"]:
    # This rank's node lists the same build of the shards (the same digest file, as many examples) in
    # another order (a stale copy re-indexed, a listing sorted otherwise): its indices name other examples.
    import pipeline.privacy.training as training
    class Reordered(training.ShardDataset):
        def key(self, i):
            return super().key(len(self) - 1 - i if self.directory.name == "private" else i)
    training.ShardDataset = Reordered
if "othernoise" in faults and os.environ.get("RANK", "0") == faults["othernoise"]:
    # This rank's GPU is of another kind: torch's CUDA draws, which follow the multiprocessor count,
    # give it other noise from the same generator (here: the noise of another key at the same step).
    import pipeline.privacy.engine as engine_module
    real_step_noise = engine_module.step_noise
    engine_module.step_noise = lambda key, step, device: real_step_noise(key + 7, step, device)
# This rank's node reads its own copy of params.yaml: with another micro-batch its part of each step's
# sample is cut by another rule than the other rank's; with another dp.frozen it sums other tensors.
OTHER_PARAMS = {"othersplit": "dp.physical_batch_size=8", "otherfrozen": "dp.frozen=[encoder.blocks.0]"}
for other in set(OTHER_PARAMS) & set(faults):
    if os.environ.get("RANK", "0") == faults[other]:
        import pipeline.cli as cli_module
        real_load_params = cli_module.load_params
        cli_module.load_params = lambda path, overrides=(), o=OTHER_PARAMS[other]: real_load_params(path, [*overrides, o])
if "unreadable" in faults:  # the k-th read of sampled private examples fails, naming one of them
    from pipeline.data import loader as data_loader
    from pipeline.data.remote import ShardReadError
    real_getitem, reads = data_loader._Decoded.__getitem__, [0]
    def getitem(self, indices):
        if self.dataset.directory.name == "private":
            reads[0] += 1
            if reads[0] == int(faults["unreadable"]):
                raise ShardReadError(f"cannot read bytes 4096-5120 of p-000001.tar: member {UNREADABLE}{indices[0]}")
        return real_getitem(self, indices)
    data_loader._Decoded.__getitem__ = getitem

# The k-th step fails on every rank inside the DP step, its error naming a size that follows the
# micro-batch: the allocator the size it was asked for (`oom`), a shape error a micro-batch's rows (`mismatch`).
STEP_ERRORS = {"oom": lambda: torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {OOM_MIB} MiB"),
               "mismatch": lambda: RuntimeError(f"The size of tensor a ({MISMATCH_ROWS}) must match the size of "
                                                "tensor b (64) at non-singleton dimension 0")}
failing = [name for name in STEP_ERRORS if name in faults]
if failing:
    import pipeline.privacy.engine as engine
    import torch
    real_add_noise, calls = engine.add_noise, [0]
    def add_noise(*args):
        calls[0] += 1
        if calls[0] == int(faults[failing[0]]):
            raise STEP_ERRORS[failing[0]]()
        return real_add_noise(*args)
    engine.add_noise = add_noise

if "fetching" in faults:  # a download worker is fetching image k; the shard holding it is half written
    from pipeline.data import sources
    real_fetch = sources._fetch_row
    def fetch_row(url, *args):
        if url.endswith(f"/img{faults['fetching']}.png"):
            hang("fetching")
        return real_fetch(url, *args)
    sources._fetch_row = fetch_row

"""
UNREADABLE = "sampled-example-"  # how the `unreadable` fault names the example it could not read
OOM_MIB = "4321.25"  # the size the `oom` fault's allocator was asked for
MISMATCH_ROWS = "37"  # the micro-batch rows the `mismatch` fault's shape error names
RUN_DPFM = (f"UNREADABLE = {UNREADABLE!r}\nOOM_MIB = {OOM_MIB!r}\nMISMATCH_ROWS = {MISMATCH_ROWS!r}\n" + FAULT_HOOKS
            + "from pipeline.cli import main\nsys.exit(main(sys.argv[1:]))\n")


def dpfm(work: Path, args: list[str], fault: str = "") -> subprocess.Popen:
    """Start `dpfm <args>` in `work` (its own session, so a kill reaches its workers too, as a preemption)."""
    env = {**os.environ, "DPFM_FAULT": fault, "DPFM_FAULT_MARKER": str(work / MARKER), "OMP_NUM_THREADS": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    (work / MARKER).unlink(missing_ok=True)
    log = open(work / "dpfm.log", "a")
    return subprocess.Popen([sys.executable, "-c", RUN_DPFM, *args, "--threads", "1"], cwd=work, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_dpfm_torchrun(work: Path, args: list[str], fault: str = "") -> subprocess.Popen:
    """`dpfm <args>` under torchrun with two CPU (gloo) ranks through FAULT_HOOKS, started."""
    (work / "hooks.py").write_text(RUN_DPFM)
    env = {**os.environ, "DPFM_FAULT": fault, "DPFM_FAULT_MARKER": str(work / MARKER), "OMP_NUM_THREADS": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "hooks.py", *args,
           "--threads", "1", "--set", "run.device=cpu"]
    return subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def dpfm_torchrun(work: Path, args: list[str], fault: str = "") -> subprocess.CompletedProcess:
    """`dpfm <args>` under torchrun with two CPU (gloo) ranks through FAULT_HOOKS, run to its end."""
    proc = start_dpfm_torchrun(work, args, fault)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


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


def with_sets(stage: str, sets: list[str]) -> list[str]:
    return [stage, *sum((["--set", s] for s in sets), [])]


# -- reading back what dp-train left --------------------------------------------------------------

def dp_state(work: Path) -> tuple[list[int], dict | None]:
    """(charged steps in the ledger, the last checkpoint) of the run's resumable state."""
    [state] = (work / ".dpfm/state").glob("dp-train-*")
    lines = [json.loads(line) for line in (state / "ledger.jsonl").read_text().splitlines()]
    ckpt = torch.load(state / "checkpoint.pt", weights_only=False) if (state / "checkpoint.pt").exists() else None
    return [rec["step"] for rec in lines[1:]], ckpt


def dp_outcome(work: Path) -> tuple[dict, checkpoints.Checkpoint]:
    """(the published ledger with the run's owner-only batch sizes, the checkpoint) dp-train left."""
    ledger = json.loads((work / "models/dp/ledger.json").read_text())
    owner = json.loads((work / ".dpfm/owner/runs" / f"{ledger['run']}.json").read_text())
    return {**ledger, **owner}, checkpoints.load(work / "models/dp/checkpoint.pt")


def check_same_as_uninterrupted(got: tuple[dict, dict], ref: tuple[dict, dict], steps: int = STEPS) -> None:
    """The privacy check of a resumed run: every applied step charged once, the same batches and model."""
    (ledger, ckpt), (ref_ledger, ref_ckpt) = got, ref
    assert ledger["steps"] == ckpt.steps == steps, "ledger and optimizer disagree on the steps"
    assert ledger["batch_sizes"] == ref_ledger["batch_sizes"], "the resumed run drew other batches"
    for name, value in ref_ckpt.model.items():
        assert torch.equal(value, ckpt.model[name]), f"{name} differs from the uninterrupted run"


def mlflow_runs(work: Path) -> list:
    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    return client.search_runs([client.get_experiment_by_name("dpfm").experiment_id], max_results=100)
