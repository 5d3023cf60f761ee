"""Per-layer rules of the one-pass clipper: one entry per supported layer type, as in Opacus's
grad_sample registry. The registry is the one list of layers the DP engine supports.

A rule reads one call of its layer: the layer's input `a` and the gradient `g` of its output (both
(B, ..., d), fp32; a Linear rule also takes them in the forward's bf16, `takes_low_precision`), and gives

  per_sample(m, a, g)     {param attr: (B, *shape)}  the instantiated per-example gradients
  ghost_sq_norm(m, a, g)  (B,)                       a bound on ‖per-example gradient‖² without
                                                     instantiating it (Linear, Embedding: `has_ghost`)
  clipped_sum(m, a, g, c) {param attr: shape}        Σ_i c_i · per-example gradient i (c: the clip
                                                     factors, (B,))
  group_views(m, a, g, K) (a, g) of B examples       from B·K rows, K consecutive rows per example
                                                     (dp.mask_views: its K masked views)

  Linear      G_i = Σ_t g_it a_itᵀ           (+ bias Σ_t g_it)
  LayerNorm   γ_i = Σ_t g_it ⊙ x̂_it,  β_i = Σ_t g_it
  Embedding   E_i = Σ_t onehot(id_it) g_itᵀ
  Broadcast   P_i = g_i                       (cls/mask tokens, CLIP's temperature)

Ghost norms use ‖Σ_t g_t a_tᵀ‖² = Σ_{t,s} (a_t·a_s)(g_t·g_s). In floating point that sum can lose an
example whose tokens cancel (its terms far larger than their total), so `ghost_sq_norm` gives a
bound, the computed value plus its worst-case rounding (`gram_error`); the per-example route's norm
is a sum of squares and needs none. Which route a Linear layer takes is a
question of time and memory only (mixed ghost clipping):
  ghost         the Gram products, B·T²·(d+p) multiply-adds (from 128 tokens only the blocks on and above
                the diagonal, below it aligned columns and a corner: `gram_inner`), then the clipped sum
                (one weight gradient)
  instantiate   the per-example gradients, B·T·d·p multiply-adds (one weight gradient's worth) written out
                as B·d·p floats and held until every layer's norm is known; then a cheap weighted sum
So instantiating saves the Gram products and costs the writes: it is faster when
WRITE_COST·d·p < T²·(d+p) (long sequences: 224 px images), and it holds B·d·p floats in place of the
layer's input and output gradient, B·T·(d+p). The clipper decides with `ghost_is_faster` and its
memory budget (clipping.py).
"""

from __future__ import annotations

import contextlib
import functools

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
# Columns of a one-block Gram product come in multiples of this. On this CPU (AVX-512, one thread) a
# batch of T×T products with T = 17, 33 or 65 (a multiple of 16 plus the class token) took 1.2-1.8×
# the time of 16, 32 or 64, while a T × (T − 1) product costs what (T − 1)² does: so the product is
# formed with its columns rounded down to the multiple, and symmetry gives the rest (`gram_inner`).
GRAM_ALIGN = 16


# Products in fp32 from bf16 operands. Under bf16 autocast a Linear multiplies bf16 copies of its input,
# and the clipper holds those copies (clipping.as_autocast_multiplies). The product of two bf16 values is
# exact in fp32, so a bf16 GEMM with fp32 accumulation and output (CUDA's out_dtype overload: tensor
# cores) gives the ghost norms and per-example gradients that upcasting first gives, up to the order of
# summation. The clipped sum's scaled side c_i·g is not a bf16 value: it is rounded to one, for one
# GEMM, and the clip factor pays for the rounding (`reach_sq`). On an H200 at 224 px that took
# the clipped step from 3.4-4.1x the non-private one (upcast) to 1.5-1.9x (docs/results.md, "On a
# GPU"). LOW_PRECISION_PRODUCTS = False times the upcast route.
LOW_PRECISION_PRODUCTS = True


