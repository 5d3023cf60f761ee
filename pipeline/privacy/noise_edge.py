"""What the noise's floating-point edge gives away, and the refusal of a mechanism where that is too much.

The noise (privacy/noise.py) is drawn by Box-Muller, |z| <= sqrt(-2 ln u), from uniforms never below
2^-106: no draw passes NOISE_EDGE std (12.1), where a Gaussian passes once in 1e33 draws. torch's own
fp32 draws stop at 5.77 std on the CPU (24-bit uniforms), 6.76 on CUDA, its fp64 draws at 8.57. A
released coordinate past the edge is possible only when the example that moved it was in the batch
(docs/privacy.md, "Floating-point noise"). The ledger records the edge its noise had (`Plan.noise_edge`),
and verify checks it as dp-train's plan did.
"""

from __future__ import annotations

import math


def box_muller_edge(smallest_uniform: float) -> float:
    """The largest |z| Box-Muller gives: its radius sqrt(-2 ln u) at the smallest uniform u it can draw."""
    return math.sqrt(-2 * math.log(smallest_uniform))


NOISE_EDGE = box_muller_edge(2.0 ** -106)
# The edge of a ledger that records none: dp-train drew torch's fp32 normals until the ledger recorded
# its noise's edge (the CPU's edge, the lower of the CPU's and CUDA's).
UNRECORDED_EDGE = box_muller_edge(2.0 ** -24)
SHARE_OF_DELTA = 0.1  # the most of δ the edge alone may give away


def largest_move(sensitivity: float, adjacency: str, sample_rate: float) -> float:
    """How far one example x moves a released coordinate past the largest value its neighbour can
    release, in units of the sensitivity K·C the noise is scaled to. Where the neighbour may leave x's
    slot unsampled (q < 1) its largest is the noise's own edge, and x's clipped gradient moves C past
    it, under either adjacency. A full batch (q = 1) under replace-one always holds x's replacement,
    whose gradient can point the other way: 2C. Per batch (K = 2) the clipped mean moves at most 2C."""
    return 2.0 / sensitivity if adjacency == "replace_one" and sample_rate >= 1 and sensitivity < 2 else 1.0


def noise_edge_floor(sigma: float, sample_rate: float, steps: int, edge: float = NOISE_EDGE, *, move: float) -> float:
    """The chance that a run shows an informed adversary (who knows everything but which of two
    neighbouring datasets it trains on) a released coordinate past the largest value one of them allows:
    x moves it `move`/σ noise stds past that (`largest_move`) in each step that samples it. The DP
    guarantee fails outright on that event, so it is a floor under the run's true δ."""
    per_step = sample_rate * 0.5 * math.erfc((edge - move / sigma) / math.sqrt(2))
    return -math.expm1(steps * math.log1p(-min(per_step, 1.0 - 1e-16)))


def edge_problem(sigma: float, sample_rate: float, steps: int, delta: float, edge: float = NOISE_EDGE, *,
                 move: float) -> str | None:
    """Why the noise's edge alone gives away more than SHARE_OF_DELTA of δ, or None: a small σ moves x's
    coordinate too close to the edge."""
    floor = noise_edge_floor(sigma, sample_rate, steps, edge, move=move)
    if floor <= SHARE_OF_DELTA * delta:
        return None
    return (f"sigma={sigma:.4g} over {steps} steps at q={sample_rate:.3g}: the noise as drawn never passes {edge:.2f} "
            f"std, so with probability {floor:.2g} the run shows an informed adversary a coordinate that only one "
            f"of two neighbouring datasets allows, above delta/10 = {SHARE_OF_DELTA * delta:.2g}")


def check_noise_edge(sigma: float, sample_rate: float, steps: int, delta: float, *, move: float) -> None:
    """Refuse, before any work, a mechanism whose noise edge gives away too much (`edge_problem`)."""
    problem = edge_problem(sigma, sample_rate, steps, delta, move=move)
    if problem:
        raise ValueError(f"{problem}; lower dp.epsilon or take more steps (σ, calibrated to them, grows); with "
                         "dp.sigma given, raise it or take fewer steps")
