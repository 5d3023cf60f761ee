"""Faults at the Snakemake level: two invocations on one workdir, a `kill -9` of snakemake, the whole
DAG killed -9 mid dp-train as a preemption (then `snakemake --unlock; snakemake` resumes dp-train to
the uninterrupted result), MLflow runs of a dead pipeline marked KILLED (only this workdir's), and a
file system without locks.

Stage processes under the DAG load tests/fault_hooks.py through a sitecustomize shim.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from fault_hooks import (BIN, FAULT_HOOKS, MARKER, check_same_as_uninterrupted, complete, dp_outcome, dp_state, dpfm,
                         mlflow_runs)
from snakemake_project import MICRO, planned_rules, set_params, snakemake_project


# -- Snakemake: two invocations on one workdir, and a kill -9 of the whole run -------------------------------------

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


def test_only_this_workdirs_dead_pipeline_runs_are_marked_killed(local_mlflow):
    """Dead: its Snakemake's process is gone, or it ran on another machine (a requeued job). One still
    running here (disjoint targets run side by side: Snakemake locks files, not the workdir) is left open."""
    from pipeline import tracking

    client = tracking._mlflow("dpfm").tracking.MlflowClient()
    finished = tracking.start_parent("dpfm")
    exp_id = client.get_experiment_by_name("dpfm").experiment_id
    finished_stage = client.create_run(exp_id, tags={"mlflow.parentRunId": finished, "dpfm.stage": "shards"})
    client.set_terminated(finished_stage.info.run_id)  # a parent with no stage under it is deleted, not ended
    tracking.end_parent("dpfm", finished, ok=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tracking.start_parent("dpfm")  # then kill -9: never ended
    client.set_tag(dead, "dpfm.pid", str(gone.pid))
    dead_stage = client.create_run(exp_id, tags={"mlflow.parentRunId": dead, "dpfm.stage": "dp-train"}).info.run_id
    requeued = tracking.start_parent("dpfm")  # on a node the job left
    client.set_tag(requeued, "dpfm.host", "another-node")
    live = tracking.start_parent("dpfm")  # this process: alive
    live_stage = client.create_run(exp_id, tags={"mlflow.parentRunId": live, "dpfm.stage": "synthetic"}).info.run_id
    elsewhere = client.create_run(exp_id, tags={"dpfm.pipeline": "true", "dpfm.workdir": "/another/project"}).info.run_id
    standalone = client.create_run(exp_id, tags={"dpfm.stage": "evaluate"}).info.run_id  # `dpfm evaluate` by hand
    new = tracking.start_parent("dpfm")
    status = {run_id: client.get_run(run_id).info.status for run_id in (finished, dead, dead_stage, requeued, live,
                                                                           live_stage, elsewhere, standalone, new)}
    assert status == {finished: "FINISHED", dead: "KILLED", dead_stage: "KILLED", requeued: "KILLED", live: "RUNNING",
                      live_stage: "RUNNING", elsewhere: "RUNNING", standalone: "RUNNING", new: "RUNNING"}


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


@pytest.mark.e2e
def test_preempted_whole_dag_run_resumes_dp_train_to_the_uninterrupted_result(tmp_path):
    """The whole pipeline killed -9 mid dp-train (after step 2 is charged); then what a user does:
    `snakemake --unlock; snakemake`. Only the killed stage and those after it run; dp-train resumes
    from its checkpoint with the same secret key, and ends where an uninterrupted run ends."""
    work = snakemake_project(tmp_path / "project")
    set_params(work, {**MICRO, "curve": {"epsilons": []}})  # dp-train alone charges steps: the hook's target
    dp_steps = MICRO["dp"]["steps"]
    shim = tmp_path / "shim"  # the fault hooks, loaded into the stage processes the rules start
    shim.mkdir()
    (shim / "fault_hooks.py").write_text(FAULT_HOOKS)
    (shim / "sitecustomize.py").write_text(
        "import os, sys\nif os.environ.get('DPFM_FAULT') and 'pipeline.cli' in sys.orig_argv:\n    import fault_hooks\n")
    pythonpath = os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))  # the rerun's pipeline too
    run = snakemake(work, path=f"{BIN}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=pythonpath,
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
    # The killed stage and those after it (the empty curve runs too if it had not run before the kill).
    assert planned_rules(out) - {"curve"} == {"dp_train", "verify", "evaluate", "report"}
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


def test_a_lock_is_released_when_its_holder_is_done_even_if_a_forked_child_keeps_the_descriptor(tmp_path, monkeypatch):
    """Training forks decoding workers while it holds its run's lock; the lock must end with the run."""
    import multiprocessing

    from pipeline.errors import StageBusy
    from pipeline.locking import exclusive

    monkeypatch.chdir(tmp_path)
    ctx = multiprocessing.get_context("fork")
    done = ctx.Event()
    with exclusive(tmp_path / "run.lock", "busy"):
        child = ctx.Process(target=done.wait)  # holds a copy of the lock's descriptor until told to end
        child.start()
    try:
        with exclusive(tmp_path / "run.lock", "busy"):  # would raise StageBusy while the child's copy held it
            pass
    except StageBusy:
        pytest.fail("the lock outlived its holder's with-block")
    finally:
        done.set()
        child.join(60)


