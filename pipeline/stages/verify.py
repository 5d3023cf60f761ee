"""The `verify` stage: recompute ε from the ledger with independent accountants, check the run
(privacy/run_checks.py), compose it with the other DP runs charged to the budget (privacy/budget.py), and
write verification.json only when every check passed."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import VerificationFailed
from pipeline.io import write_json
from pipeline.privacy import budget, owner, release
from pipeline.privacy.accounting import bound_text
from pipeline.privacy.run_checks import load_run, owner_record, verify


def failure_report(verification: Path) -> Path:
    """Where a failed check's details go: beside verification.json, which a failure never leaves."""
    return verification.with_name("verification-failed.json")


def run(params: dict, ctx) -> None:
    out, dp_dir = ctx.stage.output("verification"), ctx.stage.input("dp")
    failed_out = failure_report(out)
    # A pass from an earlier run must never outlive a failed (or crashed) re-check.
    out.unlink(missing_ok=True)
    ledger, optimizer_steps = load_run(dp_dir)
    alpha = params["verify"]["batch_size_alpha"]
    result = verify(ledger, optimizer_steps, params["dp"], params["verify"]["accountants"], alpha,
                    params["privacy"]["adjacency"])
    owner.write(f"{owner.run_record(ledger['run'])}-verify", owner_record(ledger, alpha))
    for c in result["checks"]:
        print(f"  [{'ok' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}")
    ctx.tracker.set_tags({"dpfm.verified": str(result["passed"]).lower()})
    if not result["passed"]:
        write_json(failed_out, result)
        failed = [c["name"] for c in result["checks"] if not c["passed"]]
        raise VerificationFailed(f"privacy verification failed: {', '.join(failed)} (details in {failed_out})")
    failed_out.unlink(missing_ok=True)
    # Only a verified ε goes to MLflow: a figure that failed its checks is in the failure report alone.
    ctx.tracker.log_metrics({f"epsilon_{a}": e for a, e in result["epsilon"].items()}
                            | {f"epsilon_add_remove_{a}": e for a, e in result["epsilon_add_remove"].items()})
    curve = result["epsilon_curve"]
    for a in result["epsilon"]:
        ctx.tracker.log_series(f"epsilon_curve_{a}", curve[a], curve["steps"])
    # The budget as verify found it: the curve's points and evaluate's seeds may be charged after
    # (the run's final composition is the report's, results/privacy/privacy.json).
    result["composition_at_verify"] = budget.composition(ledger, result["delta"])
    write_json(out, result)
    # verify.accountants that account the run's adjacency (rdp and prv account add/remove alone)
    others = "".join(f", {a}: {bound_text(e, 3)}" for a, e in result["epsilon"].items())
    print(f"verify: passed; ε = {bound_text(result['epsilon_reported'], 3)} ({result['accountant']}, "
          f"{result['adjacency'].replace('_', '-')}){others}"
          + ("" if result["adjacency"] == "add_remove" else
             "; add/remove (the literature's): "
             + ", ".join(f"{a}: {bound_text(e, 3)}" for a, e in result["epsilon_add_remove"].items())))
    c = result["composition_at_verify"]
    if c["runs"] > 1:
        # Which runs share examples with this one is the owner's to know: the tighter figure is theirs,
        # computed on request (its time follows the overlaps; this stage's time is published).
        print(f"verify: the {c['runs']} DP runs charged to data/budget compose to ε = "
              f"{bound_text(c['epsilon_dp_runs'], 3)} at δ = {bound_text(c['delta'], 2, exponent=True)} (this run "
              f"alone: {bound_text(result['epsilon_reported'], 3)}; over only the runs that "
              "share examples with it, for the data owner: `dpfm owner-composition`)")
    # epsilon_composed goes to MLflow from the report, after the curve's and the seeds' DP trainings:
    # here it would be stale.
    # What was checked goes with the run: the mechanism (not the per-step batch sizes, which depend on
    # the private data), the verdict, and the verified model itself.
    ctx.tracker.log_artifact(str(out))
    ctx.tracker.log_dict({k: v for k, v in ledger.items() if k != "batch_sizes"}, "mechanism.json")
    # Registered as private only when nothing the run (or the budget) records left DP. Every version on
    # this budget, earlier runs' too, is tagged with what the budget composes to now; the report, which
    # knows the curve and the eval split too, tags them all again (tracking.tag_dp_models).
    reasons = release.not_private_reasons(params, {}, c)
    for reason in reasons:
        print(f"verify: NOT PRIVATE as a whole: {reason}")
    ctx.tracker.set_tags(release.not_private_tags(reasons))  # beside the ε this run logs
    if params["privacy"]["testing"]:  # a known noise key: never registered as a private model
        print("verify: privacy.testing is set: the model is NOT PRIVATE and is not registered")
        return
    ctx.tracker.log_dp_model(dp_dir / "checkpoint.pt", result["epsilon_reported"], result["delta"], c["epsilon"],
                             c["delta"], private=not reasons, budget=budget.registry_id())
    ctx.tracker.tag_dp_models(release.registry_tags(c["epsilon"], c["delta"], c["runs"], reasons), budget.registry_id())
