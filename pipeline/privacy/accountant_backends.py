"""The accountant back-ends behind pipeline.privacy.accounting: PLD (dp_accounting, with its
discretisation refined until stable and an RDP safety net), RDP and PRV (Opacus). All work with the
noise multiplier σ relative to the sensitivity. The libraries are imported where they are used:
Opacus brings torch, dp_accounting scipy, so a CLI that needs one loads only that one.

Adjacency: `add_remove` (one example added or removed: the literature's, and every accountant's)
or `replace_one` (one example replaced by another: n is the same in both worlds, so releasing it
costs nothing). Only PLD accounts replace-one for Poisson sampling (dp_accounting's
REPLACE_ONE relation); its safety net is then the group-privacy bound of two add/remove steps."""

from __future__ import annotations

import functools
import logging
import math
import warnings
from typing import List, Tuple

import numpy as np

# PLD discretisation ladder: start coarse, halve until two successive values
# agree to PLD_REL_TOL.  The pessimistic error shrinks at least linearly in
# the interval, so the last difference bounds the error left in the final
# value (measured errors are 2-10x smaller than the bound).
PLD_START_INTERVAL = 4e-3
PLD_REL_TOL = 1e-3
_PLD_MIN_INTERVAL = 1e-6
_PLD_MAX_GRID = 2_000_000  # one-step PLD points; bounds memory of the FFT
_PLD_NOISE_TOL = 0.01  # spread of the last values tolerated at a noise floor
# dp_accounting composes T steps by raising the one-step PLD's FFT to the power T: every point's mass
# carries round-off of about T * 2^-52. Past a tenth of delta no grid resolves epsilon at delta.
_PLD_ROUND_OFF_SHARE = 0.1
# Coarse intervals used only to steer searches, never to report a number.
_PLD_SEARCH_INTERVALS = (1e-2, 1e-3)

# Opacus' PRV default; its result is the upper end of a +-eps_error band.
PRV_EPS_ERROR = 0.01


ADJACENCIES = ("add_remove", "replace_one")


def supports(accountant: str, adjacency: str) -> bool:
    """Whether `accountant` accounts `adjacency` neighbours (replace-one: PLD only)."""
    return adjacency == "add_remove" or accountant == "pld"


def check_adjacency(adjacency: str, accountant: str) -> str:
    if adjacency not in ADJACENCIES:
        raise ValueError(f"adjacency must be one of {', '.join(ADJACENCIES)}, got {adjacency!r}")
    if not supports(accountant, adjacency):
        raise ValueError(f"accountant {accountant} accounts add/remove adjacency only: use pld for replace_one")
    return adjacency


def _relation(adjacency: str):
    import dp_accounting

    return (dp_accounting.NeighboringRelation.REPLACE_ONE if adjacency == "replace_one"
            else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)


@functools.lru_cache(maxsize=64)
def _pld_step(noise: float, q: float, interval: float, adjacency: str = "add_remove"):
    # Building the one-step PLD dominates the cost (~70%); caching it lets
    # curves and step searches recompose it for many step counts cheaply.
    from dp_accounting.pld import privacy_loss_distribution as _pld_lib

    return _pld_lib.from_gaussian_mechanism(
        standard_deviation=noise,
        sensitivity=1.0,
        sampling_prob=q,
        pessimistic_estimate=True,
        value_discretization_interval=interval,
        neighboring_relation=_relation(adjacency),
    )


# A composition of Poisson-subsampled Gaussian mechanisms, one (σ, q, T) per run: a run alone is one
# part; the budget composes every run charged to the data (budget.composed_epsilon). Both take the same
# ladder, noise floor and safety net below.
Parts = Tuple[Tuple[float, float, int], ...]


def _pld_eps_at(noise: float, q: float, steps: int, delta: float, interval: float,
                adjacency: str = "add_remove") -> float:
    """dp_accounting PLD epsilon of one run at one fixed discretisation interval."""
    return _pld_parts_at(((noise, q, steps),), delta, interval, adjacency)


@functools.lru_cache(maxsize=4096)
def _pld_parts_at(parts: Parts, delta: float, interval: float, adjacency: str = "add_remove") -> float:
    """PLD epsilon of the parts composed, at one fixed discretisation interval."""
    composed = None
    for noise, q, steps in parts:
        part = _pld_step(noise, q, interval, adjacency).self_compose(steps)
        composed = part if composed is None else composed.compose(part)
    return float(composed.get_epsilon_for_delta(delta))


def _pld_grid_size(noise: float, q: float, interval: float, adjacency: str = "add_remove") -> int:
    # Number of points of the one-step PLD (private attribute; 0 if absent).
    pmf = getattr(_pld_step(noise, q, interval, adjacency), "_pmf_remove", None)
    return int(getattr(pmf, "size", 0) or 0)


def _pld_epsilon_and_interval(noise: float, q: float, steps: int, delta: float,
                              adjacency: str = "add_remove") -> Tuple[float, float]:
    """One run's PLD epsilon and the interval it settled at (`_pld_ladder`)."""
    return _pld_ladder(((noise, q, steps),), delta, adjacency)


