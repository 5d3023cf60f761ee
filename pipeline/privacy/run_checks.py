"""The checks behind the `verify` stage: recompute ε from the ledger with independent accountants and
check that the run is the mechanism that was accounted, and the one params.yaml asked for. Any failed check exits
non-zero and leaves no verification.json, so nothing downstream publishes an unverified model as private.

Each check guards against one way the ledger, the checkpoint or the training code can be wrong, and
reads only what that check needs, so a failure names its cause (tests/test_verify.py doctors a valid
ledger in each of these ways).
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path

from pipeline import checkpoints
from pipeline.errors import VerificationFailed
from pipeline.io import read_json
from pipeline.objectives import OBJECTIVES
from pipeline.privacy import accounting, owner
from pipeline.privacy.accounting import bound_text
from pipeline.privacy.noise_edge import NOISE_EDGE, UNRECORDED_EDGE, edge_problem, largest_move

CURVE_POINTS = 40  # ε-against-step points written for the report and MLflow

# What the ledger must hold, and what each value must be, for any check to be meaningful.
_POSITIVE = ("sigma", "clip_norm", "sensitivity", "noise_std", "target_epsilon")
_LEDGER_KEYS = ("n", "delta", "sample_rate", "steps", "batch_sizes", "sampler", "objective", "accountant",
                "epsilon") + _POSITIVE


def ledger_problems(ledger: dict) -> list[str]:
    """Why this ledger cannot be checked at all (missing or nonsensical fields); empty if it can."""
    missing = [k for k in _LEDGER_KEYS if k not in ledger]
    if missing:
        return [f"missing {', '.join(missing)}"]

    def real(x):
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)

    problems = [f"{k}={ledger[k]!r} must be a finite number > 0" for k in _POSITIVE
                if not (real(ledger[k]) and ledger[k] > 0)]
    n = ledger["n"]
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        problems.append(f"n={n!r} must be a positive integer")
    if not (real(ledger["sample_rate"]) and 0 < ledger["sample_rate"] <= 1):
        problems.append(f"sample_rate={ledger['sample_rate']!r} must be in (0, 1]")
    if not (real(ledger["delta"]) and 0 < ledger["delta"] < 1):
        problems.append(f"delta={ledger['delta']!r} must be in (0, 1)")
    if not real(ledger["epsilon"]):
        problems.append(f"epsilon={ledger['epsilon']!r} must be a finite number")
    if "noise_edge" in ledger and not (real(ledger["noise_edge"]) and 0 < ledger["noise_edge"] <= NOISE_EDGE):
        # No noise dpfm draws goes past NOISE_EDGE: a ledger recording more would hide what its edge gives away.
        problems.append(f"noise_edge={ledger['noise_edge']!r} must be in (0, {NOISE_EDGE:.4g}], the farthest "
                        "dpfm's noise reaches")
    if ledger["accountant"] not in accounting.ACCOUNTANTS:
        problems.append(f"accountant={ledger['accountant']!r} must be one of {', '.join(accounting.ACCOUNTANTS)}")
    sizes = ledger["batch_sizes"]
    if not isinstance(sizes, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in sizes):
        problems.append("batch_sizes must be a list of integers")
    elif isinstance(n, int) and any(not 0 <= b <= n for b in sizes):
        problems.append(f"batch_sizes must lie in [0, n={n}]")
    return problems


def batch_size_tests(batch_sizes: list[int], n: int, q: float) -> dict:
    """Two-sided p-values that the realised sizes are Binomial(n, q): their mean and their spread.

    The spread test is what tells Poisson sampling from a fixed-size sampler with the same mean
    (whose sizes do not vary at all): Σ (b - nq)² / (nq(1-q)) is about χ² with one degree of freedom
    per step under Binomial sizes, and far below it for fixed ones."""
    from scipy import stats as sstats  # ~1 s to import: where the test runs, not in every rank that imports this

    t = len(batch_sizes)
    mean, var = n * q, n * q * (1 - q)
    if t == 0 or var == 0:
        return {"p_mean": 1.0, "p_dispersion": 1.0}
    z = (sum(batch_sizes) - t * mean) / math.sqrt(t * var)
    chi2 = sum((b - mean) ** 2 for b in batch_sizes) / var
    cdf = sstats.chi2.cdf(chi2, df=t)
    return {"p_mean": float(2 * sstats.norm.sf(abs(z))), "p_dispersion": float(2 * min(cdf, 1 - cdf))}


def batch_sizes_pass(p_values: dict, alpha: float) -> bool:
    """Both tests at α/2 (Bonferroni): a genuine Poisson run fails with probability ≤ α."""
    return min(p_values.values()) >= alpha / 2


def curve_steps(steps: int, points: int = CURVE_POINTS) -> list[int]:
    """Step counts at which the ε curve is evaluated: evenly spread, always ending at `steps`."""
    return sorted({max(1, round(steps * i / points)) for i in range(1, points + 1)}) if steps else []


def epsilon_curves(multiplier: float, q: float, steps: int, delta: float, accountants: list[str],
                   adjacency: str = "add_remove") -> dict:
    """ε after each step count, one list per accountant, for the report and MLflow."""
    grid = curve_steps(steps)
    return {"steps": grid, **{a: accounting.epsilon_curve(multiplier, q, grid, delta, accountant=a, adjacency=adjacency)
                              for a in accountants}}


def supporting(accountants: list[str], adjacency: str) -> list[str]:
    """The accountants that account `adjacency` (replace-one: PLD only)."""
    from pipeline.privacy.accountant_backends import supports

    return [a for a in accountants if supports(a, adjacency)]


def verify(ledger: dict, optimizer_steps: int, dp: dict, accountants: list[str], alpha: float,
           adjacency: str | None = None) -> dict:
    """Run every check on a ledger and the optimizer's own step count. `dp` is the params.yaml
    section the run was asked to follow, `adjacency` its privacy.adjacency (None: not compared).
    Raises VerificationFailed if the ledger is unreadable."""
    problems = ledger_problems(ledger)
    if not (isinstance(optimizer_steps, int) and not isinstance(optimizer_steps, bool)):
        problems.append(f"checkpoint optimizer_steps={optimizer_steps!r} must be an integer")
    if problems:
        raise VerificationFailed("the ledger cannot be verified: " + "; ".join(problems))
    checks = []

    def check(name: str, passed: bool, detail: str) -> None:
        checks.append({"name": name, "passed": bool(passed), "detail": detail})

    n, q, delta = ledger["n"], ledger["sample_rate"], ledger["delta"]
    steps = len(ledger["batch_sizes"])
    check("ledger_steps_match_optimizer", steps == ledger["steps"] == optimizer_steps,
          f"ledger records {steps} steps (header says {ledger['steps']}), the optimizer applied {optimizer_steps}")
    check("sampler_is_poisson", ledger["sampler"] == "poisson", f"sampler: {ledger['sampler']}")
    expected_k = OBJECTIVES[ledger["objective"]].sensitivity if ledger["objective"] in OBJECTIVES else None
    check("sensitivity_matches_objective", expected_k is not None and ledger["sensitivity"] == expected_k,
          f"objective {ledger['objective']} needs sensitivity {expected_k}·C, ledger says {ledger['sensitivity']}·C")
    want_std = ledger["sigma"] * ledger["sensitivity"] * ledger["clip_norm"]
    check("noise_matches_sigma", math.isclose(ledger["noise_std"], want_std, rel_tol=1e-9),
          f"noise std {ledger['noise_std']} vs σ·K·C = {want_std}")
    sizes = batch_size_tests(ledger["batch_sizes"], n, q)
    # The p-values are statistics of the realised (private) batch sizes: the verdict is published,
    # they are not (`owner_record`).
    check("batch_sizes_binomial", batch_sizes_pass(sizes, alpha),
          f"realised batch sizes tested against Binomial(n={n}, q={q:.5g}) at α = {alpha:g} (p-values: data owner only)")
    check("delta_below_1_over_n", delta < 1 / n,
          f"δ={bound_text(delta, 2, exponent=True)} must be below 1/n = {1 / n:.3g}: a larger δ allows publishing "
          "whole records")
    want_delta = accounting.parse_delta(dp["delta"], n)
    asked = {"objective": (ledger["objective"], dp["objective"]), "clip_norm": (ledger["clip_norm"], dp["clip_norm"]),
             "target_epsilon": (ledger["target_epsilon"], dp["epsilon"]), "delta": (delta, want_delta),
             "expected_batch_size": (q * n, dp["expected_batch_size"]),
             "accountant": (ledger["accountant"], dp["accountant"])}
    if dp["sigma"] is not None:  # otherwise σ was calibrated from the target
        asked["sigma"] = (ledger["sigma"], dp["sigma"])
    # A ledger written before adjacency was recorded was accounted add/remove.
    relation = ledger.get("adjacency", "add_remove")
    if adjacency is not None:
        asked["adjacency"] = (relation, adjacency)
    differ = {k: v for k, v in asked.items()
              if not (v[0] == v[1] if isinstance(v[1], str) else math.isclose(v[0], v[1], rel_tol=1e-9))}
    check("ledger_matches_params", not differ,
          "ledger agrees with params.yaml dp" if not differ else
          "ledger vs params.yaml dp (run verify with the params dp-train ran with): "
          + ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in differ.items()))

    # Noise multiplier relative to the sensitivity, recovered from the recorded noise itself.
    multiplier = ledger["noise_std"] / (ledger["sensitivity"] * ledger["clip_norm"])
    main = ledger["accountant"]
    check("accountant_supports_adjacency", main in supporting([main], relation),
          f"{main} accounts {relation.replace('_', '-')} neighbours" if main in supporting([main], relation) else
          f"{main} accounts add/remove only, the ledger says {relation}: its ε would not cover the run")
    if main not in supporting([main], relation):
        main = "pld"
    # ε under the run's adjacency (the reported one); under add/remove for every accountant, as the
    # literature states it (equal to the former when the run is add/remove).
    literature = {a: accounting.epsilon(multiplier, q, steps, delta, accountant=a) for a in dict.fromkeys(accountants + [main])}
    eps = literature if relation == "add_remove" else {
        a: accounting.epsilon(multiplier, q, steps, delta, accountant=a, adjacency=relation)
        for a in supporting(list(dict.fromkeys(accountants + [main])), relation)}
    main_eps = eps[main]
    eps = {a: eps[a] for a in supporting(accountants, relation)}
    # The δ printed holds only if the noise's floating-point edge gives away little of it (noise_edge.py).
    edge = ledger.get("noise_edge", UNRECORDED_EDGE)
    move = largest_move(ledger["sensitivity"], relation, q)  # x's move of a coordinate, in units of K·C
    problem = edge_problem(multiplier, q, steps, delta, edge, move=move) if multiplier > 0 else "no noise"
    check("noise_edge_within_delta", problem is None,
          problem or f"the noise reaches {edge:.2f} std: its edge gives away under a tenth of δ")
    target = dp["epsilon"]  # what the user asked for, not what the ledger says it was asked
    check("epsilon_within_target", main_eps <= target * (1 + 1e-9),
          f"ε={bound_text(main_eps, 4)} ({main}, {relation.replace('_', '-')}) vs target {target} "
          "(params.yaml dp.epsilon)")
    claimed = ledger["epsilon"]
    check("claimed_epsilon_reproduced", math.isclose(claimed, main_eps, rel_tol=1e-3),
          f"training claimed ε={bound_text(claimed, 4)}, recomputed {bound_text(main_eps, 4)} ({main})")
    if relation == "replace_one":
        # Replace-one is remove-then-add: never below add/remove, never above its group-privacy bound.
        from pipeline.privacy.accountant_backends import _rdp_bound

        ar, group = accounting.epsilon(multiplier, q, steps, delta), _rdp_bound(multiplier, q, steps, delta, relation)
        check("accountants_agree", ar * (1 - 1e-3) <= main_eps <= group,
              f"replace-one PLD ε={bound_text(main_eps, 4)} must lie between add/remove PLD "
              f"ε={bound_text(ar, 4)} and the group-privacy bound {bound_text(group, 4)}")
    elif "pld" in eps and "rdp" in eps:
        # RDP is an upper bound too, only looser: a PLD above it means one of them is wrong.
        check("accountants_agree", eps["pld"] <= eps["rdp"] * 1.01,
              f"PLD ε={bound_text(eps['pld'], 4)} must not exceed RDP ε={bound_text(eps['rdp'], 4)}")
    # From below, by another library. Every figure above is an upper bound computed by the code that
    # calibrated σ and claimed ε, so none of those checks sees an ε too small: the unsafe error.
    lower, by = lower_bound(multiplier, q, steps, delta, main)
    never_below = ", which a replace-one ε is never below" if relation == "replace_one" else ""
    check("epsilon_not_below_lower_bound", main_eps >= lower,
          f"ε={bound_text(main_eps, 4)} ({main}, {relation.replace('_', '-')}) vs {by}'s lower bound "
          f"{lower:.4f} on the add/remove ε{never_below}")
    return {"passed": all(c["passed"] for c in checks), "checks": checks, "run": ledger.get("run"), "epsilon": eps,
            "epsilon_reported": main_eps, "accountant": main, "adjacency": relation, "delta": delta, "steps": steps,
            "epsilon_add_remove": {a: literature[a] for a in accountants},
            "sigma": ledger["sigma"], "noise_multiplier": multiplier, "sample_rate": q, "n": n,
            "epsilon_curve": epsilon_curves(multiplier, q, steps, delta, supporting(accountants, relation), relation)}


def lower_bound(multiplier: float, q: float, steps: int, delta: float, main: str) -> tuple[float, str]:
    """A lower bound on the add/remove ε from another library than `main`'s, and its name: Opacus PRV's
    (about PRV_EPS_ERROR below it), or for PRV itself dp_accounting's PLD less its ladder's tolerance.
    A replace-one ε is never below it: replacing an example by one whose gradient is zero removes it."""
    from pipeline.privacy.accountant_backends import PLD_REL_TOL, prv_bounds

    if main == "prv":
        return accounting.epsilon(multiplier, q, steps, delta) * (1 - PLD_REL_TOL), "dp_accounting PLD"
    return prv_bounds(multiplier, q, steps, delta)[0], "Opacus PRV"


def owner_record(ledger: dict, alpha: float) -> dict:
    """What verify found that only the data owner may see: the batch-size test's p-values."""
    return {"batch_size_p_values": batch_size_tests(ledger["batch_sizes"], ledger["n"], ledger["sample_rate"]),
            "alpha": alpha}


