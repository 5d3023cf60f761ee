"""Scale path: the launcher the training rules call, the SLURM profile's jobs, and MLflow through a server.

There is no SLURM here: Snakemake's dry run resolves each job's resources from profiles/slurm, and the
SLURM plugin's own functions turn them into the sbatch command it would submit.
"""

import os
import re
import shlex
import shutil
import signal
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

from pipeline import launch, slurm

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PY = (BIN / "snakemake").read_text().splitlines()[0][2:]  # the interpreter the rules call stages with
PROFILE_ENV = ("DPFM_SLURM_ACCOUNT", "DPFM_SLURM_PARTITION", "DPFM_SLURM_GPU_PARTITION", "DPFM_GPU_MODEL",
               "DPFM_GPUS_PER_NODE", "DPFM_NODES")
PLACEHOLDERS = {"DPFM_SLURM_ACCOUNT": "acct-placeholder", "DPFM_SLURM_PARTITION": "cpu-placeholder",
                "DPFM_SLURM_GPU_PARTITION": "gpu-placeholder", "DPFM_GPU_MODEL": "h100"}
STAGE = ["dpfm", "dp-train", "--threads", "8"]
TRAP = "trap : TERM INT; "  # how rules/stages.smk's shell begins


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
    got = launch.launch_command(STAGE, nodes=2, gpus=16, head="gpu001.ib", port=21234, job_id="41234",
                                head_node="gpu001")
    assert shlex.join(got) == (
        "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 "
        f"{shlex.quote(sys.executable)} -m pipeline.launch --agent-of gpu001 -- --nnodes=2 --nproc_per_node=8 "
        "--rdzv_backend=c10d --rdzv_endpoint=gpu001.ib:21234 --rdzv_id=41234 --no-python dpfm dp-train --threads 8")


@pytest.mark.parametrize("nodes, gpus, match", [(2, 13, "multiple of 2"), (2, 3, "multiple of 2"),
                                                (0, 8, "nodes must be"), (1, -1, "gpus must be")])
def test_bad_resources_are_named(nodes, gpus, match):
    with pytest.raises(ValueError, match=match):
        launch.launch_command(STAGE, nodes=nodes, gpus=gpus, head="h", port=1, job_id="1", head_node="h")


def test_two_cpu_nodes_run_one_gloo_process_each():
    got = launch.launch_command(STAGE, nodes=2, gpus=0, head="cpu001", port=21234, job_id="7", head_node="cpu001")
    assert "--nnodes=2" in got and "--nproc_per_node=1" in got and got[0] == "srun"


def fake_scontrol(monkeypatch, jobs: dict[str, str], pids: dict[int, str] | None = None) -> list:
    """scontrol as SLURM answers it, for the jobs given (`show job -o ID` lines)."""
    calls = []
    hostnames = {"gpu[017-018]": "gpu017\ngpu018\n", "cpu001": "cpu001\n"}

    def scontrol(*args):
        calls.append(args)
        if args[:2] == ("show", "hostnames"):
            return hostnames[args[2]]
        if args[:3] == ("show", "job", "-o"):
            return jobs[args[3]]
        if args[:3] == ("show", "node", "-o"):
            return f"NodeName={args[3]} Arch=x86_64 NodeAddr={args[3]}.ib.cluster NodeHostName={args[3]} CPUTot=64"
        if args[0] == "pidinfo" and pids and int(args[1]) in pids:
            return (f"Slurm JobId={pids[int(args[1])]} ends at Wed Nov 24 05:06:30 2027\n"
                    "Job remaining time is 60 seconds\n")
        raise slurm.subprocess.CalledProcessError(1, ["scontrol", *args])

    monkeypatch.setattr(slurm, "_scontrol", scontrol)
    return calls


JOB = "JobId=41234 JobName=dp_train UserId=me(1) NumNodes=2 NumCPUs=32 NumTasks=2 NodeList=gpu[017-018] Partition=gpu"


def test_rendezvous_ports_differ_for_neighbouring_jobs_and_stay_below_the_ephemeral_range():
    """Ports from 20,000 to 39,999 put a third of the jobs in Linux's ephemeral range (32,768 on), where an
    outgoing connection on the head node may already hold the port and the rendezvous store cannot bind."""
    ports = [launch.rendezvous_port(str(job)) for job in range(4_000_000, 4_017_000)]
    assert len(set(ports)) == len(ports) and 1024 <= min(ports) and max(ports) < 32768
    assert launch.rendezvous_port("41234_7") == launch.BASE_PORT  # an array task's id: below the range too


def test_only_the_head_node_is_told_to_host_the_rendezvous_store():
    """Each node's torchrun is told whether it hosts the store by its SLURM node name: the head alone
    (two hosts, or none, and the nodes never meet); outside SLURM, torch's own guess."""
    args = ["--nnodes=2", "--rdzv_endpoint=gpu017.ib.cluster:15000"]
    for node, host in (("gpu017", 1), ("gpu018", 0)):
        told = launch.agent_command(args, "gpu017", {"SLURMD_NODENAME": node})
        assert told == [*launch.TORCHRUN, f"--rdzv_conf=is_host={host}", *args]
    assert launch.agent_command(args, "gpu017", {}) == [*launch.TORCHRUN, *args]


def test_torchruns_grace_for_saving_ends_before_slurm_kills_the_job():
    """SLURM's TERM comes STOP_NOTICE_S before its KILL (the rules ask for it): torchrun's wait for its
    workers to save must end inside that notice, with time left for the job to end."""
    assert 30 < launch.SHUTDOWN_GRACE_S <= launch.STOP_NOTICE_S - 30


def test_rendezvous_comes_from_scontrol_not_from_stripped_variables(monkeypatch):
    """The SLURM plugin's job step keeps SLURM_JOB_ID and drops SLURM_JOB_NODELIST (jobstep 0.6.1):
    the launcher once stopped there, naming the wrong variable."""
    fake_scontrol(monkeypatch, {"41234": JOB})
    env = {"SLURM_JOB_ID": "41234"}  # what the jobstep plugin leaves
    assert launch.slurm_rendezvous(2, env) == ("gpu017.ib.cluster", launch.rendezvous_port("41234"), "41234",
                                               "gpu017")
    with pytest.raises(RuntimeError, match="has 2 node"):
        launch.slurm_rendezvous(4, env)
    monkeypatch.setattr(slurm, "_in_slurm_cgroup", lambda: False)
    with pytest.raises(RuntimeError, match="in none"):
        launch.slurm_rendezvous(2, {})


