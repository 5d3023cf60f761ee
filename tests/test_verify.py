"""The `verify` stage: a ledger from a realistic run passes; a ledger doctored to break one guarantee
fails exactly the check that guards it; the stage exits 3 and leaves no verification.json."""

import copy
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from pipeline import checkpoints, cli
from pipeline.config import load_params
from pipeline.privacy.sampling import PoissonSampler
from pipeline.privacy.plan import plan_mechanism
from pipeline.errors import VerificationFailed
from pipeline.io import read_json, write_json
from pipeline.models import ModelConfig, build_model
from pipeline.privacy import accountant_backends, accounting, run_checks as V
from pipeline.privacy.ledger import Ledger
from pipeline.privacy.noise_edge import NOISE_EDGE
from pipeline.artifacts import artifact
from pipeline.stages.verify import failure_report

ROOT = Path(__file__).resolve().parents[1]
N = 1257  # usable private examples of the default digits split
ALPHA = 0.001
ACCOUNTANTS = ["pld", "rdp"]


def default_dp() -> dict:
    return load_params(ROOT / "params.yaml", schema_path=ROOT / "schemas/params.schema.yaml")["dp"]


def realistic_ledger(tmp, dp: dict, n: int = N, key: int = 7, steps: int | None = None, q: float | None = None,
                     adjacency: str = "add_remove") -> dict:
    """What dp-train writes: plan_mechanism's header, the real Poisson sampler's batch sizes, the claimed ε."""
    plan = plan_mechanism(dp, n, adjacency)
    sampler = PoissonSampler(n, q or plan.sample_rate, key)
    ledger = Ledger(tmp / f"ledger-{key}-{dp['objective']}.jsonl", plan)
    for t in range(steps or dp["steps"]):
        ledger.record_step(t, len(sampler.batch(t)))
    record = ledger.to_dict()
    record["nonfinite_examples"] = 0
    record["epsilon"] = accounting.epsilon(plan.sigma, plan.sample_rate, ledger.steps, plan.delta,
                                           accountant=plan.accountant, adjacency=adjacency)
    return record


@pytest.fixture(scope="module")
def dp():
    return default_dp()


@pytest.fixture(scope="module")
def valid(tmp_path_factory, dp):
    return realistic_ledger(tmp_path_factory.mktemp("ledger"), dp)


@pytest.fixture(scope="module")
def valid_replace_one(tmp_path_factory, dp):
    """dp-train's default: σ calibrated to replace-one neighbours (n is released)."""
    return realistic_ledger(tmp_path_factory.mktemp("ledger"), dp, adjacency="replace_one")


def failed(result: dict) -> set[str]:
    return {c["name"] for c in result["checks"] if not c["passed"]}


def run_verify(ledger, steps=None, dp=None):
    dp = dp or default_dp()
    return V.verify(ledger, len(ledger["batch_sizes"]) if steps is None else steps, dp, ACCOUNTANTS, ALPHA)


def test_realistic_run_passes_every_check(valid, dp):
    result = run_verify(valid, dp=dp)
    assert failed(result) == set(), result["checks"]
    assert len(result["checks"]) == 13
    assert result["epsilon_reported"] == pytest.approx(valid["epsilon"], rel=1e-3)
    assert result["epsilon"]["pld"] <= result["epsilon"]["rdp"]
    assert result["epsilon_reported"] <= dp["epsilon"]


def test_realistic_clip_run_passes(tmp_path, dp):
    dp = {**dp, "objective": "clip"}
    ledger = realistic_ledger(tmp_path, dp)
    assert ledger["sensitivity"] == 2.0 and ledger["noise_std"] == pytest.approx(2 * ledger["sigma"] * dp["clip_norm"])
    assert failed(run_verify(ledger, dp=dp)) == set()


@pytest.mark.parametrize("adjacency", ["add_remove", "replace_one"])
def test_every_epsilon_and_delta_a_check_states_is_at_least_the_bound(tmp_path, dp, adjacency, monkeypatch):
    """The checks' lines are published in the report beside its ε: each ε and δ in them is rounded up.
    The accountants are made to answer figures that round down to nearest (7.98441 to 7.9844, 9.60001
    to 9.6000, δ = 3.97452e-4 to 0.000397), so a line that rounds to nearest is caught."""
    import re

    from pipeline.privacy import accountant_backends

    dp = {**dp, "delta": 3.97452e-4}
    ledger = realistic_ledger(tmp_path, dp, adjacency=adjacency)
    answers = {"pld": 7.98441, "rdp": 9.60001}
    monkeypatch.setattr(V.accounting, "epsilon", lambda *a, accountant="pld", **k: answers[accountant])
    monkeypatch.setattr(accountant_backends, "_rdp_bound", lambda *a, **k: 9.70001)
    result = run_verify(_with(ledger, epsilon=7.98441), dp=dp)
    stated = [(c["name"], name, text) for c in result["checks"]
              for name, text in re.findall(r"(ε|δ)=([\d.e+-]*\d)", c["detail"])]
    assert len(stated) >= 4
    for check, name, text in stated:
        truth = min((3.97452e-4, 7.98441, 9.60001, 9.70001), key=lambda b: abs(b - float(text)) / b)
        assert float(text) >= truth, f"{check}: {name}={text} below {truth}"


def test_epsilon_curve_ends_at_the_reported_epsilon(valid):
    result = run_verify(valid)
    curve = result["epsilon_curve"]
    assert curve["steps"][-1] == valid["steps"] and len(curve["steps"]) == len(curve["pld"]) == len(curve["rdp"])
    assert curve["steps"] == sorted(set(curve["steps"]))
    assert all(np.diff(curve["pld"]) > 0) and all(np.diff(curve["rdp"]) > 0)
    assert curve["pld"][-1] == pytest.approx(result["epsilon"]["pld"], rel=2e-3)
    assert curve["rdp"][-1] == pytest.approx(result["epsilon"]["rdp"], rel=1e-9)


def _with(ledger, **changes):
    out = copy.deepcopy(ledger)
    out.update(changes)
    return out