def with_batch_sizes(ledger: dict) -> dict:
    """The published ledger (models/dp/ledger.json) joined with its run's owner-only batch sizes."""
    name = owner.run_record(ledger.get("run", "?"))
    record = owner.read(name)
    if record is None:
        raise VerificationFailed(f"{owner.path(name)} is missing: the realised batch sizes of run {ledger.get('run')} "
                                 "are kept owner-only on the machine that trained it; verify there")
    return {**ledger, "batch_sizes": record["batch_sizes"]}


def check_made_for(run: str | None, artifact: Path, dp_dir: Path, remake: str) -> None:
    """Refuse an artifact made for the DP run `run` unless that is the run in `dp_dir`: a stage run by hand
    after dp-train ran again with other params (another ε, the same steps), before `remake`, would publish
    the earlier run's ε or accuracies beside the new model."""
    ledger = read_json(dp_dir / "ledger.json")
    if run != ledger.get("run"):
        raise VerificationFailed(f"{artifact} was made for another DP run than {dp_dir} (run {run}, not "
                                 f"{ledger.get('run')}): run `{remake}` first")


def load_run(dp_dir: str | Path) -> tuple[dict, int]:
    """The ledger (with the owner-only batch sizes) and the optimizer's own count of applied updates
    from the dp-train outputs."""
    dp_dir = Path(dp_dir)
    for name in ("ledger.json", "checkpoint.pt"):
        if not (dp_dir / name).is_file():
            raise VerificationFailed(f"{dp_dir / name} is missing: run dp-train first")
    try:
        steps = checkpoints.load(dp_dir / "checkpoint.pt").steps
    except checkpoints.CheckpointError as e:
        raise VerificationFailed(str(e)) from None
    return with_batch_sizes(read_json(dp_dir / "ledger.json")), steps
