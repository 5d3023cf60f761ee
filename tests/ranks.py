"""Run a function in two gloo processes (CPU), as torchrun would run a training's ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.distributed import World


def _worker(rank, rendezvous, job, out):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        result = job[0](*job[1:], World(rank, 2))
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def on_two_ranks(tmp_path, fn, *args):
    """fn(*args, world) run by two gloo processes; rank 0's result. `fn` must be importable by name."""
    out = tmp_path / "result.pt"
    mp.start_processes(_worker, args=(str(tmp_path / "rdv"), (fn, *args), str(out)), nprocs=2, start_method="spawn")
    return torch.load(out, weights_only=False)