def test_a_process_without_slurm_variables_finds_its_job_through_pidinfo(monkeypatch):
    fake_scontrol(monkeypatch, {"41234": JOB}, pids={os.getpid(): "41234"})
    monkeypatch.setattr(slurm, "_in_slurm_cgroup", lambda: True)
    monkeypatch.setattr(slurm.shutil, "which", lambda name: "/usr/bin/" + name)
    assert slurm.allocation({}) == slurm.Allocation("41234", ("gpu017", "gpu018"), 32)


def test_stage_threads_are_the_cpus_slurm_gave_the_node(monkeypatch):
    """Snakemake caps a rule's threads at --cores: `--cores 2` once ran dp-train on 2 threads of 8."""
    fake_scontrol(monkeypatch, {"41234": JOB, "9": "JobId=9 NumNodes=1 NumCPUs=8 NodeList=cpu001"})
    assert slurm.threads_per_process(2, {"SLURM_JOB_ID": "9"}) == 8
    assert slurm.threads_per_process(2, {"SLURM_JOB_ID": "41234", "LOCAL_WORLD_SIZE": "4"}) == 4  # 16 CPUs a node
    monkeypatch.setattr(slurm, "_in_slurm_cgroup", lambda: False)
    assert slurm.threads_per_process(2, {}) == 2  # not in SLURM: as asked


def test_stage_threads_stay_at_least_one_and_fall_back_to_the_request_where_scontrol_says_too_little(monkeypatch):
    """More local ranks than CPUs on the node: one thread each (torch refuses 0). A job line scontrol
    gives without its nodes or with a CPU count that is no number: the threads asked for, not a crash."""
    fake_scontrol(monkeypatch, {"9": "JobId=9 NumNodes=1 NumCPUs=8 NodeList=cpu001", "10": "JobId=10 NumCPUs=8",
                                "11": "JobId=11 NumCPUs=eight NodeList=cpu001"})
    assert slurm.threads_per_process(2, {"SLURM_JOB_ID": "9", "LOCAL_WORLD_SIZE": "16"}) == 1
    assert slurm.threads_per_process(2, {"SLURM_JOB_ID": "10"}) == 2
    assert slurm.threads_per_process(2, {"SLURM_JOB_ID": "11"}) == 2


def test_the_job_is_found_by_either_variable_and_scontrol_is_asked_only_inside_a_slurm_cgroup(monkeypatch):
    """SLURM_JOBID is the older name some sites' environments still set. Without either variable, a
    process asks `scontrol pidinfo` only where its cgroup is a SLURM job's: a login node that has
    scontrol would otherwise wait on it at every stage start."""
    import io

    calls = fake_scontrol(monkeypatch, {}, pids={os.getpid(): "41234"})
    monkeypatch.setattr(slurm.shutil, "which", lambda name: "/usr/bin/" + name)
    assert slurm.job_id({"SLURM_JOBID": "9"}) == "9" and slurm.job_id({"SLURM_JOB_ID": "8", "SLURM_JOBID": "9"}) == "8"
    assert calls == []
    for cgroup, found in (("0::/user.slice/user-1000.slice/session-3.scope\n", None),
                          ("0::/system.slice/slurmstepd.scope/job_41234/step_0/user/task_0\n", "41234")):
        monkeypatch.setattr(slurm, "open", lambda path, cgroup=cgroup: io.StringIO(cgroup), raising=False)
        assert slurm.job_id({}) == found
    assert calls == [("pidinfo", str(os.getpid()))]  # once: inside the job's cgroup


def test_launcher_passes_the_stage_exit_status_through(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "pipeline.launch", *a], capture_output=True,
                                    text=True, timeout=60, env=tool_env())
    assert run("--nodes", "1", "--gpus", "0", "--", sys.executable, "-c", "raise SystemExit(3)").returncode == 3
    bad = run("--nodes", "2", "--gpus", "16", "--", "true")
    assert bad.returncode == 2 and "must start inside a SLURM job" in bad.stderr


def test_a_stage_given_gpus_it_cannot_see_refuses_to_train_on_the_cpu(monkeypatch):
    """Measured through the launcher: the job's GPU count reaches the stage, and `auto` (or `cuda`) with
    GPUs given but none visible to torch (a driver older than its CUDA, a CPU-only build) stops with one
    line, where `auto` fell back to the CPU and held the GPUs for days. This machine has no CUDA device."""
    import torch

    from pipeline.cli import resolve_device
    from pipeline.config import ParamsError

    show = "import os; print(os.environ['DPFM_JOB_GPUS'])"
    for gpus in ("0", "1"):  # the job's own count, whatever the environment it was started from held
        done = subprocess.run([sys.executable, "-m", "pipeline.launch", "--gpus", gpus, "--", sys.executable, "-c", show],
                              capture_output=True, text=True, timeout=60, env=tool_env(DPFM_JOB_GPUS="8"))
        assert done.returncode == 0 and done.stdout.strip() == gpus, done.stderr
    assert not torch.cuda.is_available()
    monkeypatch.delenv("DPFM_JOB_GPUS", raising=False)
    assert resolve_device("auto") == "cpu"  # no launcher (a test, a laptop): the CPU it is
    monkeypatch.setenv("DPFM_JOB_GPUS", "0")
    assert resolve_device("auto") == "cpu"  # a CPU job (DPFM_GPUS_PER_NODE=0)
    monkeypatch.setenv("DPFM_JOB_GPUS", "8")
    for requested in ("auto", "cuda"):
        with pytest.raises(ParamsError, match="given 8 GPU"):
            resolve_device(requested)
    assert resolve_device("cpu") == "cpu"  # said outright


