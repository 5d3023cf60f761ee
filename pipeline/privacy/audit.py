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
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy import stats
from tqdm import tqdm

from pipeline.data.sampling import PoissonSampler
from pipeline.io import write_json
from pipeline.privacy import accounting
from pipeline.privacy.engine import CLIPPERS, SENSITIVITY, make_clipper, noisy_update


@dataclass(frozen=True)
class AuditConfig:
    canaries: int = 5000
    steps: int = 300
    expected_batch_size: int = 512
    physical_batch_size: int = 128
    epsilon: float = 2.0               # the audited run's σ is calibrated to this ε (PLD)
    delta: float = 1e-5
    clip_norm: float = 1.0
    canary_gradient_norm: float = 10.0  # canary gradients before clipping, in units of C
    lr: float = 0.05
    clipping: str = "bookkeeping"      # the per-sample clipping method audited (as dp.clipping)
    confidence: float = 0.95
    seed: int = 0
    # Deliberate faults, so one can see the audit catch a broken engine:
    clipping_enabled: bool = True      # False: the clipper is built with an infinite clip norm
    noise_scale: float = 1.0           # 0.1: noise ten times below what was accounted

    def check(self) -> None:
        problems = []
        if self.canaries < 2:
            problems.append(f"canaries={self.canaries} must be ≥ 2")
        for name in ("steps", "expected_batch_size", "physical_batch_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be ≥ 1")
        for name in ("epsilon", "clip_norm", "lr", "noise_scale"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)} must be > 0")
        if not self.canary_gradient_norm >= 1:
            problems.append(f"canary_gradient_norm={self.canary_gradient_norm} must be ≥ 1 (a canary must reach C)")
        if not 0 < self.delta < 1:
            problems.append(f"delta={self.delta} must be in (0, 1)")
        if not 0.5 <= self.confidence < 1:
            problems.append(f"confidence={self.confidence} must be in [0.5, 1)")
        if problems:
            raise ValueError("audit settings are invalid: " + "; ".join(problems))


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
    # Any per-sample objective selects the per-sample clipper; a broken run gets no effective clipping.
    try:
        clipper = make_clipper("mae", model, clip if cfg.clipping_enabled else math.inf, cfg.clipping)
    except KeyError:
        raise ValueError(f"audit settings are invalid: clipping={cfg.clipping!r} is not a per-sample clipping "
                         f"method of the engine (the values of dp.clipping, e.g. {', '.join(CLIPPERS)})") from None
    noise_std = sigma * SENSITIVITY["per_sample"] * clip * cfg.noise_scale
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)  # plain SGD: the update is a sum of steps
    sampler = PoissonSampler(n, q, sample_key)
    canary_value = cfg.canary_gradient_norm * clip
    start_weights = model.canary.weight.detach().clone()

    def inputs(chunk: np.ndarray):
        is_canary = chunk >= n_real
        rows = torch.as_tensor(chunk[~is_canary])
        x = torch.zeros(len(chunk), x_real.shape[1])
        y = torch.zeros(len(chunk), dtype=torch.long)
        x[torch.as_tensor(~is_canary)], y[torch.as_tensor(~is_canary)] = x_real[rows], y_real[rows]
        z = torch.zeros(len(chunk), m)
        z[torch.as_tensor(np.flatnonzero(is_canary)), torch.as_tensor(inside[chunk[is_canary] - n_real])] = canary_value
        return x, y, z, torch.as_tensor(is_canary, dtype=torch.float32)

    for step in tqdm(range(cfg.steps), desc="audit", disable=not progress):
        indices = sampler.batch(step)
        clipper.reset()
        for chunk in sampler.split(indices, cfg.physical_batch_size):
            if len(chunk):
                clipper.accumulate(*inputs(chunk))
        optimizer.zero_grad(set_to_none=True)
        # Divided by the expected batch size, as dp-train does.
        noisy_update(clipper, noise_std, cfg.expected_batch_size, torch.Generator().manual_seed(noise_seed + step))
        optimizer.step()

    # ⟨θ_T - θ_0, e_j⟩ for each canary direction e_j, sign flipped so that "sampled" scores high.
    scores = -(model.canary.weight.detach() - start_weights).flatten().double().numpy()
    found = audit_scores(scores, included, cfg.delta, cfg.confidence)
    flagged = found["epsilon_lower"] > eps_claimed
    return {"settings": asdict(cfg), "included": int(included.sum()), "n": n, "sample_rate": q, "sigma": sigma,
            "noise_std": noise_std, "epsilon_claimed": eps_claimed, **found,
            "score_gap": float(scores[included].mean() - scores[~included].mean()),
            "verdict": "flagged" if flagged else "consistent", "seconds": time.perf_counter() - started}


