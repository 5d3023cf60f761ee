"""The cluster path on a real SLURM: docs/cluster.md's command for a CPU-only partition runs the DAG
to dp-train through sbatch, and a 2-node dp-train (two slurmd on loopback, srun + torchrun over
gloo) gives the 1-process weights.

The cluster is started here, without systemd: munged, slurmctld and two slurmd from Debian's
slurm-wlm (.ci/run installs them), nodes `n1` and `n2` on 127.0.0.1, no accounting daemon (so the
plugin asks squeue, as docs/cluster.md says for such clusters). Skips, naming what is missing,
where SLURM cannot run.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline import checkpoints
from snakemake_project import MICRO, set_params, snakemake_project

pytestmark = pytest.mark.slurm
BIN = Path(sys.executable).parent
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue")
# docs/cluster.md's command (no slurmdbd), with the polling of a test (the plugin waits 40 s before its first check).
COMMAND = [str(BIN / "snakemake"), "--workflow-profile", "profiles/slurm", "--slurm-status-command", "squeue",
           "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "2"]
# CPU-only, sized for the test nodes; dp-train's noise key is fixed (a test run) so runs can be compared.
CLUSTER_ENV = {"DPFM_GPUS_PER_NODE": "0", "DPFM_TRAIN_CPUS": "2", "DPFM_CPU_MEM_MB": "1500"}
TEST_RUN = {"dp": {"noise_seed": 11, "steps": 4}, "privacy": {"testing": True}, "run": {"device": "cpu"}}


def test_the_commands_run_here_are_the_documented_ones():
    """docs/cluster.md's commands for a CPU-only partition and a cluster without slurmdbd are the ones
    this file runs (with a test's polling added), so the doc cannot drift from what is tested."""
    doc = (Path(__file__).resolve().parents[1] / "docs/cluster.md").read_text()
    assert "snakemake --workflow-profile profiles/slurm --slurm-status-command squeue" in doc
    assert "DPFM_GPUS_PER_NODE=0" in doc and "DPFM_NODES=4 snakemake --workflow-profile profiles/slurm" in doc
    for variable in CLUSTER_ENV:
        assert f"`{variable}`" in doc, variable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing() -> str | None:
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs as their user"
    pytest.importorskip("snakemake_executor_plugin_slurm", reason="SLURM plugin missing: the `cluster` extra")
    return None


def daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def start_munge() -> None:
    """munged, unless one answers already (SLURM's auth/munge uses its default socket)."""
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
        return
    for d in ("/run/munge", "/var/lib/munge", "/var/log/munge", "/etc/munge"):
        os.makedirs(d, exist_ok=True)
    if not Path("/etc/munge/munge.key").exists():
        subprocess.run(["dd", "if=/dev/urandom", "of=/etc/munge/munge.key", "bs=1024", "count=1"], check=True,
                       capture_output=True)
        os.chmod("/etc/munge/munge.key", 0o400)
    subprocess.run([daemon("munged"), "--force"], check=True, capture_output=True)


def slurm_conf(root: Path) -> str:
    ports = [free_port() for _ in range(3)]
    nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs=4 RealMemory=4000 "
                      "State=UNKNOWN" for n, p in (("n1", ports[1]), ("n2", ports[2])))
    return f"""ClusterName=dpfmtest
SlurmctldHost=localhost
SlurmctldPort={ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
MpiDefault=none
MinJobAge=600
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


SYSTEM_CONF = Path("/etc/slurm/slurm.conf")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A two-node SLURM on loopback; its config is where SLURM's clients look for it by default,
    as on a cluster (the plugin's job step drops SLURM_CONF with the other SLURM_ variables)."""
    reason = missing() or (f"{SYSTEM_CONF} exists: this machine has a SLURM of its own" if SYSTEM_CONF.exists()
                           else None)
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    for d in ("state", "spool/n1", "spool/n2"):
        (root / d).mkdir(parents=True)
    SYSTEM_CONF.parent.mkdir(parents=True, exist_ok=True)
    SYSTEM_CONF.write_text(slurm_conf(root))
    (root / "slurm.conf").symlink_to(SYSTEM_CONF)
    env = {**os.environ, "SLURM_CONF": str(SYSTEM_CONF)}
    start_munge()
    subprocess.run([daemon("slurmctld"), "-f", str(root / "slurm.conf")], env=env, check=True)
    for node in ("n1", "n2"):
        subprocess.run([daemon("slurmd"), "-f", str(root / "slurm.conf"), "-N", node], env=env, check=True)
    try:
        deadline = time.time() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t %D"], env=env, capture_output=True,
                                           text=True).stdout.replace("idle 2", "idle"):
            if time.time() > deadline:
                pytest.fail("SLURM nodes never became idle:\n" + (root / "slurmctld.log").read_text()[-3000:])
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True)
        SYSTEM_CONF.unlink(missing_ok=True)
        for pidfile in [root / "slurmctld.pid", root / "slurmd-n1.pid", root / "slurmd-n2.pid"]:
            if pidfile.exists():
                try:
                    os.kill(int(pidfile.read_text()), 15)
                except (ProcessLookupError, ValueError):
                    pass


