"""The SLURM allocation a process runs in, read from SLURM itself.

A job step started by Snakemake's SLURM plugin keeps few of SLURM's variables (the jobstep plugin
drops SLURM_JOB_NODELIST, SLURM_CPUS_PER_TASK and the like before it runs the rule), so nothing
here trusts them beyond the job id: the nodes and CPUs come from `scontrol show job`, and a process
without even SLURM_JOB_ID asks `scontrol pidinfo` which job it belongs to.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Allocation:
    job_id: str
    hosts: tuple[str, ...]   # the job's nodes, head first
    cpus: int                # CPUs of the whole job

    @property
    def cpus_per_node(self) -> int:
        return max(1, self.cpus // max(1, len(self.hosts)))


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True, timeout=60).stdout


def job_id(env=os.environ) -> str | None:
    """This process's SLURM job, or None outside SLURM."""
    for name in ("SLURM_JOB_ID", "SLURM_JOBID"):
        if env.get(name):
            return env[name]
    if shutil.which("scontrol") is None or not _in_slurm_cgroup():
        return None
    try:  # "Slurm JobId=123 ends at ..." for a process of a job
        found = re.search(r"JobId=(\d+)", _scontrol("pidinfo", str(os.getpid())))
    except (subprocess.SubprocessError, OSError):
        return None
    return found.group(1) if found else None


def _in_slurm_cgroup() -> bool:
    """slurmd puts a job's processes in its own cgroup (…/slurm/uid_…/job_…): a hint that is not an
    environment variable, so asking scontrol is worth it (and a laptop never waits for it)."""
    try:
        with open("/proc/self/cgroup") as f:
            return "slurm" in f.read()
    except OSError:
        return False


def parse_fields(text: str) -> dict[str, str]:
    """`scontrol show job|node -o ...` (one line of key=value) as a dict."""
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


def node_address(host: str) -> str:
    """The address SLURM reaches a node by (NodeAddr; its name where they agree)."""
    return parse_fields(_scontrol("show", "node", "-o", host)).get("NodeAddr") or host


def allocation(env=os.environ) -> Allocation | None:
    """The allocation of this process's job, or None outside SLURM."""
    job = job_id(env)
    if job is None:
        return None
    fields = parse_fields(_scontrol("show", "job", "-o", job))
    hosts = tuple(_scontrol("show", "hostnames", fields["NodeList"]).split())
    return Allocation(job, hosts, int(fields.get("NumCPUs", "1")))


def threads_per_process(requested: int, env=os.environ) -> int:
    """Inside a SLURM job, the CPUs SLURM gave this node shared by its processes (torchrun's local
    ranks); elsewhere `requested`. Snakemake caps a rule's threads at the submit host's --cores, so a
    job given 8 CPUs could otherwise run on 2."""
    try:
        alloc = allocation(env)
    except (subprocess.SubprocessError, OSError, KeyError, ValueError):
        alloc = None
    if alloc is None:
        return requested
    return max(1, alloc.cpus_per_node // int(env.get("LOCAL_WORLD_SIZE", "1")))
