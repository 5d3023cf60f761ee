"""Scale path: the launcher the training rules call, the SLURM profile's jobs, and MLflow through a server.

There is no SLURM here: Snakemake's dry run resolves each job's resources from profiles/slurm, and the
SLURM plugin's own functions turn them into the sbatch command it would submit.
"""

import os
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import tomllib
import urllib.request
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
from snakemake_project import set_params

from pipeline import launch

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PY = (BIN / "snakemake").read_text().splitlines()[0][2:]  # the interpreter the rules call stages with
PROFILE_ENV = ("DPFM_SLURM_ACCOUNT", "DPFM_SLURM_PARTITION", "DPFM_SLURM_GPU_PARTITION", "DPFM_GPU_MODEL",
               "DPFM_GPUS_PER_NODE", "DPFM_NODES")
PLACEHOLDERS = {"DPFM_SLURM_ACCOUNT": "acct-placeholder", "DPFM_SLURM_PARTITION": "cpu-placeholder",
                "DPFM_SLURM_GPU_PARTITION": "gpu-placeholder", "DPFM_GPU_MODEL": "h100"}
STAGE = ["dpfm", "dp-train", "--threads", "8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in PROFILE_ENV and k != "MLFLOW_TRACKING_URI"}
    return {**env, "PATH": f"{BIN}{os.pathsep}{env['PATH']}", **extra}


# ---- the launcher ------------------------------------------------------------------------------------

def test_one_process_runs_the_stage_as_it_is():
    assert launch.launch_command(STAGE, nodes=1, gpus=0) == STAGE
    assert launch.launch_command(STAGE, nodes=1, gpus=1) == STAGE


def test_one_node_starts_torchrun_standalone_with_a_process_per_gpu():
    assert launch.launch_command(STAGE, nodes=1, gpus=8) == [
        *launch.TORCHRUN, "--standalone", "--nproc_per_node=8", "--no-python", *STAGE]


def test_two_nodes_of_eight_gpus_render_srun_with_one_torchrun_per_node():
    got = launch.launch_command(STAGE, nodes=2, gpus=16, head="gpu001", port=21234, job_id="41234")
    assert shlex.join(got) == (
        "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 "
        f"{shlex.join(launch.TORCHRUN)} --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d "
        "--rdzv_endpoint=gpu001:21234 --rdzv_id=41234 --no-python dpfm dp-train --threads 8")


@pytest.mark.parametrize("nodes, gpus, match", [(2, 13, "multiple of 2"), (2, 0, "multiple of 2"),
                                                (0, 8, "nodes must be"), (1, -1, "gpus must be")])
def test_bad_resources_are_named(nodes, gpus, match):
    with pytest.raises(ValueError, match=match):
        launch.launch_command(STAGE, nodes=nodes, gpus=gpus, head="h", port=1, job_id="1")


def test_rendezvous_comes_from_the_slurm_allocation(monkeypatch):
    calls = []

    def scontrol(cmd, **kw):
        calls.append(cmd)
        return SimpleNamespace(stdout="gpu017\ngpu018\n")

    monkeypatch.setattr(launch.subprocess, "run", scontrol)
    env = {"SLURM_JOB_ID": "41234", "SLURM_JOB_NODELIST": "gpu[017-018]", "SLURM_JOB_NUM_NODES": "2"}
    assert launch.slurm_rendezvous(2, env) == ("gpu017", 20000 + 41234 % 20000, "41234")
    assert calls == [["scontrol", "show", "hostnames", "gpu[017-018]"]]
    with pytest.raises(RuntimeError, match="has 1 node"):
        launch.slurm_rendezvous(2, {**env, "SLURM_JOB_NUM_NODES": "1"})
    with pytest.raises(RuntimeError, match="inside a SLURM allocation"):
        launch.slurm_rendezvous(2, {})


def test_launcher_passes_the_stage_exit_status_through(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "pipeline.launch", *a], capture_output=True,
                                    text=True, timeout=60, env=tool_env())
    assert run("--nodes", "1", "--gpus", "0", "--", sys.executable, "-c", "raise SystemExit(3)").returncode == 3
    bad = run("--nodes", "2", "--gpus", "16", "--", "true")
    assert bad.returncode == 2 and "SLURM allocation" in bad.stderr


