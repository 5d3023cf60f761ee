"""When one example leaves a large batch, the other examples' part of the released sum moves by
rounding alone, and by less than the step audit's tolerance above C: the clipped sum is accumulated
over micro-batches and summed over ranks in fp64 (clipping.SUM_DTYPE). In fp32 that rounding is
about 2^-24·B·C and grows with B (every later micro-batch shifts when an example leaves), so the
sensitivity the accountant is told, C, was exceeded by more than the tolerance from B ≈ 1,000 on.
Dp-CLIP sums in fp32: its one clip, after the sum, bounds whatever the sum rounded to.

What fp32 rounding is left (each micro-batch's products) stays inside x's bucket: the per-example sum
is cut into micro-batches by index range (sampling.split_by_index), so x leaving regroups its own
bucket and no other. The move outside the bucket is the fp64 sum's rounding alone, and the rest is
what a batch of one bucket shows, whatever B.

Measured on the real step (`dp_step`, every example clipped, σ = 0) for every objective at 1 and 2
ranks: R(B) − R(B∖x) − R({x}), the part of the move that is not x's own contribution, and
R(B) − R(B∖x) − (R(b) − R(b∖x)) for x's bucket b."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ranks import on_two_ranks
from stage_runs import MICRO

from pipeline.config import load_params
from pipeline.distributed import World, gather_with_grad
from pipeline.models import ModelConfig, build_model
from pipeline.objectives import OBJECTIVES
from pipeline.privacy import clipping
from pipeline.privacy.clipping import view_rows
from pipeline.privacy.engine import dp_step, make_clipper
from pipeline.privacy.plan import Plan
from pipeline.privacy import engine
from pipeline.privacy.sampling import FixedBatch, PoissonSampler, bucket_count
from pipeline.privacy.tools.step_audit import AMPLIFY, SENSITIVITY_TOL, Amplified, public_inputs

ROOT = Path(__file__).resolve().parents[1]
BATCH, PHYSICAL, C = 2048, 8, 1.0  # 256 micro-batches on one rank
# What x moves outside its own bucket: the fp64 sum's rounding (~2^-53·B·C), nothing of fp32's.
BEYOND_BUCKET_TOL = 1e-9


def moves(name: str, world: World) -> dict:
    """The others' move (per example) or both releases' norms (per batch), in units of C."""
    params = load_params(ROOT / "params.yaml", [*MICRO, f"dp.objective={name}"])
    obj = OBJECTIVES[name]
    mcfg = ModelConfig.from_params(params["model"], name, params["tokenizer"]["vocab_size"] if obj.tokens else None)
    # The rounding grows with the sum's norm (at most B·C): per example, every example has one caption,
    # which turns the text side's gradients one way; per batch, distinct ones (a contrastive loss).
    inputs, masks = public_inputs(params, BATCH, seed=0)
    plan = Plan.unaccounted(name, obj.clipping, 0.0, C, n=1)  # no noise, divided by 1: the sum itself

    def fetch(step, idx, pos):
        rows = idx[pos]
        texts = rows if obj.clipping == "per_batch" else np.zeros_like(rows)
        picked = [inputs[0][rows], *(t[texts] for t in inputs[1:])]
        return view_rows(picked, masks[rows] if masks is not None else None, 1)

    def release(indices: np.ndarray) -> torch.Tensor:
        torch.manual_seed(0)
        model = Amplified(build_model(name, mcfg), AMPLIFY)  # every example clipped
        clipper = make_clipper(obj.clipping, model, C, "bookkeeping",
                               gather=gather_with_grad(world) if obj.clipping == "per_batch" else None)
        dp_step(0, sampler=FixedBatch(indices, BATCH), fetch=fetch, clipper=clipper, plan=plan, key=1, world=world,
                physical_batch_size=PHYSICAL)
        return torch.cat([v.flatten().double() for v in clipper.sum.values()])  # before the cast to the grads' dtype

    everyone, x = np.arange(BATCH), BATCH // 3
    full, rest = release(everyone), release(np.delete(everyone, x))
    if obj.clipping == "per_batch":  # a clipped mean: any two releases are within 2C whatever was summed
        return {"full": float(full.norm()) / C, "rest": float(rest.norm()) / C}
    own = release(np.array([x]))
    # x's bucket alone, as a batch of its own (the same n and settings, so the same micro-batches): the
    # move x makes there is the move it makes in the whole batch, if no other bucket regroups.
    buckets = bucket_count(BATCH, PHYSICAL, world.size)
    bucket = everyone[everyone * buckets // BATCH == x * buckets // BATCH]
    local = release(bucket) - release(np.delete(bucket, np.searchsorted(bucket, x)))
    return {"others": float((full - rest - own).norm()) / C, "own": float(own.norm()) / C,
            "sum": float(full.norm()) / C, "beyond_bucket": float((full - rest - local).norm()) / C,
            "bucket_size": len(bucket)}


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_the_others_part_of_a_large_batch_moves_by_less_than_the_audits_tolerance(tmp_path, name):
    for result in (moves(name, World()), on_two_ranks(tmp_path, moves, name)):
        if OBJECTIVES[name].clipping == "per_batch":
            assert result["full"] <= 1 + 1e-6 and result["rest"] <= 1 + 1e-6, result
            continue
        assert result["sum"] > BATCH / 2 and result["own"] == pytest.approx(1, abs=1e-4), result  # all clipped
        assert result["others"] <= SENSITIVITY_TOL, result
        assert result["bucket_size"] < BATCH / 4 and result["beyond_bucket"] <= BEYOND_BUCKET_TOL, result


@pytest.mark.parametrize("name", [n for n, o in OBJECTIVES.items() if o.clipping == "per_sample"])
def test_fp32_sums_move_the_others_by_more_than_the_tolerance(monkeypatch, name):
    """The measurement above can fail: with the sums kept in fp32, x moves the other buckets' part by
    about 2^-24·‖S‖ (1.2e-4·C here, above the audit's tolerance, against exactly 0 in fp64)."""
    monkeypatch.setattr(clipping.ClippedSum, "sum_dtype", torch.float32)
    assert moves(name, World())["beyond_bucket"] > 1e4 * BEYOND_BUCKET_TOL


def positions_in_order(indices, sampler, mode, physical, world):
    """The split before buckets: micro-batches by place in the batch, so x leaving shifts every later one."""
    return PoissonSampler.split(np.arange(len(indices)), physical, world.rank, world.size)


@pytest.mark.parametrize("name", [n for n, o in OBJECTIVES.items() if o.clipping == "per_sample"])
def test_micro_batches_by_place_move_the_others_beyond_the_bucket(monkeypatch, name):
    """The bucket measurement above can fail: cut by place, x regroups every later micro-batch."""
    monkeypatch.setattr(engine, "rank_share", positions_in_order)
    assert moves(name, World())["beyond_bucket"] > 100 * BEYOND_BUCKET_TOL