WORKER_THAT_SAVES_SLOWLY = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    out, rank, told = Path(sys.argv[1]), os.environ["RANK"], []
    signal.signal(signal.SIGTERM, lambda *_: told.append(1))
    (out / f"started{rank}").write_text("")
    while not told:
        time.sleep(0.05)
    (out / f"told{rank}").write_text("")
    while not (out / "go").exists():  # a step and a checkpoint at scale: the test says when they end
        time.sleep(0.05)
    (out / f"saved{rank}").write_text("")
    sys.exit(128 + signal.SIGTERM)
""")


def test_torchrun_gives_its_workers_longer_than_its_own_30_s_to_save_after_sigterm(tmp_path):
    """torchrun kills its workers 30 s after it forwards a SIGTERM, by default; a step and a checkpoint
    at scale take longer, and SLURM's notice is 5 min. The workers here save 35 s after the signal."""
    (tmp_path / "worker.py").write_text(WORKER_THAT_SAVES_SLOWLY)
    env = {k: v for k, v in tool_env().items() if k != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    job = subprocess.Popen([sys.executable, "-m", "pipeline.launch", "--gpus", "2", "--", sys.executable,
                            str(tmp_path / "worker.py"), str(tmp_path)], start_new_session=True, env=env,
                           stderr=subprocess.PIPE, text=True)
    while not all((tmp_path / f"started{r}").exists() for r in (0, 1)):
        assert job.poll() is None, job.stderr.read()[-3000:]
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGTERM)  # every process of the step, as SLURM signals it
    while not all((tmp_path / f"told{r}").exists() for r in (0, 1)):
        time.sleep(0.05)
    time.sleep(35)  # past torchrun's own grace, which this test measures the launcher lifts
    assert job.poll() is None, "torchrun ended before its workers saved"
    (tmp_path / "go").write_text("")
    job.wait(timeout=60)
    assert all((tmp_path / f"saved{r}").exists() for r in (0, 1)), job.stderr.read()[-3000:]


# torch's guess of whether this machine hosts the rendezvous store, as it goes where the head's NodeAddr
# names another interface than its hostname (an InfiniBand name): no node matches it.
NO_NODE_MATCHES = """
import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as backend
backend._matches_machine_hostname = lambda host: False
"""


@pytest.mark.parametrize("endpoint_matches", [True, False], ids=["hostname", "another-interface"])
def test_the_rendered_multi_node_torchrun_meets_on_one_rendezvous(tmp_path, endpoint_matches):
    """Two torchrun agents (the two srun tasks, on nodes node0 and node1), here both on loopback: 2 nodes x
    1 process = world of 2. Where no node's name or address matched the endpoint, every node took
    itself for a client of a store nobody hosted, and none met: the head's agent is told it hosts."""
    env = tool_env()
    if not endpoint_matches:
        (tmp_path / "sitecustomize.py").write_text(NO_NODE_MATCHES)  # in every interpreter the agents start
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    say = ["sh", "-c", 'echo "rank=$RANK world=$WORLD_SIZE"']
    argv = launch.launch_command(say, nodes=2, gpus=2, head="127.0.0.1", port=free_port(), job_id="7",
                                 head_node="node0")
    agent = argv[argv.index("pipeline.launch") - 2:]  # what srun starts on each node
    procs = [subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**env, "SLURMD_NODENAME": f"node{i}"}) for i in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(line for o in outs for line in o.splitlines() if line.startswith("rank=")) == [
        "rank=0 world=2", "rank=1 world=2"]


# ---- the SLURM profile -------------------------------------------------------------------------------

def dry_run(tmp_path: Path, shards: dict | None = None, extra: tuple = (), **env) -> str:
    """The README's `snakemake --workflow-profile profiles/slurm`, dry (-n -p), in a copy of the project
    (with `shards` params and `extra` arguments)."""
    pytest.importorskip("snakemake_executor_plugin_slurm",
                        reason="SLURM plugin missing: pip install -c constraints.txt -e '.[cluster]'")
    work = tmp_path / "project"
    work.mkdir()
    for item in ("Snakefile", "rules", "schemas", "envs", "profiles", "params.yaml"):
        src = ROOT / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / item)
    # No ε = ∞ point: on a web source it is refused as the workflow starts (release.check_asked_for).
    set_params(work, {"shards": shards or {}, "curve": {"epsilons": [1, 8]}})
    targets = ("models/dp", "results/curve/curve.json", "results/eval/metrics.json", "data/synthetic")
    proc = subprocess.run([str(BIN / "snakemake"), "--workflow-profile", "profiles/slurm", "-n", "-p", *targets, *extra],
                          cwd=work, env=tool_env(**env), capture_output=True, text=True, timeout=120)
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
                           command=shell.removeprefix(TRAP), is_group=lambda: False)


def sbatch_command(job, monkeypatch) -> str:
    """The sbatch call the SLURM plugin builds for `job` (account validation, which asks sacctmgr, stubbed)."""
    plugin = pytest.importorskip("snakemake_executor_plugin_slurm",
                                 reason="SLURM plugin missing: pip install -c constraints.txt -e '.[cluster]'")
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    monkeypatch.setattr(plugin, "validate_account", lambda account, logger: account)
    # No default partition to look up with sinfo: a job without one gets no -p.
    executor = SimpleNamespace(logger=None, _fallback_account_arg=None, _partitions=None, _fallback_partition="")
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
    reqs = {Requirement(p).name: Requirement(p) for p in pins}
    req = reqs["snakemake-executor-plugin-slurm"]
    assert "2.7.0" not in req.specifier and "2.7.1" in req.specifier  # 2.7.1 stopped the implicit --ntasks-per-gpu
    for name, req in reqs.items():  # the versions tests/test_slurm.py runs on a real SLURM
        assert req.specifier.contains(metadata.version(name)), (name, metadata.version(name))