# ---- `dpfm audit` ----------------------------------------------------------------------------------

def add_audit_command(subparsers) -> None:
    d = AuditConfig()
    p = subparsers.add_parser("audit", help="empirical privacy audit of the DP engine in one training run",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--canaries", type=int, default=d.canaries, help=f"m (default {d.canaries})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"DP-SGD steps (default {d.steps})")
    p.add_argument("--batch-size", type=int, default=d.expected_batch_size, dest="expected_batch_size",
                   help=f"expected (Poisson) batch size (default {d.expected_batch_size})")
    p.add_argument("--epsilon", type=float, default=d.epsilon, help=f"ε the run is calibrated to (default {d.epsilon})")
    p.add_argument("--delta", type=float, default=d.delta, help=f"δ (default {d.delta})")
    p.add_argument("--clipping", default=d.clipping,
                   help=f"per-sample clipping method to audit, as dp.clipping (default {d.clipping})")
    p.add_argument("--confidence", type=float, default=d.confidence, help="of the lower bound (default 0.95)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-clipping", action="store_false", dest="clipping_enabled",
                   help="FAULT: disable per-sample clipping (the audit should flag the run)")
    p.add_argument("--noise-scale", type=float, default=d.noise_scale,
                   help="FAULT when < 1: multiply the accounted noise, e.g. 0.1 (the audit should flag the run)")
    p.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the model is tiny)")
    p.set_defaults(func=_run_audit_command, _parser=p)


def _run_audit_command(args) -> int:
    fields = {k: getattr(args, k) for k in ("canaries", "steps", "expected_batch_size", "epsilon", "delta", "clipping",
                                            "confidence", "seed", "clipping_enabled", "noise_scale")}
    torch.set_num_threads(max(1, args.threads))
    try:
        result = run_audit(AuditConfig(**fields))
    except ValueError as e:
        args._parser.error(str(e))
    faults = [f for f, on in (("clipping disabled", not args.clipping_enabled),
                              (f"noise ×{args.noise_scale:g}", args.noise_scale != 1)) if on]
    print(f"audit: {args.canaries} canaries ({result['included']} included), {args.steps} steps, "
          f"q={result['sample_rate']:.4g}, σ={result['sigma']:.4g}, δ={args.delta:g}"
          + (f"; faults injected: {', '.join(faults)}" if faults else ""))
    print(f"  {'ε claimed (PLD)':<20} = {result['epsilon_claimed']:.3f}")
    how = (f"{result['correct']}/{result['guesses']} correct: top {result['k_in']} guessed in, "
           f"bottom {result['k_out']} out" if result["guesses"] else "no guess count beats chance")
    print(f"  {f'ε lower ({args.confidence:.0%} conf.)':<20} = {result['epsilon_lower']:.3f}   ({how})")
    if result["verdict"] == "flagged":
        print("  verdict: FLAGGED: the run leaks more than the ε claimed for it; the engine is broken")
    else:
        print("  verdict: consistent: the audit found no leak beyond the ε claimed")
    print(f"  ({result['seconds']:.1f} s)")
    if args.json:
        write_json(args.json, result)
    return 1 if result["verdict"] == "flagged" else 0
