"""The DP step with one bug switched on (`with bug(name):`), for the checks that must catch it."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist

from pipeline import objectives
from pipeline.models import CLIP
from pipeline.privacy import clipping, engine


def every_rank_takes_the_whole_batch(indices, sampler, mode, physical, world):
    """Every example counted W times (the old per-batch DDP path did this, then clipped per rank)."""
    return [np.arange(len(indices))]


def local_negatives_only(self, imgs, tokens, gather=None):
    """CLIP's loss computed per rank without the other ranks' examples as negatives."""
    return REAL["clip_forward"](self, imgs, tokens, gather=None)


def noise_divided_by_world_size(clipper, noise_std, denominator, generator):
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    return REAL["add_noise"](clipper, noise_std / ranks, denominator, generator)


def noise_scaled(factor):
    return lambda clipper, noise_std, denominator, generator: REAL["add_noise"](clipper, noise_std * factor,
                                                                                 denominator, generator)


def as_torch_generator(generator, device) -> torch.Generator:
    """A torch generator seeded from the step's noise generator (numpy's on the CPU, noise.step_noise),
    for the bugs that draw through torch."""
    if isinstance(generator, torch.Generator):
        return generator
    return torch.Generator(device=device).manual_seed(int(generator.integers(2 ** 63)))


def noise_from_the_ranks_own_stream(clipper, noise_std, denominator, generator):
    """Each rank seeds its own noise: W independent draws summed into the update, not one."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if isinstance(generator, torch.Generator):
        own = generator.manual_seed(generator.initial_seed() + rank)
    else:
        own = np.random.Generator(np.random.PCG64([int(generator.integers(2 ** 63)), rank]))
    return REAL["add_noise"](clipper, noise_std, denominator, own)


def noise_from_the_global_stream(clipper, noise_std, denominator, generator):
    """The noise drawn from torch's global generator: it depends on everything drawn before (a
    resumed run draws other noise than the uninterrupted one)."""
    return REAL["add_noise"](clipper, noise_std, denominator, torch.default_generator)


def noise_drawn_in_fp32(clipper, noise_std, denominator, generator):
    """The noise drawn as fp32 normals (then scaled, added and divided in fp64 as the real step does):
    Box-Muller on 24-bit uniforms never passes 5.77 std."""
    for name, total in clipper.sum.items():
        z = torch.randn(total.shape, generator=as_torch_generator(generator, total.device), device=total.device,
                        dtype=torch.float32)
        noisy = z.double().mul_(noise_std).add_(total)
        clipper.params[name].grad = noisy.div_(denominator).to(clipper.params[name].dtype)


def clip_bound_doubled(norms, clip_norm):
    return REAL["clip_factors"](norms, 2 * clip_norm)


def every_group_bound_c(model, clip_norm, encoder_share):
    """Clip groups each given the whole C: an example's gradient reaches C·√G, not C."""
    group_of, bounds = REAL["group_bounds"](model, clip_norm, encoder_share)
    return group_of, [clip_norm] * len(bounds)


def views_clipped_apart(self, model, clip_norm, views=1, **kw):
    """dp.mask_views' rows taken for examples: each view clipped to C, so one example moves the sum by up to K·C."""
    REAL["clipped_sum_init"](self, model, clip_norm, **kw)


REAL = {"rank_share": engine.rank_share, "add_noise": engine.add_noise, "clip_factors": clipping.clip_factors,
        "group_bounds": clipping.group_bounds,
        "clip_forward": CLIP.forward, "clipped_sum_init": clipping.ClippedSum.__init__}
BUGS = {
    "local negatives only": (CLIP, "forward", local_negatives_only),
    "whole batch per rank": (engine, "rank_share", every_rank_takes_the_whole_batch),
    "noise / W": (engine, "add_noise", noise_divided_by_world_size),
    "noise x0.7": (engine, "add_noise", noise_scaled(0.7)),
    "noise per rank": (engine, "add_noise", noise_from_the_ranks_own_stream),
    "noise from the global stream": (engine, "add_noise", noise_from_the_global_stream),
    "noise x0.5": (engine, "add_noise", noise_scaled(0.5)),
    "noise drawn in fp32": (engine, "add_noise", noise_drawn_in_fp32),
    "clip bound 2C": (clipping, "clip_factors", clip_bound_doubled),
    "every clip group bound C": (clipping, "group_bounds", every_group_bound_c),
    "mask views clipped apart": (clipping.ClippedSum, "__init__", views_clipped_apart),
    "per-batch K=1": (objectives.SENSITIVITY, "per_batch", 1.0),  # Dp-CLIP's noise halved, its accounting unchanged
}


@contextlib.contextmanager
def bug(name):
    if name is None:
        yield
        return
    module, attr, broken = BUGS[name]
    get, put = ((module.__getitem__, module.__setitem__) if isinstance(module, dict) else
                (lambda a: getattr(module, a), lambda a, v: setattr(module, a, v)))
    original = get(attr)
    put(attr, broken)
    try:
        yield
    finally:
        put(attr, original)
