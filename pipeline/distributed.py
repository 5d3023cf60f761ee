"""Data parallelism under torchrun: one Poisson logical batch split across ranks, the clipped sums
all-reduced, the noise drawn identically on every rank (same secret generator), so it is added once."""

from __future__ import annotations

import hashlib

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(device: str) -> World:
    """The torchrun world (RANK/WORLD_SIZE in the environment), or a single process."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    return World(dist.get_rank(), dist.get_world_size())


def process_rank() -> int:
    """This process's rank before any process group exists (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def all_reduce_sum(tensors: dict[str, torch.Tensor], world: World) -> None:
    """Sum each tensor over ranks in place, as one flat buffer (one collective per step)."""
    if world.size == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for t in tensors.values():
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def collective_device() -> torch.device:
    """Where a collective's tensor must live: NCCL moves CUDA tensors only, gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_int(value: int, world: World) -> int:
    if world.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.broadcast(t, src=0)
    return int(t.item())


def broadcast_floats(values: list[float], world: World) -> list[float]:
    """The main rank's `values`, on every rank (float64: exactly)."""
    if world.size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.broadcast(t, src=0)
    return t.tolist()


def spread_over_ranks(values: list[float], world: World) -> list[float]:
    """How far apart the ranks' `values` lie: the largest less the smallest of each, 0 exactly where
    every rank holds the same (float64; one all-reduce of each value and its negation)."""
    if world.size == 1:
        return [0.0] * len(values)
    t = torch.tensor([*values, *(-v for v in values)], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return (t[:len(values)] + t[len(values):]).tolist()


def fingerprint(value) -> int:
    """A 52-bit digest of repr(value): exact in float64, so the ranks can compare it (same_on_every_rank)."""
    return int(hashlib.sha256(repr(value).encode()).hexdigest()[:13], 16)


def same_on_every_rank(values: list[float], world: World) -> bool:
    """Whether every rank holds exactly these `values`."""
    return not any(spread_over_ranks(values, world))


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()


class _GatherWithGrad(torch.autograd.Function):
    """All ranks' rows in rank order; the backward sends each rank the summed gradient of its rows
    (all-reduce rather than reduce-scatter, which gloo lacks). Parts may differ in length."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: tuple, rank: int) -> torch.Tensor:
        ctx.sizes, ctx.rank = sizes, rank
        padded = x.new_zeros((max(sizes), *x.shape[1:]))
        padded[:len(x)] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = sum(ctx.sizes[:ctx.rank])
        return grad[start:start + ctx.sizes[ctx.rank]], None, None


def gather_with_grad(world: World):
    """x -> (every rank's x concatenated in rank order, where this rank's rows start), differentiable:
    a loss that couples examples across ranks (CLIP's) sees the whole batch, and the gradients of the
    ranks' parts add up to the gradient of the whole. Collective: every rank calls it, the same times."""

    @torch.compiler.disable  # eager under dp.compile: traced, the gathers' sizes mismatched across ranks (gloo)
    def gather(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        if world.size == 1:
            return x, 0
        size = torch.tensor([len(x)], dtype=torch.int64, device=x.device)
        sizes = [torch.zeros_like(size) for _ in range(world.size)]
        dist.all_gather(sizes, size)
        sizes = tuple(int(s.item()) for s in sizes)
        full = _GatherWithGrad.apply(x.float().contiguous(), sizes, world.rank).to(x.dtype)
        return full, sum(sizes[:world.rank])

    return gather