def _reclaim(ledger):
    """Re-derive the claimed ε from the (doctored) ledger, so only the doctored property is wrong."""
    m = ledger["noise_std"] / (ledger["sensitivity"] * ledger["clip_norm"])
    return _with(ledger, epsilon=accounting.epsilon(m, ledger["sample_rate"], len(ledger["batch_sizes"]),
                                                    ledger["delta"], accountant=ledger["accountant"]))


def _sizes(ledger, q, steps=None, key=99):
    sampler = PoissonSampler(ledger["n"], q, key)
    return [len(sampler.batch(t)) for t in range(steps or ledger["steps"])]


# Each case: (doctored ledger, the optimizer's step count, params dp) -> the checks that must fail.
DOCTORED = {
    "optimizer applied an uncharged step": (lambda L, dp: (L, L["steps"] + 1, dp), {"ledger_steps_match_optimizer"}),
    "optimizer applied fewer steps": (lambda L, dp: (L, L["steps"] - 1, dp), {"ledger_steps_match_optimizer"}),
    "header step count disagrees": (lambda L, dp: (_with(L, steps=L["steps"] - 1), None, dp),
                                    {"ledger_steps_match_optimizer"}),
    "shuffling sampler": (lambda L, dp: (_with(L, sampler="shuffle"), None, dp), {"sampler_is_poisson"}),
    "clip objective accounted at sensitivity 1": (
        lambda L, dp: (_with(L, objective="clip"), None, {**dp, "objective": "clip"}),
        {"sensitivity_matches_objective"}),
    "per-sample objective accounted at sensitivity 2": (
        lambda L, dp: (_reclaim(_with(L, sensitivity=2.0, noise_std=2 * L["noise_std"])), None, dp),
        {"sensitivity_matches_objective"}),
    "σ recorded above the noise applied": (lambda L, dp: (_with(L, sigma=1.5 * L["sigma"]), None, dp),
                                           {"noise_matches_sigma"}),
    "noise applied below σ·K·C": (lambda L, dp: (_with(L, noise_std=0.8 * L["noise_std"]), None, dp),
                                  {"noise_matches_sigma", "epsilon_within_target", "claimed_epsilon_reproduced"}),
    "fixed-size batches of q·n": (lambda L, dp: (_with(L, batch_sizes=[round(L["sample_rate"] * L["n"])] * L["steps"]),
                                                 None, dp), {"batch_sizes_binomial"}),
    "Poisson batches at 1.25·q": (lambda L, dp: (_with(L, batch_sizes=_sizes(L, 1.25 * L["sample_rate"])), None, dp),
                                  {"batch_sizes_binomial"}),
    "Poisson batches at 0.8·q": (lambda L, dp: (_with(L, batch_sizes=_sizes(L, 0.8 * L["sample_rate"])), None, dp),
                                 {"batch_sizes_binomial"}),
    "twice the planned steps": (
        lambda L, dp: (_reclaim(_with(L, steps=2 * L["steps"], batch_sizes=_sizes(L, L["sample_rate"], 2 * L["steps"]))),
                       None, dp), {"epsilon_within_target"}),
    "claimed ε below the recomputed one": (lambda L, dp: (_with(L, epsilon=0.9 * L["epsilon"]), None, dp),
                                           {"claimed_epsilon_reproduced"}),
    "claimed ε above the recomputed one": (lambda L, dp: (_with(L, epsilon=1.01 * L["epsilon"]), None, dp),
                                           {"claimed_epsilon_reproduced"}),
    "δ of 2/n": (lambda L, dp: (_reclaim(_with(L, delta=2 / L["n"])), None, {**dp, "delta": 2 / L["n"]}),
                 {"delta_below_1_over_n"}),
    "δ of exactly 1/n": (lambda L, dp: (_reclaim(_with(L, delta=1 / L["n"])), None, {**dp, "delta": 1 / L["n"]}),
                         {"delta_below_1_over_n"}),
    "ledger target above the params target": (
        lambda L, dp: (_reclaim(_with(L, target_epsilon=100.0, noise_std=0.7 * L["noise_std"], sigma=0.7 * L["sigma"])),
                       None, dp), {"ledger_matches_params", "epsilon_within_target"}),
    "ε a tenth of a percent above the target": (  # a slack in the comparison would let it through
        lambda L, dp: (_with(L, target_epsilon=L["epsilon"] / 1.001), None, {**dp, "epsilon": L["epsilon"] / 1.001}),
        {"epsilon_within_target"}),
    "clip norm other than params": (lambda L, dp: (L, None, {**dp, "clip_norm": 2 * dp["clip_norm"]}),
                                    {"ledger_matches_params"}),
    "expected batch size other than params": (
        lambda L, dp: (L, None, {**dp, "expected_batch_size": dp["expected_batch_size"] + 1}),
        {"ledger_matches_params"}),
    "σ other than the params' fixed σ": (lambda L, dp: (L, None, {**dp, "sigma": 2 * L["sigma"]}),
                                        {"ledger_matches_params"}),
    "noise drawn with a coarser edge than the ledger's σ allows": (
        lambda L, dp: (_with(L, noise_edge=4.0), None, dp), {"noise_edge_within_delta"}),
    "replace-one accounted by an add/remove-only accountant": (
        lambda L, dp: (_with(L, adjacency="replace_one", accountant="rdp"), None, {**dp, "accountant": "rdp"}),
        {"accountant_supports_adjacency", "claimed_epsilon_reproduced", "epsilon_within_target"}),
}


def test_a_ledger_that_records_no_noise_edge_is_checked_at_torchs_fp32_edge(tmp_path, dp):
    """The scale table's MAE at ε = 8 (σ 1.198, B = 2,048 of 60,000, 800 steps): its δ holds with the
    edge dp-train's noise has, and not at torch's fp32 edge, which a ledger without the field drew."""
    mae = {**dp, "objective": "mae", "epsilon": 8.0, "expected_batch_size": 2048, "steps": 800}
    ledger = realistic_ledger(tmp_path, mae, n=60_000, adjacency="replace_one")
    assert ledger["noise_edge"] == NOISE_EDGE
    assert failed(V.verify(ledger, 800, mae, ACCOUNTANTS, ALPHA, "replace_one")) == set()
    before = {k: v for k, v in ledger.items() if k != "noise_edge"}
    assert failed(V.verify(before, 800, mae, ACCOUNTANTS, ALPHA, "replace_one")) == {"noise_edge_within_delta"}