HOLDER_WITH_A_WORKER = """
import os, signal
from pipeline.locking import stage_lock
with stage_lock("shards"):
    worker = os.fork()  # a scan worker, blocked on its queue
    if worker == 0:  # says so once its fork handlers ran (the parent's print raced them under load)
        print(os.getpid(), flush=True)
        signal.pause()
        os._exit(0)
    signal.pause()
"""


def test_a_holder_killed_while_its_forked_worker_lives_leaves_no_lock(tmp_path, monkeypatch):
    """The shards stage's scan pool forks its workers while the stage holds its lock. After a kill -9 of
    the stage the orphaned workers, blocked on their queue, held the lock's open file: the next
    `dpfm shards` was refused as busy for as long as they lived."""
    import sys

    from pipeline.errors import StageBusy
    from pipeline.locking import stage_lock

    root = Path(__file__).resolve().parents[1]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER_WITH_A_WORKER], cwd=tmp_path, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(root)})
    worker = int(holder.stdout.readline())
    holder.kill()
    holder.wait(60)
    monkeypatch.chdir(tmp_path)
    try:
        with stage_lock("shards"):
            pass
    except StageBusy:
        pytest.fail("a forked worker of a killed holder kept the stage's lock")
    finally:
        os.kill(worker, signal.SIGKILL)


WAITER = """
import sys
from pathlib import Path
from pipeline.locking import training_lock
with training_lock(Path("state"), "dp-train-run", wait=True):
    Path("trained").touch()  # what the second training would do to the run's ledger and checkpoint
"""


def blocked_on_a_lock(pid: int) -> bool:
    """Whether process `pid` waits in the kernel for a flock another holds (/proc/locks marks it `->`)."""
    return any(line.split()[1] == "->" and line.split()[5] == str(pid)
               for line in Path("/proc/locks").read_text().splitlines())


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads Linux's /proc/locks")
def test_a_training_that_waits_for_the_lock_starts_only_once_its_holder_is_done(tmp_path, monkeypatch):
    """A second dp-train on one run (the curve's point beside dp-train) waits for the first: it says so,
    then blocks in the kernel on the lock, and trains only after the holder released it."""
    import sys

    from pipeline.locking import training_lock

    monkeypatch.chdir(tmp_path)
    root = Path(__file__).resolve().parents[1]
    with training_lock(Path("state"), "dp-train-run", wait=False):
        waiter = subprocess.Popen([sys.executable, "-c", WAITER], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(root)})
        assert "a training in state is already running" in waiter.stderr.readline()
        deadline = time.monotonic() + 60
        while not blocked_on_a_lock(waiter.pid):
            assert waiter.poll() is None and time.monotonic() < deadline, "the waiter did not wait for the lock"
            time.sleep(0.01)
        assert not (tmp_path / "trained").exists()
    assert waiter.wait(60) == 0 and (tmp_path / "trained").exists()


