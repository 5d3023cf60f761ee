"""benchmarks/utility.py's targets: each can fail, on outcomes made to break it; and the figures its rows carry
(the schedule's σ/B and epochs), each the one it is named for."""

import math

import numpy as np
import pytest

from benchmarks import utility
from benchmarks.utility import PIXELS, check_targets, schedule, table_rows

EPSILONS = [1.0, 8.0, math.inf]


def outcomes():
    rng = np.random.default_rng(0)
    weak = rng.random((3, 300)) < 0.8
    strong = weak | (rng.random((3, 300)) < 0.6)  # right on every example weak gets, and many more
    probe = {(None, "random", None): weak, (None, "pixels", None): strong[:1], ("mae", "random", 8.0): weak}
    probe.update({("mae", "synthetic", e): strong for e in EPSILONS})
    return probe, weak, strong


def passed(probe, zero=None):
    return {k: t["passed"] for k, t in check_targets(probe, zero or {}, ["mae"], EPSILONS).items()}


def test_a_clear_gain_passes_every_target():
    probe, _, strong = outcomes()
    assert all(passed(probe).values())


def test_each_target_fails_when_its_comparison_breaks():
    probe, weak, strong = outcomes()
    probe["mae", "synthetic", math.inf] = weak  # no better than random, and a drop from ε = 8
    result = passed(probe)
    assert not result["a_mae"] and not result["c_mae_8_to_inf"] and result["b_mae"]
    probe, weak, _ = outcomes()
    probe["mae", "synthetic", 8.0] = weak  # DP from synthetic no better than from random
    assert not passed(probe)["b_mae"]
    probe, _, _ = outcomes()
    probe[None, "pixels", None] = np.ones_like(probe[None, "pixels", None])  # pixels out of every encoder's reach
    assert not passed(probe)["d_best_vs_pixels"]


def test_the_intervals_cover_the_probe_refits():
    """With refits, the paired intervals cover which images the probe was fit on: refits that disagree
    wildly (half the probes wrong everywhere) widen a clear gain's interval past 0; refits that repeat
    the full probe leave the verdict as it was."""
    probe, weak, strong = outcomes()
    fits = 10
    steady = {k: np.repeat(v[:, None], fits, axis=1) for k, v in probe.items() if k[1] != "pixels"}
    wild = dict(steady)
    for e in EPSILONS:
        r = steady["mae", "synthetic", e].copy()
        r[:, ::2] = False  # every other refit of the trained rows gets nothing right
        wild["mae", "synthetic", e] = r

    def verdicts(refits):
        return {k: t["passed"] for k, t in check_targets(probe, {}, ["mae"], EPSILONS, refits).items()}

    assert verdicts(steady)["a_mae"] and verdicts(None)["a_mae"]
    assert not verdicts(wild)["a_mae"]


def test_a_compares_with_the_untrained_random_encoder_not_dp_from_random():
    """Target a is ε = ∞ from synthetic against the random-init encoder as built (no training): a DP
    encoder trained from random init, however good or bad, does not move its verdict."""
    probe, weak, strong = outcomes()
    probe["mae", "random", 8.0] = strong  # DP from random as good as ε = ∞ from synthetic
    assert passed(probe)["a_mae"]
    probe, weak, strong = outcomes()
    probe[None, "random", None] = strong  # the untrained encoder as good as ε = ∞ from synthetic: no gain
    assert not passed(probe)["a_mae"]


def zero_shot(dp, nonprivate):
    """Zero-shot outcomes of caption's synthetic-init rows at ε = 8 and ∞, chance 0.5: "high" well above it
    (90% right on 3 × 300 images), "chance" at it."""
    rng = np.random.default_rng(1)
    rate = {"high": 0.9, "chance": 0.5}
    zero = {("caption", "synthetic", e): rng.random((3, 300)) < rate[level] for e, level in ((8.0, dp),
                                                                                           (math.inf, nonprivate))}
    return {"chance": 0.5, **zero}


def test_e_asks_dp_zero_shot_above_chance_only_where_the_nonprivate_one_is():
    """Target e: DP-Cap's zero-shot at ε = 8 is above chance wherever its non-private twin's is. Both above:
    passed; the twin above and DP at chance: failed; both at chance: passed (nothing to keep)."""
    probe, _, _ = outcomes()

    def e(dp, nonprivate):
        return check_targets(probe, zero_shot(dp, nonprivate), ["mae"], EPSILONS)["e_caption_zero_shot"]

    assert e("high", "high")["passed"]
    assert not e("chance", "high")["passed"]
    assert e("chance", "chance")["passed"]
    assert e("high", "high")["chance"] == 0.5


def test_d_takes_the_best_encoder_even_an_untrained_one():
    """Target d's best encoder is over every encoder row, the untrained random-init and synthetic-only ones
    (ε null) too: where the random weights beat every trained encoder, they are the row held to the pixels."""
    probe, _, _ = outcomes()
    probe[None, "random", None] = np.ones_like(probe[None, "random", None])
    d = check_targets(probe, {}, ["mae"], EPSILONS)["d_best_vs_pixels"]
    assert d["best"] == "encoder/random"
    assert d["passed"]


@pytest.fixture(scope="module")
def params():
    from pipeline.config import load_params

    return load_params(str(utility.ROOT / "params.yaml"), ["run.device=cpu"])


def test_the_schedule_gives_sigma_over_the_batch_and_the_epochs(params):
    """The row's σ/B is σ over the expected batch (not over the steps), and its epochs the examples the
    steps sample (B·T) over the n private ones."""
    n = 1000
    s = schedule(params, n, 8.0)
    assert s["sigma"] > 0 and s["batch"] != s["steps"]
    assert s["sigma_over_b"] == pytest.approx(s["sigma"] / s["batch"])
    assert s["epochs"] == pytest.approx(s["batch"] * s["steps"] / n, abs=0.005)
    assert schedule(params, 2 * n, 8.0)["epochs"] == pytest.approx(s["epochs"] / 2, abs=0.01)


def test_table_rows_carry_each_schedule_figure_under_its_own_name():
    """A trained row's σ, B, T, σ/B and noise per coordinate, each from its own entry of the schedule
    (distinct values here, so a swap shows), rounded as printed; untrained rows carry none."""
    rng = np.random.default_rng(2)
    trained = ("mae", "synthetic", 8.0)
    probe = {PIXELS: rng.random((1, 200)) < 0.9, (None, "synthetic", None): rng.random((2, 200)) < 0.6,
             trained: rng.random((2, 200)) < 0.8}
    noise = {trained: {"sigma": 0.87654321, "batch": 128, "steps": 40, "sigma_over_b": 0.00123456,
                       "noise_per_coordinate": 0.0456789}}
    rows = {(r["objective"], r["init"], r["epsilon"]): r for r in table_rows(probe, {}, {"chance": 0.1}, noise, 500)}
    row = rows["mae", "synthetic", 8.0]
    assert (row["sigma"], row["batch"], row["steps"]) == (0.8765, 128, 40)
    assert row["sigma_over_b"] == 0.00123
    assert row["noise_per_coordinate"] == 0.0457
    assert row["n"] == 500 and row["seeds"] == 2
    assert "sigma" not in rows[None, "synthetic", None] and "sigma_over_b" not in rows[None, "pixels", None]