def test_a_run_whose_epsilon_is_its_target_exactly_passes(valid, dp):
    ledger = _with(valid, target_epsilon=valid["epsilon"])
    assert failed(run_verify(ledger, None, {**dp, "epsilon": valid["epsilon"]})) == set()


def test_every_check_has_a_doctored_case(valid):
    covered = set().union(*(expected for _, expected in DOCTORED.values())) | {  # see below
        "accountants_agree", "epsilon_not_below_lower_bound"}
    assert {c["name"] for c in run_verify(valid)["checks"]} <= covered


@pytest.mark.parametrize("case", list(DOCTORED))
def test_each_doctored_ledger_fails_its_check(valid, dp, case):
    doctor, expected = DOCTORED[case]
    ledger, steps, dp_used = doctor(copy.deepcopy(valid), dp)
    result = run_verify(ledger, steps, dp_used)
    assert failed(result) == expected, [c for c in result["checks"] if not c["passed"]]
    assert not result["passed"]


def test_a_replace_one_run_passes_and_reports_the_literatures_epsilon_beside(valid_replace_one, dp):
    result = V.verify(valid_replace_one, valid_replace_one["steps"], dp, ACCOUNTANTS, ALPHA, "replace_one")
    assert failed(result) == set(), result["checks"]
    assert result["adjacency"] == "replace_one" and set(result["epsilon"]) == {"pld"}
    assert result["epsilon_reported"] <= dp["epsilon"] and set(result["epsilon_add_remove"]) == set(ACCOUNTANTS)
    assert result["epsilon_add_remove"]["pld"] < result["epsilon_reported"]  # the add/remove figure is smaller


@pytest.mark.parametrize("case, expected", [
    ("claims the add/remove ε", {"claimed_epsilon_reproduced"}),
    ("params ask for add/remove", {"ledger_matches_params"}),
])
def test_an_adjacency_other_than_accounted_fails(valid_replace_one, dp, case, expected):
    ledger, adjacency = copy.deepcopy(valid_replace_one), "replace_one"
    if case == "claims the add/remove ε":
        ledger["epsilon"] = accounting.epsilon(ledger["sigma"], ledger["sample_rate"], ledger["steps"], ledger["delta"])
    else:
        adjacency = "add_remove"
    assert failed(V.verify(ledger, ledger["steps"], dp, ACCOUNTANTS, ALPHA, adjacency)) == expected


def test_broken_accountant_is_caught(valid, monkeypatch):
    """The two accountants are cross-checked: a PLD that under-reports against RDP... here an RDP
    that under-reports against PLD (so the reported PLD figure stays right) fails accountants_agree."""
    real = accounting.epsilon

    def broken(*args, accountant="pld", **kw):
        value = real(*args, accountant=accountant, **kw)
        return value * 0.5 if accountant == "rdp" else value

    monkeypatch.setattr(accounting, "epsilon", broken)
    assert failed(run_verify(valid)) == {"accountants_agree"}


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
@pytest.mark.parametrize("adjacency", ["add_remove", "replace_one"])
@pytest.mark.parametrize("accountants", [["pld", "rdp"], ["pld", "prv"], ["pld"]])
def test_a_pld_that_under_reports_is_caught_from_below(tmp_path, monkeypatch, objective, adjacency, accountants):
    """dp-train calibrates σ and claims ε with the very PLD code verify recomputes with, and RDP only bounds
    it from above: a PLD reading 0.6× the truth trained under too little noise and passed every check
    (replace-one's lower limit, the add/remove PLD, moved with it). Opacus PRV's lower bound catches it,
    whichever accountants verify lists; a PRV run is checked against dp_accounting's PLD the same way."""
    from pipeline.privacy import accountant_backends

    dp = {**default_dp(), "objective": objective, "steps": 37, "accountant": "pld"}  # 37: no cached σ
    real, real_prv = accountant_backends._pld_parts_at, accountant_backends.prv_bounds
    monkeypatch.setattr(accountant_backends, "_pld_parts_at", lambda *a: 0.6 * real(*a))
    broken = realistic_ledger(tmp_path, dp, adjacency=adjacency)  # σ calibrated, ε claimed, by the broken PLD
    result = V.verify(broken, broken["steps"], dp, accountants, ALPHA, adjacency)
    assert failed(result) == {"epsilon_not_below_lower_bound"}, result["checks"]
    monkeypatch.undo()
    assert failed(V.verify(broken, broken["steps"], dp, accountants, ALPHA, adjacency)) >= {
        "claimed_epsilon_reproduced"}  # the true PLD: the claim was too small, and ε may pass its target
    if adjacency == "add_remove":  # PRV's own figure, from below by the PLD
        prv = {**dp, "accountant": "prv"}
        monkeypatch.setattr(accountant_backends, "prv_bounds", lambda *a: tuple(0.6 * e for e in real_prv(*a)))
        ledger = realistic_ledger(tmp_path, prv, key=8, adjacency=adjacency)
        assert failed(V.verify(ledger, ledger["steps"], prv, accountants, ALPHA, adjacency)) == {
            "epsilon_not_below_lower_bound"}


@pytest.mark.parametrize("doctor, message", [
    (lambda L: L.pop("noise_std"), "missing noise_std"),
    (lambda L: L.update(noise_std=0.0), "noise_std=0.0 must be a finite number > 0"),
    (lambda L: L.update(batch_sizes=L["batch_sizes"][:-1] + [-1]), "batch_sizes must lie in [0, n="),
    (lambda L: L.update(sample_rate=1.5), "sample_rate=1.5 must be in (0, 1]"),
    (lambda L: L.update(accountant="moments"), "accountant='moments' must be one of"),
    (lambda L: L.update(noise_edge="12"), "noise_edge='12' must be in (0, 12.12]"),
])
def test_malformed_ledger_is_refused_with_its_reason(valid, doctor, message):
    ledger = copy.deepcopy(valid)
    doctor(ledger)
    with pytest.raises(VerificationFailed, match=None) as err:
        run_verify(ledger, valid["steps"])
    assert message in str(err.value)