def composed_epsilon(parts: Parts, delta: float, adjacency: str = "add_remove") -> float:
    """ε at δ of the parts applied one after another to the same data (`_pld_ladder`)."""
    check_adjacency(adjacency, "pld")  # below, any name but replace_one would read as add/remove
    parts = tuple((float(n), float(q), int(t)) for n, q, t in parts if t > 0)
    return _pld_ladder(parts, delta, adjacency)[0] if parts else 0.0


def _pld_ladder(parts: Parts, delta: float, adjacency: str = "add_remove") -> Tuple[float, float]:
    """Refine the interval until epsilon is stable to PLD_REL_TOL.

    The ladder always starts at PLD_START_INTERVAL and halves, so the result
    is a deterministic function of the inputs (and the cache is reused).

    Very long runs at tiny delta hit floating-point limits: dp_accounting
    composes by raising the FFT of the one-step PLD to the power T, so
    round-off of ~T * 1e-16 in probability mass competes with delta.  At
    T ~ 3e5, delta ~ 2e-9 this is ~0.1% noise in epsilon; at T ~ 2e6,
    delta ~ 1e-10 the values are garbage in *both* directions, and at
    T = 6e5 they drift by 3% around the true value, so that two successive
    ones could agree by chance below it: once T * 2^-52 exceeds delta / 10
    the ladder is not run and RDP is reported.  When a
    refinement changes epsilon more than the previous one did (noise floor)
    or the grid gets huge, the ladder stops: if its last three values agree
    to 1% it reports their maximum (conservative), otherwise PLD cannot be
    trusted and the RDP bound (closed-form, always valid) is reported with a
    RuntimeWarning.  A PLD value above RDP is likewise a numerical failure
    (the exact PLD epsilon never exceeds RDP's) and is replaced by RDP.
    """
    interval = PLD_START_INTERVAL
    if _round_off_swamps_delta(sum(t for *_, t in parts), delta):
        # The values drift with the grid in both directions, and two can agree by chance below the
        # true epsilon (how the noise falls depends on the CPU's FFT): not worth asking.
        return _unstable(parts, delta, adjacency, f"round-off of about {sum(t for *_, t in parts) * np.finfo(float).eps:.2g} "
                         "per point of the composed loss against delta"), interval
    values = [_pld_parts_at(parts, delta, interval, adjacency)]
    diffs: List[float] = []
    while True:
        interval /= 2
        current = _pld_parts_at(parts, delta, interval, adjacency)
        if not math.isfinite(current):
            return current, interval
        diffs.append(abs(values[-1] - current))
        values.append(current)
        if diffs[-1] <= PLD_REL_TOL * current:
            return _capped_by_rdp(current, parts, delta, adjacency), interval
        noise_floor = len(diffs) >= 3 and diffs[-1] > diffs[-2]
        too_fine = (
            interval / 2 < _PLD_MIN_INTERVAL
            or max(_pld_grid_size(n, q, interval, adjacency) for n, q, _ in parts) > _PLD_MAX_GRID // 2
        )
        if noise_floor or too_fine:
            recent = values[-3:]
            if max(recent) - min(recent) <= _PLD_NOISE_TOL * max(recent):
                return _capped_by_rdp(max(recent), parts, delta, adjacency), interval
            return _unstable(parts, delta, adjacency, f"epsilon varies {min(recent):.4g}..{max(recent):.4g} "
                             "with the grid"), interval


def _round_off_swamps_delta(steps: int, delta: float) -> bool:
    """Whether a PLD composed over `steps` carries more round-off per point than a tenth of δ: its ε is
    then not to be trusted in either direction, and the RDP bound stands in (`_pld_ladder`)."""
    return steps * np.finfo(float).eps > _PLD_ROUND_OFF_SHARE * delta


def _unstable(parts: Parts, delta: float, adjacency: str, why: str) -> float:
    """The RDP bound, with a warning that PLD could not resolve these parts."""
    warnings.warn(f"PLD accounting is numerically unstable here (steps={sum(t for *_, t in parts)}, "
                  f"delta={delta:g}: {why}); reporting the RDP upper bound instead", RuntimeWarning, stacklevel=3)
    return _rdp_parts_bound(parts, delta, adjacency)


def _rdp_bound(noise: float, q: float, steps: int, delta: float, adjacency: str = "add_remove") -> float:
    """One run's `_rdp_parts_bound`."""
    return _rdp_parts_bound(((noise, q, steps),), delta, adjacency)


def _rdp_parts_bound(parts: Parts, delta: float, adjacency: str = "add_remove") -> float:
    """dp_accounting's RDP bound: the PLD's safety net, without Opacus's torch import. Replace-one is
    remove-then-add, a group of two under add/remove: (2ε, δ)-DP for an ε that the add/remove ε at
    δ / (1 + e^ε) does not exceed (`group_of_two`)."""
    if adjacency == "replace_one":
        return 2 * group_of_two(lambda d: _rdp_parts_bound(parts, d), delta)
    return float(_rdp_composed(parts).get_epsilon(delta))


