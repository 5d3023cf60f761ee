"""Per-layer rules of the one-pass clipper: one entry per supported layer type, as in Opacus's
grad_sample registry. The registry is the one list of layers the DP engine supports.

A rule reads one call of its layer: the layer's input `a` and the gradient `g` of its output (both
(B, ..., d), fp32), and gives

  per_sample(m, a, g)     {param attr: (B, *shape)}  the instantiated per-example gradients
  ghost_sq_norm(m, a, g)  (B,)                       ‖per-example gradient‖² without instantiating
                                                     it (Linear, Embedding: `has_ghost`)
  clipped_sum(m, a, g, c) {param attr: shape}        Σ_i c_i · per-example gradient i (c: the clip
                                                     factors, (B,))

  Linear      G_i = Σ_t g_it a_itᵀ           (+ bias Σ_t g_it)
  LayerNorm   γ_i = Σ_t g_it ⊙ x̂_it,  β_i = Σ_t g_it
  Embedding   E_i = Σ_t onehot(id_it) g_itᵀ
  Broadcast   P_i = g_i                       (cls/mask tokens, CLIP's temperature)

Ghost norms use ‖Σ_t g_t a_tᵀ‖² = Σ_{t,s} (a_t·a_s)(g_t·g_s). Both routes are exact; which one a
Linear layer takes is a question of time and memory only (mixed ghost clipping):
  ghost         the Gram products, B·T²·(d+p) multiply-adds (from 128 tokens only the blocks on and above
                the diagonal: `gram_inner`), then the clipped sum (one weight gradient)
  instantiate   the per-example gradients, B·T·d·p multiply-adds (one weight gradient's worth) written out
                as B·d·p floats and held until every layer's norm is known; then a cheap weighted sum
So instantiating saves the Gram products and costs the writes: it is faster when
WRITE_COST·d·p < T²·(d+p) (long sequences: 224 px images), and it holds B·d·p floats in place of the
layer's input and output gradient, B·T·(d+p). The clipper decides with `ghost_is_faster` and its
memory budget (clipping.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models.layers import BroadcastParameter

# Multiply-adds that writing (and reading back) one per-example gradient float costs, against the Gram
# products' multiply-adds: on 2 CPU cores the crossover lies between T²(d+p)/(d·p) = 15 (ghost 30% faster)
# and 55 (instantiating 20% faster; benchmarks/clipping_routes.py). It moves the choice between two
# exact routes, never a result.
WRITE_COST = 30.0
# Tokens per block of the Gram products. Both T×T Gram matrices are symmetric, so over k blocks only the
# k(k+1)/2 block products on and above the diagonal are formed, the others counting twice. From two
# blocks (T ≥ 128) that took the Gram products 10-22% less time on 2 CPU cores (T = 129-577:
# benchmarks/clipping_routes.py); below that the smaller products cost more than they save.
GRAM_BLOCK = 64


def as_3d(x: torch.Tensor) -> torch.Tensor:
    """(B, d) -> (B, 1, d); (B, T1, T2, ..., d) -> (B, T, d)."""
    return x.reshape(x.shape[0], -1, x.shape[-1]) if x.dim() != 2 else x.unsqueeze(1)


def gram_inner(a: torch.Tensor, g: torch.Tensor, block: int = GRAM_BLOCK) -> torch.Tensor:
    """(B,) Σ_{t,s} (a_t·a_s)(g_t·g_s) = ‖Σ_t g_t a_tᵀ‖² per example, of a (B, T, d) and g (B, T, p)."""
    T = a.shape[1]
    cuts = [i * block for i in range(max(1, T // block))] + [T]  # the last block takes the remainder
    blocks = [(a[:, s:e], g[:, s:e]) for s, e in zip(cuts, cuts[1:])]
    total = torch.zeros(a.shape[0], dtype=a.dtype, device=a.device)
    for i, (a_i, g_i) in enumerate(blocks):
        for j in range(i, len(blocks)):
            a_j, g_j = blocks[j]
            part = ((a_i @ a_j.transpose(1, 2)) * (g_i @ g_j.transpose(1, 2))).sum((1, 2))
            total += part if i == j else 2 * part
    return total


class LayerRule:
    needs_input = True  # whether the clipper must keep the layer's input
    has_ghost = False   # whether ghost_sq_norm exists for this layer type

    def per_sample(self, m, a, g) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def ghost_sq_norm(self, m, a, g) -> torch.Tensor:
        """(B,) ‖per-example gradient‖² without instantiating it (only where has_ghost)."""
        raise NotImplementedError

    def ghost_is_faster(self, m, a, g) -> bool:
        return True

    def held_if_instantiated(self, m, a, g) -> int:
        """Floats that instantiating keeps beyond the input and output gradient it frees (may be < 0;
        the clipper instantiates inside the backward when the per-example gradients take no more
        floats than the output gradient: clipping.py)."""
        return 0

    def clipped_sum(self, m, a, g, factors) -> dict[str, torch.Tensor]:
        return {k: torch.einsum("b,b...->...", factors, v) for k, v in self.per_sample(m, a, g).items()}


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
    has_ghost = True

    def per_sample(self, m, a, g):
        g3 = as_3d(g)
        out = {"weight": torch.einsum("bto,bti->boi", g3, as_3d(a))}
        if m.bias is not None:
            out["bias"] = g3.sum(1)
        return out

    def ghost_sq_norm(self, m, a, g):
        g3 = as_3d(g)
        sq = gram_inner(as_3d(a), g3)
        if m.bias is not None:
            sq = sq + g3.sum(1).pow(2).sum(1)
        return sq

    def ghost_is_faster(self, m, a, g):
        T, d, p = as_3d(g).shape[1], m.in_features, m.out_features
        return T * T * (d + p) < WRITE_COST * d * p

    def held_if_instantiated(self, m, a, g):
        g3 = as_3d(g)
        B, T, d, p = g3.shape[0], g3.shape[1], m.in_features, m.out_features
        return B * (d * p - T * (d + p))

    def clipped_sum(self, m, a, g, factors):
        g3, a3 = as_3d(g), as_3d(a)
        scale = factors.view(-1, 1, 1)
        if a3.shape[-1] < g3.shape[-1]:  # Σ_i c_i g_iᵀa_i: the narrower side carries c_i (fc1: 4x fewer products)
            out = {"weight": torch.einsum("bto,bti->oi", g3, a3 * scale)}
        else:
            out = {"weight": torch.einsum("bto,bti->oi", g3 * scale, a3)}
        if m.bias is not None:
            out["bias"] = factors @ g3.sum(1)
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

    def held_if_instantiated(self, m, a, g):
        per_example = sum(p.numel() for p in (m.weight, m.bias) if p is not None)
        return g.shape[0] * per_example - a.numel() - g.numel()


@register(nn.Embedding)
class EmbeddingRule(LayerRule):
    def per_sample(self, m, ids, g):
        g3, ids = as_3d(g), ids.reshape(g.shape[0], -1)
        per = torch.zeros(g.shape[0], m.num_embeddings, m.embedding_dim, dtype=g3.dtype, device=g.device)
        per.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, m.embedding_dim), g3)
        return {"weight": per}

    has_ghost = True

    def ghost_is_faster(self, m, ids, g):
        T = ids.reshape(g.shape[0], -1).shape[1]
        return T * T < m.num_embeddings * m.embedding_dim

    def held_if_instantiated(self, m, ids, g):
        B, T = g.shape[0], ids.reshape(g.shape[0], -1).shape[1]
        return B * (m.num_embeddings * m.embedding_dim - T * m.embedding_dim)

    def ghost_sq_norm(self, m, ids, g):
        g3, ids = as_3d(g), ids.reshape(g.shape[0], -1)
        same = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(g3.dtype)
        return (same * (g3 @ g3.transpose(1, 2))).sum((1, 2))

    def clipped_sum(self, m, ids, g, factors):
        out = torch.zeros(m.num_embeddings, m.embedding_dim, dtype=g.dtype, device=g.device)
        out.index_add_(0, ids.reshape(-1), (as_3d(g) * factors.view(-1, 1, 1)).reshape(-1, m.embedding_dim))
        return {"weight": out}


@register(BroadcastParameter)
class BroadcastRule(LayerRule):
    needs_input = False  # the output gradient is the per-example gradient itself

    def per_sample(self, m, a, g):
        return {"weight": g}


SUPPORTED_LAYERS = tuple(RULES)