def test_batch_size_check_fails_a_genuine_run_at_about_rate_alpha(dp):
    """The Binomial test is calibrated: over many runs whose sizes are Binomial(n, q) it fails about
    α of them: not more (Bonferroni over its two tests), and not none (it is not vacuous)."""
    q, alpha, trials = dp["expected_batch_size"] / N, 0.05, 2000
    sizes = np.random.default_rng(0).binomial(N, q, size=(trials, dp["steps"]))
    fails = sum(not V.batch_sizes_pass(V.batch_size_tests(run.tolist(), N, q), alpha) for run in sizes)
    assert 0.03 <= fails / trials <= 0.065, fails


def test_dispersion_test_separates_fixed_size_from_poisson():
    n, q, t = 5000, 0.02, 200
    rng = np.random.default_rng(0)
    poisson = V.batch_size_tests(rng.binomial(n, q, size=t).tolist(), n, q)
    fixed = V.batch_size_tests([int(n * q)] * t, n, q)
    overdispersed = V.batch_size_tests(rng.binomial(n, q, size=t) + rng.integers(-20, 21, size=t), n, q)
    assert min(poisson.values()) > 0.001
    assert fixed["p_mean"] == 1.0 and fixed["p_dispersion"] < 1e-12
    assert overdispersed["p_dispersion"] < 1e-6


# ---- the stage through the `dpfm` command, in a scratch project ------------------------------------

@pytest.fixture
def project(in_tmp, monkeypatch, valid_replace_one):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DPFM_PARENT_RUN_ID", raising=False)

    def write(ledger, optimizer_steps=None):
        """dp-train's outputs: the published ledger, and its batch sizes in the owner-only zone."""
        from pipeline.privacy import budget, owner

        budget.registry_id()  # the budget dp-train charged (its key): composing without one would be refused
        write_json("models/dp/ledger.json", {**{k: v for k, v in ledger.items() if k != "batch_sizes"}, "run": "r1"})
        owner.write(owner.run_record("r1"), {"batch_sizes": ledger["batch_sizes"], "nonfinite_examples": 0})
        cfg = ModelConfig.of({"size": "micro"}).to_dict()
        checkpoints.save("models/dp/checkpoint.pt", build_model("mae", cfg), objective="mae", model_cfg=cfg,
                         steps=ledger["steps"] if optimizer_steps is None else optimizer_steps, private=True, config={})
    write(valid_replace_one)
    return write


def test_stage_writes_verification_with_curves_and_logs_them(project, in_tmp, valid_replace_one):
    valid = valid_replace_one
    assert cli.main(["verify"]) == 0
    out = read_json(in_tmp / artifact("verification"))
    assert out["passed"] and out["epsilon_reported"] == pytest.approx(valid["epsilon"], rel=1e-3)
    # Replace-one (the default) is accounted by PLD; RDP states the add/remove ε beside it.
    assert set(out["epsilon_curve"]) == {"steps", "pld"} and set(out["epsilon_add_remove"]) == {"pld", "rdp"}
    assert not (in_tmp / failure_report(artifact("verification"))).exists()

    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{in_tmp / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("dpfm").experiment_id])[0]
    assert run.data.tags["dpfm.verified"] == "true"
    history = client.get_metric_history(run.info.run_id, "epsilon_curve_pld")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == out["epsilon_curve"]["steps"]
    assert sorted(history, key=lambda m: m.step)[-1].value == pytest.approx(out["epsilon_curve"]["pld"][-1])


def test_the_printed_line_lists_the_accountants_that_account_the_runs_adjacency(project, in_tmp, valid_replace_one,
                                                                                capsys):
    """rdp and prv account add/remove alone: under replace-one with verify.accountants=[rdp, prv] the line
    read "ε = 7.993 (pld, replace-one), ; add/remove …"."""
    assert cli.main(["verify"]) == 0
    assert "(pld, replace-one), pld: " in capsys.readouterr().out
    assert cli.main(["verify", "--set", "verify.accountants=[rdp, prv]"]) == 0
    line = capsys.readouterr().out
    assert "(pld, replace-one); add/remove (the literature's): " in line and ", ;" not in line


def test_the_batch_size_test_is_owner_only(project, in_tmp, capsys, valid_replace_one):
    """Its p-values are statistics of the realised (private) batch sizes: the verdict is published, the
    p-values go to the owner-only zone, and without that zone's record verify says where it is.
    Measured: another realisation of the batch sizes (which also passes) leaves everything verify prints
    and publishes, its verification.json and its MLflow run, as it was."""
    import mlflow

    from pipeline.privacy import owner

    def released() -> tuple:  # stdout, verification.json, the MLflow run's figures, verdict and mechanism
        client = mlflow.tracking.MlflowClient(f"sqlite:///{in_tmp / 'mlflow.db'}")
        [run] = client.search_runs([client.get_experiment_by_name("dpfm").experiment_id], max_results=1)
        mechanism = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/mechanism.json")
        return (capsys.readouterr().out, (in_tmp / artifact("verification")).read_text(), run.data.metrics,
                run.data.tags["dpfm.verified"], mechanism)

    assert cli.main(["verify"]) == 0
    first = released()
    assert first[-1]["sample_rate"] == valid_replace_one["sample_rate"]  # the mechanism is there to compare
    ledger, rng = valid_replace_one, np.random.default_rng(1)
    other = rng.binomial(ledger["n"], ledger["sample_rate"], size=len(ledger["batch_sizes"])).tolist()
    while not V.batch_sizes_pass(V.batch_size_tests(other, ledger["n"], ledger["sample_rate"]), ALPHA):
        other = rng.binomial(ledger["n"], ledger["sample_rate"], size=len(other)).tolist()
    assert other != ledger["batch_sizes"]
    owner.write(owner.run_record("r1"), {"batch_sizes": other, "nonfinite_examples": 0})  # the same run otherwise
    assert cli.main(["verify"]) == 0
    assert released() == first
    owner.write(owner.run_record("r1"), {"batch_sizes": ledger["batch_sizes"], "nonfinite_examples": 0})
    assert cli.main(["verify"]) == 0
    printed, published = capsys.readouterr().out, (in_tmp / artifact("verification")).read_text()
    p_values = owner.read("runs/r1-verify")["batch_size_p_values"]
    assert set(p_values) == {"p_mean", "p_dispersion"}
    for p in p_values.values():
        for text in (repr(p), f"{p:.4g}", f"{p:.3g}"):
            assert text not in printed and text not in published, text
    assert "p_mean" not in published and "batch_sizes" not in (in_tmp / "models/dp/ledger.json").read_text()
    (owner.path("runs/r1")).unlink()
    assert cli.main(["verify"]) == 3
    assert "are kept owner-only on the machine that trained it" in capsys.readouterr().err


