"""Per-layer rules of the one-pass clipper: one entry per supported layer type, as in Opacus's
grad_sample registry. The registry is the one list of layers the DP engine supports.

A rule reads one call of its layer: the layer's input `a` and the gradient `g` of its output (both
(B, ..., d), fp32), and gives

  per_sample(m, a, g)     {param attr: (B, *shape)}  the instantiated per-example gradients
  ghost_sq_norm(m, a, g)  (B,) or None               ‖per-example gradient‖² without instantiating
                                                     it, where that is cheaper (None: instantiate)
  clipped_sum(m, a, g)    {param attr: shape}        Σ_i per-example gradient, for g already scaled
                                                     per example by its clip factor

  Linear      G_i = Σ_t g_it a_itᵀ           (+ bias Σ_t g_it)
  LayerNorm   γ_i = Σ_t g_it ⊙ x̂_it,  β_i = Σ_t g_it
  Embedding   E_i = Σ_t onehot(id_it) g_itᵀ
  Broadcast   P_i = g_i                       (cls/mask tokens, CLIP's temperature)

Ghost norms use ‖Σ_t g_t a_tᵀ‖² = Σ_{t,s} (a_t·a_s)(g_t·g_s), used for a Linear layer when its
per-sample gradients (d_in·d_out floats each) are larger than its input and output gradient
(T·(d_in + d_out)); otherwise they are instantiated, which is faster and then no larger.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models.layers import BroadcastParameter


def as_3d(x: torch.Tensor) -> torch.Tensor:
    """(B, d) -> (B, 1, d); (B, T1, T2, ..., d) -> (B, T, d)."""
    return x.reshape(x.shape[0], -1, x.shape[-1]) if x.dim() != 2 else x.unsqueeze(1)


class LayerRule:
    needs_input = True  # whether the clipper must keep the layer's input

    def per_sample(self, m, a, g) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def ghost_sq_norm(self, m, a, g, force: bool | None) -> torch.Tensor | None:
        """`force`: None picks by cost, True always, False never."""
        return None

    def clipped_sum(self, m, a, g) -> dict[str, torch.Tensor]:
        return {k: v.sum(0) for k, v in self.per_sample(m, a, g).items()}


RULES: dict[type, LayerRule] = {}


def register(layer_type: type):
    def add(rule_cls):
        RULES[layer_type] = rule_cls()
        return rule_cls
    return add


def rule_for(module: nn.Module) -> LayerRule | None:
    """The rule of the module's type or of its nearest registered base class (ClassToken -> Broadcast)."""
    for cls in type(module).__mro__:
        if cls in RULES:
            return RULES[cls]
    return None


@register(nn.Linear)
class LinearRule(LayerRule):
    def per_sample(self, m, a, g):
        g3 = as_3d(g)
        out = {"weight": torch.einsum("bto,bti->boi", g3, as_3d(a))}
        if m.bias is not None:
            out["bias"] = g3.sum(1)
        return out

    def ghost_sq_norm(self, m, a, g, force):
        g3, a3 = as_3d(g), as_3d(a)
        T = g3.shape[1]
        # Instantiating costs B·d·p floats and one weight gradient; the ghost norm keeps a and g
        # (B·T·(d+p)) and its Gram products cost B·T²·(d+p) on top of the clipped sum. Where the
        # per-sample gradients are no larger than a and g, they are cheaper in time and memory both.
        d, p = m.in_features, m.out_features
        if force is False or (force is None and d * p <= T * (d + p)):
            return None
        sq = ((a3 @ a3.transpose(1, 2)) * (g3 @ g3.transpose(1, 2))).sum((1, 2))
        if m.bias is not None:
            sq = sq + g3.sum(1).pow(2).sum(1)
        return sq

    def clipped_sum(self, m, a, g):
        g3 = as_3d(g)
        out = {"weight": torch.einsum("bto,bti->oi", g3, as_3d(a))}
        if m.bias is not None:
            out["bias"] = g3.sum((0, 1))
        return out


@register(nn.LayerNorm)
class LayerNormRule(LayerRule):
    def per_sample(self, m, a, g):
        x_hat = F.layer_norm(a, m.normalized_shape, eps=m.eps)
        per = lambda t: t.reshape(g.shape[0], -1, *m.normalized_shape).sum(1)  # noqa: E731
        out = {}
        if m.weight is not None:
            out["weight"] = per(g * x_hat)
        if m.bias is not None:
            out["bias"] = per(g)
        return out


@register(nn.Embedding)
class EmbeddingRule(LayerRule):
    def per_sample(self, m, ids, g):
        g3, ids = as_3d(g), ids.reshape(g.shape[0], -1)
        per = torch.zeros(g.shape[0], m.num_embeddings, m.embedding_dim, dtype=g3.dtype, device=g.device)
        per.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, m.embedding_dim), g3)
        return {"weight": per}

    def ghost_sq_norm(self, m, ids, g, force):
        g3, ids = as_3d(g), ids.reshape(g.shape[0], -1)
        T = ids.shape[1]
        if force is False or (force is None and T * T >= m.num_embeddings * m.embedding_dim):
            return None
        same = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(g3.dtype)
        return (same * (g3 @ g3.transpose(1, 2))).sum((1, 2))

    def clipped_sum(self, m, ids, g):
        out = torch.zeros(m.num_embeddings, m.embedding_dim, dtype=g.dtype, device=g.device)
        out.index_add_(0, ids.reshape(-1), as_3d(g).reshape(-1, m.embedding_dim))
        return {"weight": out}


@register(BroadcastParameter)
class BroadcastRule(LayerRule):
    needs_input = False  # the output gradient is the per-example gradient itself

    def per_sample(self, m, a, g):
        return {"weight": g}


SUPPORTED_LAYERS = tuple(RULES)
