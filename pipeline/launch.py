"""How a training rule starts its stage: one process, torchrun on one node, or srun + torchrun on many.

The rules call `PYTHON -m pipeline.launch --nodes N --gpus G -- PYTHON -m pipeline.cli <stage> ...` with
the job's resources (G is the job's total GPU count, as the SLURM plugin's `gpu` resource), PYTHON
being the interpreter that runs Snakemake: a job needs no activated environment. torchrun is started
as `PYTHON -m torch.distributed.run` for the same reason. The stage reads its rank from torchrun's
environment (pipeline.distributed), so the DVC command stays `dpfm <stage>`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from pipeline import slurm

# Rendezvous ports: BASE_PORT + job id mod PORT_SPAN, so jobs sharing a head node differ; all below Linux's
# ephemeral range (32768-60999), where an outgoing connection on the head may already hold the port.
BASE_PORT = 15000
PORT_SPAN = 17000
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # not `torchrun`: a job's PATH may lack the venv
# SLURM tells a training job to stop this long before its time limit (rules/common.smk asks for it).
STOP_NOTICE_S = 300
# How long torchrun waits for its workers to save after a SIGTERM before it kills them: its own default,
# 30 s, is shorter than a step plus a checkpoint at scale. A minute is left for the job to end.
SHUTDOWN_GRACE_S = STOP_NOTICE_S - 60
# The GPUs the job was given, for the stage (cli.resolve_device): a job that asked for GPUs must not
# fall back to the CPU because torch cannot see them (a driver older than its CUDA, a CPU-only build).
JOB_GPUS_ENV = "DPFM_JOB_GPUS"


def launch_command(command: list[str], nodes: int = 1, gpus: int = 0, head: str | None = None,
                   port: int | None = None, job_id: str | None = None, head_node: str | None = None) -> list[str]:
    """The argv that runs `command` once per GPU: plain for one process, else torchrun (under srun on
    several nodes, one torchrun per node meeting at `head:port`, the store on the node named `head_node`
    (agent_command); one CPU process per node when the job has no GPUs)."""
    if not command:
        raise ValueError("launch: no command given (expected `-- dpfm <stage> ...`)")
    if nodes < 1:
        raise ValueError(f"launch: nodes must be >= 1, got {nodes}")
    if gpus < 0:
        raise ValueError(f"launch: gpus must be >= 0, got {gpus}")
    if nodes == 1:
        if gpus <= 1:
            return list(command)
        return [*TORCHRUN, "--standalone", f"--nproc_per_node={gpus}", "--no-python", *command]
    if gpus % nodes:
        raise ValueError(f"launch: a {nodes}-node run needs the same number of GPUs on every node; "
                         f"resources.gpu (the job's total) is {gpus}, not a multiple of {nodes}")
    per_node = gpus // nodes or 1  # no GPUs: one CPU process per node (gloo)
    if not head or port is None or not job_id or not head_node:
        raise ValueError("launch: a multi-node run needs the rendezvous head node, its address, a port and job id")
    return ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            sys.executable, "-m", "pipeline.launch", "--agent-of", head_node, "--",
            f"--nnodes={nodes}", f"--nproc_per_node={per_node}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={head}:{port}", f"--rdzv_id={job_id}", "--no-python", *command]


def agent_command(torchrun_args: list[str], head_node: str, env=os.environ) -> list[str]:
    """torchrun on one node of a multi-node run (srun's task there), told whether it hosts the
    rendezvous store: torch guesses it by comparing the endpoint with this machine's name and
    addresses, and where the head's NodeAddr names another interface (an InfiniBand name) no node
    took the store and every node failed to meet. SLURM names each task's node (SLURMD_NODENAME)."""
    node = env.get("SLURMD_NODENAME")
    told = [f"--rdzv_conf=is_host={int(node == head_node)}"] if node else []  # outside SLURM: torch's guess
    return [*TORCHRUN, *told, *torchrun_args]


def rendezvous_port(job_id: str) -> int:
    return BASE_PORT + int(job_id) % PORT_SPAN if job_id.isdigit() else BASE_PORT


def slurm_rendezvous(nodes: int, env=os.environ) -> tuple[str, int, str, str]:
    """(head address, port, job id, head node) of the SLURM allocation this multi-node run is in, from scontrol
    (pipeline/slurm.py): the plugin's job step keeps few of SLURM's variables."""
    alloc = slurm.allocation(env)
    if alloc is None:
        raise RuntimeError(f"launch: a {nodes}-node run must start inside a SLURM job, and this process is in "
                           "none (neither SLURM_JOB_ID nor `scontrol pidinfo` names one); run snakemake with "
                           "--workflow-profile profiles/slurm")
    if len(alloc.hosts) < nodes:
        raise RuntimeError(f"launch: resources.nodes is {nodes} but SLURM job {alloc.job_id} has "
                           f"{len(alloc.hosts)} node(s); set DPFM_NODES before submitting so the profile asks for them")
    # The head's address as SLURM reaches it (NodeAddr), which other nodes resolve where a name may not.
    return slurm.node_address(alloc.hosts[0]), rendezvous_port(alloc.job_id), alloc.job_id, alloc.hosts[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the job (resources.nodes)")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs of the whole job (resources.gpu)")
    parser.add_argument("--print", action="store_true", help="print the command instead of running it")
    parser.add_argument("--agent-of", metavar="NODE", help="run one node's torchrun of a multi-node run whose "
                        "rendezvous store is on NODE, the command being torchrun's arguments (srun starts it)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- dpfm <stage> ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.agent_of:
        agent = agent_command(command, args.agent_of)
        os.execvp(agent[0], agent)
    try:
        head = port = job_id = head_node = None
        if args.nodes > 1:
            head, port, job_id, head_node = slurm_rendezvous(args.nodes)
        argv_out = launch_command(command, args.nodes, args.gpus, head, port, job_id, head_node)
    except (ValueError, RuntimeError) as e:
        print(e, file=sys.stderr)
        return 2
    rendered = shlex.join(argv_out)
    if args.print:
        print(rendered)
        return 0
    print(f"launch: {rendered}", file=sys.stderr, flush=True)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_GRACE_S))  # srun passes it on
    os.environ[JOB_GPUS_ENV] = str(args.gpus)
    os.execvp(argv_out[0], argv_out)  # the stage's exit status becomes the rule's


if __name__ == "__main__":
    sys.exit(main())
