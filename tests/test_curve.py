"""The curve stage (pipeline/stages/curve.py): one point per ε and init, each a verified DP
training charged to the data's budget, or the recipe's non-private twin at ε = ∞; and the report's
curve section."""

import json
import math

import numpy as np
import pytest
from recording import RecordingTracker
from stage_runs import charged_runs, flat, initial_weights, inside, project, run_in_process, torchrun, train

from pipeline import checkpoints
from pipeline.errors import VerificationFailed
from pipeline.privacy import training
from pipeline.artifacts import artifact


def run_curve(work, overrides):
    with inside(work):
        run_in_process("curve", ["curve.inits=[random]", *overrides])
    return json.loads((work / artifact("curve")).read_text())


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


def test_a_point_that_fails_verification_stops_the_stage(data_dir, tmp_path, one_update_more):
    """The bug flipped on: the optimizer applies one update more than the ledger charged."""
    work = project(data_dir, tmp_path)
    one_update_more()
    with pytest.raises(VerificationFailed, match="ledger_steps_match_optimizer"):
        run_curve(work, ["curve.epsilons=[2]"])
    assert not (work / artifact("curve")).exists()


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_a_point_dp_train_would_refuse_stops_the_curve_before_any_point_is_charged(data_dir, tmp_path, objective,
                                                                                     ranks):
    """ε = 100 in one step: the noise edge refuses its σ. The curve trained and charged ε = 2 first, then
    stopped at that point's plan; every point is planned before the first is charged."""
    from pipeline.config import ParamsError

    work, sets = project(data_dir, tmp_path), [f"dp.objective={objective}", "curve.epsilons=[2, 100]", "dp.steps=1"]
    if ranks == 1:
        with pytest.raises(ParamsError, match=r"(?s)the curve's point at ε = 100 .*never passes 12.12 std"):
            run_curve(work, sets)
    else:
        refused = torchrun(work, "curve", ["curve.inits=[random]", *sets], check=False)
        assert refused.returncode != 0 and "the curve's point at ε = 100" in refused.stderr, refused.stderr[-3000:]
    assert charged_runs(work) == [] and not (work / artifact("curve")).exists()


def test_the_points_are_planned_at_the_private_n(data_dir, tmp_path, monkeypatch):
    """σ and q follow n: the points are planned as dp-train plans them, on the private split's usable
    examples, not on the eval split's."""
    class Planned(Exception):
        pass

    def planned_at(dp, n, *args, **kwargs):
        seen.append(n)
        raise Planned
    seen, work = [], project(data_dir, tmp_path)
    stats = json.loads((work / "data/shards/stats.json").read_text())
    assert stats["private"]["usable"] != stats["eval"]["usable"]
    monkeypatch.setattr(training, "checked_plan", planned_at)
    with pytest.raises(Planned):
        run_curve(work, ["curve.epsilons=[2]"])
    assert seen == [stats["private"]["usable"]]


def test_each_seed_is_its_own_dp_training(data_dir, tmp_path, monkeypatch):
    """...probed as evaluate probes its rows' seeds: with the run's probe seed, so a point at training
    seed k and evaluate's row at seed k differ by nothing else (the probe seed followed k here once)."""
    from pipeline.stages import curve

    probe_seeds, splits, probed, pooled = [], [], [], []
    probe_outcomes, accuracy_ci, train_point = curve.probe_outcomes, curve.accuracy_ci, curve.train_point
    monkeypatch.setattr(curve, "probe_outcomes", lambda *a: probe_seeds.append(a[4]) or splits.append(a[2])
                        or probed.append(probe_outcomes(*a)) or probed[-1])
    monkeypatch.setattr(curve, "accuracy_ci", lambda correct, seed, refits: pooled.append((correct, refits))
                        or accuracy_ci(correct, seed, refits=refits))

    def spent_apart(p, *a):  # the seeds' ε set apart, to see which the point reports
        model, eps, is_main = train_point(p, *a)
        return model, eps * (1 + 0.01 * (p["run"]["seed"] - 5)), is_main
    monkeypatch.setattr(curve, "train_point", spent_apart)
    work = project(data_dir, tmp_path)
    result = run_curve(work, ["curve.epsilons=[2]", "curve.seeds=2", "run.seed=5", "evaluate.probe_refits=2"])
    assert probe_seeds == [5, 5]
    assert all(np.array_equal(a, b) for split in splits[1:] for a, b in zip(split, splits[0]))  # one split, every seed
    (point,) = result["points"]
    assert point["seeds"] == result["seeds"] == 2
    # The point pools both seeds: its accuracy over both, its interval over both and their probes' refits,
    # and the most ε either spent.
    [(correct, refits)] = pooled
    assert np.array_equal(correct, np.stack([outcomes for outcomes, _ in probed]))
    assert np.array_equal(refits, np.stack([refit for _, refit in probed])) and refits.shape[:2] == (2, 2)
    assert point["linear_probe"] == pytest.approx(correct.mean())
    assert point["epsilon_spent"] > 2 * 1.005  # the second seed's, set 1% above the first's (at most 2)
    runs = charged_runs(work)
    assert len(runs) == 2 and len({r["run"] for r in runs}) == 2  # two identities, both charged


