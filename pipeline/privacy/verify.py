"""The `verify` stage: recompute ε from the ledger with independent accountants and check that the
run is the mechanism that was accounted. Any failed check exits non-zero, so nothing downstream
publishes an unverified model as private."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from scipy import stats as sstats

from pipeline.errors import VerificationFailed
from pipeline.io import read_json, write_json
from pipeline.privacy import accounting
from pipeline.privacy.engine import SENSITIVITY

DP_DIR, OUT = "models/dp", "results/privacy/verification.json"
FAILED_OUT = "results/privacy/verification-failed.json"


def batch_size_tests(batch_sizes: list[int], n: int, q: float) -> dict:
    """Two-sided p-values that the realised sizes are Binomial(n, q): their mean and their spread."""
    t = len(batch_sizes)
    mean, var = n * q, n * q * (1 - q)
    if t == 0 or var == 0:
        return {"p_mean": 1.0, "p_dispersion": 1.0}
    z = (sum(batch_sizes) - t * mean) / math.sqrt(t * var)
    chi2 = sum((b - mean) ** 2 for b in batch_sizes) / var
    cdf = sstats.chi2.cdf(chi2, df=t)
    return {"p_mean": float(2 * sstats.norm.sf(abs(z))), "p_dispersion": float(2 * min(cdf, 1 - cdf))}


def verify(ledger: dict, optimizer_steps: int, accountants: list[str], alpha: float) -> dict:
    checks = []

    def check(name: str, passed: bool, detail: str) -> None:
        checks.append({"name": name, "passed": bool(passed), "detail": detail})

    steps = len(ledger["batch_sizes"])
    check("ledger_steps_match_optimizer", steps == ledger["steps"] == optimizer_steps,
          f"ledger records {steps} steps (header says {ledger['steps']}), the optimizer applied {optimizer_steps}")
    check("sampler_is_poisson", ledger["sampler"] == "poisson", f"sampler: {ledger['sampler']}")
    expected_k = SENSITIVITY["per_batch" if ledger["objective"] == "clip" else "per_sample"]
    check("sensitivity_matches_objective", ledger["sensitivity"] == expected_k,
          f"objective {ledger['objective']} needs sensitivity {expected_k}·C, ledger says {ledger['sensitivity']}·C")
    want_std = ledger["sigma"] * ledger["sensitivity"] * ledger["clip_norm"]
    check("noise_matches_sigma", math.isclose(ledger["noise_std"], want_std, rel_tol=1e-9),
          f"noise std {ledger['noise_std']} vs σ·K·C = {want_std}")
    sizes = batch_size_tests(ledger["batch_sizes"], ledger["n"], ledger["sample_rate"])
    check("batch_sizes_binomial", min(sizes.values()) >= alpha,
          f"p-values {sizes} against Binomial(n={ledger['n']}, q={ledger['sample_rate']:.5g}) at α={alpha}")

    # Noise multiplier relative to the sensitivity, recovered from the recorded noise itself.
    multiplier = ledger["noise_std"] / (ledger["sensitivity"] * ledger["clip_norm"])
    eps = {a: accounting.epsilon(multiplier, ledger["sample_rate"], steps, ledger["delta"], accountant=a)
           for a in accountants}
    claimed = ledger["epsilon"]
    main = ledger["accountant"]
    main_eps = eps.get(main) or accounting.epsilon(multiplier, ledger["sample_rate"], steps, ledger["delta"], accountant=main)
    check("epsilon_within_target", main_eps <= ledger["target_epsilon"] * (1 + 1e-9),
          f"ε={main_eps:.4f} ({main}) vs target {ledger['target_epsilon']}")
    check("claimed_epsilon_reproduced", math.isclose(claimed, main_eps, rel_tol=1e-3),
          f"training claimed ε={claimed:.4f}, recomputed {main_eps:.4f} ({main})")
    if "pld" in eps and "rdp" in eps:
        # RDP is an upper bound too, only looser: a PLD above it means one of them is wrong.
        check("accountants_agree", eps["pld"] <= eps["rdp"] * 1.01,
              f"PLD ε={eps['pld']:.4f} must not exceed RDP ε={eps['rdp']:.4f}")
    return {"passed": all(c["passed"] for c in checks), "checks": checks, "epsilon": eps,
            "epsilon_reported": main_eps, "accountant": main, "delta": ledger["delta"], "steps": steps,
            "sigma": ledger["sigma"], "sample_rate": ledger["sample_rate"], "n": ledger["n"]}


def run(params: dict, ctx) -> None:
    ledger = read_json(f"{DP_DIR}/ledger.json")
    ckpt = torch.load(f"{DP_DIR}/checkpoint.pt", map_location="cpu", weights_only=False)
    result = verify(ledger, ckpt["optimizer_steps"], params["verify"]["accountants"],
                    params["verify"]["batch_size_alpha"])
    for c in result["checks"]:
        print(f"  [{'ok' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}")
    ctx.tracker.log_metrics({f"epsilon_{a}": e for a, e in result["epsilon"].items()})
    ctx.tracker.set_tags({"dpfm.verified": str(result["passed"]).lower()})
    if not result["passed"]:
        write_json(FAILED_OUT, result)
        failed = [c["name"] for c in result["checks"] if not c["passed"]]
        raise VerificationFailed(f"privacy verification failed: {', '.join(failed)} (details in {FAILED_OUT})")
    Path(FAILED_OUT).unlink(missing_ok=True)
    write_json(OUT, result)
    print(f"verify: passed; ε = {result['epsilon_reported']:.3f} ({result['accountant']}), "
          + ", ".join(f"{a}: {e:.3f}" for a, e in result["epsilon"].items()))