def submit(work: Path, env: dict, *targets: str, **extra_env) -> str:
    proc = subprocess.run([*COMMAND, *targets], cwd=work, env={**env, **CLUSTER_ENV, **extra_env,
                                                               "MLFLOW_TRACKING_URI": f"sqlite:///{work}/mlflow.db"},
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    logs = "\n".join(f"--- {p}\n{p.read_text()[-1500:]}" for p in sorted((work / ".snakemake/slurm_logs").rglob("*.log")))
    assert proc.returncode == 0, out[-4000:] + logs[-6000:]
    return out


def weights(work: Path) -> dict:
    return checkpoints.load(work / "models/dp/checkpoint.pt").model


@pytest.fixture(scope="module")
def one_node_run(cluster, tmp_path_factory):
    work = snakemake_project(tmp_path_factory.mktemp("project"))
    set_params(work, MICRO)
    set_params(work, TEST_RUN)
    out = submit(work, cluster, "models/dp")
    return work, out


def slurm_jobs(env: dict) -> dict[str, str]:
    """{rule: state} of the jobs SLURM ran (the plugin comments each job with its rule)."""
    listing = subprocess.run(["scontrol", "show", "job", "-o"], env=env, capture_output=True, text=True).stdout
    jobs = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in listing.splitlines()]
    return {j["Comment"].removeprefix("rule_"): j["JobState"] for j in jobs if j.get("Comment", "").startswith("rule_")}


def test_the_documented_command_runs_the_dag_to_dp_train_through_sbatch(cluster, one_node_run):
    work, out = one_node_run
    assert (work / "models/dp/checkpoint.pt").is_file() and (work / "models/dp/ledger.json").is_file()
    ran = slurm_jobs(cluster)
    for rule in ("shards", "synthetic", "tokenizer", "pretrain", "dp_train"):
        assert ran.get(rule) == "COMPLETED", (rule, ran)
    assert f"--backend-store-uri sqlite:///{work}/mlflow.db" in out  # the closing message names the store in use
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{work}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("dpfm").experiment_id])
    tagged = {r.data.tags.get("dpfm.stage"): r.data.tags.get("slurm.job_id") for r in runs}
    assert tagged.get("dp-train", "").isdigit(), tagged  # the stage's MLflow run names its SLURM job


def test_two_nodes_train_the_one_process_model(cluster, one_node_run):
    """srun starts one torchrun per node (the launcher reads the nodes from scontrol), the two ranks
    meet over gloo and give the 1-process weights."""
    work, _ = one_node_run
    one = weights(work)
    shutil.rmtree(work / "models/dp")
    for state in (work / ".dpfm/state").glob("dp-train-*"):
        shutil.rmtree(state)
    submit(work, cluster, "models/dp", "--forcerun", "dp_train", DPFM_NODES="2")
    launched = (work / "logs/dp-train.log").read_text()
    assert "srun --nodes=2" in launched and "--nnodes=2 --nproc_per_node=1" in launched, launched[:2000]
    two = weights(work)
    assert one.keys() == two.keys()
    for name in one:
        assert torch.allclose(one[name], two[name], rtol=1e-4, atol=1e-6), name