def group_of_two(epsilon_at, delta: float, max_steps: int = 60) -> float:
    """An ε with epsilon_at(δ / (1 + e^ε)) ≤ ε, near the least one: a mechanism that is (ε, δ')-DP
    under add/remove at δ' = δ / (1 + e^ε) is (2ε, (1 + e^ε)δ') = (2ε, δ)-DP for a group of two.

    f(ε) = epsilon_at(δ / (1 + e^ε)) grows with ε. Iterating f upwards from f(0), as this did until
    2026-11-28, stopped after 20 steps wherever it was, below the fixed point, where f(ε) > ε: an
    ε too small (σ 0.75, q 0.1, 40 steps, δ 1e-4: 18.974064 where 18.974070 was needed). From above
    every iterate satisfies the condition (ε' = f(ε) ≤ ε gives f(ε') ≤ f(ε) = ε'), so the search
    first doubles ε until f(ε) ≤ ε, then descends by f, and stops anywhere with a valid ε; ∞ where
    none is found before e^ε overflows."""
    def f(eps: float) -> float:
        return epsilon_at(delta / (1 + math.exp(eps))) if eps < 700 else math.inf

    eps = max(f(0.0), 1e-6)
    while f(eps) > eps:  # below the fixed point: not a valid ε
        eps *= 2
        if eps >= 700:
            return math.inf
    valid = eps
    for _ in range(max_steps):
        lower = f(eps)
        if lower > eps:  # f not monotone to the last bit: keep the last ε checked
            break
        valid = eps
        if lower >= eps * (1 - 1e-12):
            break
        eps = lower
    return valid


@functools.lru_cache(maxsize=256)
def _rdp_composed(parts: Parts):
    """dp_accounting's RDP accountant over the parts' Poisson-sampled Gaussian steps. Its RDP curve does
    not depend on δ, so the replace-one group bound above reads one composition at each of its δ:
    composing anew for each took verify 2.4 s of its 9 (fractional orders that fail to converge, 1,000
    terms each). Those orders are left out of the bound, which only loosens it: dp_accounting's warning
    for each (six lines a composition in every stage log) is kept below ERROR."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        for noise, q, steps in parts:
            accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(noise)), steps)
    finally:
        absl.setLevel(level)
    return accountant


def _capped_by_rdp(eps: float, parts: Parts, delta: float, adjacency: str = "add_remove") -> float:
    if adjacency == "replace_one":  # the group-privacy bound is far looser than any PLD: no cap to apply
        return eps
    rdp = _rdp_parts_bound(parts, delta, adjacency)
    if eps > rdp:
        warnings.warn(
            f"PLD epsilon {eps:.4g} exceeds the RDP bound {rdp:.4g} (numerical "
            "failure of the PLD composition); reporting the RDP bound",
            RuntimeWarning,
            stacklevel=3,
        )
        return rdp
    return eps


@functools.lru_cache(maxsize=256)
def _rdp_per_step(noise: float, q: float) -> Tuple[float, ...]:
    # RDP composes additively, so one step's curve serves every step count.
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as _rdp_lib

    return tuple(_rdp_lib.compute_rdp(q=q, noise_multiplier=noise, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS))


def _rdp_eps(noise: float, q: float, steps: int, delta: float) -> float:
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as _rdp_lib

    rdp = np.asarray(_rdp_per_step(noise, q)) * steps
    with warnings.catch_warnings():
        # "Optimal order is the largest alpha": the bound is still valid,
        # just looser; it is reported as-is to match Opacus.
        warnings.filterwarnings("ignore", message="Optimal order")
        eps, _ = _rdp_lib.get_privacy_spent(
            orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta
        )
    return float(eps)


def _prv_eps(noise: float, q: float, steps: int, delta: float) -> float:
    return prv_bounds(noise, q, steps, delta)[1]


@functools.lru_cache(maxsize=1024)
def prv_bounds(noise: float, q: float, steps: int, delta: float) -> Tuple[float, float]:
    """Opacus PRV's (lower, upper) bounds on the add/remove ε at δ, PRV_EPS_ERROR apart: the upper is
    what Opacus reports (`get_epsilon`); the lower lets verify check an ε from another library from
    below, which no upper bound (RDP) can. Both as get_epsilon computes them (δ's error δ/1000)."""
    from opacus.accountants import PRVAccountant

    accountant = PRVAccountant()
    accountant.history = [(noise, q, steps)]
    delta_error = delta / 1000  # get_epsilon's default
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' domain-size chatter
        prv = accountant._get_dprv(eps_error=PRV_EPS_ERROR, delta_error=delta_error)
        lower, _, upper = prv.compute_epsilon(delta, delta_error, PRV_EPS_ERROR)
    return float(lower), float(upper)


def _eps_noise(noise: float, q: float, steps: int, delta: float, accountant: str,
               adjacency: str = "add_remove") -> float:
    check_adjacency(adjacency, accountant)
    if steps == 0:
        return 0.0  # nothing released, nothing spent
    if accountant == "pld":
        return _pld_epsilon_and_interval(noise, q, steps, delta, adjacency)[0]
    if accountant == "rdp":
        return _rdp_eps(noise, q, steps, delta)
    return _prv_eps(noise, q, steps, delta)