def test_single_node_dp_train_job_asks_for_eight_gpus_and_runs_once(tmp_path, monkeypatch):
    out = dry_run(tmp_path, **PLACEHOLDERS)
    dp, pre, shards = (planned_job(out, r) for r in ("dp_train", "pretrain", "shards"))

    sbatch = sbatch_command(dp, monkeypatch)
    args = shlex.split(sbatch)
    for flag in ("-A", "acct-placeholder", "-p", "gpu-placeholder", "--gpus=h100:8", "--cpus-per-gpu=8",
                 "--mem", "256000", "-t", "2880", "--nodes=1", "--signal=TERM@300"):
        assert flag in args, (flag, sbatch)
    assert_one_launcher_per_node(sbatch, nodes=1)
    assert dp.command.startswith(f"{PY} -m pipeline.launch --nodes 1 --gpus 8 -- {PY} -m pipeline.cli dp-train --threads 8 ")
    assert dp.shell.startswith(TRAP)  # it waits for a stage told to end (test_the_rules_shell_waits…)

    sbatch = sbatch_command(pre, monkeypatch)
    assert "--gpus=h100:8" in sbatch and "--cpus-per-gpu=8" in sbatch and "--signal=TERM@300" in sbatch
    assert_one_launcher_per_node(sbatch, nodes=1)
    assert pre.command.startswith(f"{PY} -m pipeline.launch --nodes 1 --gpus 8 -- {PY} -m pipeline.cli pretrain ")

    sbatch = sbatch_command(shards, monkeypatch)  # CPU stages: CPU partition, one task, no GPU
    assert "-p cpu-placeholder" in sbatch and "--ntasks=1" in sbatch and "--gpus" not in sbatch

    # The curve and evaluate (which trains the DP recipe again at each other seed of evaluate.seeds;
    # it once got no GPU and the default hour) train one point after another on one GPU.
    for rule, name in (("curve", "curve"), ("evaluate", "evaluate")):
        job = planned_job(out, rule)
        args = shlex.split(sbatch_command(job, monkeypatch))
        for flag in ("-p", "gpu-placeholder", "--gpus=h100:1", "--cpus-per-gpu=8", "-t", "2880", "--signal=TERM@300"):
            assert flag in args, (rule, flag, args)
        assert job.command.startswith(f"{PY} -m pipeline.launch --nodes 1 --gpus 1 -- {PY} -m pipeline.cli {name} ")


def test_two_node_dp_train_job_gets_one_task_per_node(tmp_path, monkeypatch):
    out = dry_run(tmp_path, **PLACEHOLDERS, DPFM_NODES="2")
    dp = planned_job(out, "dp_train")
    assert dp.resources["mpi"] == "srun"  # the rule runs its own srun: no plugin `srun -n1` around it
    sbatch = sbatch_command(dp, monkeypatch)
    args = shlex.split(sbatch)
    assert {"--nodes=2", "--ntasks=2", "--gpus=h100:16", "--cpus-per-gpu=8"} <= set(args), sbatch
    assert_one_launcher_per_node(sbatch, nodes=2)
    assert dp.command.startswith(f"{PY} -m pipeline.launch --nodes 2 --gpus 16 -- {PY} -m pipeline.cli dp-train ")
    assert planned_job(out, "pretrain").resources["nodes"] == 1


def test_a_cpu_only_partition_takes_one_variable(tmp_path, monkeypatch):
    """DPFM_GPUS_PER_NODE=0 once left the curve asking for a GPU (sbatch: invalid gres) and refused 2 nodes."""
    out = dry_run(tmp_path, DPFM_GPUS_PER_NODE="0", DPFM_NODES="2", DPFM_SLURM_PARTITION="cpu", DPFM_SLURM_ACCOUNT="a")
    for rule in ("pretrain", "dp_train", "curve", "evaluate"):
        job = planned_job(out, rule)
        sbatch = sbatch_command(job, monkeypatch)
        assert "--gpus" not in sbatch and "--gres" not in sbatch and "--cpus-per-task=8" in sbatch, (rule, sbatch)
        assert " --threads 8 " in job.shell
    dp = planned_job(out, "dp_train")
    assert {"--nodes=2", "--ntasks=2", "--signal=TERM@300"} <= set(shlex.split(sbatch_command(dp, monkeypatch)))
    assert dp.command.startswith(f"{PY} -m pipeline.launch --nodes 2 --gpus 0 -- ")


def test_memory_follows_the_gpus_and_the_variables(tmp_path, monkeypatch):
    """Fixed requests (256 GB per training node, 24 GB for the shards of the digits) once made sbatch
    refuse a 20 GB node."""
    out = dry_run(tmp_path, DPFM_GPUS_PER_NODE="2", DPFM_MEM_MB_PER_GPU="9000", DPFM_CPU_MEM_MB="4000",
                  DPFM_SLURM_ACCOUNT="a")
    for rule, mem in (("dp_train", 18000), ("pretrain", 18000), ("curve", 9000), ("evaluate", 9000), ("shards", 4000),
                      ("synthetic", 4000)):
        args = shlex.split(sbatch_command(planned_job(out, rule), monkeypatch))
        assert args[args.index("--mem") + 1] == str(mem), (rule, args)
    synthetic = planned_job(out, "synthetic")  # ViP's 1.05M shader images: ~6 core-hours
    args = shlex.split(sbatch_command(synthetic, monkeypatch))
    assert args[args.index("-t") + 1] == "240" and "--cpus-per-task=4" in args, args


def test_no_job_asks_for_more_than_the_partitions_time_limit(tmp_path, monkeypatch):
    """Fixed 48 h requests stayed pending for ever (PartitionTimeLimit) on a partition capped at 24 h."""
    out = dry_run(tmp_path, DPFM_MAX_RUNTIME_MIN="1440", DPFM_SLURM_ACCOUNT="a")
    for rule, minutes in (("dp_train", "1440"), ("curve", "1440"), ("evaluate", "1440"), ("pretrain", "720"),
                          ("synthetic", "240")):
        args = shlex.split(sbatch_command(planned_job(out, rule), monkeypatch))
        assert args[args.index("-t") + 1] == minutes, (rule, args)


