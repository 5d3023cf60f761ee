"""The DP-SGD step: clip each example's gradient to C, sum, add Gaussian noise once per logical
batch, divide by the expected batch size.

Per-sample gradients here come from torch.func (vmap of grad over single samples): exact for every
layer. Per-batch clipping (Dp-CLIP, whose contrastive loss does not split per sample) clips the
whole batch gradient instead; its sensitivity under add/remove of one example is 2C.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import functional_call, grad, vmap

SENSITIVITY = {"per_sample": 1.0, "per_batch": 2.0}


@dataclass
class ClipStats:
    norms: list            # per-sample (or per-batch) gradient norms before clipping
    nonfinite: int = 0     # examples whose norm was not finite: they contribute nothing


class PerSampleClipper:
    """Σ_i min(1, C/‖g_i‖) g_i over a micro-batch, accumulated into `self.sum`."""

    mode = "per_sample"

    def __init__(self, model: torch.nn.Module, clip_norm: float):
        self.model, self.clip_norm = model, clip_norm
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.sum = None


        def loss_one(params, buffers, *sample):
            batch = tuple(x.unsqueeze(0) for x in sample)
            return functional_call(model, (params, buffers), batch)[0]

        self._grad_one = grad(loss_one)

    def reset(self) -> None:
        self.sum = {n: torch.zeros_like(p) for n, p in self.model.named_parameters() if p.requires_grad}

    def accumulate(self, *batch: torch.Tensor) -> ClipStats:
        params = {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}
        buffers = dict(self.model.named_buffers())
        in_dims = (None, None) + (0,) * len(batch)
        grads = vmap(self._grad_one, in_dims=in_dims)(params, buffers, *batch)
        flat_sq = sum(g.float().pow(2).flatten(1).sum(1) for g in grads.values())
        norms = flat_sq.sqrt()
        finite = torch.isfinite(norms)
        scale = torch.where(finite, (self.clip_norm / (norms + 1e-6)).clamp(max=1.0), torch.zeros_like(norms))
        for n, g in grads.items():
            g = torch.where(finite.view(-1, *[1] * (g.ndim - 1)), g, torch.zeros_like(g))
            self.sum[n] += torch.einsum("b,b...->...", scale, g.float())
        return ClipStats(norms.tolist(), int((~finite).sum()))


class PerBatchClipper:
    """The whole batch's mean-loss gradient clipped to C (for batch-coupled losses such as CLIP)."""

    mode = "per_batch"

    def __init__(self, model: torch.nn.Module, clip_norm: float):
        self.model, self.clip_norm = model, clip_norm
        self.sum = None

    def reset(self) -> None:
        self.sum = {n: torch.zeros_like(p) for n, p in self.model.named_parameters() if p.requires_grad}

    def accumulate(self, *batch: torch.Tensor) -> ClipStats:
        if len(batch[0]) == 0:
            return ClipStats([])
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        loss = self.model(*batch).mean()
        grads = torch.autograd.grad(loss, [p for _, p in named])
        norm = torch.sqrt(sum(g.float().pow(2).sum() for g in grads))
        if not torch.isfinite(norm):
            return ClipStats([float(norm)], nonfinite=1)
        scale = min(1.0, self.clip_norm / (float(norm) + 1e-6))
        for (n, _), g in zip(named, grads):
            self.sum[n] += scale * g.float()
        return ClipStats([float(norm)])


def make_clipper(objective: str, model: torch.nn.Module, clip_norm: float):
    return PerBatchClipper(model, clip_norm) if objective == "clip" else PerSampleClipper(model, clip_norm)


def noisy_update(clipper, noise_std: float, denominator: float, generator: torch.Generator) -> None:
    """Set p.grad = (clipped sum + N(0, noise_std²)) / denominator, noise drawn once per parameter."""
    for n, p in clipper.model.named_parameters():
        if not p.requires_grad:
            continue
        noise = torch.randn(p.shape, generator=generator, dtype=torch.float32) * noise_std
        p.grad = ((clipper.sum[n] + noise.to(p.device)) / denominator).to(p.dtype)