def test_the_rendered_multi_node_torchrun_meets_on_one_rendezvous():
    """Two torchrun agents (the two srun tasks), here both on loopback: 2 nodes x 1 process = world of 2."""
    say = ["sh", "-c", 'echo "rank=$RANK world=$WORLD_SIZE"']
    argv = launch.launch_command(say, nodes=2, gpus=2, head="127.0.0.1", port=free_port(), job_id="7")
    agent = argv[argv.index("torch.distributed.run") - 2:]  # what srun starts on each node
    procs = [subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=tool_env())
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(line for o in outs for line in o.splitlines() if line.startswith("rank=")) == [
        "rank=0 world=2", "rank=1 world=2"]


# ---- the SLURM profile -------------------------------------------------------------------------------

def dry_run(tmp_path: Path, shards: dict | None = None, **env) -> str:
    """`snakemake --workflow-profile profiles/slurm -n -p` in a copy of the project (with `shards` params)."""
    pytest.importorskip("snakemake_executor_plugin_slurm",
                        reason="SLURM plugin missing: pip install -c constraints.txt -e '.[cluster]'")
    work = tmp_path / "project"
    work.mkdir()
    for item in ("Snakefile", "rules", "schemas", "envs", "profiles", "params.yaml"):
        src = ROOT / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / item)
    set_params(work, {"shards": shards or {}})
    proc = subprocess.run([str(BIN / "snakemake"), "--workflow-profile", "profiles/slurm", "-n", "-p",
                           "--cores", "64", "models/dp"], cwd=work, env=tool_env(**env), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


class Resources(dict):
    """A job's resources as the plugin reads them (`.get(name)` and `.name`)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def planned_job(output: str, rule: str) -> SimpleNamespace:
    """One job of a dry run: its threads, resources and shell command, as Snakemake resolved them."""
    block = output.split(f"\nrule {rule}:\n")[1].split("\nShell command: ")
    info, shell = block[0], block[1].splitlines()[0]
    threads = int(info.split("threads: ")[1].split()[0]) if "threads: " in info else 1
    res = Resources()
    for item in info.split("resources: ")[1].splitlines()[0].split(", "):
        key, value = item.split("=", 1)
        res[key] = int(value) if value.isdigit() else value
    return SimpleNamespace(name=rule, threads=threads, resources=res, wildcards={}, shell=shell,
                           is_group=lambda: False)


def sbatch_command(job, monkeypatch) -> str:
    """The sbatch call the SLURM plugin builds for `job` (account validation, which asks sacctmgr, stubbed)."""
    plugin = pytest.importorskip("snakemake_executor_plugin_slurm",
                                 reason="SLURM plugin missing: pip install -c constraints.txt -e '.[cluster]'")
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    monkeypatch.setattr(plugin, "validate_account", lambda account, logger: account)
    executor = SimpleNamespace(logger=None, _fallback_account_arg=None, _partitions=None, _fallback_partition=None)
    params = {"run_uuid": "uuid", "slurm_logfile": "logs/%j.log", "comment_str": f"rule_{job.name}",
              "account": next(plugin.Executor.get_account_arg(executor, job)),
              "partition": plugin.Executor.get_partition_arg(executor, job), "workdir": "/project"}
    return get_submit_command(job, params) + set_gres_string(job)


def assert_one_launcher_per_node(sbatch: str, nodes: int) -> None:
    """The N-copies trap: --ntasks-per-gpu=k makes SLURM start k x GPUs tasks, each running the whole rule."""
    args = shlex.split(sbatch)
    assert not any(a.startswith("--ntasks-per-gpu") for a in args), f"GPU job would run once per GPU: {sbatch}"
    tasks = [a for a in args if a.startswith("--ntasks=")]
    assert tasks in ([], [f"--ntasks={nodes}"]), f"expected one task per node ({nodes}): {sbatch}"


def test_installed_slurm_plugin_is_in_the_pinned_range():
    from packaging.requirements import Requirement

    pytest.importorskip("snakemake_executor_plugin_slurm",
                        reason="SLURM plugin missing: pip install -c constraints.txt -e '.[cluster]'")
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cluster"]
    req = next(Requirement(p) for p in pins if p.startswith("snakemake-executor-plugin-slurm"))
    assert "2.7.0" not in req.specifier and "2.7.1" in req.specifier  # 2.7.1 stopped the implicit --ntasks-per-gpu
    assert req.specifier.contains(metadata.version("snakemake-executor-plugin-slurm"))


def test_single_node_dp_train_job_asks_for_eight_gpus_and_runs_once(tmp_path, monkeypatch):
    out = dry_run(tmp_path, **PLACEHOLDERS)
    dp, pre, shards = (planned_job(out, r) for r in ("dp_train", "pretrain", "shards"))

    sbatch = sbatch_command(dp, monkeypatch)
    args = shlex.split(sbatch)
    for flag in ("-A", "acct-placeholder", "-p", "gpu-placeholder", "--gpus=h100:8", "--cpus-per-gpu=8",
                 "--mem", "256000", "-t", "2880", "--nodes=1", "--signal=TERM@300"):
        assert flag in args, (flag, sbatch)
    assert_one_launcher_per_node(sbatch, nodes=1)
    assert dp.shell.startswith(f"{PY} -m pipeline.launch --nodes 1 --gpus 8 -- {PY} -m pipeline.cli dp-train --threads 8 ")

    sbatch = sbatch_command(pre, monkeypatch)
    assert "--gpus=h100:8" in sbatch and "--cpus-per-gpu=8" in sbatch and "--signal=TERM@300" in sbatch
    assert_one_launcher_per_node(sbatch, nodes=1)
    assert pre.shell.startswith(f"{PY} -m pipeline.launch --nodes 1 --gpus 8 -- {PY} -m pipeline.cli pretrain ")

    sbatch = sbatch_command(shards, monkeypatch)  # CPU stages: CPU partition, one task, no GPU
    assert "-p cpu-placeholder" in sbatch and "--ntasks=1" in sbatch and "--gpus" not in sbatch


def test_two_node_dp_train_job_gets_one_task_per_node(tmp_path, monkeypatch):
    out = dry_run(tmp_path, **PLACEHOLDERS, DPFM_NODES="2")
    dp = planned_job(out, "dp_train")
    assert dp.resources["mpi"] == "srun"  # the rule runs its own srun: no plugin `srun -n1` around it
    sbatch = sbatch_command(dp, monkeypatch)
    args = shlex.split(sbatch)
    assert {"--nodes=2", "--ntasks=2", "--gpus=h100:16", "--cpus-per-gpu=8"} <= set(args), sbatch
    assert_one_launcher_per_node(sbatch, nodes=2)
    assert dp.shell.startswith(f"{PY} -m pipeline.launch --nodes 2 --gpus 16 -- {PY} -m pipeline.cli dp-train ")
    assert planned_job(out, "pretrain").resources["nodes"] == 1


def test_scan_jobs_and_their_gather_get_the_profiles_cpus_memory_and_time(tmp_path, monkeypatch):
    out = dry_run(tmp_path, {"source": "urls", "urls": ["s3://b/laion/{00000..00299}.tar"], "scan_groups": 3},
                  **PLACEHOLDERS)
    for rule, cpus, mem, minutes in (("scan_shards", 8, 16000, 60), ("shards", 4, 24000, 240)):
        job = planned_job(out, rule)
        assert job.threads == cpus and f" --threads {cpus} " in job.shell
        sbatch = sbatch_command(job, monkeypatch)
        args = shlex.split(sbatch)
        for flag in ("-p", "cpu-placeholder", f"--cpus-per-task={cpus}", "--mem", str(mem), "-t", str(minutes)):
            assert flag in args, (rule, flag, sbatch)
        assert "--gpus" not in sbatch


def test_the_copies_check_catches_a_profile_that_asks_for_tasks_per_gpu(monkeypatch):
    """A profile in the trap (tasks set, no tasks_per_gpu: 0) gives --ntasks-per-gpu, and the check says so."""
    res = Resources(mem_mb=256000, runtime=2880, gpu=8, nodes=1, cpus_per_gpu=8, tasks=1,
                    slurm_account="a", slurm_partition="p")
    trapped = SimpleNamespace(name="dp_train", threads=8, resources=res, wildcards={}, is_group=lambda: False)
    sbatch = sbatch_command(trapped, monkeypatch)
    assert "--ntasks-per-gpu=1" in sbatch
    with pytest.raises(AssertionError, match="once per GPU"):
        assert_one_launcher_per_node(sbatch, nodes=1)
    res["tasks_per_gpu"] = 0  # what the profile sets
    assert_one_launcher_per_node(sbatch_command(trapped, monkeypatch), nodes=1)


# ---- MLflow through a tracking server ----------------------------------------------------------------

STAGE_LOGGER = textwrap.dedent("""
    import sys, time, urllib.request
    import mlflow  # slow: imported while the server starts
    from pipeline.stages import stage
    from pipeline.tracking import stage_run
    name, url, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    deadline = time.time() + 120
    while True:  # imports done while the server starts; log once it answers
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)
    with stage_run(stage(name), {"run": {"seed": 0}, "dp": {"lr": 0.1}}, "cluster-test") as run:
        for i in range(n):
            run.log_metrics({"loss": 1.0 / (i + 1), "step_time": 0.01 * i}, step=i)
        run.log_series("curve", [float(i) for i in range(10 * n)], range(10 * n))
        print("RUN", run.run_id)