def test_trainings_of_other_runs_hold_their_own_locks_and_a_released_lock_leaves_forks_their_files(tmp_path,
                                                                                                  monkeypatch):
    """Two runs' trainings never exclude each other (the lock is named for the run); the same run's
    second is refused. Once released, the lock's descriptor number is no longer the lock's: a file
    opened under that number later reaches a forked child whole, not turned into /dev/null."""
    import multiprocessing

    from pipeline import locking
    from pipeline.errors import StageBusy

    monkeypatch.chdir(tmp_path)
    with locking.training_lock(Path("a"), "dp-train-a", wait=False):
        with locking.training_lock(Path("b"), "curve-b", wait=False):
            (held, _) = sorted(locking._HELD)
        with pytest.raises(StageBusy, match="a training in a is already running"):
            with locking.training_lock(Path("a"), "dp-train-a", wait=False):
                pass
    assert not locking._HELD
    (tmp_path / "data").write_text("the shard's bytes")
    fd = os.open(tmp_path / "data", os.O_RDONLY)
    if fd != held:  # the number the released lock had, as the next open usually takes it
        os.dup2(fd, held)
        os.close(fd)
    reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=lambda: writer.send(os.pread(held, 100, 0)))
    child.start()
    try:
        assert reader.poll(60) and reader.recv() == b"the shard's bytes"
    finally:
        child.join(60)
        os.close(held)


def test_a_stage_already_running_in_the_directory_is_refused_at_once(in_tmp, capsys):
    """The stage's own lock, measured directly (a dp-train's second lock, on its run, would only make a
    second one wait): `dpfm shards` while another holds the stage exits 1 saying so, having built nothing."""
    import socket

    from pipeline import cli
    from pipeline.locking import LOCK_DIR, stage_lock

    LOCK_DIR.mkdir(parents=True)  # a dead holder's note, longer than this one's: replaced whole, not overwritten
    (LOCK_DIR / "shards.lock").write_text("pid 4000000 on a-node-of-a-cluster-long-gone.example.org")
    with stage_lock("shards"):
        assert cli.main(["shards"]) == 1
    err = capsys.readouterr().err
    assert "shards is already running in this directory" in err
    assert f"(pid {os.getpid()} on {socket.gethostname()}, {LOCK_DIR / 'shards.lock'})" in err, err
    assert not (in_tmp / "data/shards").exists()


@pytest.mark.parametrize("error, status", [(ValueError("bad input"), "FAILED"),
                                           ("stopped", "KILLED"), (KeyboardInterrupt(), "KILLED")],
                         ids=["error", "stopped", "ctrl-c"])
def test_a_stage_that_fails_or_is_stopped_ends_its_run_failed_or_killed_and_still_raises(local_mlflow, error,
                                                                                        status):
    """A stage's exception must reach `dpfm` (its exit status tells Snakemake the job failed) and its run
    must not show as running forever: FAILED for an error, KILLED for a stop (SIGTERM, Ctrl-C), which
    resumes; and the next stage in the process opens a run of its own, not one nested in the dead one."""
    import types

    import mlflow

    from pipeline import tracking
    from pipeline.errors import Stopped

    error = Stopped(15, "stopped after step 3") if error == "stopped" else error
    stage = types.SimpleNamespace(name="dp-train", input_paths=[], touches_private_data=False)
    with pytest.raises(type(error)):
        with tracking.stage_run(stage, {"run": {"seed": 0}}, "dpfm") as run:
            failed = run.run_id
            raise error
    client = mlflow.tracking.MlflowClient()
    assert client.get_run(failed).info.status == status
    assert mlflow.active_run() is None


def test_a_dead_pipeline_whose_snakemake_belongs_to_another_user_is_left_running(local_mlflow, monkeypatch):
    """Another user's Snakemake on this machine cannot be signalled (EPERM) but is alive: its runs are not
    marked KILLED under it."""
    import socket

    from pipeline import tracking

    client = tracking._mlflow("dpfm").tracking.MlflowClient()
    theirs = tracking.start_parent("dpfm")
    client.set_tag(theirs, "dpfm.host", socket.gethostname())
    client.set_tag(theirs, "dpfm.pid", "4242")

    def not_permitted(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(tracking.os, "kill", not_permitted)
    exp_id = client.get_experiment_by_name("dpfm").experiment_id
    assert tracking.mark_killed_runs(client, exp_id, client.get_run(theirs).data.tags["dpfm.workdir"]) == []
    assert client.get_run(theirs).info.status == "RUNNING"
