"""Empirical privacy audit in one training run (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with
One (1) Training Run").

m canaries are each put into the training set independently with probability ½; one DP-SGD run then
goes through our engine (Poisson sampler, per-sample clipper, Gaussian noise); the auditor scores every
canary from the trained model, guesses "in" for the highest scores and "out" for the lowest (abstaining
on the rest), and turns the number of correct guesses into a lower bound ε_lower on the ε of what ran,
valid with 95% confidence. A correct engine gives ε_lower ≤ ε claimed; an engine that clips wrongly or
adds too little noise gives more, which the audit reports.

Canaries live in gradient space (the paper's Dirac canaries): canary j is an example whose loss is
w·z_j on a canary layer w, with z_j = G·e_j, so its gradient is G·e_j (G = `canary_gradient_norm`·C)
and zero everywhere else; real examples (scikit-learn's bundled digits, classified by a small MLP)
have zero gradient on w. Only the clipper stands between G and the update, so a clipper that lets a
gradient through above C is what the audit sees. The score of canary j is the inner product of the
total model update with its direction, -⟨θ_T - θ_0, e_j⟩: with plain SGD this is the sum over steps
of the noisy clipped gradients' j-th coordinate, which grows by C each time canary j is sampled.

One-run audits are loose (they cannot certify a large ε: with m canaries ε_lower stays below about
ln(m/3)), so the audited run is calibrated to a small ε (2 by default), not the pipeline's target.
The engine code is the same whatever ε it is calibrated to.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy import stats
from tqdm import tqdm

from pipeline.privacy.sampling import PoissonSampler
from pipeline.privacy.tools.canary_settings import AuditConfig
from pipeline.privacy import accounting
from pipeline.privacy.engine import CLIPPERS, dp_step, make_clipper
from pipeline.privacy.plan import Plan


# ---- the statistics: correct guesses -> ε lower bound ------------------------------------------------

def p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Probability of ≥ v correct guesses out of r (the rest abstained) about m canaries, each included
    with probability ½, if the training run is (ε, δ)-DP: the tail of Binomial(r, e^ε/(1+e^ε)) plus
    the δ term, as in Steinke et al. (2023)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 ≤ correct ({v}) ≤ guesses ({r}) ≤ canaries ({m})")
    if v == 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-eps))  # accuracy of ε-DP randomized response
    beta = stats.binom.sf(v - 1, r, q)
    # α = max over i in 1..v of P[v-i ≤ Binomial(r, q) < v] / i
    below = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, q))
    alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(1.0, float(beta) + alpha * delta * 2 * m)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, level: float) -> float:
    """The largest ε that v correct guesses out of r reject at significance `level` (0 if none):
    the run is not (ε, δ)-DP for any smaller ε, with confidence 1 - level."""
    if p_value(m, r, v, 0.0, delta) >= level:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < level:
        lo, hi = hi, 2 * hi
        if hi > 1e3:
            return lo
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p_value(m, r, v, mid, delta) < level else (lo, mid)
    return lo


def guess_menu(m: int) -> list[tuple[int, int]]:
    """(k_in, k_out) guess counts tried, fixed before any score is seen. The bound is taken at
    level (1 - confidence)/len(menu) for each (Bonferroni), so the best of them is still valid."""
    menu = {(max(1, round(f * m)), 0) for f in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)}
    menu |= {(max(1, round(f * m / 2)), max(1, round(f * m / 2))) for f in (0.1, 0.2, 0.5, 1.0)}
    return sorted(menu)


def audit_scores(scores: np.ndarray, included: np.ndarray, delta: float, confidence: float) -> dict:
    """ε_lower from membership scores (higher = more likely included) and the true inclusions."""
    m = len(scores)
    order = np.argsort(-scores, kind="stable")
    menu = guess_menu(m)
    level = (1 - confidence) / len(menu)
    best = {"epsilon_lower": 0.0, "guesses": 0, "correct": 0, "k_in": 0, "k_out": 0}
    for k_in, k_out in menu:
        guessed_out = order[m - k_out:] if k_out else order[:0]
        correct = int(included[order[:k_in]].sum() + (~included[guessed_out]).sum())
        eps = epsilon_lower_bound(m, k_in + k_out, correct, delta, level)
        if eps > best["epsilon_lower"]:
            best = {"epsilon_lower": eps, "guesses": k_in + k_out, "correct": correct, "k_in": k_in, "k_out": k_out}
    return {**best, "menu_size": len(menu), "level_per_guess_count": level}


# ---- the training run ----------------------------------------------------------------------------

class CanaryModel(nn.Module):
    """A small classifier for the real examples beside a canary layer. Per-sample loss: the
    classification loss for a real example; w·z for a canary (its gradient z lies on w alone)."""

    def __init__(self, features: int, classes: int, canaries: int, width: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, width), nn.GELU(), nn.LayerNorm(width),
                                  nn.Linear(width, classes))
        self.canary = nn.Linear(canaries, 1, bias=False)
        nn.init.zeros_(self.canary.weight)

    def forward(self, x, y, z, is_canary):
        real_loss = F.cross_entropy(self.body(x), y, reduction="none")
        return real_loss * (1 - is_canary) + self.canary(z).squeeze(-1)


def real_examples() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits (no download): 1797 flattened 8x8 images and their labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return torch.tensor(digits.data / 16.0, dtype=torch.float32), torch.tensor(digits.target, dtype=torch.long)


def run_audit(cfg: AuditConfig = AuditConfig(), progress: bool = True) -> dict:
    """One DP-SGD run with canaries through our engine; the audit's figures and verdict."""
    cfg.check()
    started = time.perf_counter()
    m, clip = cfg.canaries, cfg.clip_norm
    # Independent streams: who is in (the auditor's secret), model init, sampling, noise.
    inclusion_seed, init_seed, sample_key, noise_seed = map(int, np.random.SeedSequence(cfg.seed).generate_state(4))
    included = np.random.default_rng(inclusion_seed).random(m) < 0.5
    x_real, y_real = real_examples()
    n_real, inside = len(x_real), np.flatnonzero(included)
    n = n_real + len(inside)
    # q is fixed from the expected dataset size before the draw, so it does not depend on who is in:
    # the run is then exactly the Poisson-subsampled Gaussian mechanism the accountant analyses.
    expected_n = n_real + m / 2
    q = cfg.expected_batch_size / expected_n
    if q > 1:
        raise ValueError(f"expected_batch_size={cfg.expected_batch_size} exceeds the {expected_n:g} expected examples")
    accounting.check_delta(cfg.delta, n_real + m)
    sigma = accounting.calibrate_sigma(cfg.epsilon, q, cfg.steps, cfg.delta)
    eps_claimed = accounting.epsilon(sigma, q, cfg.steps, cfg.delta)

    torch.manual_seed(init_seed)
    model = CanaryModel(x_real.shape[1], int(y_real.max()) + 1, m)
    # A broken run gets no effective clipping.
    try:
        clipper = make_clipper("per_sample", model, clip if cfg.clipping_enabled else math.inf, cfg.clipping)
    except ValueError:
        raise ValueError(f"audit settings are invalid: clipping={cfg.clipping!r} is not a per-sample clipping "
                         f"method of the engine (the values of dp.clipping, e.g. {', '.join(CLIPPERS)})") from None
    # Divided by the expected batch size, as dp-train does.
    # n is what the accountant is told (the expected count): the canaries inside are the secret, so
    # the divisor q·n = expected batch size must not depend on them.
    plan = Plan(objective="canary", clipping="per_sample", n=expected_n, sample_rate=q, sigma=sigma * cfg.noise_scale,
                clip_norm=clip, steps=cfg.steps, delta=cfg.delta, accountant="pld", adjacency="add_remove",
                target_epsilon=cfg.epsilon, epsilon=eps_claimed)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)  # plain SGD: the update is a sum of steps
    sampler = PoissonSampler(n, q, sample_key)
    canary_value = cfg.canary_gradient_norm * clip
    start_weights = model.canary.weight.detach().clone()

    def inputs(step: int, indices: np.ndarray, positions: np.ndarray):
        chunk = indices[positions]
        is_canary = chunk >= n_real
        rows = torch.as_tensor(chunk[~is_canary])
        x = torch.zeros(len(chunk), x_real.shape[1])
        y = torch.zeros(len(chunk), dtype=torch.long)
        x[torch.as_tensor(~is_canary)], y[torch.as_tensor(~is_canary)] = x_real[rows], y_real[rows]
        z = torch.zeros(len(chunk), m)
        z[torch.as_tensor(np.flatnonzero(is_canary)), torch.as_tensor(inside[chunk[is_canary] - n_real])] = canary_value
        return x, y, z, torch.as_tensor(is_canary, dtype=torch.float32)

    for step in tqdm(range(cfg.steps), desc="audit", disable=not progress):
        dp_step(step, sampler=sampler, fetch=inputs, clipper=clipper, plan=plan, key=noise_seed,
                physical_batch_size=cfg.physical_batch_size)
        optimizer.step()

    # ⟨θ_T - θ_0, e_j⟩ for each canary direction e_j, sign flipped so that "sampled" scores high.
    scores = -(model.canary.weight.detach() - start_weights).flatten().double().numpy()
    found = audit_scores(scores, included, cfg.delta, cfg.confidence)
    flagged = found["epsilon_lower"] > eps_claimed
    return {"settings": asdict(cfg), "included": int(included.sum()), "n": n, "sample_rate": q, "sigma": sigma,
            "noise_std": plan.noise_std, "epsilon_claimed": eps_claimed, **found,
            "score_gap": float(scores[included].mean() - scores[~included].mean()),
            "verdict": "flagged" if flagged else "consistent", "seconds": time.perf_counter() - started}