""")


def wait_for(url: str, proc, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return True
        except OSError:
            time.sleep(0.5)
    return False


def test_two_stages_log_at_once_through_an_mlflow_server(tmp_path):
    port, n = free_port(), 15
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    env = tool_env(MLFLOW_TRACKING_URI=url, PYTHONPATH=str(ROOT))
    stages, loggers = ["pretrain", "dp-train"], []
    try:
        # Both stage processes start with the server and log the moment it answers: concurrent writes.
        loggers = [subprocess.Popen([sys.executable, "-c", STAGE_LOGGER, s, url, str(n)], cwd=tmp_path, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in stages]
        from mlflow.tracking import MlflowClient  # slow import, while the server starts

        if not wait_for(url, server, 60):
            assert server.poll() is None, f"mlflow server exited with status {server.returncode}"
            pytest.skip("mlflow server did not answer within 60 s on this machine (loaded?)")
        results = [p.communicate(timeout=180) for p in loggers]
        assert [p.returncode for p in loggers] == [0, 0], [err[-2000:] for _, err in results]
        run_ids = [out.split("RUN ")[1].split()[0] for out, _ in results]
        client = MlflowClient(tracking_uri=url)
        exp = client.get_experiment_by_name("cluster-test")
        found = {r.info.run_id: r for r in client.search_runs([exp.experiment_id])}
        assert set(found) == set(run_ids)
        for name, run_id in zip(stages, run_ids):
            run = found[run_id]
            assert run.info.status == "FINISHED" and run.data.tags["dpfm.stage"] == name
            assert run.data.params == {"run.seed": "0", "dp.lr": "0.1"}
            for metric, count in (("loss", n), ("step_time", n), ("curve", 10 * n)):
                history = client.get_metric_history(run_id, metric)
                assert sorted(m.step for m in history) == list(range(count)), (name, metric)
    finally:
        for p in loggers:
            if p.poll() is None:
                p.kill()
                p.wait()
        os.killpg(server.pid, 15)  # the server and its uvicorn worker
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()
