"""Opacus's per-sample clipping behind the same interface as ours, as a baseline to compare with.

`opacus-hooks` instantiates every per-sample gradient (GradSampleModule); `opacus-ghost` computes
norms with ghost clipping and then runs a second, reweighted backward pass.

Opacus's module hooks never fire for our broadcast parameters (cls/mask tokens, CLIP's temperature):
their output does not depend on their input. Those few parameters are hidden from Opacus and their
per-sample gradients (the output gradient itself) are read through tensor hooks, then combined
with Opacus's into one per-sample norm.
"""

from __future__ import annotations

import contextlib

import torch
from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping

from pipeline.models.layers import BroadcastParameter
from pipeline.privacy.clipping import SUM_DTYPE, ClipStats, clip_factors, reject_unboundable, zero_sums
from pipeline.privacy.layer_rules import bounded_sq_norms


class _OpacusBase:
    mode = "per_sample"

    def __init__(self, model: torch.nn.Module, clip_norm: float, autocast=contextlib.nullcontext, loss_scale=1.0):
        if loss_scale != 1.0:
            raise ValueError("the Opacus baselines have no loss scale: use dp.clipping=bookkeeping for fp16")
        reject_unboundable(model, per_example_rules=False)
        self.model, self.clip_norm, self.autocast = model, clip_norm, autocast
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.broadcast = [m for m in model.modules() if isinstance(m, BroadcastParameter) and m.weight.requires_grad]
        self.broadcast_names = {id(m.weight): n for n, m in model.named_modules() if m in self.broadcast
                                for n in [n + ".weight"]}
        self._grads: dict[int, torch.Tensor] = {}
        for m in self.broadcast:
            m.register_forward_hook(self._capture)
        self.sum = None

    def _capture(self, module, inputs, output):
        output = output.detach().requires_grad_(True)
        output.register_hook(lambda g: self._grads.__setitem__(id(module), g.detach().float()))
        return output

    def _hidden_from_opacus(self):
        for m in self.broadcast:
            m.weight.requires_grad_(False)

    def reset(self, parts: int = 1) -> None:
        self.sum = None
        self.sum = zero_sums(self.params, SUM_DTYPE, parts)

    def finish(self, batch_size: int) -> int:
        return 0

    def _broadcast_sq_norms(self) -> torch.Tensor:
        return sum(g.flatten(1).pow(2).sum(1) for g in self._grads.values())


class OpacusHooksClipper(_OpacusBase):
    def __init__(self, model, clip_norm, **kw):
        super().__init__(model, clip_norm, **kw)
        self._hidden_from_opacus()
        self.gsm = GradSampleModule(model, loss_reduction="sum", strict=False)

    def accumulate(self, *batch) -> ClipStats:
        self._grads = {}
        with self.autocast():
            losses = self.gsm(*batch)
        losses.float().sum().backward()
        grads = {n: p.grad_sample.float() for n, p in self.params.items() if id(p) not in self.broadcast_names}
        grads.update({self.broadcast_names[id(m.weight)]: self._grads[id(m)] for m in self.broadcast})
        # Never below the exact norms, as the other routes' (one fp32 sum of squares read them low: 1.0000002·C)
        norms = torch.sqrt(sum(bounded_sq_norms(g) for g in grads.values()))
        scale, finite = clip_factors(norms, self.clip_norm)
        for n, g in grads.items():
            g = torch.where(finite.view(-1, *[1] * (g.dim() - 1)), g, torch.zeros_like(g))
            self.sum[n] += torch.einsum("b,b...->...", scale, g)
        for p in self.params.values():
            p.grad_sample, p.grad = None, None
        return ClipStats(norms.tolist(), int((~finite).sum()))


class OpacusGhostClipper(_OpacusBase):
    def __init__(self, model, clip_norm, **kw):
        super().__init__(model, clip_norm, **kw)
        self._hidden_from_opacus()
        self.gsm = GradSampleModuleFastGradientClipping(model, loss_reduction="sum", strict=False,
                                                        max_grad_norm=clip_norm, use_ghost_clipping=True)

    def accumulate(self, *batch) -> ClipStats:
        self._grads = {}
        self.gsm.enable_hooks()
        with self.autocast():
            losses = self.gsm(*batch).float()
        losses.sum().backward(retain_graph=True)  # pass 1: per-sample norms through Opacus's hooks
        norms = torch.sqrt(self.gsm.get_norm_sample().float().pow(2) + self._broadcast_sq_norms())
        coef, finite = clip_factors(norms, self.clip_norm)
        for p in self.params.values():
            p.grad = None
        self.gsm.disable_hooks()
        self._grads = {}
        (losses * coef).sum().backward()  # pass 2: the clipped sum
        for n, p in self.params.items():
            if id(p) in self.broadcast_names:
                continue
            self.sum[n] += p.grad.float()
            p.grad = None
        for m in self.broadcast:
            self.sum[self.broadcast_names[id(m.weight)]] += self._grads[id(m)].sum(0)
        return ClipStats(norms.tolist(), int((~finite).sum()))
