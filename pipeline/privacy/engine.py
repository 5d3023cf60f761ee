"""The DP-SGD step, written once. dp-train, its non-private baseline and `dpfm audit` call
`dp_step`; nothing else in the project samples a private batch, clips or adds noise.

One logical step t:
  1. sample   B_t: Poisson with rate q, drawn from (secret key, t), the same on every rank;
              charged to the ledger before anything else (so the count never trails the updates)
  2. clip     each rank runs its share of B_t through the clipper:
                per example: Σ_{i in share} min(1, C/‖g_i‖)·g_i, in micro-batches cut by index range
                             (one example in or out regroups its own range only: `rank_share`)
                per batch:   its part of ∇Σ_{i in B_t} loss_i (the loss all-gathers what couples
                             the examples, with gradient, so the parts add up to the whole)
  3. sum      one all-reduce over ranks: every rank holds the sum over the whole of B_t, each
              example in it exactly once whatever the world size W
              (per batch: now divided by |B_t| and clipped to C, once)
  4. noise    z ~ N(0, (σ·K·C)²) from the generator of (key, t), drawn on the device in fp64 with a tail
              to 12.1 std (noise.py): identical on every rank, so it is added once, not W times
  5. divide   by the expected batch size q·n (per example; never the realised |B_t|, which is
              private) or 1 (per batch: the clipped quantity is already a mean)

Sensitivity K·C under add/remove of one example x:
  per example  K = 1: the sum gains or loses the one term c_x·g_x, ‖c_x·g_x‖ ≤ C.
  per batch    K = 2: x changes every term of a contrastive loss, but the released quantity is the
               clipped batch mean, so both neighbours' values have norm ≤ C and differ by ≤ 2C.
               Under W ranks the parts are summed before the one clip, so the bound is the same
               for any W (clipping each rank's part and summing would give 2·W·C).

All of 2-5 is fp32 outside autocast (clipping.py), and per example a sum over several micro-batches or
ranks fp64 (clipping.SUM_DTYPE); the noise is drawn, added and divided in fp64 (noise.py); only the
forward is in bf16/fp16.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from pipeline.distributed import World, all_reduce_sum, spread_over_ranks
from pipeline.errors import InputError, RanksDisagree
from pipeline.privacy.clipping import BookKeepingClipper, PerBatchClipper, PlainSum, VmapClipper
from pipeline.privacy.compiled_records import CompiledBookKeepingClipper
from pipeline.privacy.noise import NoiseGenerator, gaussian, step_noise
from pipeline.privacy.noise_edge import NOISE_EDGE
from pipeline.privacy.plan import Plan

CLIPPERS = {"bookkeeping": BookKeepingClipper, "vmap": VmapClipper}


# Models whose layers an Opacus baseline fails on: the captioner's bias-free LayerNorms; for the ghost
# baseline, untried on clip-public, that model too. (opacus-hooks runs clip-public, its scalar logit
# scale once broke our norm of its per-sample gradients, and matches bookkeeping's sum there to 3e-8.)
OPACUS_CANNOT_RUN = {"opacus-hooks": ("caption",), "opacus-ghost": ("caption", "clip-public")}


def check_clipping(method: str, precision: str, encoder_share: float | None = None,
                   views: int = 1, mode: str = "per_sample", objective: str | None = None) -> None:
    """Refuse a clipper × precision whose clipped sum can exceed C (the accounted sensitivity), clip
    groups or mask views on a clipper that has one bound per row, fp16 for a whole-batch loss, and an
    Opacus baseline on a model its hooks cannot run."""
    if objective in OPACUS_CANNOT_RUN.get(method, ()):
        raise ValueError(f"dp.clipping={method} cannot run the {objective} model (Opacus's per-sample hooks fail on "
                         f"its layers): use dp.clipping=bookkeeping (the Opacus baselines run the MAE; opacus-hooks clip-public too)")
    if mode == "per_batch" and precision == "fp16":
        # The batch's contrastive loss, scaled by fp16's fixed 2^12, overflows its gradient: every batch
        # is dropped as non-finite and the run trains on noise alone (the step audit's measurement).
        raise ValueError("dp.precision=fp16 overflows a whole-batch loss's gradient (Dp-CLIP) under fp16's fixed "
                         "loss scale, so every batch would be dropped: use bf16 or fp32")
    if encoder_share is not None and method.startswith("opacus-"):
        raise ValueError(f"dp.clipping={method} has one clip bound: dp.encoder_clip_share needs bookkeeping or vmap")
    if views > 1 and method.startswith("opacus-"):
        raise ValueError(f"dp.clipping={method} clips every row apart: dp.mask_views needs bookkeeping or vmap")

    if method == "opacus-ghost":
        # Its ghost norms are Gram products taken as exact: an example whose tokens cancel loses its
        # norm to rounding while its whole gradient is summed (100·C measured in fp32, and 1.0013·C on
        # random inputs under bf16). Book-keeping bounds that rounding (layer_rules.gram_error).
        raise ValueError("dp.clipping=opacus-ghost can let one example exceed the clip norm (its ghost norms "
                         "take no account of rounding): use dp.clipping=bookkeeping, which bounds it, or "
                         "opacus-hooks; opacus-ghost stays a speed baseline in benchmarks/dp_overhead.py")
    if method.startswith("opacus-") and precision == "fp16":
        raise ValueError("the Opacus baselines have no loss scale: use dp.clipping=bookkeeping for fp16")


def make_clipper(mode: str, model: torch.nn.Module, clip_norm: float, method: str = "bookkeeping",
                 autocast=contextlib.nullcontext, loss_scale: float = 1.0, gather=None,
                 encoder_share: float | None = None, views: int = 1, compiled: bool = False):
    """The clipper for a clipping mode ("per_sample" or "per_batch") and, per example, a method:
    bookkeeping | vmap | opacus-hooks | opacus-ghost, or `plain` (no clipping: non-private only).
    `encoder_share`: clip the image encoder's part of each gradient to C·√s, the rest to C·√(1−s).
    `views`: each example comes as that many consecutive rows (its masked views, clipping.view_rows).
    `compiled`: the model will be compiled (dp.compile): book-keeping takes its records without the
    hooks that break the graph (compiled_records.py); the other clippers compile as they are."""
    kw = {"autocast": autocast, "loss_scale": loss_scale}
    if mode == "per_batch":
        return PerBatchClipper(model, math.inf if method == "plain" else clip_norm, gather=gather,
                               encoder_share=encoder_share, views=views, **kw)
    if method == "plain":
        return PlainSum(model, math.inf, views=views, **kw)
    if method.startswith("opacus-"):  # baselines; imported only when asked for
        if views > 1:
            raise ValueError(f"dp.clipping={method} clips every row apart: dp.mask_views needs bookkeeping or vmap")
        if encoder_share is not None:
            raise ValueError(f"dp.clipping={method} has one clip bound: dp.encoder_clip_share needs bookkeeping or vmap")
        from pipeline.privacy.tools.opacus_clipper import OpacusGhostClipper, OpacusHooksClipper

        return {"opacus-hooks": OpacusHooksClipper, "opacus-ghost": OpacusGhostClipper}[method](model, clip_norm, **kw)
    if method not in CLIPPERS:
        raise ValueError(f"unknown clipping method {method!r} (allowed: {', '.join(CLIPPERS)}, opacus-hooks, "
                         "opacus-ghost)")
    clipper = CompiledBookKeepingClipper if compiled and method == "bookkeeping" else CLIPPERS[method]
    return clipper(model, clip_norm, encoder_share=encoder_share, views=views, **kw)


def rank_share(indices: np.ndarray, sampler, mode: str, physical_batch_size: int, world: World) -> list[np.ndarray]:
    """This rank's positions in the logical batch `indices` (from `sampler`: its n and rate q), as
    micro-batches. Per example: buckets of the index range (sampling.split_by_index), so an example
    in or out regroups its own bucket only. Per batch: one part per rank, by place (the loss needs the
    whole part at once, and every rank joins its gathers)."""
    from pipeline.privacy.sampling import PoissonSampler, split_by_index

    if mode == "per_batch":
        return PoissonSampler.split(np.arange(len(indices)), max(1, len(indices)), world.rank, world.size)
    return split_by_index(indices, sampler.n, sampler.n * sampler.q, physical_batch_size, world.rank, world.size)


def pieces(positions: np.ndarray, size: int) -> list[np.ndarray]:
    """`positions` in consecutive pieces of at most `size` (one empty piece if there are none): how a
    loader decodes a per-batch part without holding it whole in each worker."""
    return [positions[i:i + size] for i in range(0, len(positions), size)] or [positions]


def micro_batches(indices: np.ndarray, sampler, mode: str, physical_batch_size: int,
                  world: World) -> Iterator[np.ndarray]:
    """The positions in the logical batch that this rank's clipper computes, one array per call of
    `fetch`: a streaming loader decodes exactly these, in this order, ahead of the step."""
    for positions in rank_share(indices, sampler, mode, physical_batch_size, world):
        if len(positions) or mode == "per_batch" and len(indices):  # a per-batch part joins the gathers
            yield positions


@dataclass
class StepResult:
    batch_size: int   # |B_t|: private, for the ledger only
    nonfinite: int    # examples (per batch: batches) dropped as non-finite, summed over ranks: private


class StepRefused(InputError, RuntimeError):
    """A guard refused the step before it sampled: its message names the plan alone, not the data."""


def dp_step(step: int, *, sampler, fetch: Callable[[int, np.ndarray, np.ndarray], Iterable[torch.Tensor]],
            clipper, plan: Plan, key: int, world: World = World(), physical_batch_size: int = 1 << 30,
            ledger=None) -> StepResult:
    """Steps 1-5 above; leaves the noisy gradient in p.grad for the caller's optimizer.

    `fetch(step, indices, positions)` gives the model inputs of the examples `indices[positions]`;
    `ledger.record_step(step, |B_t|)` (rank 0) charges the step before it is computed."""
    if step >= plan.steps:  # budget guard: ε was paid for plan.steps steps, no more
        raise StepRefused(f"refusing step {step}: ε was accounted for {plan.steps} steps")
    if plan.noise_edge != NOISE_EDGE:  # a ledger from before the noise reached it: another mechanism
        raise StepRefused(f"refusing step {step}: the plan's noise stops at {plan.noise_edge:.2f} std, this step's "
                           f"at {NOISE_EDGE:.2f}")
    indices = sampler.batch(step)
    if ledger is not None:
        ledger.record_step(step, len(indices))
    parts = list(micro_batches(indices, sampler, clipper.mode, physical_batch_size, world))
    clipper.reset(max(1, len(parts)) * world.size)  # partial sums to add up: fp64 from two on (clipping.SUM_DTYPE)
    nonfinite = 0
    for positions in parts:
        nonfinite += clipper.accumulate(*fetch(step, indices, positions)).nonfinite
    first = next(iter(clipper.sum.values()))
    count = torch.tensor([float(nonfinite)], dtype=first.dtype, device=first.device)
    all_reduce_sum({**clipper.sum, "__nonfinite__": count}, world)
    dropped = clipper.finish(len(indices))
    add_noise(clipper, plan.noise_std, plan.denominator, step_noise(key, step, first.device))
    check_same_update(clipper, world)
    return StepResult(len(indices), int(count.item()) + dropped)


SAME_UPDATE_TOL = 1e-10  # relative: GPUs of two kinds may add up the same values in another order


def check_same_update(clipper, world: World) -> None:
    """Every rank must apply the same noisy gradient, the noise counted once. torch's CUDA draws follow
    the GPU's count of multiprocessors, so ranks on GPUs of different kinds could add different noise
    to the same sum: the ranks' weights would part, each carrying noise the accountant never counted.
    The ranks compare Σg² of the update (another draw moves it by about √(2/d) of itself, the same
    draw by rounding alone) and stop before it is applied."""
    if world.size == 1:
        return
    total = float(sum(clipper.params[name].grad.double().pow(2).sum() for name in clipper.sum))
    (spread,) = spread_over_ranks([total], world)
    if not spread <= SAME_UPDATE_TOL * total:
        raise RanksDisagree("the ranks drew different noise for one step, so each would add noise of its own: torch's "
                            "CUDA draws follow the GPU's multiprocessor count; run every rank on the same kind of GPU")


def add_noise(clipper, noise_std: float, denominator: float, generator: NoiseGenerator) -> None:
    """p.grad = (sum + N(0, noise_std²)) / denominator for every parameter the clipper summed, in fp64,
    rounded to the parameter's dtype last. The noise comes from the step's noise generator
    (noise.step_noise) through noise.gaussian, whose tail reaches 12.1 std where fp32 draws stop at
    5.77, one parameter after another in a fixed order, so every rank and every re-run draws the same noise."""
    for name, total in clipper.sum.items():
        p = clipper.params[name]
        if noise_std > 0:
            total = gaussian(total.shape, generator, total.device).mul_(noise_std).add_(total)
        p.grad = total.div_(denominator).to(p.dtype)
