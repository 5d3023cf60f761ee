"""The DP-SGD step: clip, sum, add Gaussian noise once per logical batch, divide by the expected
batch size. Clipping engines live in clipping.py.

Per-batch clipping (Dp-CLIP, whose contrastive loss does not split per sample) clips the whole
batch gradient; under add/remove of one example its sensitivity is 2C (both batches' clipped
gradients have norm ≤ C), so noise of std 2σC gives the same guarantee as σC does per sample.
"""

from __future__ import annotations

import torch

from pipeline.privacy.clipping import BookKeepingClipper, PerBatchClipper, VmapClipper

SENSITIVITY = {"per_sample": 1.0, "per_batch": 2.0}
CLIPPERS = {"bookkeeping": BookKeepingClipper, "vmap": VmapClipper}


def make_clipper(objective: str, model: torch.nn.Module, clip_norm: float, method: str = "bookkeeping"):
    if objective == "clip":
        return PerBatchClipper(model, clip_norm)
    if method.startswith("opacus-"):  # baselines; imported only when asked for
        from pipeline.privacy.opacus_clipper import OpacusGhostClipper, OpacusHooksClipper

        return {"opacus-hooks": OpacusHooksClipper, "opacus-ghost": OpacusGhostClipper}[method](model, clip_norm)
    return CLIPPERS[method](model, clip_norm)


def noisy_update(clipper, noise_std: float, denominator: float, generator: torch.Generator) -> None:
    """Set p.grad = (clipped sum + N(0, noise_std²)) / denominator for every parameter the clipper
    summed, noise drawn once per parameter (in a fixed order, so the same generator gives the same noise)."""
    params = dict(clipper.model.named_parameters())
    for n, total in clipper.sum.items():
        p = params[n]
        noise = torch.randn(p.shape, generator=generator, dtype=torch.float32) * noise_std
        p.grad = ((total + noise.to(p.device)) / denominator).to(p.dtype)
