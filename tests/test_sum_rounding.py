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

import pytest
import torch
from ranks import on_two_ranks
from stage_runs import MICRO

from benchmarks.sum_rounding import by_place
from pipeline.config import load_params
from pipeline.distributed import World
from pipeline.objectives import OBJECTIVES
from pipeline.privacy import clipping, engine
from pipeline.privacy.tools.step_audit import SENSITIVITY_TOL, rounding_moves

ROOT = Path(__file__).resolve().parents[1]
BATCH, PHYSICAL, C = 2048, 8, 1.0  # 256 micro-batches on one rank
# What x moves outside its own bucket: the fp64 sum's rounding (~2^-53·B·C), nothing of fp32's.
BEYOND_BUCKET_TOL = 1e-9


def moves(name: str, world: World) -> dict:
    """step_audit.rounding_moves on the shared micro profile, at B = 2,048 in micro-batches of 8."""
    params = load_params(ROOT / "params.yaml", [*MICRO, f"dp.objective={name}"])
    return rounding_moves(params, BATCH, PHYSICAL, world, C)


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
def test_fp32_sums_move_the_others_outside_the_bucket(monkeypatch, name):
    """The measurement above can fail: with the sums kept in fp32, x moves the other buckets' part by
    about 2^-24·‖S‖ (1.2e-4·C here, above the audit's tolerance, against exactly 0 in fp64)."""
    monkeypatch.setattr(clipping.ClippedSum, "sum_dtype", torch.float32)
    assert moves(name, World())["beyond_bucket"] > 1e4 * BEYOND_BUCKET_TOL


@pytest.mark.parametrize("name", [n for n, o in OBJECTIVES.items() if o.clipping == "per_sample"])
def test_micro_batches_by_place_move_the_others_beyond_the_bucket(monkeypatch, name):
    """The bucket measurement above can fail: cut by place, x regroups every later micro-batch."""
    monkeypatch.setattr(engine, "rank_share", by_place)
    assert moves(name, World())["beyond_bucket"] > 100 * BEYOND_BUCKET_TOL