def test_a_command_line_override_keeps_the_stop_signal_and_one_launcher(tmp_path, monkeypatch):
    """`--set-resources` replaces the profile's whole block: it once dropped --signal=TERM@300 (no
    checkpoint at preemption) and tasks_per_gpu: 0 along with the one value it lowered."""
    out = dry_run(tmp_path, extra=("--set-resources", "dp_train:mem_mb=20000"), **PLACEHOLDERS)
    dp = planned_job(out, "dp_train")
    sbatch = sbatch_command(dp, monkeypatch)
    args = shlex.split(sbatch)
    assert args[args.index("--mem") + 1] == "20000" and "--signal=TERM@300" in args, sbatch
    assert_one_launcher_per_node(sbatch, nodes=1)
    assert dp.resources["runtime"] == 2880  # the rule's own time limit, as the profile's


def test_scan_jobs_and_their_gather_get_the_profiles_cpus_memory_and_time(tmp_path, monkeypatch):
    out = dry_run(tmp_path, {"source": "urls", "urls": ["s3://b/laion/{00000..00299}.tar"], "scan_groups": 3},
                  **PLACEHOLDERS)
    for rule, cpus, mem, minutes in (("scan_shards", 8, 16000, 60), ("shards", 4, 16000, 240)):
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


# ---- what a cluster run leaves behind ------------------------------------------------------------

def rule_log_pipe() -> str:
    """How the stage rules send a stage's output to its log (rules/stages.smk)."""
    found = re.search(r'2>&1 \| (.*?)"', (ROOT / "rules/stages.smk").read_text())
    return found.group(1).replace("{log}", "stage.log")


STOPPING_STAGE = ("import signal, sys, time\n"
                  "signal.signal(signal.SIGTERM, lambda *a: (print('dp-train: stopped after step 3', flush=True),"
                  " sys.exit(143)))\n"
                  "print('step 1', flush=True)\n"
                  "time.sleep(60)\n")


@pytest.mark.parametrize("pipe", ["rule", "plain tee (before)"])
def test_the_stop_message_reaches_the_stage_log(tmp_path, pipe):
    """SLURM signals every process of the job: a plain `| tee {log}` died with the stage, so the
    one-line stop message reached neither the stage log nor SLURM's."""
    tail = rule_log_pipe() if pipe == "rule" else "tee stage.log"
    job = subprocess.Popen(["bash", "-c", f"set -euo pipefail; {sys.executable} -c {shlex.quote(STOPPING_STAGE)} "
                                          f"2>&1 | {tail}"], cwd=tmp_path, stdout=subprocess.PIPE,
                           start_new_session=True)
    assert job.stdout.readline() == b"step 1\n"  # the stage runs, its handler is installed
    os.killpg(job.pid, signal.SIGTERM)  # as SLURM does: the whole job, tee included
    job.communicate(timeout=60)
    logged = "dp-train: stopped after step 3" in (tmp_path / "stage.log").read_text()
    assert logged == (pipe == "rule")


def test_stage_runs_carry_the_slurm_job_id(local_mlflow, monkeypatch):
    from pipeline import tracking
    from pipeline.stages import stage

    monkeypatch.setenv("SLURM_JOB_ID", "41234")
    with tracking.stage_run(stage("verify"), {"run": {"seed": 0}}, "dpfm") as run:
        run_id = run.run_id
    client = tracking._mlflow("dpfm").tracking.MlflowClient()
    assert client.get_run(run_id).data.tags["slurm.job_id"] == "41234"


def test_no_stage_records_the_machines_load_while_a_job_on_the_private_shards_writes(local_mlflow, tmp_path,
                                                                                   monkeypatch):
    """MLflow's system metrics sample the whole machine: pretrain (public data), run beside the shards
    stage or a scan, would publish their disk writes and load. No stage records them, even when the
    environment asks MLflow to; here a writer stands in for a job on the private shards."""
    import threading

    from pipeline import tracking
    from pipeline.stages import stage

    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "true")
    tracking._mlflow("dpfm").set_system_metrics_sampling_interval(0.2)
    client = tracking._mlflow("dpfm").tracking.MlflowClient()
    for name in ("pretrain", "synthetic", "verify", "dp-train"):
        stop, wrote = threading.Event(), threading.Event()

        def private_job():
            with open(tmp_path / "shard.tar", "wb") as f:
                while not stop.is_set():
                    f.write(bytes(1 << 20))
                    wrote.set()

        writer = threading.Thread(target=private_job)
        writer.start()
        with tracking.stage_run(stage(name), {"run": {"seed": 0}}, "dpfm") as run:
            run_id = run.run_id
            wrote.wait(10)
            time.sleep(1.0)  # five of MLflow's sampling intervals, had the monitor been started
        stop.set()
        writer.join()
        metrics = client.get_run(run_id).data.metrics
        assert not [k for k in metrics if k.startswith("system/")], (name, sorted(metrics))


def test_the_parent_is_named_from_this_runs_outputs_only_and_carries_its_report_only(local_mlflow):
    """A partial target (`snakemake models/dp`) once named its parent from a verification.json that an
    earlier run had left, and attached the report an earlier run had left (another run's ε beside this one)."""
    from pipeline import tracking
    from pipeline.io import write_json

    write_json("results/privacy/verification.json", {"epsilon_reported": 7.5, "sigma": 0.9, "delta": 1e-5})
    write_json("models/dp/ledger.json", {"objective": "mae"})
    write_json("results/privacy/privacy.json", {"private": True, "not_private": [], "epsilon_composed": "7.5"})
    Path("results/report").mkdir(parents=True)
    Path("results/report/report.md").write_text("# an earlier run's report")
    old = time.time() - 3600
    for path in ("results/privacy/verification.json", "models/dp/ledger.json", "results/privacy/privacy.json",
                 "results/report/report.md"):
        os.utime(path, (old, old))
    client = tracking._mlflow("dpfm").tracking.MlflowClient()
    names, reports = [], []
    for fresh in (False, True):
        parent = tracking.start_parent("dpfm")
        exp_id = client.get_experiment_by_name("dpfm").experiment_id
        client.set_terminated(client.create_run(exp_id, tags={"mlflow.parentRunId": parent}).info.run_id)
        if fresh:  # this run wrote them
            for path in ("results/privacy/verification.json", "results/privacy/privacy.json"):
                os.utime(path)
        tracking.end_parent("dpfm", parent, ok=True)
        names.append(client.get_run(parent).data.tags["mlflow.runName"])
        reports.append(sorted(a.path for a in client.list_artifacts(parent, "report")))
    assert "7.50" not in names[0] and "ε=7.50" in names[1], names
    assert reports == [[], ["report/privacy.json", "report/report.md"]], reports


