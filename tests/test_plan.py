"""The plan: one frozen description of the mechanism, written as the ledger's header and read back
by the budget, verify and the report without losing or changing a value."""

from __future__ import annotations

import math

import pytest

from pipeline.objectives import OBJECTIVES
from pipeline.privacy.plan import Plan, plan_mechanism

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
    in the comparison may let through; the σ calibrated to 8 itself plans."""
    from pipeline.privacy import accounting

    q, delta = 128 / 1258, accounting.parse_delta("1/2n", 1258)
    acc = {"accountant": "pld", "adjacency": "replace_one"}
    short = accounting.calibrate_sigma(8.0 * 1.005, q, 40, delta, **acc)
    assert 8.0 < accounting.epsilon(short, q, 40, delta, **acc) < 8.08
    with pytest.raises(ValueError, match="above the target dp.epsilon=8.0"):
        plan_mechanism({**DP, "objective": "mae", "sigma": short}, 1258, "replace_one")
    exact = accounting.calibrate_sigma(8.0, q, 40, delta, **acc)
    assert plan_mechanism({**DP, "objective": "mae", "sigma": exact}, 1258, "replace_one").sigma == exact