@functools.cache
def cuda_has_low_gemm() -> bool:
    """Whether this torch has CUDA's bf16 GEMM with fp32 output (PyTorch 2.8 on)."""
    one = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")
    try:
        return torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


def low_gemm_applies(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether x @ y may run as a bf16 GEMM with fp32 output: both bf16 and on CUDA (no CPU kernel)."""
    return LOW_PRECISION_PRODUCTS and x.dtype == y.dtype == torch.bfloat16 and x.is_cuda and cuda_has_low_gemm()


def low_gemm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """bf16 (batched) matrix product, fp32 accumulation and output."""
    return (torch.bmm if x.dim() == 3 else torch.mm)(x, y, out_dtype=torch.float32)


@contextlib.contextmanager
def fp32_only(device: torch.device):
    """The privacy arithmetic in full fp32, whatever the caller set: autocast off, and fp32 products at
    full precision (`gram_error` assumes it), not TF32 on a GPU or bf16 inside oneDNN on a CPU, which
    torch.set_float32_matmul_precision("high" or "medium") would allow. Inside a compiled graph (the
    per-example gradients of dp.compile's backward: summed as computed, so any precision is exact there)
    only autocast is turned off."""
    eager = not torch.compiler.is_compiling()
    precision = torch.get_float32_matmul_precision() if eager else None
    if eager:
        torch.set_float32_matmul_precision("highest")
    try:
        with torch.autocast(device_type=device.type, enabled=False):
            yield
    finally:
        if eager:
            torch.set_float32_matmul_precision(precision)


def sum32(x: torch.Tensor, dim) -> torch.Tensor:
    """x summed over dim in fp32 (or wider): upcast element by element, without an fp32 copy of x."""
    return x.sum(dim, dtype=None if x.dtype in (torch.float32, torch.float64) else torch.float32)


def wide(x: torch.Tensor) -> torch.Tensor:
    """x upcast to fp32 if it is narrower (bf16, fp16); fp32 and fp64 as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def mm32(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x @ y (2-D or batched 3-D) in fp32 (or wider) from the values x and y hold."""
    if low_gemm_applies(x, y):
        return low_gemm(x, y)
    return torch.matmul(wide(x), wide(y))


# c·x computed in fp32 and rounded to bf16 (8 significand bits, to nearest) lies within this share of
# |c·x| entry by entry: 2^-8 for the bf16 rounding, the rest covers the fp32 product's own rounding.
BF16_ROUNDOFF = 2.0**-8 + 2.0**-22


def scaled_to_bf16(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x·scale computed in fp32 and rounded to bf16 as it is written: one kernel where a product and a
    cast took two (the same values; a GPU step is bound by its launches). `reach_sq` bounds what
    the rounding moves."""
    return torch.mul(x, scale, out=torch.empty(x.shape, dtype=torch.bfloat16, device=x.device))


# One fp32 norm over a whole per-example gradient read low on CPU, by 4e-5 at ViT-B's fc1 (2.4M
# entries), so an example clipped by it carried more than C. Over runs of at most NORM_RUN entries, each
# run's rounding stays within NORM_RUN units of fp32 round-off of its square, whatever the kernel's order
# of summation; the margin covers that, the fp32 results, the layers' squares added in fp32 (up to 512
# of them: group_norms) and the clipped product's own rounding.
NORM_RUN = 128
NORM_MARGIN = (NORM_RUN + 512) * 2.0**-24


def bounded_sq_norms(v: torch.Tensor) -> torch.Tensor:
    """(B,) fp32 squared norms of B per-example tensors, never below the exact ones (at most 4e-5
    above): fp32 norms over runs of NORM_RUN entries (as fast as one norm over the whole row), their
    squares summed in fp64, raised by NORM_MARGIN."""
    rows = v.reshape(len(v), -1)
    whole = rows.shape[1] - rows.shape[1] % NORM_RUN
    runs = [rows[:, :whole].reshape(len(v), -1, NORM_RUN)] if whole else []
    runs += [rows[:, whole:].unsqueeze(1)] if whole < rows.shape[1] else []
    sq = sum(torch.linalg.vector_norm(r, dim=2, dtype=torch.float32).double().square().sum(1) for r in runs)
    return (sq * (1 + NORM_MARGIN)).float()


def as_3d(x: torch.Tensor) -> torch.Tensor:
    """(B, d) -> (B, 1, d); (B, T1, T2, ..., d) -> (B, T, d)."""
    return x.reshape(x.shape[0], -1, x.shape[-1]) if x.dim() != 2 else x.unsqueeze(1)


def gram_inner(a: torch.Tensor, g: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) Σ_{t,s} (a_t·a_s)(g_t·g_s) = ‖Σ_t g_t a_tᵀ‖² per example, of a (B, T, d) and g (B, T, p), as
    computed, and (B,) S = Σ_t ‖a_t‖·‖g_t‖ from the Gram matrices' diagonals, for the rounding bound
    (`gram_error`); `block` tokens per block (default GRAM_BLOCK, read at the call)."""
    T, block = a.shape[1], block or GRAM_BLOCK
    width = torch.promote_types(a.dtype, torch.float32)  # fp32, or fp64 given fp64
    if T < 2 * block:
        total, s = gram_inner_one_block(a, g)
        return total.to(width), s
    cuts = [i * block for i in range(max(1, T // block))] + [T]  # the last block takes the remainder
    blocks = [(a[:, s:e], g[:, s:e]) for s, e in zip(cuts, cuts[1:])]
    total, s = 0, 0
    for i, (a_i, g_i) in enumerate(blocks):
        block_total, block_s = gram_inner_one_block(a_i, g_i)
        total, s = total + block_total, s + block_s
        for a_j, g_j in blocks[i + 1:]:  # the later (perhaps longer) block as rows: the columns stay aligned
            total = total + 2 * row_dot(mm32(a_j, a_i.transpose(1, 2)), mm32(g_j, g_i.transpose(1, 2)))
    return total.to(width), s


def row_dot(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(B,) Σ p⊙q over each example's entries: each row's products summed in the Gram products' precision,
    the rows' sums in fp64, so the rounding added grows with T, not T² (`gram_error`)."""
    return (p * q).sum(2).double().sum(1)


def diagonal_s(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(B,) Σ_t √(P_tt·Q_tt) = Σ_t ‖a_t‖·‖g_t‖ over the square Gram matrices' tokens."""
    return (torch.diagonal(p, dim1=1, dim2=2) * torch.diagonal(q, dim1=1, dim2=2)).clamp_min(0).sqrt().sum(1)


# Unit roundoff of an fp32 accumulation, doubled: a GPU's tensor cores may align addends by truncation.
ACC_ROUNDOFF = 2.0**-23


def gamma(n: int, u: float = ACC_ROUNDOFF) -> float:
    """γ_n = n·u / (1 − n·u): a sum of n products, in any order, is within γ_n·Σ|x_k·y_k| of the exact one."""
    return n * u / (1 - n * u)


def gram_error(d: int, p: int, tokens: int) -> float:
    """κ with |gram_inner(a, g) − ‖Σ_t g_t a_tᵀ‖²| ≤ κ·S², S = Σ_t ‖a_t‖‖g_t‖, however the tokens cancel:
    each entry of a·aᵀ (d terms) is within γ_d·‖a_t‖‖a_s‖, each of g·gᵀ within γ_p·‖g_t‖‖g_s‖, each
    row's products are rounded and summed in fp32 (γ_T), the rows in fp64, the total rounded to fp32
    once; the margin covers S's own rounding (from the diagonals: sums of squares, relative γ_d, γ_p).
    Where tokens cancel (inputs that nearly repeat with opposite gradients) the computed value can be
    far below the true one, even 0: the clipper takes sq + κ·S² as the norm."""
    gd, gp, gt = gamma(d), gamma(p), gamma(tokens + 1)
    kappa = (1 + gd) * (1 + gp) * (1 + gt) * (1 + gamma(tokens * tokens + 1, 2.0**-53)) * (1 + 2.0**-24) - 1
    return kappa * (1 + 8 * (d + p + tokens) * 2.0**-24)


def gram_inner_one_block(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gram_inner with every token in one block. P = a·aᵀ and Q = g·gᵀ are symmetric, so Σ P⊙Q over
    the first m columns (every row), plus the same over rows m.. (the columns m.. above the corner,
    transposed), plus the r×r corner's, is the whole sum; m is T rounded down to GRAM_ALIGN."""
    m = a.shape[1] - a.shape[1] % GRAM_ALIGN
    if m in (0, a.shape[1]):
        p_all, q_all = mm32(a, a.transpose(1, 2)), mm32(g, g.transpose(1, 2))
        return row_dot(p_all, q_all), diagonal_s(p_all, q_all)
    p_cols, q_cols = mm32(a, a[:, :m].transpose(1, 2)), mm32(g, g[:, :m].transpose(1, 2))
    a_r, g_r = a[:, m:], g[:, m:]
    p_corner, q_corner = mm32(a_r, a_r.transpose(1, 2)), mm32(g_r, g_r.transpose(1, 2))
    return (row_dot(p_cols, q_cols) + row_dot(p_cols[:, m:], q_cols[:, m:]) + row_dot(p_corner, q_corner),
            diagonal_s(p_cols[:, :m], q_cols[:, :m]) + diagonal_s(p_corner, q_corner))


class LayerRule:
    needs_input = True  # whether the clipper must keep the layer's input
    has_ghost = False   # whether ghost_sq_norm exists for this layer type
    takes_low_precision = False  # whether a and g may come in the forward's bf16 (else fp32)

    def per_sample(self, m, a, g) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def ghost_sq_norm(self, m, a, g) -> torch.Tensor:
        """(B,) a bound on ‖per-example gradient‖², without instantiating it (only where has_ghost)."""
        raise NotImplementedError

    def ghost_is_faster(self, m, a, g) -> bool:
        return True

    def reach_sq(self, m, a, g, sq: torch.Tensor) -> torch.Tensor | None:
        """(B,) a bound on the squared norm of what `clipped_sum` carries of each example per unit of its
        clip factor, given `sq` as the rule computed it (None: `sq` is the squared norm of what is
        summed, the per-example gradients or a sum of squares)."""
        return None

    def held_if_instantiated(self, m, a, g) -> int:
        """Floats that instantiating keeps beyond the input and output gradient it frees (may be < 0;
        the clipper instantiates inside the backward when the per-example gradients take no more
        floats than the output gradient: clipping.py)."""
        return 0

    def clipped_sum(self, m, a, g, factors) -> dict[str, torch.Tensor]:
        return {k: torch.einsum("b,b...->...", factors, v) for k, v in self.per_sample(m, a, g).items()}

    def group_views(self, m, a, g, views: int):
        """(a, g) with each example's `views` rows (consecutive) made one example: its per-example
        gradient is then the sum over its views. The views' tokens become one longer sequence."""
        tokens = lambda x: x.reshape(x.shape[0] // views, -1, x.shape[-1])  # noqa: E731
        return (tokens(a) if a is not None else None), tokens(g)


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
    takes_low_precision = True  # its products go through mm32 / low_gemm; everything else is upcast

    def per_sample(self, m, a, g):
        g3 = as_3d(g)
        out = {"weight": mm32(g3.transpose(1, 2), as_3d(a))}
        if m.bias is not None:
            out["bias"] = sum32(g3, 1)
        return out

    def ghost_sq_norm(self, m, a, g):
        """A bound: the Gram products and their worst-case rounding, κ·S² (`gram_error`)."""
        g3 = as_3d(g)
        sq, s = gram_inner(as_3d(a), g3)
        sq = sq.clamp_min(0) + gram_error(m.in_features, m.out_features, g3.shape[1]) * s.square()
        if m.bias is not None:  # bounded too: a plain fp32 sum of squares can read below the exact norm
            sq = sq + bounded_sq_norms(sum32(g3, 1))
        return sq

    def ghost_is_faster(self, m, a, g):
        T, d, p = as_3d(g).shape[1], m.in_features, m.out_features
        return T * T * (d + p) < WRITE_COST * d * p

    def held_if_instantiated(self, m, a, g):
        g3 = as_3d(g)
        B, T, d, p = g3.shape[0], g3.shape[1], m.in_features, m.out_features
        return B * (d * p - T * (d + p))

    def reach_sq(self, m, a, g, sq):
        """On the bf16 GEMM, rounding c·(one side) to bf16 moves token t's product by δ_t with ‖δ_t‖ ≤
        u·c·‖g_t‖·‖a_t‖, so the example's weight gradient by at most u·c·Σ_t ‖g_t‖·‖a_t‖ beyond its norm
        (`sq`, a bound already), whatever cancels."""
        if not low_gemm_applies(a, g):
            return None
        norms = lambda x: torch.linalg.vector_norm(as_3d(x), dim=-1, dtype=torch.float32)  # noqa: E731
        return (sq.sqrt() + BF16_ROUNDOFF * (norms(a) * norms(g)).sum(1)).square()

    def clipped_sum(self, m, a, g, factors):
        g3, a3 = as_3d(g), as_3d(a)
        scale = factors.view(-1, 1, 1)
        rows = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731  (B·T, width)
        # As reach_sq assumes: on the bf16 GEMM the side that carries c_i is rounded to bf16 (the
        # other is bf16 already); else both sides are multiplied as they are, in fp32.
        rounded = low_gemm_applies(a3, g3)
        scaled, mm = (scaled_to_bf16, low_gemm) if rounded else (torch.mul, mm32)
        if a3.shape[-1] < g3.shape[-1]:  # Σ_i c_i g_iᵀa_i: the narrower side carries c_i (fc1: 4x fewer products)
            weight = mm(rows(g3).t(), rows(scaled(a3, scale)))
        else:
            weight = mm(rows(scaled(g3, scale)).t(), rows(a3))
        out = {"weight": weight}
        if m.bias is not None:
            out["bias"] = factors @ sum32(g3, 1)
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
        """A bound, as a Linear's: a repeated id's gradients may cancel; each entry of g·gᵀ is within
        γ_p·‖g_t‖‖g_s‖ and the 0/1 matrix is exact (`gram_error` with d = 0, S = Σ_t ‖g_t‖)."""
        g3, ids = as_3d(g), ids.reshape(g.shape[0], -1)
        same = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(g3.dtype)
        q = g3 @ g3.transpose(1, 2)
        s = torch.diagonal(q, dim1=1, dim2=2).clamp_min(0).sqrt().sum(1)
        sq = row_dot(same, q).to(g3.dtype).clamp_min(0)
        return sq + gram_error(0, g3.shape[-1], g3.shape[1]) * s.square()

    def group_views(self, m, ids, g, views):
        return ids.reshape(ids.shape[0] // views, -1), g.reshape(g.shape[0] // views, -1, g.shape[-1])

    def clipped_sum(self, m, ids, g, factors):
        out = torch.zeros(m.num_embeddings, m.embedding_dim, dtype=g.dtype, device=g.device)
        out.index_add_(0, ids.reshape(-1), (as_3d(g) * factors.view(-1, 1, 1)).reshape(-1, m.embedding_dim))
        return {"weight": out}


@register(BroadcastParameter)
class BroadcastRule(LayerRule):
    needs_input = False  # the output gradient is the per-example gradient itself

    def per_sample(self, m, a, g):
        return {"weight": g}

    def group_views(self, m, a, g, views):
        return None, g.reshape(g.shape[0] // views, views, *g.shape[1:]).sum(1)


SUPPORTED_LAYERS = tuple(RULES)