def test_the_parent_carries_the_params_its_jobs_ran_with_and_the_released_models_figures(local_mlflow):
    """The parent logged params.yaml as it was when the workflow ended, edited since perhaps; and its
    headline accuracy, beside one model's ε, was the mean over evaluate.seeds DP models."""
    import mlflow
    import yaml

    from pipeline import tracking
    from pipeline.config import load_params
    from pipeline.io import write_json

    shutil.copy(ROOT / "params.yaml", "params.yaml")
    shutil.copytree(ROOT / "schemas", "schemas")
    validated = load_params("params.yaml", ["dp.epsilon=2"])  # what the workflow's jobs read
    client = tracking._mlflow("dpfm").tracking.MlflowClient()
    parent = tracking.start_parent("dpfm", validated)
    time.sleep(0.01)  # the outputs are this run's: written after it started (the parent reads only those)
    write_json("results/privacy/verification.json", {"epsilon_reported": 2.0, "sigma": 1.4, "delta": 4e-4})
    write_json("results/eval/metrics.json", {"primary_set": "digits", "sets": {"digits": {"results": {"dp": {
        "linear_probe": 0.9, "seeds": 3, "first_seed": {"linear_probe": 0.85}}}}}})
    exp_id = client.get_experiment_by_name("dpfm").experiment_id
    client.set_terminated(client.create_run(exp_id, tags={"mlflow.parentRunId": parent}).info.run_id)
    tracking.end_parent("dpfm", parent, ok=True, params=validated)  # params.yaml on disk: ε = 8
    logged = yaml.safe_load(open(mlflow.artifacts.download_artifacts(run_id=parent, artifact_path="params.yaml")))
    assert logged["dp"]["epsilon"] == 2
    metrics = client.get_run(parent).data.metrics
    assert metrics["epsilon"] == 2.0 and metrics["linear_probe"] == 0.85


def test_a_parent_whose_report_did_not_run_is_named_not_private_from_its_config_and_verify(local_mlflow):
    """`snakemake verify` (no report, so no fresh privacy.json) named a test run's parent "ViP ε=2.00"
    with nothing to say it is NOT PRIVATE, and so a run whose budget records a release outside DP; a
    parent whose report ran but verify did not kept its start name. A config and a budget that give no
    reason claim nothing either way."""
    from pipeline import tracking
    from pipeline.config import load_params
    from pipeline.io import write_json

    shutil.copy(ROOT / "params.yaml", "params.yaml")
    shutil.copytree(ROOT / "schemas", "schemas")
    client = tracking._mlflow("dpfm").tracking.MlflowClient()
    exp_id = client.get_experiment_by_name("dpfm").experiment_id

    def parent_tags(testing: bool, outside_dp: list, verified: bool = True, report: dict | None = None,
                    ok: bool = True, sets: tuple = ()) -> dict:
        validated = load_params("params.yaml", [f"privacy.testing={str(testing).lower()}", "curve.epsilons=[]", *sets])
        parent = tracking.start_parent("dpfm", validated)
        time.sleep(0.01)  # written after the parent started: this run's
        if verified:
            write_json("results/privacy/verification.json", {"epsilon_reported": 2.0, "sigma": 1.4, "delta": 4e-4,
                                                             "composition_at_verify": {"outside_dp": outside_dp}})
        if report:
            write_json("results/privacy/privacy.json", report)
        client.set_terminated(client.create_run(exp_id, tags={"mlflow.parentRunId": parent}).info.run_id)
        tracking.end_parent("dpfm", parent, ok=ok, params=validated)
        return client.get_run(parent).data.tags

    test_run = parent_tags(True, [])
    assert test_run["mlflow.runName"].startswith("NOT PRIVATE "), test_run["mlflow.runName"]
    assert "test run" in test_run["dpfm.not_private"] and test_run["dpfm.private"] == "false"
    released = parent_tags(False, ["dp-train-twin (ε = ∞)"])
    assert released["mlflow.runName"].startswith("NOT PRIVATE ") and "dp-train-twin" in released["dpfm.not_private"]
    both = parent_tags(True, ["dp-train-twin (ε = ∞)"])["dpfm.not_private"]  # every reason, not the first
    assert "test run" in both and "dp-train-twin" in both, both
    private = parent_tags(False, [])
    assert not private["mlflow.runName"].startswith("NOT PRIVATE") and "dpfm.private" not in private
    os.remove("results/privacy/verification.json")
    unverified = parent_tags(False, [], verified=False, report={"private": False, "not_private": ["a reason"]})
    assert unverified["mlflow.runName"] == "NOT PRIVATE mae ε≤8", unverified["mlflow.runName"]
    # A workflow that failed after the shards stage logged n: under add_remove its ε does not cover n, and
    # the parent says so; its config giving no reason, it claims nothing.
    failed = parent_tags(False, [], verified=False, ok=False, sets=("privacy.adjacency=add_remove",))
    assert failed["mlflow.runName"].startswith("NOT PRIVATE ") and "add_remove" in failed["dpfm.not_private"]
    assert "dpfm.private" not in parent_tags(False, [], verified=False, ok=False)


STAGE_THAT_SAVES = textwrap.dedent("""
    import pathlib, signal, sys, time
    out = pathlib.Path(sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: (print("told to end", flush=True), (out / "told").write_text("")))
    print("training", flush=True)
    while not (out / "go").exists():  # the step in flight, then the checkpoint: as long as the test holds it
        time.sleep(0.02)
    (out / "saved").write_text("")
    sys.exit(128 + signal.SIGTERM)
""")


