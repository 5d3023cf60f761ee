"""White-box audit of the DP step that dp-train runs: the real `engine.dp_step` on the configured
model, objective, clipping method, precision and world size (run it under torchrun with the
training's ranks), fed public random inputs, never private data.

It measures the two numbers the accountant takes on trust, from the step's own output:
  noise        two runs on one batch with two keys: their difference is z₁ - z₂, so its std / √2,
               times the divisor, is the std of the noise the step adds. Must be ≥ σ·K·C (a
               one-sided chi-square test at level 1e-6: noise ×0.97 is already caught with 10⁵
               parameters).
  sensitivity  runs with one key on the batch and on the batch less one example: the noise cancels,
               and the change, times the divisor, is what one example can move the release by.
               Must be ≤ K·C. The loss is multiplied by a large factor so every example (or the
               batch) is clipped: a clipper that lets more than C through shows here.
  batch mean   (per batch) the run on the batch less the run on no example, with one key: the
               clipped batch mean. Must be ≤ K·C/2, the most a neighbour can turn it by.
A step whose noise is scaled ×0.5 or ×0.7, divided by the world size, or whose examples count W
times, fails with a message naming the figure that is off. The one-run canary audit (canary_audit.py) is
the statistical, black-box complement.

Random inputs rarely reach the sensitivity bound: a per-batch clipped mean of 16 random examples
moves by a fraction of 2C when one leaves, so an engine told K = 1 for Dp-CLIP would pass those
moves (the clipped mean's own norm, above, catches it on the real model). The worst-case
neighbours (`worst_case_sensitivity`) reach it by construction, on a model whose per-example loss
is ⟨θ, v_i⟩ so each example's gradient is the vector it is given: per example,
one example of large gradient joins (the release moves by exactly C, clipped); per batch, one
example joins a batch whose mean points one way and turns it the other way (the clipped mean
flips from +C·u to −C·u: the release moves by 2C). Either way the measured move must not exceed
K·C, for every clipper and precision dp-train accepts.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
from scipy import stats

from pipeline.distributed import World, gather_with_grad
from pipeline.models import ModelConfig, build_model
from pipeline.objectives import objective
from pipeline.objectives import SENSITIVITY
from pipeline.privacy.clipping import view_rows
from pipeline.privacy.engine import dp_step, make_clipper
from pipeline.privacy.plan import Plan
from pipeline.privacy.sampling import FixedBatch, bucket_count, bucket_of
from pipeline.train import autocast, freeze, loss_scale

LEVEL = 1e-6            # significance of the noise test: a correct step fails it once in a million
SENSITIVITY_TOL = 1e-4  # fp32 round-off allowed above K·C
AMPLIFY = 1e4           # how far every gradient norm exceeds C: the loss is multiplied (C divided in fp16)


class Amplified(nn.Module):
    """The model with its per-example loss multiplied: the same layers (the clipper hooks them), larger
    gradients, so clipping is always active."""

    def __init__(self, model: nn.Module, factor: float):
        super().__init__()
        self.model, self.factor = model, factor

    def forward(self, *batch, **kw):
        return self.model(*batch, **kw) * self.factor


def public_inputs(params: dict, count: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Random images (and caption tokens) of the configured shapes, and each example's masks
    (count, dp.mask_views, patches) where the model reads them: no private data."""
    obj, m = objective(params["dp"]["objective"]), params["model"]
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.rand(count, 3, m["img_size"], m["img_size"], generator=g) * 2 - 1]
    if obj.tokens:
        inputs.append(torch.randint(4, params["tokenizer"]["vocab_size"], (count, m["max_caption_len"]), generator=g))
    masks = None
    if ModelConfig.from_params(m, obj.name).reads_masks(obj.name):
        masks = torch.rand(count, params["dp"]["mask_views"], (m["img_size"] // m["patch_size"]) ** 2, generator=g)
    return inputs, masks


def audit_step(params: dict, sigma: float, world: World = World(), device: str = "cpu", batch_size: int = 16,
               removed: int = 3, seed: int = 0) -> dict:
    """The step's measured noise std and sensitivity against what the accountant was told."""
    dp, obj = params["dp"], objective(params["dp"]["objective"])
    vocab = params["tokenizer"]["vocab_size"] if obj.tokens else None
    mcfg = ModelConfig.from_params(params["model"], dp["objective"], vocab)
    # Every example clipped: its loss amplified, or in fp16 (whose loss scale, 2^12, would overflow the
    # amplified gradients to inf, every example dropped and nothing measured) C divided instead.
    fp16 = dp["precision"] == "fp16"
    factor, clip_norm = (1.0, dp["clip_norm"] / AMPLIFY) if fp16 else (AMPLIFY, dp["clip_norm"])
    # One step over a fixed batch, divided as dp-train divides (by the expected batch size per example).
    plan = Plan.unaccounted(dp["objective"], obj.clipping, sigma, clip_norm, n=dp["expected_batch_size"])
    inputs, masks = public_inputs(params, batch_size, seed)
    views = dp["mask_views"]

    def fetch(step: int, idx: np.ndarray, pos: np.ndarray) -> tuple:  # as dp-train's: examples as their views' rows
        mine = masks[idx[pos]] if masks is not None else None
        return tuple(x.to(device) for x in view_rows([x[idx[pos]] for x in inputs], mine, views))

    # One model and clipper for every release, as dp-train keeps them across its steps (compiled: its
    # graphs too). A release leaves the weights as they were: dp_step only writes p.grad.
    torch.manual_seed(seed)
    built = build_model(dp["objective"], mcfg)
    freeze(built, dp["frozen"])  # as dp-train keeps them: out of the clipping and the noise
    model = Amplified(built, factor).to(device)
    clipper = make_clipper(obj.clipping, model, clip_norm, dp["clipping"],
                           autocast=lambda: autocast(device, dp["precision"]), loss_scale=loss_scale(dp["precision"]),
                           gather=gather_with_grad(world) if obj.clipping == "per_batch" else None,
                           encoder_share=dp["encoder_clip_share"], views=views, compiled=dp["compile"])
    if dp["compile"]:  # as dp-train compiles it
        model.compile(backend=dp["compile_backend"])
    dropped = []

    def release(indices: np.ndarray, key: int) -> torch.Tensor:
        torch.manual_seed(seed)
        dropped.append(dp_step(0, sampler=FixedBatch(indices, batch_size), fetch=fetch, clipper=clipper, plan=plan,
                               key=key, world=world,
                               physical_batch_size=max(1, dp["physical_batch_size"] // views)).nonfinite)
        return torch.cat([p.grad.flatten().double().cpu() for p in model.parameters() if p.grad is not None])

    batch = np.arange(batch_size)
    first, second = release(batch, seed + 1), release(batch, seed + 2)
    noise = (first - second) * plan.denominator / math.sqrt(2)
    moves = [float((first - release(np.delete(batch, i), seed + 1)).norm()) * plan.denominator
             for i in range(removed)]
    batch_norm = None
    if obj.clipping == "per_batch":  # against the empty batch with the same key the noise cancels: the clipped mean
        batch_norm = float((first - release(batch[:0], seed + 1)).norm()) * plan.denominator
    return judge(noise, max(moves), plan, world.size, sum(dropped), batch_norm)


def rounding_moves(params: dict, batch_size: int, physical_batch_size: int, world: World = World(),
                   clip_norm: float = 1.0, device: str = "cpu") -> dict:
    """What rounding moves when one example x leaves a batch of `batch_size` public random examples, on
    the real step (every example clipped, σ = 0, divided by 1), in units of C. Per example: the others'
    part, R(B) − R(B∖x) − R({x}), and what x moves outside its bucket (sampling.split_by_index),
    R(B) − R(B∖x) − (R(b) − R(b∖x)) for x's bucket b alone (the same micro-batches: the same n and
    settings). Per batch: both releases' norms (a clipped mean, within C whatever the sum rounded to).
    The forward runs in dp.precision (bf16 on a GPU: its kernels' batch dependence shows here too)."""
    name, views, precision = params["dp"]["objective"], params["dp"]["mask_views"], params["dp"]["precision"]
    if precision == "fp16":
        raise ValueError("rounding_moves amplifies the loss past fp16's range: measure with fp32 or bf16")
    obj = objective(name)
    mcfg = ModelConfig.from_params(params["model"], name, params["tokenizer"]["vocab_size"] if obj.tokens else None)
    # The rounding grows with the sum's norm (at most B·C): per example, every example has one caption,
    # which turns the text side's gradients one way; per batch, distinct ones (a contrastive loss).
    inputs, masks = public_inputs(params, batch_size, seed=0)
    plan = Plan.unaccounted(name, obj.clipping, 0.0, clip_norm, n=1)

    def fetch(step: int, idx: np.ndarray, pos: np.ndarray) -> tuple:
        rows = idx[pos]
        texts = rows if obj.clipping == "per_batch" else np.zeros_like(rows)
        picked = [inputs[0][rows], *(t[texts] for t in inputs[1:])]
        return tuple(x.to(device) for x in view_rows(picked, masks[rows] if masks is not None else None, views))

    def release(indices: np.ndarray) -> torch.Tensor:
        torch.manual_seed(0)
        model = Amplified(build_model(name, mcfg), AMPLIFY).to(device)  # every example clipped
        clipper = make_clipper(obj.clipping, model, clip_norm, "bookkeeping", views=views,
                               autocast=lambda: autocast(device, precision), loss_scale=loss_scale(precision),
                               gather=gather_with_grad(world) if obj.clipping == "per_batch" else None)
        dp_step(0, sampler=FixedBatch(indices, batch_size), fetch=fetch, clipper=clipper, plan=plan, key=1,
                world=world, physical_batch_size=max(1, physical_batch_size // views))
        return torch.cat([v.flatten().double().cpu() for v in clipper.sum.values()]) / clip_norm  # before the cast

    everyone, x = np.arange(batch_size), batch_size // 3
    full, rest = release(everyone), release(np.delete(everyone, x))
    if obj.clipping == "per_batch":
        return {"full": float(full.norm()), "rest": float(rest.norm())}
    own = release(np.array([x]))
    buckets = bucket_count(batch_size, max(1, physical_batch_size // views), world.size)
    bucket = everyone[bucket_of(everyone, batch_size, buckets) == bucket_of(x, batch_size, buckets)]
    local = release(bucket) - release(np.delete(bucket, np.searchsorted(bucket, x)))
    return {"others": float((full - rest - own).norm()), "own": float(own.norm()), "sum": float(full.norm()),
            "beyond_bucket": float((full - rest - local).norm()), "bucket_size": len(bucket)}


def judge(noise: torch.Tensor, largest_move: float, plan: Plan, world_size: int, dropped: int = 0,
          batch_norm: float | None = None) -> dict:
    """`dropped`: examples (per batch: batches) the steps dropped as non-finite. An audit measures a
    step only where it clips every example: a dropped one moves nothing, and a per-example step whose
    removed examples move it by less than 0.9·C clipped none of them (or dropped them).
    `batch_norm` (per batch): the norm of the clipped batch mean. Two neighbours' releases differ by
    at most the sum of their norms, and a neighbour can turn the mean around (worst_case_pair), so
    K·C holds only where every clipped mean is within K·C/2: a random batch never moves by that much
    when one example leaves, but its clipped mean's norm shows a bound of 2C, or K = 1, at once."""
    accounted, bound = plan.noise_std, plan.sensitivity * plan.clip_norm
    d = noise.numel()
    measured = float(noise.pow(2).mean().sqrt())
    # One-sided: Σ z²/s² ~ χ²(d) for a correct step; too small a sum means too little noise.
    p_low = float(stats.chi2.cdf(float(noise.pow(2).sum()) / accounted ** 2, df=d))
    problems = []
    if p_low < LEVEL:
        ratio = measured / accounted
        hint = (f": 1/W = {1 / world_size:.3f} at this world size, is the noise divided by the ranks?"
                if world_size > 1 and abs(ratio * world_size - 1) < 0.05 else "")
        problems.append(f"the step adds noise of std {measured:.4g}, {ratio:.2f}× the accounted σ·K·C = "
                        f"{accounted:.4g} (p = {p_low:.1e}){hint}")
    if largest_move > bound * (1 + SENSITIVITY_TOL):
        problems.append(f"one example moves the released sum by {largest_move:.4g}, {largest_move / bound:.2f}× "
                        f"the accounted sensitivity K·C = {bound:.4g}")
    half = bound / 2
    if batch_norm is not None and batch_norm > half * (1 + SENSITIVITY_TOL):
        problems.append(f"the clipped batch mean has norm {batch_norm:.4g}, {batch_norm / half:.2f}× the K·C/2 = "
                        f"{half:.4g} the accounted sensitivity needs (a neighbour turning it around moves the "
                        f"release by twice its norm)")
    if dropped:
        problems.append(f"the audit's steps dropped {dropped} examples (or batches) as non-finite: it measured nothing")
    elif batch_norm is not None and batch_norm < 0.9 * half:
        problems.append(f"the clipped batch mean has norm {batch_norm / half:.3f}× K·C/2: the batch should be "
                        f"clipped, so the audit measured nothing")
    elif plan.clipping == "per_sample" and largest_move < 0.9 * bound:
        problems.append(f"a removed example moved the release by only {largest_move / bound:.3f}× C: every example "
                        f"should be clipped, so the audit measured nothing")
    return {"parameters": d, "noise_std": measured, "noise_std_accounted": accounted, "noise_ratio": measured / accounted,
            "noise_p_low": p_low, "sensitivity": largest_move, "sensitivity_accounted": bound,
            "sensitivity_ratio": largest_move / bound, "sigma_accounted": plan.sigma, "batch_norm": batch_norm,
            "batch_norm_ratio": None if batch_norm is None else batch_norm / half,
            "sigma_effective": measured / max(largest_move, bound), "world_size": world_size,
            "verdict": "flagged" if problems else "consistent", "problems": problems}


class LinearLoss(nn.Module):
    """loss_i = ⟨θ, v_i⟩: example i's gradient is exactly v_i, so the audit chooses every gradient.
    `grouped`: a second copy of θ named `encoder` (clip groups), whose gradient is v_i too."""

    def __init__(self, dim: int, grouped: bool = False):
        super().__init__()
        self.head = nn.Linear(dim, 1, bias=False)
        self.encoder = nn.Linear(dim, 1, bias=False) if grouped else None

    def forward(self, v: torch.Tensor, gather=None) -> torch.Tensor:
        loss = self.head(v).squeeze(-1)
        return loss if self.encoder is None else loss + self.encoder(v).squeeze(-1)


def worst_case_pair(mode: str, dim: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradients of D, of D plus one example) whose releases differ the most under `mode` clipping."""
    u = torch.zeros(dim)
    u[0] = scale  # beyond C: everything is clipped (and within fp16's range under its loss scale)
    if mode == "per_batch":  # mean +u over D; the joiner makes the mean of D' equal to -u
        return u[None].clone(), torch.stack([u, -3 * u])
    others = torch.randn(3, dim, generator=torch.Generator().manual_seed(0)) * scale
    return others, torch.cat([others, u[None]])


def worst_case_sensitivity(mode: str, method: str, precision: str, clip_norm: float = 1.0, sigma: float = 1.0,
                           device: str = "cpu", dim: int = 8, world: World = World(),
                           encoder_share: float | None = None, views: int = 1) -> dict:
    """How far one example moves the step's release at its worst, against the accounted K·C, for a
    clipping mode ("per_sample" | "per_batch"), a clipper method, a precision and clip groups (with
    `encoder_share` the joiner's gradient exceeds both groups' bounds). With `views` each example
    comes as that many rows, all with its gradient: a clipper that clipped rows, not examples, would
    let the joiner move the release by views·C."""
    sensitivity = SENSITIVITY[mode]
    plan = Plan.unaccounted("linear", mode, sigma, clip_norm, n=1)  # divided by 1: the sum itself
    small, large = (x.to(device) for x in worst_case_pair(mode, dim, 2 * clip_norm))

    def release(grads: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)
        model = LinearLoss(dim, grouped=encoder_share is not None).to(device)
        clipper = make_clipper(mode, model, clip_norm, method, autocast=lambda: autocast(device, precision),
                               loss_scale=loss_scale(precision),
                               gather=gather_with_grad(world) if mode == "per_batch" else None,
                               encoder_share=encoder_share, views=views)
        dp_step(0, sampler=FixedBatch(np.arange(len(grads)), len(large)),
                fetch=lambda s, idx, pos: view_rows([grads[idx[pos]]], None, views), clipper=clipper, plan=plan, key=7,
                world=world)
        return torch.cat([p.grad.flatten().double().cpu() for p in model.parameters()])

    move = float((release(large) - release(small)).norm())
    bound = sensitivity * clip_norm
    problems = [] if move <= bound * (1 + SENSITIVITY_TOL) else [
        f"worst-case neighbours move the release by {move:.4g}, {move / bound:.2f}× the accounted sensitivity "
        f"K·C = {bound:.4g} ({mode} clipping, {method}, {precision})"]
    return {"mode": mode, "method": method, "precision": precision, "move": move, "bound": bound,
            "ratio": move / bound, "problems": problems}