def test_every_metric_of_the_curve_carries_the_stages_one_timestamp_and_its_trainings_name(data_dir, tmp_path,
                                                                                            local_mlflow):
    """Measured in MLflow's store: two trainings in one stage, each logging per step, then each point's
    probe. With the time of each call, or a stamp per training, the timestamps would split the stage's
    wall time into how long each training took (which follows the batch sizes it sampled). Each
    training's series is its own: under one name they interleaved, two values per step, and MLflow showed
    whichever was larger as the latest. A run with an ε = ∞ point is labelled NOT PRIVATE on its own run."""
    import mlflow

    work = project(data_dir, tmp_path)
    with inside(work):
        run_in_process("curve", ["curve.inits=[random]", "curve.epsilons=[2, .inf]", "dp.eval_every=1",
                                 "run.seed=3"], tracked=True)
    client = mlflow.tracking.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("dpfm").experiment_id])
    history = {k: client.get_metric_history(run.info.run_id, k) for k in run.data.metrics}
    trained = {"curve.random.eps_2.seed_3.": "", "curve.random.eps_inf.seed_3.": "nonprivate_"}
    assert set(history) == {f"{t}{p}{m}" for t, p in trained.items() for m in ("heldout_loss", "lr")} | {
        f"curve.random.eps_{e}.linear_probe{end}" for e in ("2", "inf") for end in ("", "_ci_lo", "_ci_hi")}, \
        set(history)
    for point in json.loads((work / "results/curve/curve.json").read_text())["points"]:  # each with its interval
        name = f"curve.random.eps_{point['epsilon']}.linear_probe"
        assert [history[name + end][0].value for end in ("", "_ci_lo", "_ci_hi")] == pytest.approx(
            [point["linear_probe"], *point["linear_probe_ci"]])
    for name in ("curve.random.eps_2.seed_3.heldout_loss", "curve.random.eps_inf.seed_3.nonprivate_heldout_loss"):
        steps = [m.step for m in history[name]]
        assert len(steps) > 1 and len(steps) == len(set(steps)), (name, steps)  # one training's, per step
    assert {m.timestamp for ms in history.values() for m in ms} == {run.info.start_time}
    assert run.data.tags["dpfm.private"] == "false" and "ε = ∞ point" in run.data.tags["dpfm.not_private"]


def test_a_curve_run_on_a_budget_that_records_a_release_outside_dp_is_labelled_not_private(data_dir, tmp_path,
                                                                                            local_mlflow):
    """The curve's own run was labelled from its params alone: on a budget that records a release made
    without DP (here dp-train's, under a known noise key), a curve of secret-key points, every
    composition over it ∞, was logged in MLflow with nothing to say it is NOT PRIVATE."""
    import mlflow

    work = project(data_dir, tmp_path)
    train(work)  # dp-train under the project's known noise key: charged as a release outside DP
    with inside(work):
        run_in_process("curve", ["curve.inits=[random]", "curve.epsilons=[2]", "dp.noise_seed=null",
                                 "privacy.testing=false"], tracked=True)
    client = mlflow.tracking.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("dpfm").experiment_id])
    assert run.data.tags["dpfm.private"] == "false", run.data.tags
    assert "data/budget records releases of its examples made without DP" in run.data.tags["dpfm.not_private"]


