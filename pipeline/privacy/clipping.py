"""Exact per-sample gradient clipping in one backward pass (book-keeping style).

Forward hooks keep each layer's input; tensor hooks keep the gradient of its output. One backward
of Σ_i loss_i then gives, per layer and per example i, everything its per-sample gradient is made of:

  Linear      G_i = Σ_t g_it a_itᵀ           (+ bias Σ_t g_it)
  LayerNorm   γ_i = Σ_t g_it ⊙ x̂_it,  β_i = Σ_t g_it
  Embedding   E_i = Σ_t onehot(id_it) g_itᵀ
  Broadcast   P_i = g_i                       (cls/mask tokens, CLIP's temperature)

Per-sample squared norms come from the ghost-norm identity ‖Σ_t g_t a_tᵀ‖² = Σ_{t,s} (a_t·a_s)(g_t·g_s)
where that is cheaper (T² < d_in·d_out), otherwise from the instantiated G_i. With the norms summed
over layers, c_i = min(1, C/‖g_i‖), and the clipped sum Σ_i c_i G_i is formed per layer from the same
tensors: there is no second backward pass. Parameters are kept out of autograd (requires_grad off)
so the backward computes only what the hooks read, not the unclipped parameter gradients as well.

Norms, clipping factors and sums are computed in fp32 whatever the autocast dtype.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from pipeline.models.layers import BroadcastParameter

@dataclass
class ClipStats:
    norms: list            # per-sample (or per-batch) gradient norms before clipping
    nonfinite: int = 0     # examples whose norm was not finite: they contribute nothing


SUPPORTED = (nn.Linear, nn.LayerNorm, nn.Embedding, BroadcastParameter)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """(B, d) -> (B, 1, d); (B, T1, T2, ..., d) -> (B, T, d)."""
    return x.reshape(x.shape[0], -1, x.shape[-1]) if x.dim() != 2 else x.unsqueeze(1)


def _zero_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep.view(-1, *[1] * (x.dim() - 1)), x, torch.zeros_like(x))


class _Record:
    """One call of one module: its input (activation) and, after backward, its output gradient."""

    __slots__ = ("module", "activation", "grad")

    def __init__(self, module, activation):
        self.module, self.activation, self.grad = module, activation, None


class BookKeepingClipper:
    """Σ_i min(1, C/‖∇loss_i‖) ∇loss_i over micro-batches, accumulated into `self.sum` (name -> tensor)."""

    mode = "per_sample"

    def __init__(self, model: nn.Module, clip_norm: float, ghost: bool | None = None):
        """`ghost`: None picks per layer by cost; True/False force ghost norms on/off (for tests)."""
        self.model, self.clip_norm, self.ghost = model, clip_norm, ghost
        self.loss_scale = 1.0  # fp16 training multiplies the loss so small gradients do not underflow
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        owned = {id(p) for m in model.modules() if isinstance(m, SUPPORTED) for p in m.parameters(recurse=False)}
        foreign = [n for n, p in self.params.items() if id(p) not in owned]
        if foreign:
            raise TypeError(f"parameters outside supported layers {[t.__name__ for t in SUPPORTED]}: {foreign}")
        self.layers = [m for m in model.modules() if isinstance(m, SUPPORTED)
                       and any(p.requires_grad for p in m.parameters(recurse=False))]
        self._names = {id(p): n for n, p in self.params.items()}
        self._records: list[_Record] = []
        self._capturing = False
        self.sum = None
        for m in self.layers:
            m.register_forward_hook(self._forward_hook)

    # -- capture ----------------------------------------------------------------------------------
    def _forward_hook(self, module, inputs, output):
        if not self._capturing:
            return None
        activation = None if isinstance(module, BroadcastParameter) else inputs[0].detach()
        record = _Record(module, activation)
        self._records.append(record)
        if not output.requires_grad:  # a layer fed only by data/ids: start the graph here
            output = output.detach().requires_grad_(True)

        def keep(grad):
            record.grad = grad.detach()

        output.register_hook(keep)
        return output

    @contextmanager
    def _capture(self):
        frozen = [p for p in self.params.values()]
        for p in frozen:
            p.requires_grad_(False)
        self._records, self._capturing = [], True
        try:
            yield
        finally:
            self._capturing = False
            for p in frozen:
                p.requires_grad_(True)

    # -- per-layer algebra ------------------------------------------------------------------------
    @staticmethod
    def _per_sample_grads(record: _Record) -> dict[str, torch.Tensor]:
        """Instantiated per-sample gradients {param attr: (B, *shape)} of one call."""
        m, g = record.module, record.grad.float()
        if isinstance(m, BroadcastParameter):
            return {"weight": g}
        g3 = _as_3d(g)
        if isinstance(m, nn.Linear):
            a3 = _as_3d(record.activation.float())
            out = {"weight": torch.einsum("bto,bti->boi", g3, a3)}
            if m.bias is not None:
                out["bias"] = g3.sum(1)
            return out
        if isinstance(m, nn.LayerNorm):
            x_hat = F.layer_norm(record.activation.float(), m.normalized_shape, eps=m.eps)
            out = {}
            if m.weight is not None:
                out["weight"] = (g * x_hat).reshape(g.shape[0], -1, *m.normalized_shape).sum(1)
            if m.bias is not None:
                out["bias"] = g.reshape(g.shape[0], -1, *m.normalized_shape).sum(1)
            return out
        if isinstance(m, nn.Embedding):
            ids = record.activation.reshape(g.shape[0], -1)
            per = torch.zeros(g.shape[0], m.num_embeddings, m.embedding_dim, dtype=torch.float32, device=g.device)
            per.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, m.embedding_dim), g3)
            return {"weight": per}
        raise TypeError(type(m))

    def _ghost_sq_norm(self, record: _Record) -> torch.Tensor | None:
        """Per-sample squared gradient norm without instantiating it, where that is cheaper."""
        m = record.module
        if self.ghost is False:
            return None
        if isinstance(m, nn.Linear):
            g3, a3 = _as_3d(record.grad.float()), _as_3d(record.activation.float())
            T = g3.shape[1]
            if T * T >= m.in_features * m.out_features and not self.ghost:
                return None
            sq = ((a3 @ a3.transpose(1, 2)) * (g3 @ g3.transpose(1, 2))).sum((1, 2))
            if m.bias is not None:
                sq = sq + g3.sum(1).pow(2).sum(1)
            return sq
        if isinstance(m, nn.Embedding):
            g3 = _as_3d(record.grad.float())
            ids = record.activation.reshape(g3.shape[0], -1)
            T = ids.shape[1]
            if T * T >= m.num_embeddings * m.embedding_dim and not self.ghost:
                return None
            same = (ids.unsqueeze(2) == ids.unsqueeze(1)).float()
            return (same * (g3 @ g3.transpose(1, 2))).sum((1, 2))
        return None

    @staticmethod
    def _clipped_sum(record: _Record, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """Σ_i scale_i · (per-sample gradient of this call) for a ghost-normed Linear or Embedding,
        without instantiating it. (Other layers are small and instantiated.)"""
        m = record.module
        g3 = _as_3d(record.grad.float() * scale.view(-1, *[1] * (record.grad.dim() - 1)))
        if isinstance(m, nn.Linear):
            out = {"weight": torch.einsum("bto,bti->oi", g3, _as_3d(record.activation.float()))}
            if m.bias is not None:
                out["bias"] = g3.sum((0, 1))
            return out
        out = torch.zeros(m.num_embeddings, m.embedding_dim, dtype=torch.float32, device=g3.device)
        out.index_add_(0, record.activation.reshape(-1), g3.reshape(-1, m.embedding_dim))
        return {"weight": out}

    # -- the public step --------------------------------------------------------------------------
    def reset(self) -> None:
        self.sum = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in self.params.items()}

    def accumulate(self, *batch: torch.Tensor) -> ClipStats:
        with self._capture():
            losses = self.model(*batch)
            (losses.float().sum() * self.loss_scale).backward()
        records = [r for r in self._records if r.grad is not None]  # a call that did not reach the loss
        for r in records:
            r.grad = r.grad.float() / self.loss_scale
        calls: dict[int, list[_Record]] = {}
        for r in records:
            calls.setdefault(id(r.module), []).append(r)
        batch_size = losses.shape[0]
        sq = torch.zeros(batch_size, dtype=torch.float32, device=losses.device)
        kept: list[tuple[nn.Module, dict]] = []  # instantiated grads of layers called more than once
        for module_calls in calls.values():
            if len(module_calls) == 1 and (ghost := self._ghost_sq_norm(module_calls[0])) is not None:
                sq += ghost
                continue
            # One call without a cheap ghost norm, or a layer reused: sum its calls per sample first.
            per: dict[str, torch.Tensor] = {}
            for r in module_calls:
                for k, v in self._per_sample_grads(r).items():
                    per[k] = per[k] + v if k in per else v
            sq += sum(v.flatten(1).pow(2).sum(1) for v in per.values())
            kept.append((module_calls[0].module, per))
        norms = sq.sqrt()
        finite = torch.isfinite(norms)
        scale = torch.where(finite, (self.clip_norm / (norms + 1e-6)).clamp(max=1.0), torch.zeros_like(norms))
        instantiated = {id(m) for m, _ in kept}
        for m, per in kept:
            for k, v in per.items():
                v = _zero_rows(v, finite)
                self.sum[self._names[id(getattr(m, k))]] += torch.einsum("b,b...->...", scale, v)
        for r in records:
            if id(r.module) in instantiated:
                continue
            if not finite.all():  # a non-finite example contributes nothing (0·NaN would still be NaN)
                r.grad = _zero_rows(r.grad, finite)
                if r.activation is not None and r.activation.is_floating_point():
                    r.activation = _zero_rows(r.activation, finite)
            for k, v in self._clipped_sum(r, scale).items():
                self.sum[self._names[id(getattr(r.module, k))]] += v
        self._records = []
        return ClipStats(norms.tolist(), int((~finite).sum()))


class VmapClipper:
    """Reference engine: per-sample gradients from torch.func (vmap of grad over single samples).
    Exact for any layer but slower and O(B·params) in memory. Σ_i min(1, C/‖g_i‖) g_i over a micro-batch, accumulated into `self.sum`."""

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


class PlainSum:
    """Σ_i ∇loss_i with no clipping: the non-private baseline of the same recipe (never for DP runs)."""

    mode = "per_sample"

    def __init__(self, model: torch.nn.Module, clip_norm: float = float("inf")):
        self.model = model
        self.sum = None

    def reset(self) -> None:
        self.sum = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in self.model.named_parameters()
                    if p.requires_grad}

    def accumulate(self, *batch: torch.Tensor) -> ClipStats:
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        grads = torch.autograd.grad(self.model(*batch).float().sum(), [p for _, p in named])
        for (n, _), g in zip(named, grads):
            self.sum[n] += g.float()
        return ClipStats([])
