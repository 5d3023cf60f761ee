"""The noise's floating-point edge (docs/privacy.md, "Floating-point noise"): dp-train's normals reach
12.1 std, the floor the edge puts under δ is what an adversary sees, and a plan whose σ brings an example's
coordinate too close to the edge is refused. The engine's draw itself: tests/test_engine.py
(`test_the_noise_is_drawn_finer_than_fp32_…`), for every objective at 1 and 2 ranks."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from scipy import stats

from pipeline.privacy import noise_edge
from pipeline.privacy.noise import FINE, TORCH_EDGES, box_muller, gaussian, uniforms as noise_uniforms
from pipeline.privacy.engine import dp_step
from pipeline.privacy.ledger import Ledger, LedgerError
from pipeline.privacy.plan import Plan, plan_mechanism
from pipeline.privacy.tools.accounting_cli import main

DP = {"expected_batch_size": 128, "delta": "1/2n", "sigma": None, "epsilon": 8.0, "steps": 40, "accountant": "pld",
      "clip_norm": 1.0, "objective": "mae"}


def uniforms(count, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(count, generator=g, dtype=torch.float64) for _ in range(3)]


def test_the_noise_is_standard_normal():
    z = gaussian(torch.Size([1000, 1000]), torch.Generator().manual_seed(2), torch.device("cpu"))
    assert z.dtype == torch.float64 and stats.kstest(z.flatten().numpy(), "norm").pvalue > 1e-3


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_the_noise_uniforms_are_every_multiple_of_2_to_the_minus_53_on_every_device(device):
    """The edge the ledger records needs 1 - u down to 2^-53 (every k·2^-53 below 1, odd k too): CUDA's
    fp64 torch.rand rounds its upper half to even multiples, so its 1 - u stops at 2^-52."""
    u = noise_uniforms(1 << 20, torch.Generator(device).manual_seed(4), torch.device(device)).cpu()
    k = u / FINE
    assert u.dtype == torch.float64 and torch.equal(k, k.round()) and 0 <= float(u.min()) and float(u.max()) < 1
    upper = k[u >= 0.5].to(torch.int64)
    assert 0.45 < float((upper % 2).float().mean()) < 0.55  # odd multiples as often as even ones
    if device == "cpu":  # the CPU's fp64 draws were already these: the noise of earlier runs is unchanged
        assert torch.equal(u, torch.rand(1 << 20, generator=torch.Generator().manual_seed(4), dtype=torch.float64))


def test_the_uniforms_check_catches_cudas_rounded_draws():
    """CUDA's fp64 torch.rand, emulated: cuRAND's (k + 1/2)·2^-53 rounded to fp64, 1 turned into 0."""
    k = torch.randint(0, 2 ** 53, (1 << 20,), generator=torch.Generator().manual_seed(4), dtype=torch.int64)
    cuda_like = (k.to(torch.float64) * FINE + FINE / 2)
    cuda_like[cuda_like == 1.0] = 0.0
    upper = (cuda_like[cuda_like >= 0.5] / FINE).to(torch.int64)
    assert float((upper % 2).float().mean()) == 0.0  # what the test above refuses
    assert float(1 - cuda_like[cuda_like < 1].max()) >= 2 * FINE


def test_the_normality_check_catches_a_radius_and_angle_from_one_uniform():
    coarse, fine, _ = uniforms(500_000, 3)
    broken = box_muller(coarse.clone(), fine, coarse.clone())  # the angle reuses the radius's uniform
    assert stats.kstest(broken.numpy(), "norm").pvalue < 1e-6


def test_the_smallest_uniforms_give_the_edge_the_accounting_checks_against():
    zero = torch.zeros(1, dtype=torch.float64)
    largest = float(box_muller(zero.clone(), torch.full((1,), 1 - FINE, dtype=torch.float64), zero.clone())[0])
    assert largest == pytest.approx(noise_edge.NOISE_EDGE, rel=1e-12)
    assert largest > TORCH_EDGES["torch fp64"] + 3 > TORCH_EDGES["torch fp32, CPU"] + 5
    # one uniform alone stops where torch's fp64 draws do
    one_uniform = float(box_muller(torch.full((1,), FINE, dtype=torch.float64), torch.ones(1, dtype=torch.float64),
                                   zero.clone())[0])
    assert one_uniform == pytest.approx(TORCH_EDGES["torch fp64"], rel=1e-12)


# (adjacency, q, 1/σ, T): x's slot left empty by its neighbour, or (a full batch, replace-one) always
# holding a replacement whose gradient points the other way.
ADVERSARIES = [("add_remove", 0.2, 2.9, 50), ("replace_one", 0.2, 2.9, 50), ("replace_one", 1.0, 1.6, 20)]


@pytest.mark.parametrize("adjacency, q, inverse_sigma, steps", ADVERSARIES)
def test_the_edge_floor_is_the_rate_an_informed_adversary_sees(adjacency, q, inverse_sigma, steps):
    """Simulated runs with torch's fp32 normals, whose edge (5.77 std) is near enough to watch: x, sampled
    with rate q in each of T steps, moves its coordinate by 1/σ; its neighbour has no x (add/remove) or an
    x' that moves it by -1/σ (replace-one). The adversary flags a run whose release passes the highest
    value the neighbour can release. The neighbour's runs are never flagged; x's are, at noise_edge_floor."""
    runs, edge = 40_000, TORCH_EDGES["torch fp32, CPU"]
    g = torch.Generator().manual_seed(4)
    z = torch.randn(runs, steps, generator=g)
    sampled = torch.rand(runs, steps, generator=g) < q
    neighbour = z - inverse_sigma * sampled if adjacency == "replace_one" else z
    highest = edge - (inverse_sigma if adjacency == "replace_one" and q == 1 else 0.0)  # with x's slot empty: edge
    assert float(neighbour.max()) <= highest
    flagged = ((z + inverse_sigma > highest) & sampled).any(dim=1).double().mean().item()
    want = noise_edge.noise_edge_floor(1 / inverse_sigma, q, steps, edge,
                                       move=noise_edge.largest_move(1.0, adjacency, q))
    assert abs(flagged - want) < 4 * math.sqrt(want * (1 - want) / runs)
    assert 0.01 < want < 0.99  # the test has events to count


def test_a_full_batch_under_replace_one_is_refused_where_x_moves_twice_as_far():
    """At q = 1 under replace-one every step holds x or its replacement: their gradients, 2C apart, bring
    x's coordinate twice as close to the edge. Per batch (K = 2) the clipped mean moves 2C = K·C either way."""
    full = {**DP, "expected_batch_size": 1258, "sigma": 0.2, "epsilon": 1e4}
    plan_mechanism(full, 1258, "add_remove")
    plan_mechanism({**full, "expected_batch_size": 1257}, 1258, "replace_one")  # x's slot may be empty
    with pytest.raises(ValueError, match=r"never passes 12\.12 std"):
        plan_mechanism(full, 1258, "replace_one")
    assert noise_edge.largest_move(2.0, "replace_one", 1.0) == noise_edge.largest_move(1.0, "add_remove", 1.0) == 1.0


