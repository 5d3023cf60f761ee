"""The plan: one frozen description of the mechanism, written as the ledger's header and read back
by the budget, verify and the report without losing or changing a value."""

from __future__ import annotations

import dataclasses
import math

import pytest
from ranks import on_two_ranks

from pipeline.distributed import World
from pipeline.objectives import OBJECTIVES
from pipeline.privacy.plan import Plan, agreed_plan, plan_mechanism, secret_key

DP = {"expected_batch_size": 128, "delta": "1/2n", "sigma": None, "epsilon": 8.0, "steps": 40, "accountant": "pld",
      "clip_norm": 1.5}


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_the_header_reads_back_as_the_same_plan(name):
    plan = plan_mechanism({**DP, "objective": name}, 1258, "replace_one")
    assert Plan.from_header(plan.header()) == plan
    assert plan.header()["noise_std"] == pytest.approx(plan.sigma * plan.sensitivity * 1.5)
    # divided by the expected batch q·n per example (never the realised size), by 1 per batch
    want = 1.0 if OBJECTIVES[name].clipping == "per_batch" else 128.0
    assert plan.denominator == pytest.approx(want)


def test_the_plan_holds_the_params_schedule_and_refuses_a_delta_of_one_over_n():
    """δ ≥ 1/n allows publishing a whole record: refused at the boundary itself, not from 2/n on."""
    plan = plan_mechanism({**DP, "objective": "mae", "delta": 1e-4}, 1258, "replace_one")
    assert (plan.steps, plan.sample_rate, plan.delta, plan.clip_norm) == (40, 128 / 1258, 1e-4, 1.5)
    small = {**DP, "objective": "mae", "expected_batch_size": 10}
    with pytest.raises(ValueError, match="delta=0.01 is >= 1/n"):
        plan_mechanism({**small, "delta": 0.01}, 100, "replace_one")
    assert plan_mechanism({**small, "delta": 0.0099}, 100, "replace_one").delta == 0.0099


@pytest.mark.parametrize("field,value", [("noise_std", 0.5), ("sensitivity", 1.0)])
def test_a_header_whose_derived_values_disagree_is_refused(field, value):
    header = plan_mechanism({**DP, "objective": "clip"}, 1258, "replace_one").header()
    with pytest.raises(ValueError, match=field):
        Plan.from_header({**header, field: value})


def test_the_plan_cannot_be_changed_and_its_twin_is_not_accounted():
    plan = plan_mechanism({**DP, "objective": "mae"}, 1258, "add_remove")
    with pytest.raises(AttributeError):
        plan.sigma = 0.0
    twin = plan.without_noise(steps=500)
    assert twin.noise_std == 0 and twin.steps == 500 and math.isinf(twin.epsilon)
    assert twin.sample_rate == plan.sample_rate and plan.sigma > 0


def test_a_fixed_sigma_a_hair_short_of_the_target_is_refused_and_one_at_it_accepted():
    """dp.sigma given: the σ calibrated to ε = 8.04 overshoots the target 8 by under 1%, which no slack
    in the comparison may let through; the σ calibrated to 8 itself plans, and so does a target equal to its ε."""
    from pipeline.privacy import accounting

    q, delta = 128 / 1258, accounting.parse_delta("1/2n", 1258)
    acc = {"accountant": "pld", "adjacency": "replace_one"}
    short = accounting.calibrate_sigma(8.0 * 1.005, q, 40, delta, **acc)
    assert 8.0 < accounting.epsilon(short, q, 40, delta, **acc) < 8.08
    with pytest.raises(ValueError, match="above the target dp.epsilon=8.0"):
        plan_mechanism({**DP, "objective": "mae", "sigma": short}, 1258, "replace_one")
    exact = accounting.calibrate_sigma(8.0, q, 40, delta, **acc)
    assert plan_mechanism({**DP, "objective": "mae", "sigma": exact}, 1258, "replace_one").sigma == exact
    at = accounting.epsilon(exact, q, 40, delta, **acc)  # ε ≤ target is the contract: equal to it plans
    assert plan_mechanism({**DP, "objective": "mae", "sigma": exact, "epsilon": at}, 1258, "replace_one").epsilon == at


def test_a_header_whose_noise_std_is_off_by_a_percent_is_refused():
    """The ledger's written noise std must be the plan's to rounding, not within a few percent: 1% less
    noise than accounted is a different mechanism."""
    header = plan_mechanism({**DP, "objective": "mae"}, 1258, "replace_one").header()
    with pytest.raises(ValueError, match="noise_std"):
        Plan.from_header({**header, "noise_std": header["noise_std"] * 0.99})


def agreed_sigmas(world: World) -> list:
    """Each rank's (σ, ε) after agreed_plan, rank 1 having calibrated a σ a rounding apart."""
    import torch.distributed as dist

    plan = plan_mechanism({**DP, "objective": "mae"}, 1258, "replace_one")
    mine = dataclasses.replace(plan, sigma=plan.sigma * (1 + 1e-12 * world.rank), epsilon=plan.epsilon - world.rank)
    agreed = agreed_plan(mine, world)
    everyone = [None] * world.size
    dist.all_gather_object(everyone, (agreed.sigma, agreed.epsilon))
    return everyone


def test_every_rank_takes_the_main_ranks_sigma_and_epsilon(tmp_path):
    """Ranks whose accountants round differently add the same noise: rank 0's σ and ε on both (not
    swapped, not each its own); on one rank the plan is unchanged."""
    plan = plan_mechanism({**DP, "objective": "mae"}, 1258, "replace_one")
    assert agreed_plan(plan, World()) == plan
    assert on_two_ranks(tmp_path, agreed_sigmas) == [(plan.sigma, plan.epsilon)] * 2


def test_a_noise_seed_of_zero_is_used_and_drawn_keys_have_63_bits(tmp_path):
    """dp.noise_seed = 0 is a seed like any other (not "draw one"), and a drawn key uses its 63 bits: a
    key of 31 bits is one of 2^31, found by search from one released update."""
    assert secret_key(tmp_path / "zero", 0) == 0 and not (tmp_path / "zero").exists()
    keys = [secret_key(tmp_path / f"run{i}", None) for i in range(16)]
    assert all(0 <= k < 2 ** 63 for k in keys) and max(keys) >= 2 ** 40  # all 16 below 2^40: odds 2^-368


def test_a_full_batch_of_per_batch_clipping_under_replace_one_moves_one_noise_unit():
    """Per batch (K = 2) the clipped mean moves 2C = K·C under replace-one even at q = 1: the edge check must
    use the objective's K, or a DP-CLIP full batch is refused where the same σ per example add/remove passes."""
    full = {**DP, "objective": "mae", "expected_batch_size": 1258, "sigma": 0.2, "epsilon": 1e4}
    plan_mechanism(full, 1258, "add_remove")
    assert plan_mechanism({**full, "objective": "clip"}, 1258, "replace_one").sensitivity == 2.0

