"""The `verify` stage: recompute ε from the ledger with independent accountants, check the run
(privacy/verify.py), compose it with the other DP runs on the same data (privacy/budget.py), and
write verification.json only when every check passed."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import VerificationFailed
from pipeline.io import write_json
from pipeline.privacy import budget
from pipeline.privacy.verify import DP_DIR, FAILED_OUT, OUT, load_run, verify


def run(params: dict, ctx) -> None:
    # A pass from an earlier run must never outlive a failed (or crashed) re-check.
    Path(OUT).unlink(missing_ok=True)
    ledger, optimizer_steps = load_run()
    result = verify(ledger, optimizer_steps, params["dp"], params["verify"]["accountants"],
                    params["verify"]["batch_size_alpha"])
    for c in result["checks"]:
        print(f"  [{'ok' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}")
    ctx.tracker.log_metrics({f"epsilon_{a}": e for a, e in result["epsilon"].items()})
    curve = result["epsilon_curve"]
    for a in result["epsilon"]:
        ctx.tracker.log_series(f"epsilon_curve_{a}", curve[a], curve["steps"])
    ctx.tracker.set_tags({"dpfm.verified": str(result["passed"]).lower()})
    if not result["passed"]:
        write_json(FAILED_OUT, result)
        failed = [c["name"] for c in result["checks"] if not c["passed"]]
        raise VerificationFailed(f"privacy verification failed: {', '.join(failed)} (details in {FAILED_OUT})")
    Path(FAILED_OUT).unlink(missing_ok=True)
    result["composition"] = budget.composition(ledger, result["delta"])
    write_json(OUT, result)
    print(f"verify: passed; ε = {result['epsilon_reported']:.3f} ({result['accountant']}), "
          + ", ".join(f"{a}: {e:.3f}" for a, e in result["epsilon"].items()))
    c = result["composition"]
    if c["runs"] > 1:
        print(f"verify: {c['runs']} DP runs on this private data compose to ε = {c['epsilon']:.3f} at δ = "
              f"{result['delta']:.2e} (this run alone: {result['epsilon_reported']:.3f})")
    ctx.tracker.log_metrics({"epsilon_composed": c["epsilon"], "dp_runs_on_data": c["runs"]})
    # What was checked goes with the run: the mechanism (not the per-step batch sizes, which depend on
    # the private data), the verdict, and the verified model itself.
    ctx.tracker.log_artifact(OUT)
    ctx.tracker.log_dict({k: v for k, v in ledger.items() if k != "batch_sizes"}, "mechanism.json")
    ctx.tracker.log_dp_model(f"{DP_DIR}/checkpoint.pt", result["epsilon_reported"], result["delta"])