def test_a_budget_that_records_a_release_outside_dp_leaves_the_verified_model_not_private(project, in_tmp,
                                                                                          monkeypatch, capsys):
    """The run's own params are clean, but the budget it was charged to records an earlier release of
    its examples without DP: verify passes the mechanism, and registers the model as NOT PRIVATE."""
    import mlflow

    from pipeline.privacy import budget
    from pipeline.stages import verify as verify_stage

    composed = budget.composition
    monkeypatch.setattr(verify_stage.budget, "composition", lambda ledger, delta: {
        **composed(ledger, delta), "epsilon": math.inf, "outside_dp": ["an earlier twin trained without DP"]})
    assert cli.main(["verify"]) == 0
    assert "verify: NOT PRIVATE as a whole: data/budget records releases" in capsys.readouterr().out
    client = mlflow.tracking.MlflowClient(f"sqlite:///{in_tmp / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("dpfm").experiment_id], max_results=1)
    assert "an earlier twin trained without DP" in run.data.tags["dpfm.not_private"]
    [version] = client.search_model_versions()
    assert version.tags["private"] == "false" and version.tags["epsilon"] == "inf"


def test_stage_exits_3_and_leaves_no_verification_on_failure(project, in_tmp, valid_replace_one, capsys):
    valid = valid_replace_one
    doctored = {"sampler_is_poisson": (_with(valid, sampler="shuffle"), None),
                "ledger_steps_match_optimizer": (valid, valid["steps"] + 1),
                "batch_sizes_binomial": (_with(valid, batch_sizes=[128] * valid["steps"]), None)}
    for check, (ledger, optimizer_steps) in doctored.items():
        write_json(in_tmp / artifact("verification"), {"passed": True, "stale": True})  # a pass from an earlier run
        project(ledger, optimizer_steps)
        assert cli.main(["verify"]) == 3
        assert not (in_tmp / artifact("verification")).exists()
        assert check in capsys.readouterr().err
        assert failed(read_json(in_tmp / failure_report(artifact("verification")))) == {check}

    # The target that counts is params.yaml's, not the ledger's own (which this run meets).
    project(valid)
    assert cli.main(["verify", "--set", f"dp.epsilon={valid['epsilon'] / 2}"]) == 3
    assert failed(read_json(in_tmp / failure_report(artifact("verification")))) == {"epsilon_within_target", "ledger_matches_params"}
    import mlflow  # no failed run's ε in MLflow, where it would read as the run's: its verdict alone

    client = mlflow.tracking.MlflowClient(f"sqlite:///{in_tmp / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("dpfm").experiment_id])
    assert len(runs) == 4 and {r.data.tags["dpfm.verified"] for r in runs} == {"false"}  # the 4 that failed checks
    assert not [k for r in runs for k in r.data.metrics if k.startswith("epsilon")]

    torch.save({"model": {}}, "models/dp/checkpoint.pt")
    assert cli.main(["verify"]) == 3
    assert "has no objective, model_cfg, encoder: it was not written by a dpfm stage" in capsys.readouterr().err
    whole = (in_tmp / "models/dp/checkpoint.pt").read_bytes()
    (in_tmp / "models/dp/checkpoint.pt").write_bytes(whole[:len(whole) // 2])  # a copy cut short: a traceback once
    assert cli.main(["verify"]) == 3
    assert "models/dp/checkpoint.pt cannot be read as a dpfm checkpoint" in capsys.readouterr().err
    (in_tmp / "models/dp/checkpoint.pt").unlink()
    assert cli.main(["verify"]) == 3
    assert "checkpoint.pt is missing" in capsys.readouterr().err
    assert not (in_tmp / artifact("verification")).exists()
    # A later pass takes away the failure report an earlier check left: the two never stand side by side.
    assert (in_tmp / failure_report(artifact("verification"))).exists()
    project(valid)
    assert cli.main(["verify"]) == 0
    assert not (in_tmp / failure_report(artifact("verification"))).exists()


def test_a_test_runs_model_passes_verification_but_is_never_registered(project, in_tmp):
    """privacy.testing: the noise key is known, so the model is not private whatever its ε says; verify
    still checks the mechanism, and registers the model only when the run is not a test run."""
    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{in_tmp / 'mlflow.db'}")
    assert cli.main(["verify", "--set", "privacy.testing=true"]) == 0
    assert client.search_model_versions() == []
    assert cli.main(["verify"]) == 0
    assert len(client.search_model_versions()) == 1


def test_every_version_registered_on_the_budget_carries_what_it_composes_to_now(project, in_tmp, valid_replace_one):
    """verify registers the model before the report runs (and without it, when stages are run by hand),
    and the budget goes on charging runs after it. Every version registered on this budget, whichever run
    registered it, is tagged again with what the budget composes to now. Measured with no pipeline parent
    run (stages by hand): a second DP run charged raises the first version's composed ε to the second
    version's; a version tagged NOT PRIVATE for its own run's reason stays so; a twin trained without DP
    makes every version NOT PRIVATE with composed ε = ∞."""
    import mlflow

    from dataclasses import replace

    from pipeline.privacy import budget
    from pipeline.privacy.accounting import bound_text
    from pipeline.privacy.plan import Plan

    client = mlflow.tracking.MlflowClient(f"sqlite:///{in_tmp / 'mlflow.db'}")
    sketch = np.zeros(1 << budget.SKETCH_BITS, dtype=bool)

    def versions():
        return sorted(client.search_model_versions("name='dpfm-mae'"), key=lambda v: int(v.version))

    assert cli.main(["verify"]) == 0
    (first,) = versions()
    assert first.tags["private"] == "true" and first.tags["epsilon"] == first.tags["epsilon_run"]
    assert first.tags["delta_composed"] == first.tags["delta"]
    # The other run is on a larger set: its δ, a tenth of this run's, is the one both compose at.
    other = replace(Plan.from_header(valid_replace_one), delta=valid_replace_one["delta"] / 10)
    budget.record("set-b", sketch, "another", other, 7)
    assert cli.main(["verify"]) == 0
    first, second = versions()
    assert float(first.tags["epsilon"]) > float(first.tags["epsilon_run"])
    assert first.tags["epsilon"] == second.tags["epsilon"] and first.tags["dp_runs_on_data"] == "2"
    assert first.tags["delta_composed"] == second.tags["delta_composed"] == bound_text(other.delta, 3, exponent=True)
    assert first.tags["delta"] == bound_text(valid_replace_one["delta"], 3, exponent=True)  # its own, beside epsilon_run

    client.set_model_version_tag("dpfm-mae", first.version, "private", "false")  # as its own run's reason would
    client.set_model_version_tag("dpfm-mae", first.version, "epsilon", "inf")
    budget.record("set-c", sketch, "a third", Plan.from_header(valid_replace_one), 8)
    assert cli.main(["verify"]) == 0
    first, second, _ = versions()
    assert (first.tags["private"], first.tags["epsilon"]) == ("false", "inf")
    assert second.tags["private"] == "true" and second.tags["dp_runs_on_data"] == "3"

    (private_run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                         "tags.`dpfm.stage` = 'verify'", max_results=1)
    assert "dpfm.private" not in private_run.data.tags
    budget.record_outside_dp("earlier-set", sketch, "twin", "a training without DP on them")
    assert cli.main(["verify"]) == 0
    assert {(v.tags["private"], v.tags["epsilon"]) for v in versions()} == {("false", "inf")}
    assert all("without DP" in v.tags["not_private"] for v in versions())
    (verify_run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                         "tags.`dpfm.stage` = 'verify'", max_results=1)  # beside its ε, itself
    assert verify_run.data.tags["dpfm.private"] == "false" and "without DP" in verify_run.data.tags["dpfm.not_private"]


@pytest.mark.parametrize("reason", ["dp.nonprivate_baseline=true", "dp.log_private_stats=true"])
def test_a_version_registered_with_a_reason_from_the_params_carries_epsilon_inf(project, in_tmp, reason):
    """A reason the params give (the budget itself still composes to a finite ε): every version on the
    budget, the one an earlier run registered as private too, says NOT PRIVATE and ε = ∞ once verify has
    run (with no report after it), never the budget's finite figure."""
    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{in_tmp / 'mlflow.db'}")
    assert cli.main(["verify"]) == 0
    assert cli.main(["verify", "--set", reason]) == 0
    versions = client.search_model_versions("name='dpfm-mae'")
    assert len(versions) == 2 and {(v.tags["private"], v.tags["epsilon"]) for v in versions} == {("false", "inf")}
    assert all(reason.split("=")[0] in v.tags["not_private"] and v.tags["epsilon_run"] != "inf" for v in versions)


def test_verify_composes_every_run_without_reading_which_sets_overlap(project, in_tmp, valid_replace_one, monkeypatch):
    """How long composing only the overlapping runs takes follows which sets share examples, and verify's
    wall time is published: it composes every run charged and leaves the owner's figure to
    `dpfm owner-composition` (tests/test_report.py)."""
    from pipeline.privacy import budget
    from pipeline.privacy.plan import Plan

    sketch = np.zeros(1 << budget.SKETCH_BITS, dtype=bool)
    for key, run in enumerate(("earlier", "r1")):
        budget.record("set-a", sketch, run, Plan.from_header(valid_replace_one), key)
    ledger = read_json("models/dp/ledger.json")
    write_json("models/dp/ledger.json", {**ledger, "data_identity": "set-a"})

    def overlaps(*args, **kw):
        raise AssertionError("verify read which sets share examples")

    monkeypatch.setattr(budget, "_load_sketch", overlaps)
    assert cli.main(["verify"]) == 0
    assert read_json(in_tmp / artifact("verification"))["composition_at_verify"]["runs"] == 2


def test_every_epsilon_verify_prints_is_rounded_up(project, in_tmp, monkeypatch, capsys):
    """Every ε published is rounded up, so that the figure shown still bounds the accountant's: verify's
    line showed its independent accountants' ε to the nearest (7.99134 as 7.991). Each ε is moved to just
    above a thousandth here, where rounding to the nearest goes down."""
    from pipeline.stages import verify as verify_stage

    def just_above(result):
        for key in ("epsilon", "epsilon_add_remove"):
            result[key] = {a: math.floor(e * 1000) / 1000 + 1e-4 for a, e in result[key].items()}
        return result

    real = verify_stage.verify
    monkeypatch.setattr(verify_stage, "verify", lambda *a, **kw: just_above(real(*a, **kw)))
    assert cli.main(["verify"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("verify: passed"))
    own, add_remove = line.split("add/remove")
    result = read_json(in_tmp / artifact("verification"))
    for part, key in ((own.split(")", 1)[1], "epsilon"), (add_remove, "epsilon_add_remove")):
        shown = {a: float(v) for a, v in re.findall(r"(\w+): (\d+\.\d+)", part)}
        assert shown and set(shown) == set(result[key]), (line, result[key])
        assert all(shown[a] >= result[key][a] for a in shown), (line, result[key])


def test_a_step_the_batch_sizes_lack_fails_though_header_and_optimizer_agree(valid):
    """ε is accounted from the recorded batch sizes: a step the header and the optimizer count but that
    records no batch size was applied uncharged."""
    ledger = _reclaim(_with(valid, batch_sizes=valid["batch_sizes"][:-1]))
    assert ledger["steps"] == len(valid["batch_sizes"])
    assert failed(run_verify(ledger, ledger["steps"])) == {"ledger_steps_match_optimizer"}


@pytest.mark.parametrize("sampler", ["fixed_size", "Poisson", "uniform"])
def test_any_sampler_but_poisson_fails(valid, sampler):
    """The accountant assumes Poisson sampling: every other sampler is refused, not only `shuffle`."""
    assert failed(run_verify(_with(valid, sampler=sampler))) == {"sampler_is_poisson"}


def test_sigma_recorded_a_percent_above_the_noise_fails(valid):
    """The σ the report publishes must be the noise applied, not near it."""
    assert failed(run_verify(_with(valid, sigma=1.01 * valid["sigma"]))) == {"noise_matches_sigma"}


@pytest.mark.parametrize("field", ["delta", "objective", "accountant"])
def test_a_ledger_other_than_params_in_each_field_fails(valid, dp, field):
    """The run must be the one params.yaml asked for in δ, objective and accountant too: each differs
    here from params alone (the ledger is otherwise self-consistent and passes every other check)."""
    ledger, want = valid, dict(dp)
    if field == "delta":
        ledger = _reclaim(_with(valid, delta=1 / (1.5 * valid["n"])))  # still below 1/n
    elif field == "objective":
        want["objective"] = "caption"  # same sensitivity as mae
    else:
        want["accountant"] = "prv"
    assert failed(run_verify(ledger, dp=want)) == {"ledger_matches_params"}


@pytest.mark.parametrize("field, factor", [("clip_norm", 1.001), ("expected_batch_size", 1.001), ("delta", 1.001)])
def test_params_a_tenth_of_a_percent_off_fail(valid, dp, field, factor):
    """The params comparison is exact up to float rounding: no slack lets a nearby run pass."""
    want = dict(dp)
    want[field] = factor * (accounting.parse_delta(dp["delta"], valid["n"]) if field == "delta" else dp[field])
    assert failed(run_verify(valid, dp=want)) == {"ledger_matches_params"}


def test_a_ledger_without_adjacency_is_accounted_add_remove(valid):
    """Ledgers from before adjacency was recorded were accounted add/remove: they still pass, as such."""
    old = {k: v for k, v in valid.items() if k != "adjacency"}
    result = run_verify(old)
    assert failed(result) == set() and result["adjacency"] == "add_remove"


def test_a_full_batch_replace_one_ledger_is_checked_at_twice_the_move(tmp_path, dp):
    """q = 1 under replace-one: x's replacement is always in the batch, so x moves its coordinate 2C past
    the neighbour's highest. σ = 0.2 is far enough from the edge at C and too close at 2C."""
    full = {**dp, "expected_batch_size": 1258, "sigma": 0.2, "epsilon": 1e4, "steps": 2}
    ledger = realistic_ledger(tmp_path, full, n=1258, adjacency="add_remove")
    assert ledger["sample_rate"] == 1.0
    assert "noise_edge_within_delta" not in failed(V.verify(ledger, ledger["steps"], full, ACCOUNTANTS, ALPHA))
    replace = _with(ledger, adjacency="replace_one")
    assert "noise_edge_within_delta" in failed(V.verify(replace, ledger["steps"], full, ["pld"], ALPHA))


def test_a_replace_one_epsilon_below_the_add_remove_one_fails(valid_replace_one, dp, monkeypatch):
    """Replace-one ε is never below add/remove ε: a replace-one PLD answering 0.99× the add/remove one
    (and a claim made with it) fails accountants_agree."""
    real = accounting.epsilon

    def broken(*a, adjacency="add_remove", **k):
        return 0.99 * real(*a, **k) if adjacency == "replace_one" else real(*a, **k)

    monkeypatch.setattr(V.accounting, "epsilon", broken)
    L = valid_replace_one
    ledger = _with(L, epsilon=broken(L["sigma"], L["sample_rate"], L["steps"], L["delta"], adjacency="replace_one"))
    assert "accountants_agree" in failed(V.verify(ledger, L["steps"], dp, ACCOUNTANTS, ALPHA, "replace_one"))


def test_a_replace_one_epsilon_above_the_group_privacy_bound_fails(valid_replace_one, dp, monkeypatch):
    """The replace-one PLD must not exceed its group-privacy RDP bound: a bound below it is a contradiction."""
    L = valid_replace_one
    monkeypatch.setattr(accountant_backends, "_rdp_bound", lambda *a, **k: 0.9 * L["epsilon"])
    assert failed(V.verify(L, L["steps"], dp, ACCOUNTANTS, ALPHA, "replace_one")) == {"accountants_agree"}


def test_a_batch_size_above_n_is_refused_as_malformed(valid):
    """No batch can hold more than the n examples: the ledger is refused before any check, as for -1."""
    ledger = _with(valid, batch_sizes=valid["batch_sizes"][:-1] + [valid["n"] + 1])
    with pytest.raises(VerificationFailed, match=r"batch_sizes must lie in \[0, n="):
        run_verify(ledger)


@pytest.mark.parametrize("case, expected", [("target", {"epsilon_within_target"}),
                                            ("claim", {"claimed_epsilon_reproduced"})])
def test_near_misses_fail(valid, dp, case, expected):
    """ε a millionth above the params' target, or a claim 0.3% below the recomputed ε (three times the
    accountant's own tolerance), fails: no slack beyond float rounding and the PLD ladder's 1e-3."""
    if case == "target":
        target = valid["epsilon"] / (1 + 1e-6)
        ledger, want = _with(valid, target_epsilon=target), {**dp, "epsilon": target}
    else:
        ledger, want = _with(valid, epsilon=0.997 * valid["epsilon"]), dp
    assert failed(run_verify(ledger, dp=want)) == expected


@pytest.mark.parametrize("share, refused", [(0.09, False), (0.11, True), (0.5, True)])
def test_verify_refuses_a_ledger_whose_edge_gives_away_over_a_tenth_of_delta(valid, share, refused):
    """The ledger's noise edge is set (solved independently with scipy) where its floor is `share`·δ:
    verify refuses it past δ/10, as dp-train's plan does, not only past δ."""
    L = valid
    multiplier, q, steps = L["noise_std"] / (L["sensitivity"] * L["clip_norm"]), L["sample_rate"], L["steps"]
    per_step = -math.expm1(math.log1p(-share * L["delta"]) / steps)  # 1 - (1 - share·δ)^(1/T)
    edge = 1 / multiplier + stats.norm.isf(per_step / q)
    result = run_verify(_with(L, noise_edge=edge))
    assert failed(result) == ({"noise_edge_within_delta"} if refused else set())


def test_a_replace_one_runs_epsilon_curve_ends_at_its_reported_epsilon(valid_replace_one, dp):
    """The curve published beside a replace-one run is its own adjacency's, not the smaller add/remove one."""
    L = valid_replace_one
    result = V.verify(L, L["steps"], dp, ACCOUNTANTS, ALPHA, "replace_one")
    assert result["epsilon_curve"]["steps"][-1] == L["steps"]
    assert result["epsilon_curve"]["pld"][-1] == pytest.approx(result["epsilon_reported"], rel=2e-3)


@pytest.mark.parametrize("edge", [math.nextafter(NOISE_EDGE, math.inf), 1e9])
def test_a_ledger_recording_an_edge_past_dpfms_noise_is_refused(valid, edge):
    """No noise dpfm draws passes NOISE_EDGE, so a larger recorded edge is false, and it would hide what the
    edge gives away: 1e9 passed the edge check (its floor is 0) for any σ."""
    small_sigma = _with(valid, noise_edge=edge, sigma=0.05, noise_std=0.05 * valid["sensitivity"] * valid["clip_norm"])
    with pytest.raises(VerificationFailed, match=r"noise_edge=.* must be in \(0, 12.12\]"):
        run_verify(small_sigma)
    assert "noise_edge_within_delta" in failed(run_verify(_with(small_sigma, noise_edge=NOISE_EDGE)))


def test_a_pass_from_an_earlier_run_never_outlives_a_verify_that_cannot_read_the_run(project, in_tmp,
                                                                                    valid_replace_one):
    """dp-train's outputs gone (the checkpoint, or the owner-only batch sizes): verify stops before any
    check, and the earlier run's verification.json goes with it (left, it read as the new model's pass)."""
    from pipeline.privacy import owner

    for breakage in (lambda: (in_tmp / "models/dp/checkpoint.pt").unlink(), lambda: owner.path("runs/r1").unlink()):
        project(valid_replace_one)
        assert cli.main(["verify"]) == 0 and (in_tmp / artifact("verification")).exists()
        breakage()
        assert cli.main(["verify"]) == 3
        assert not (in_tmp / artifact("verification")).exists()


def test_a_test_runs_verify_run_is_tagged_not_private_beside_its_epsilon(project, in_tmp):
    """privacy.testing: the ε verify logs is the mechanism's, but the run is not private (its noise key is
    known): its MLflow run says so beside the ε, though no model is registered to carry the mark."""
    import mlflow

    assert cli.main(["verify", "--set", "privacy.testing=true"]) == 0
    client = mlflow.tracking.MlflowClient(f"sqlite:///{in_tmp / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("dpfm").experiment_id], max_results=1)
    assert any(k.startswith("epsilon_") for k in run.data.metrics)
    assert run.data.tags["dpfm.private"] == "false" and "a test run" in run.data.tags["dpfm.not_private"]


def test_the_verify_run_logs_every_verified_epsilon_and_the_verification(project, in_tmp):
    """The MLflow run of a pass carries each accountant's ε at the run's adjacency and at add/remove (the
    literature's), and the verification.json it checked, byte for byte."""
    import mlflow

    assert cli.main(["verify"]) == 0
    out = read_json(in_tmp / artifact("verification"))
    client = mlflow.tracking.MlflowClient(f"sqlite:///{in_tmp / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("dpfm").experiment_id], max_results=1)
    expected = ({f"epsilon_{a}": e for a, e in out["epsilon"].items()}
                | {f"epsilon_add_remove_{a}": e for a, e in out["epsilon_add_remove"].items()})
    assert {k: run.data.metrics[k] for k in expected} == pytest.approx(expected)
    logged = Path(mlflow.artifacts.download_artifacts(f"{run.info.artifact_uri}/{artifact('verification').name}",
                                                       dst_path=str(in_tmp / "dl")))
    assert logged.read_text() == (in_tmp / artifact("verification")).read_text()


def test_a_model_with_a_reason_is_registered_not_private_before_any_retagging(project, in_tmp, monkeypatch):
    """A version is created with its tags in one write: with a reason from the params it is NOT PRIVATE
    (ε = ∞) from that write on, so a verify killed before the budget-wide retagging leaves no private mark."""
    import mlflow

    from pipeline import tracking

    monkeypatch.setattr(tracking.StageRun, "tag_dp_models", lambda self, tags, budget=None: 0)
    assert cli.main(["verify", "--set", "dp.nonprivate_baseline=true"]) == 0
    [version] = mlflow.tracking.MlflowClient(f"sqlite:///{in_tmp / 'mlflow.db'}").search_model_versions()
    assert (version.tags["private"], version.tags["epsilon"]) == ("false", "inf")


def test_each_version_carries_its_own_runs_epsilon_beside_the_composed_one(project, in_tmp, valid_replace_one):
    """epsilon_run is the registering run's verified ε, not what the budget composes to: with a second run
    charged before it, the new version's epsilon_run is its verification's ε, below the composed epsilon."""
    import mlflow

    from pipeline.privacy import budget
    from pipeline.privacy.accounting import bound_text
    from pipeline.privacy.plan import Plan

    budget.registry_id()
    budget.record("set-b", np.zeros(1 << budget.SKETCH_BITS, dtype=bool), "another",
                  Plan.from_header(valid_replace_one), 7)
    assert cli.main(["verify"]) == 0
    out = read_json(in_tmp / artifact("verification"))
    [version] = mlflow.tracking.MlflowClient(f"sqlite:///{in_tmp / 'mlflow.db'}").search_model_versions()
    assert version.tags["epsilon_run"] == bound_text(out["epsilon_reported"], 4)
    assert float(version.tags["epsilon"]) > float(version.tags["epsilon_run"])