def test_the_rules_shell_waits_for_a_stage_saving_its_checkpoint_on_sigterm(tmp_path):
    """SLURM's SIGTERM before the time limit reaches every process of the job step: the rule's bash too.
    Untrapped, bash died at once (143) while the stage was still finishing its step, Snakemake took the
    job as failed and ended, and the job's end killed the stage before it saved. The rule's shell, as
    rules/stages.smk writes it, must wait for the stage and exit with its code."""
    line = next(l for l in (ROOT / "rules/stages.smk").read_text().splitlines() if "{params.command}" in l)
    template = eval(line.strip())  # the rule's shell string, as Snakemake formats it
    (tmp_path / "stage.py").write_text(STAGE_THAT_SAVES)
    shell = template.format(params=SimpleNamespace(command=f"{sys.executable} {tmp_path / 'stage.py'} {tmp_path}"),
                            threads=1, log=tmp_path / "job.log")
    job = subprocess.Popen(["bash", "-c", "set -euo pipefail; " + shell], start_new_session=True,
                           env={**os.environ, "DPFM_RESOLVED_PARAMS": "params.yaml"})  # as rules/common.smk sets it
    while "training" not in ((tmp_path / "job.log").read_text() if (tmp_path / "job.log").exists() else ""):
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGTERM)  # every process of the step, as SLURM signals it
    while not (tmp_path / "told").exists():
        time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired):  # the stage still saving: the shell must not have ended
        job.wait(timeout=3)
    (tmp_path / "go").write_text("")
    assert job.wait(timeout=60) == 128 + signal.SIGTERM and (tmp_path / "saved").exists()
    assert "told to end" in (tmp_path / "job.log").read_text()  # tee logged to the end


def test_a_private_stages_metrics_and_series_carry_its_steps_and_its_one_start_time(local_mlflow):
    """On private data every point (single metrics and whole series, past one batch of MLflow's limit)
    carries the stage's start as its time, so the gaps between calls do not publish how long each part
    took; and each is at the step given, the series' whole curve included."""
    import types

    from pipeline import tracking

    stage = types.SimpleNamespace(name="dp-train", input_paths=[], touches_private_data=True)
    with tracking.stage_run(stage, {"run": {"seed": 0}}, "dpfm") as run:
        run.log_metrics({"loss": 2.0, "skipped": None}, step=3)
        time.sleep(0.05)
        run.log_series("heldout_loss", [float(i) for i in range(1000)], range(5, 1005))
        time.sleep(0.05)
        run.log_metrics({"loss": 1.0}, step=7)
    client = tracking._mlflow("dpfm").tracking.MlflowClient()
    finished = client.get_run(run.run_id)
    loss, curve = (client.get_metric_history(run.run_id, k) for k in ("loss", "heldout_loss"))
    assert sorted((m.step, m.value) for m in loss) == [(3, 2.0), (7, 1.0)]
    assert sorted((m.step, m.value) for m in curve) == [(i + 5, float(i)) for i in range(1000)]
    assert {m.timestamp for m in loss + curve} == {finished.info.start_time}
    assert "skipped" not in finished.data.metrics


def test_a_stages_artifacts_land_under_the_path_given_and_every_tag_is_set(local_mlflow, tmp_path):
    """The report reads artifacts from where the stage put them (a folder and a file under `artifact_path`);
    a missing file is skipped; each tag of a set is written, as text."""
    import types

    from pipeline import tracking

    (tmp_path / "figs").mkdir()
    (tmp_path / "figs/a.png").write_bytes(b"png")
    (tmp_path / "table.json").write_text("{}")
    stage = types.SimpleNamespace(name="evaluate", input_paths=[], touches_private_data=False)
    with tracking.stage_run(stage, {"run": {"seed": 0}}, "dpfm") as run:
        run.log_artifact(tmp_path / "figs", "results/figs")
        run.log_artifact(tmp_path / "table.json", "results")
        run.log_artifact(tmp_path / "missing.json", "results")
        run.set_tags({"dpfm.private": False, "dpfm.not_private": "a reason", "dp_runs": 2})
    client = tracking._mlflow("dpfm").tracking.MlflowClient()
    assert sorted(a.path for a in client.list_artifacts(run.run_id, "results")) == ["results/figs",
                                                                                    "results/table.json"]
    assert [a.path for a in client.list_artifacts(run.run_id, "results/figs")] == ["results/figs/a.png"]
    tags = client.get_run(run.run_id).data.tags
    assert (tags["dpfm.private"], tags["dpfm.not_private"], tags["dp_runs"]) == ("False", "a reason", "2")


def test_a_locked_store_is_retried_and_any_other_error_or_the_last_lock_is_raised(monkeypatch):
    """Parallel stages share one SQLite writer: 'database is locked' is waited out, with backoff; an error
    of another kind, or a lock that outlasts every attempt, must reach the stage, not be dropped."""
    from pipeline import tracking

    waits = []
    monkeypatch.setattr(tracking.time, "sleep", waits.append)
    calls = []

    def locked_twice():
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("(sqlite3.OperationalError) database is locked")
        return "logged"

    assert tracking._retry(locked_twice) == "logged" and len(calls) == 3 and waits == [0.2, 0.4]
    with pytest.raises(RuntimeError, match="locked"):
        tracking._retry(lambda: (_ for _ in ()).throw(RuntimeError("database is locked")), attempts=3)
    calls.clear()

    def broken():
        calls.append(1)
        raise ValueError("no such table: runs")

    with pytest.raises(ValueError, match="no such table"):
        tracking._retry(broken)
    assert len(calls) == 1


def test_a_failed_pipelines_parent_ends_failed_and_a_not_private_one_publishes_no_composed_epsilon(local_mlflow):
    """The parent of a failed workflow must say FAILED, not FINISHED; and a run NOT PRIVATE as a whole
    has composed ε = ∞ (a tag): no finite epsilon_composed metric stands beside its ε."""
    from pipeline import tracking
    from pipeline.io import write_json

    client = tracking._mlflow("dpfm").tracking.MlflowClient()
    exp_id = client.get_experiment_by_name("dpfm").experiment_id
    statuses = []
    for ok in (False, True):
        parent = tracking.start_parent("dpfm")
        time.sleep(0.01)  # written after the parent started: this run's
        write_json("results/privacy/verification.json", {"epsilon_reported": 2.0, "sigma": 1.4, "delta": 4e-4})
        write_json("results/privacy/privacy.json", {"private": False, "not_private": ["a reason"],
                                                    "epsilon_composed": 2.5})
        client.set_terminated(client.create_run(exp_id, tags={"mlflow.parentRunId": parent}).info.run_id)
        tracking.end_parent("dpfm", parent, ok=ok)
        statuses.append(client.get_run(parent).info.status)
    finished = client.get_run(parent)
    assert statuses == ["FAILED", "FINISHED"]
    assert finished.data.metrics["epsilon"] == 2.0 and "epsilon_composed" not in finished.data.metrics
    assert finished.data.tags["dpfm.private"] == "false"