def test_a_plan_too_close_to_the_noise_edge_is_refused():
    plan_mechanism(DP, 1258, "replace_one")  # the default run passes
    with pytest.raises(ValueError, match=r"never passes 12\.12 std.*dp\.sigma"):
        plan_mechanism({**DP, "sigma": 0.1, "epsilon": 1e4}, 1258, "replace_one")


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_the_edge_refusal_sits_at_a_tenth_of_delta(objective):
    """The plan is refused once the edge alone gives away more than δ/10, not only far past it: a σ whose
    floor is 0.11 δ is refused, one whose floor is 0.09 δ is not (a threshold 100× too lax passed the
    extreme cases above, and one twice too lax passed a floor of δ/2). Per-batch clipping (K = 2) is one noise std per unit of its 2C, as per example."""
    n = 1258
    q, steps, delta = DP["expected_batch_size"] / n, DP["steps"], 1 / (2 * n)

    def sigma_at(share: float) -> float:  # the σ whose floor is `share` of δ (the floor falls as σ grows)
        lo, hi = 0.05, 1.0
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if noise_edge.noise_edge_floor(mid, q, steps, move=1.0) > share * delta else (lo, mid)
        return hi

    dp = {**DP, "objective": objective, "epsilon": 1e6}
    with pytest.raises(ValueError, match=r"never passes 12\.12 std"):
        plan_mechanism({**dp, "sigma": sigma_at(0.11)}, n, "replace_one")
    plan_mechanism({**dp, "sigma": sigma_at(0.09)}, n, "replace_one")


def test_the_edge_check_would_have_refused_torchs_fp32_draws():
    """The scale table's MAE at ε = 8 (σ 1.198, B = 2,048 of 60,000, 800 steps): with fp32 draws its edge
    alone gave away more than the δ printed; with dp-train's it is 1e-23 of it."""
    q, delta = 2048 / 60_000, 1 / 120_000
    move = noise_edge.largest_move(1.0, "replace_one", q)
    assert noise_edge.noise_edge_floor(1.198, q, 800, TORCH_EDGES["torch fp32, CPU"], move=move) > delta
    assert noise_edge.noise_edge_floor(1.198, q, 800, move=move) < 1e-20 * delta


