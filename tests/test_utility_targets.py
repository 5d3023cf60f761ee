"""benchmarks/utility.py's targets: each can fail, on outcomes made to break it."""

import math

import numpy as np

from benchmarks.utility import check_targets

EPSILONS = [1.0, 8.0, math.inf]


def outcomes():
    rng = np.random.default_rng(0)
    weak = rng.random((3, 300)) < 0.8
    strong = weak | (rng.random((3, 300)) < 0.6)  # right on every example weak gets, and many more
    probe = {(None, "random", None): weak, (None, "pixels", None): strong[:1], ("mae", "random", 8.0): weak}
    probe.update({("mae", "synthetic", e): strong for e in EPSILONS})
    return probe, weak, strong


def passed(probe):
    return {k: t["passed"] for k, t in check_targets(probe, {}, ["mae"], EPSILONS).items()}


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
