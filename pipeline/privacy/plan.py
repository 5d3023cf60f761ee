"""The mechanism a DP training is accounted for, planned before any work, and its secret key.

`plan_mechanism` turns the dp params and n into q, δ, σ (calibrated to the target ε under the stated
adjacency) and the ε they give; dp-train writes it as the ledger's header and the budget's entry.
`secret_key` is the randomness privacy rests on (who is sampled, the noise, the MAE masks): drawn
once per run, owner-only from its first byte, never in params or MLflow.
"""

from __future__ import annotations

import secrets

from pipeline.io import atomic_path
from pipeline.objectives import objective
from pipeline.privacy import accounting
from pipeline.privacy.sampling import PoissonSampler


def secret_key(directory, noise_seed: int | None) -> int:
    """The run's secret randomness key: created once, reused on resume, never logged."""
    if noise_seed is not None:
        return noise_seed
    path = directory / "secret.key"
    if not path.exists():  # owner-only from its first byte, and whole or absent (a kill leaves no half key)
        with atomic_path(path, mode=0o600) as tmp:
            tmp.write_text(str(secrets.randbits(63)))
    return int(path.read_text())


def plan_mechanism(dp: dict, n: int, adjacency: str) -> dict:
    """q, δ, σ and the ε they give under `adjacency`, checked for contradictions before any work."""
    q = dp["expected_batch_size"] / n
    if q > 1:
        raise ValueError(f"dp.expected_batch_size={dp['expected_batch_size']} exceeds the {n} usable private examples")
    delta = accounting.parse_delta(dp["delta"], n)
    accounting.check_delta(delta, n)
    sensitivity = objective(dp["objective"]).sensitivity
    # σ is the noise multiplier relative to the sensitivity: noise std = σ · sensitivity · C.
    acc = {"accountant": dp["accountant"], "adjacency": adjacency}
    sigma = dp["sigma"] or accounting.calibrate_sigma(dp["epsilon"], q, dp["steps"], delta, **acc)
    eps = accounting.epsilon(sigma, q, dp["steps"], delta, **acc)
    if eps > dp["epsilon"]:
        raise ValueError(f"dp.sigma={sigma} gives ε={eps:.3f} after {dp['steps']} steps, above the target "
                         f"dp.epsilon={dp['epsilon']}: raise sigma or lower steps")
    return {"n": n, "sample_rate": q, "delta": delta, "sigma": sigma, "clip_norm": dp["clip_norm"],
            "sensitivity": sensitivity, "noise_std": sigma * sensitivity * dp["clip_norm"],
            "sampler": PoissonSampler.name, "objective": dp["objective"], "planned_steps": dp["steps"],
            "target_epsilon": dp["epsilon"], "accountant": dp["accountant"], "adjacency": adjacency,
            "epsilon_planned": eps}