def test_dpfm_plan_marks_what_dp_train_would_refuse(capsys):
    main(["plan", "--n", "1000", "--epsilon", "300", "--delta", "1e-4", "--epochs", "1", "--batch-sizes", "100"])
    assert "refused by dp-train" in capsys.readouterr().out  # σ ≈ 0.1: the floor is 0.03
    main(["plan", "--n", "1000", "--epsilon", "8", "--delta", "1e-4", "--epochs", "1", "--batch-sizes", "100"])
    assert "refused" not in capsys.readouterr().out


@pytest.mark.parametrize("epsilon", [150, 200, 300])
def test_dpfm_plans_mark_is_dp_trains_refusal(capsys, epsilon):
    """Measured against dp-train's own plan at ε = 150, 200, 300 (the edge gives away 0.005δ, 0.8δ and
    290δ): `plan` marks the schedules dp-train refuses and no other, the one between δ/10 and δ too."""
    main(["plan", "--n", "1000", "--epsilon", str(epsilon), "--delta", "1e-4", "--epochs", "1", "--batch-sizes", "100"])
    marked = "refused by dp-train" in capsys.readouterr().out
    dp = {**DP, "expected_batch_size": 100, "delta": 1e-4, "epsilon": float(epsilon), "steps": 10}
    try:
        plan_mechanism(dp, 1000, "replace_one")
        refused = False
    except ValueError as e:
        refused = "never passes" in str(e)
    assert marked == refused == (epsilon > 150)


def test_a_ledger_from_before_the_noise_recorded_its_edge_is_not_resumed(tmp_path):
    """Its steps drew torch's fp32 normals: dp-train refuses to add steps of another noise to them, and the
    report and verify read its edge as fp32's."""
    plan = plan_mechanism(DP, 1258, "replace_one")
    path = tmp_path / "ledger.jsonl"
    Ledger(path, plan).record_step(0, 130)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["header"]["noise_edge"] == noise_edge.NOISE_EDGE
    del header["header"]["noise_edge"]
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    with pytest.raises(LedgerError, match="different mechanism"):
        Ledger(path, plan)
    assert Plan.from_header(header["header"]).noise_edge == noise_edge.UNRECORDED_EDGE
    with pytest.raises(RuntimeError, match="noise stops at 5.77 std"):
        dp_step(0, sampler=None, fetch=None, clipper=None, key=0,
                plan=dataclasses.replace(plan, noise_edge=noise_edge.UNRECORDED_EDGE))


def test_the_refusal_says_what_lets_the_plan_through():
    """ε = 100 in one step on 1,258 examples: σ is calibrated so small that the noise edge gives away
    more than δ/10. The refusal said "take fewer steps", which a calibrated σ cannot take; more steps
    raise σ, and following the advice passes."""
    from pipeline.config import load_params

    dp = {**load_params("params.yaml")["dp"], "epsilon": 100, "sigma": None}
    with pytest.raises(ValueError, match="lower dp.epsilon or take more steps") as refused:
        plan_mechanism({**dp, "steps": 1}, 1258, "replace_one")
    assert "with dp.sigma given, raise it or take fewer steps" in str(refused.value)
    assert plan_mechanism({**dp, "steps": 5}, 1258, "replace_one").sigma > 0


@pytest.mark.parametrize("sigma, q, steps, edge, move", [
    (0.5, 0.1, 1, 5.77, 1.0), (0.5, 0.1, 3, 5.77, 1.0), (0.3, 1.0, 2, 8.57, 2.0), (0.9, 0.01, 300, 6.0, 1.0)])
def test_the_edge_floor_is_one_minus_the_chance_no_sampled_step_passes(sigma, q, steps, edge, move):
    """Computed independently: each step samples x with rate q and then passes the edge with the normal tail
    past edge - move/σ; the floor is the chance that happens in at least one of the T steps."""
    per_step = q * stats.norm.sf(edge - move / sigma)
    want = 1 - (1 - per_step) ** steps
    assert noise_edge.noise_edge_floor(sigma, q, steps, edge, move=move) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("edge", [math.nextafter(noise_edge.NOISE_EDGE, math.inf), 1e9, 0.0, math.nan])
def test_a_header_recording_an_edge_dpfms_noise_cannot_have_is_refused(edge):
    """The report and the budget read a run's edge from its header: one past NOISE_EDGE would hide what the
    edge gives away, and none is at or below 0."""
    header = plan_mechanism(DP, 1258, "replace_one").header()
    assert Plan.from_header(header).noise_edge == noise_edge.NOISE_EDGE
    with pytest.raises(ValueError, match="noise_edge="):
        Plan.from_header({**header, "noise_edge": edge})