def test_the_parents_params_yaml_never_holds_the_noise_key(local_mlflow):
    """The parent's params.yaml artifact is published: a known noise key in it would let anyone subtract
    the noise from the released model."""
    import mlflow

    from pipeline import tracking
    from pipeline.config import load_params

    shutil.copy(ROOT / "params.yaml", "params.yaml")
    shutil.copytree(ROOT / "schemas", "schemas")
    params = load_params("params.yaml", ["privacy.testing=true", "dp.noise_seed=1234567"])
    client = tracking._mlflow("dpfm").tracking.MlflowClient()
    parent = tracking.start_parent("dpfm", params)
    exp_id = client.get_experiment_by_name("dpfm").experiment_id
    client.set_terminated(client.create_run(exp_id, tags={"mlflow.parentRunId": parent}).info.run_id)
    tracking.end_parent("dpfm", parent, ok=True, params=params)
    shown = Path(mlflow.artifacts.download_artifacts(run_id=parent, artifact_path="params.yaml")).read_text()
    assert "noise_seed" in shown and "1234567" not in shown, shown


def test_a_multi_node_run_missing_any_part_of_its_rendezvous_is_refused_by_name():
    """srun with `--agent-of None` or an endpoint of `None:port` starts agents that never meet: the
    launcher stops first, naming what it lacks."""
    whole = {"head": "gpu001.ib", "port": 21234, "job_id": "41234", "head_node": "gpu001"}
    for missing in whole:
        with pytest.raises(ValueError, match="rendezvous head node"):
            launch.launch_command(STAGE, nodes=2, gpus=16, **{**whole, missing: None})


def test_a_run_asking_one_node_more_than_its_job_holds_is_refused(monkeypatch):
    fake_scontrol(monkeypatch, {"41234": JOB})
    with pytest.raises(RuntimeError, match="resources.nodes is 3 but SLURM job 41234 has 2 node"):
        launch.slurm_rendezvous(3, {"SLURM_JOB_ID": "41234"})


def test_the_launcher_sets_torchruns_shutdown_grace_unless_the_job_already_did():
    show = "import os; print(os.environ['TORCH_ELASTIC_SHUTDOWN_TIMEOUT'])"
    env = {k: v for k, v in tool_env().items() if k != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    for given, wanted in (({}, str(launch.SHUTDOWN_GRACE_S)), ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"}, "90")):
        done = subprocess.run([sys.executable, "-m", "pipeline.launch", "--", sys.executable, "-c", show],
                              capture_output=True, text=True, timeout=60, env={**env, **given})
        assert done.returncode == 0 and done.stdout.strip() == wanted, done.stderr


def test_print_shows_the_command_and_runs_nothing():
    done = subprocess.run([sys.executable, "-m", "pipeline.launch", "--print", "--", "sh", "-c", "exit 5"],
                          capture_output=True, text=True, timeout=60, env=tool_env())
    assert done.returncode == 0 and done.stdout.strip() == shlex.join(["sh", "-c", "exit 5"]), done.stderr


def test_a_process_whose_job_scontrol_cannot_answer_for_runs_as_outside_slurm(monkeypatch):
    """slurmctld down or slow: `scontrol pidinfo` or `show job` fails, and the stage runs on the threads
    it asked for rather than crashing at its start."""
    fake_scontrol(monkeypatch, {}, pids={})  # every question fails, as scontrol does with a non-zero exit
    monkeypatch.setattr(slurm, "_in_slurm_cgroup", lambda: True)
    monkeypatch.setattr(slurm.shutil, "which", lambda name: "/usr/bin/" + name)
    assert slurm.job_id({}) is None and slurm.threads_per_process(3, {}) == 3

    def failing(*args):
        raise slurm.subprocess.TimeoutExpired(["scontrol", *args], 60)

    monkeypatch.setattr(slurm, "_scontrol", failing)
    assert slurm.threads_per_process(3, {"SLURM_JOB_ID": "9"}) == 3


def test_a_machine_without_proc_cgroups_never_asks_scontrol(monkeypatch):
    """A laptop (no /proc) that has scontrol: no cgroup says SLURM, so no process waits on it."""
    calls = fake_scontrol(monkeypatch, {}, pids={os.getpid(): "41234"})
    monkeypatch.setattr(slurm.shutil, "which", lambda name: "/usr/bin/" + name)

    def no_proc(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(slurm, "open", no_proc, raising=False)
    assert slurm.job_id({}) is None and calls == []


def test_scontrol_fields_holding_equals_signs_or_spaces_are_read(monkeypatch):
    """Real `scontrol show job -o` lines hold TRES=cpu=32,mem=...; `show node -o` lines an OS= with spaces
    (`OS=Linux 5.14.0 #1 SMP`), and a node without NodeAddr is reached by its name."""
    fake_scontrol(monkeypatch, {"41234": JOB + " TRES=cpu=32,mem=128G,node=2,billing=32"})
    assert slurm.allocation({"SLURM_JOB_ID": "41234"}) == slurm.Allocation("41234", ("gpu017", "gpu018"), 32)
    node = "NodeName=gpu017 Arch=x86_64 NodeAddr=gpu017-ib OS=Linux 5.14.0-362.el9.x86_64 #1 SMP PREEMPT_DYNAMIC"
    monkeypatch.setattr(slurm, "_scontrol", lambda *args: node)
    assert slurm.node_address("gpu017") == "gpu017-ib"
    monkeypatch.setattr(slurm, "_scontrol", lambda *args: "NodeName=cpu001 Arch=x86_64 State=IDLE")
    assert slurm.node_address("cpu001") == "cpu001"