def test_no_epsilons_writes_an_empty_curve(data_dir, tmp_path):
    work = project(data_dir, tmp_path)
    assert run_curve(work, ["curve.epsilons=[]"])["points"] == []
    assert charged_runs(work) == []


def test_point_params_keep_dp_trains_sections_and_plan_infinity_at_the_recipes_epsilon():
    params = {"run": {"seed": 0}, "model": {}, "dp": {"epsilon": 8.0, "sigma": None, "init": "pretrain",
                                                      "nonprivate_baseline": True},
              "privacy": {"adjacency": "replace_one"}, "curve": {}, "evaluate": {}}
    p = training.point_params(params, "random", 2)
    assert set(p) == {"run", "model", "dp", "privacy"} and p["dp"]["epsilon"] == 2.0 and p["dp"]["init"] == "random"
    assert training.point_params(params, "pretrain", math.inf)["dp"]["epsilon"] == 8.0
    fixed = {**params, "dp": {**params["dp"], "sigma": 0.7}}  # dp-train's own σ, set by hand, is not a point's
    assert training.point_params(fixed, "random", 2)["dp"]["sigma"] is None


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_the_non_private_schedule_trains_the_twin_only_and_never_recharges_the_private_run(data_dir, tmp_path,
                                                                                          objective):
    import torch

    from pipeline.config import load_params
    from pipeline.train import lr_at

    work = project(data_dir, tmp_path)
    common = [f"dp.objective={objective}", "dp.nonprivate_baseline=true"]
    _, private = train(work, [*common, "dp.nonprivate.steps=9", "dp.nonprivate.lr=0.002"])
    twin = checkpoints.load(work / "models/dp/nonprivate.pt")
    assert private.steps == 6 and twin.steps == 9
    [state] = [s for s in (torch.load(p, weights_only=False) for p in (work / ".dpfm/state").glob(
        "dp-train-*/nonprivate/checkpoint.pt")) if s["step"] == 9]  # the twin ran its own 9 steps
    warmup = load_params(work / "params.yaml")["dp"]["warmup_steps"]  # at its own rate: its last step's
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(lr_at(8, 0.002, warmup, 9))
    # Another schedule for the twin: a new twin, the same private run (resumed, not charged again).
    _, again = train(work, [*common, "dp.nonprivate.steps=12"])
    assert again.steps == 6 and len(charged_runs(work)) == 1
    assert checkpoints.load(work / "models/dp/nonprivate.pt").steps == 12
    assert {name: torch.equal(v, private.model[name]) for name, v in again.model.items()} == \
        {name: True for name in private.model}
    # The curve's ∞ point is that twin: same schedule, same state.
    result = run_curve(work, [*common, "dp.nonprivate.steps=12", "curve.epsilons=[.inf]"])
    assert result["points"][0]["epsilon"] == "inf" and len(charged_runs(work)) == 1


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_the_curve_on_two_ranks_is_the_one_process_curve_charged_once(data_dir, tmp_path, objective):
    """Under torchrun each point is one DP training over both ranks (one ledger, one budget entry,
    rank 0 writes) with the one-process update: the same noise key, each example summed once and the
    noise added once. Plain SGD keeps the update linear in the gradient, as in test_dp_train."""
    import torch

    sets = [f"dp.objective={objective}", "curve.inits=[random]", "curve.epsilons=[2, .inf]", "dp.optimizer=sgd",
            "dp.lr=0.05"]
    one, two = project(data_dir, tmp_path / "one"), project(data_dir, tmp_path / "two")
    want = run_curve(one, sets)
    torchrun(two, "curve", sets)
    got = json.loads((two / artifact("curve")).read_text())
    assert len(charged_runs(two)) == len(charged_runs(one)) == 1  # the ε = 2 point, once for both ranks
    for g, w in zip(got["points"], want["points"], strict=True):
        assert g["epsilon"] == w["epsilon"] and g["epsilon_spent"] == pytest.approx(w["epsilon_spent"])
    (ref,), (ranks,) = ([torch.load(p, weights_only=False)["model"]
                         for p in (work / ".dpfm/state").glob("dp-train-*/checkpoint.pt")] for work in (one, two))
    start = flat(initial_weights(one, [*sets, "dp.epsilon=2"]))
    update = flat(ref) - start
    assert float(update.norm()) > 0
    assert float((flat(ranks) - start - update).norm() / update.norm()) <= 1e-4


