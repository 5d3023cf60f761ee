"""The curve stage (pipeline/stages/curve.py): one point per ε and init, each a verified DP
training charged to the data's budget, or the recipe's non-private twin at ε = ∞; and the report's
curve section."""

import json
import math
import os

import pytest
from stage_runs import project, run_in_process, train

from pipeline.errors import VerificationFailed
from pipeline.privacy import budget
from pipeline.stages import curve, dp_train


def run_curve(work, overrides):
    cwd = os.getcwd()
    os.chdir(work)
    try:
        run_in_process("curve", ["curve.inits=[random]", *overrides])
        return json.loads((work / curve.OUT).read_text())
    finally:
        os.chdir(cwd)


def charged_runs(work):
    cwd = os.getcwd()
    os.chdir(work)
    try:
        return budget.runs(budget.fingerprint("data/shards/private"))
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_each_point_is_a_verified_dp_training_or_the_non_private_twin(data_dir, tmp_path, objective):
    work = project(data_dir, tmp_path)
    result = run_curve(work, [f"dp.objective={objective}", "curve.epsilons=[.inf, 1, 4]"])
    points = result["points"]
    assert [p["epsilon"] for p in points] == [1, 4, "inf"]  # sorted, ∞ last
    assert result["objective"] == objective and result["n_probe_test"] > 0
    for p in points:
        lo, hi = p["linear_probe_ci"]
        assert 0 <= lo <= p["linear_probe"] <= hi <= 1
    spent = [p["epsilon_spent"] for p in points]
    assert spent[0] <= 1 and 1 < spent[1] <= 4 and spent[2] is None  # verified ε, within each target
    runs = charged_runs(work)
    assert len(runs) == 2  # the two private points; ∞ spends nothing
    assert runs[0]["sigma"] > runs[1]["sigma"]  # ε = 1 calibrated more noise than ε = 4


def test_the_point_that_repeats_dp_train_is_the_same_run_and_charged_once(data_dir, tmp_path):
    work = project(data_dir, tmp_path)
    # dp-train also trains the non-private twin: a key of what is reported beside the private run, not
    # of the run, so the curve (which leaves it off) still finds dp-train's run.
    ledger, _ = train(work, ["dp.epsilon=8", "dp.nonprivate_baseline=true"])
    assert len(charged_runs(work)) == 1
    result = run_curve(work, ["dp.epsilon=8", "curve.epsilons=[8]"])
    assert len(charged_runs(work)) == 1
    assert result["points"][0]["epsilon_spent"] == pytest.approx(ledger["epsilon"])


def test_a_point_that_fails_verification_stops_the_stage(data_dir, tmp_path, monkeypatch):
    """The bug flipped on: the optimizer applies one update more than the ledger charged."""
    work = project(data_dir, tmp_path)
    real = dp_train.train_private

    def one_extra_update(*args, **kw):
        model, counters, record = real(*args, **kw)
        return model, {**counters, "applied_updates": counters["applied_updates"] + 1}, record

    monkeypatch.setattr(dp_train, "train_private", one_extra_update)
    with pytest.raises(VerificationFailed, match="ledger_steps_match_optimizer"):
        run_curve(work, ["curve.epsilons=[2]"])
    assert not (work / curve.OUT).exists()


def test_each_seed_is_its_own_dp_training(data_dir, tmp_path):
    work = project(data_dir, tmp_path)
    result = run_curve(work, ["curve.epsilons=[2]", "curve.seeds=2"])
    (point,) = result["points"]
    assert point["seeds"] == result["seeds"] == 2
    runs = charged_runs(work)
    assert len(runs) == 2 and len({r["run"] for r in runs}) == 2  # two identities, both charged


def test_no_epsilons_writes_an_empty_curve(data_dir, tmp_path):
    work = project(data_dir, tmp_path)
    assert run_curve(work, ["curve.epsilons=[]"])["points"] == []
    assert charged_runs(work) == []


def test_point_params_keep_dp_trains_sections_and_plan_infinity_at_the_recipes_epsilon():
    params = {"run": {"seed": 0}, "model": {}, "dp": {"epsilon": 8.0, "sigma": None, "init": "pretrain",
                                                      "nonprivate_baseline": True}, "curve": {}, "evaluate": {}}
    p = curve.point_params(params, "random", 2)
    assert set(p) == {"run", "model", "dp"} and p["dp"]["epsilon"] == 2.0 and p["dp"]["init"] == "random"
    assert curve.point_params(params, "pretrain", math.inf)["dp"]["epsilon"] == 8.0