def test_the_curve_probes_the_first_set_split_as_evaluate_splits_it_and_names_dp_trains_run(data_dir, tmp_path,
                                                                                              monkeypatch):
    """A point is read beside evaluate's rows: probed on the first eval set (not another one of
    evaluate.sets), fit on evaluate's probe-train at the run's seed and scored on its probe-test; curve.json
    names dp-train's run (evaluate refuses a curve made beside another run) and the protocol it used."""
    from PIL import Image

    from pipeline.config import load_params
    from pipeline.eval.evalsets import load_eval_set
    from pipeline.stages import curve

    work = project(data_dir, tmp_path)
    ledger, _ = train(work, ["run.seed=5"])
    pets = tmp_path / "pets"  # a second set, readable, that the curve must leave alone
    for cls in ("cat", "dog"):
        (pets / cls).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (20, 20), (60 * i, 0, 0)).save(pets / cls / f"{i}.png")
    seen, probe_outcomes = [], curve.probe_outcomes
    monkeypatch.setattr(curve, "probe_outcomes", lambda x, labels, split, *a: seen.append((labels, split))
                        or probe_outcomes(x, labels, split, *a))
    sets = "evaluate.sets=[{name: digits, source: digits}, {name: pets, source: folder, path: %s}]" % pets
    result = run_curve(work, ["run.seed=5", "curve.epsilons=[2]", "evaluate.probe_refits=2",
                              "evaluate.fewshot.shots=[]", sets])
    fraction = load_params(work / "params.yaml")["evaluate"]["probe_fraction"]
    with inside(work):
        digits = load_eval_set({"name": "digits", "source": "digits"}, 16)
    tr, te = digits.split(fraction, 5)
    assert not np.array_equal(tr, digits.split(fraction, 0)[0])  # the run's seed decides the split here
    [(labels, (fit_on, scored_on))] = seen
    assert np.array_equal(labels, digits.labels)
    assert np.array_equal(fit_on, tr) and np.array_equal(scored_on, te)
    assert result["set"] == "digits" and result["n_probe_test"] == len(te) and result["probe_refits"] == 2
    assert result["run"] == ledger["run"]


def test_a_curve_run_by_hand_refuses_its_infinite_point_before_any_point_is_charged(data_dir, tmp_path):
    """`dpfm curve` run by itself: the workflow's check (release.check_asked_for) never ran, so the stage's
    own refusal is the only one. Without it the ε = 2 point was charged, then ε = ∞ trained without DP on
    data whose params forbid it."""
    from pipeline.config import ParamsError

    work = project(data_dir, tmp_path)
    with pytest.raises(ParamsError, match="ε = ∞ point trains WITHOUT differential privacy"):
        run_curve(work, ["curve.epsilons=[2, .inf]", "privacy.nonprivate_on_private_data=false"])
    assert charged_runs(work) == [] and not (work / artifact("curve")).exists()


def test_only_the_main_process_writes_the_curve_and_labels_its_run(data_dir, tmp_path, monkeypatch):
    """Under torchrun every rank runs the stage, and only rank 0's points carry their verified ε: a curve.json
    written by another rank (after rank 0's) would publish points without it. Here every point is another
    rank's: nothing is written, labelled or logged as an artifact."""
    from pipeline.stages import curve

    train_point = curve.train_point
    monkeypatch.setattr(curve, "train_point", lambda *a: (train_point(*a)[0], None, False))
    work, tracker = project(data_dir, tmp_path), RecordingTracker()
    with inside(work):
        run_in_process("curve", ["curve.inits=[random]", "curve.epsilons=[2]"], tracker=tracker)
    assert not (work / artifact("curve")).exists() and tracker.tags == {} and tracker.artifacts == []
