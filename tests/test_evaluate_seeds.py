"""`evaluate.seeds`: the trained rows of the evaluation table over several training seeds. Each
extra DP seed is a verified DP training charged to the data's budget, shared with the curve's run
of the same seed; the intervals cover the seeds."""

import json

import pytest
from stage_runs import charged_runs, inside, project, run_in_process, train

from pipeline.errors import VerificationFailed
from pipeline.stages.evaluate import mlflow_metrics

BASELINES = "evaluate.baselines=[pixels, random, nonprivate]"  # no pretrain at micro scale (dp.init=random)


def run_stages(work, names, overrides):
    with inside(work):
        for name in names:
            run_in_process(name, overrides)
    return json.loads((work / "results/eval/metrics.json").read_text()) if "evaluate" in names else None


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_trained_rows_take_every_seed_and_each_dp_seed_is_charged(data_dir, tmp_path, monkeypatch, objective):
    from pipeline.config import load_params
    from pipeline.privacy import training
    from pipeline.stages import evaluate

    work = project(data_dir, tmp_path)
    common = [f"dp.objective={objective}", "dp.nonprivate_baseline=true", BASELINES, "evaluate.fewshot.shots=[]"]
    train(work, common)
    one = run_stages(work, ["verify", "evaluate"], common)["sets"]["digits"]
    assert len(charged_runs(work)) == 1
    trained, randoms, train_point, random_candidate = [], [], training.train_point, evaluate.random_candidate
    monkeypatch.setattr(training, "train_point", lambda p, ctx, init, epsilon, prefix: trained.append(
        (p["run"]["seed"], epsilon)) or train_point(p, ctx, init, epsilon, prefix))
    monkeypatch.setattr(evaluate, "random_candidate", lambda objective, cfg, seed, *a, **k: randoms.append(seed)
                        or random_candidate(objective, cfg, seed, *a, **k))
    full = run_stages(work, ["evaluate"], [*common, "evaluate.seeds=3"])
    params = load_params(work / "params.yaml", common)
    seed, epsilon = params["run"]["seed"], params["dp"]["epsilon"]
    # Each extra seed: the DP recipe at its ε, the twin without noise, and random init, all at that seed.
    assert trained == [(seed + 1, epsilon), (seed + 1, float("inf")), (seed + 2, epsilon), (seed + 2, float("inf"))]
    assert randoms[-2:] == [seed + 1, seed + 2]
    three = full["sets"]["digits"]
    runs = charged_runs(work)
    assert len(runs) == 3 and len({r["run"] for r in runs}) == 3  # dp-train's seed, then two more: each charged
    res = three["results"]
    assert {name: r["seeds"] for name, r in res.items()} == {"dp": 3, "nonprivate": 3, "random": 3, "pixels": 1}
    # Seed run.seed is dp-train's own model: the others are new trainings, so the mean moves. The
    # released checkpoint's own figures stay beside the mean, as a one-seed evaluation gives them.
    assert one["results"]["dp"]["seeds"] == 1 and "first_seed" not in one["results"]["dp"]
    released = {k: v for k, v in one["results"]["dp"].items() if k.startswith(("linear_probe", "zero_shot"))}
    assert res["dp"]["first_seed"] == released and len(released) == (2 if objective == "mae" else 4)
    # MLflow's headline accuracy sits beside the run's ε: the released model's, not the seeds' mean.
    flat = mlflow_metrics(full)
    assert flat["dp_linear_probe_acc"] == released["linear_probe"] and flat["epsilon"] == full["privacy"]["epsilon"]
    assert flat["digits.dp.linear_probe"] == res["dp"]["linear_probe"]
    assert res["pixels"]["linear_probe"] == one["results"]["pixels"]["linear_probe"]
    for r in res.values():
        lo, hi = r["linear_probe_ci"]
        assert 0 <= lo <= r["linear_probe"] <= hi <= 1
    if objective != "mae":
        assert "zero_shot_ci" in res["dp"]
    assert set(three["dp_versus"]) == {"nonprivate", "random", "pixels"}
    # The curve's run at dp-train's ε and a seed evaluate trained is the same run: charged once.
    run_stages(work, ["curve"], [*common, "curve.inits=[random]", "curve.epsilons=[8]", "curve.seeds=3"])
    assert len(charged_runs(work)) == 3


def test_an_extra_seed_that_fails_verification_stops_the_stage(data_dir, tmp_path, one_update_more):
    """The bug flipped on for the extra seeds only: one update more than the ledger charged."""
    work = project(data_dir, tmp_path)
    train(work, [BASELINES])
    run_stages(work, ["verify"], [])
    one_update_more()
    with pytest.raises(VerificationFailed, match="ledger_steps_match_optimizer"):
        run_stages(work, ["evaluate"], [BASELINES, "evaluate.seeds=2"])
    assert not (work / "results/eval/metrics.json").exists()


# What the evaluation asks of its set, asked of params that cannot give it: each used to stop the stage
# only after evaluate's extra seeds, or the curve's points, were trained and charged.
UNANSWERABLE = {"evaluate.fewshot.shots=[400]": "evaluate.fewshot.shots on eval set 'digits': 400-shot needs",
                "evaluate.probe_fraction=0.005": "evaluate.probe_fraction=0.005 on eval set 'digits'",
                "evaluate.last_k_blocks=3": "evaluate.last_k_blocks=3: the encoder has 1 blocks"}


@pytest.mark.parametrize("stage, bad", [(stage, bad) for stage in ("evaluate", "curve") for bad in UNANSWERABLE])
def test_an_evaluation_its_set_cannot_answer_is_refused_before_a_seed_or_point_is_charged(data_dir, tmp_path,
                                                                                         stage, bad):
    from pipeline.config import ParamsError

    work = project(data_dir, tmp_path)
    train(work, [BASELINES])
    run_stages(work, ["verify"], [])
    more = ["evaluate.seeds=2"] if stage == "evaluate" else ["curve.inits=[random]", "curve.epsilons=[4]"]
    with pytest.raises(ParamsError, match=UNANSWERABLE[bad].replace(".", r"\.").replace("[", r"\[")):
        run_stages(work, [stage], [BASELINES, bad, *more])
    assert len(charged_runs(work)) == 1  # dp-train's run alone


@pytest.mark.parametrize("stage", ["evaluate", "curve"])
def test_a_second_set_that_cannot_be_read_is_refused_before_a_seed_or_point_is_charged(data_dir, tmp_path, stage):
    """The curve probes the first set only, and evaluate reads the others after its seeds: an image that
    does not decode, or a path that is not there, in any set stops the stage before a training."""
    from PIL import Image

    from pipeline.errors import EvalSetError

    work = project(data_dir, tmp_path)
    train(work, [BASELINES])
    run_stages(work, ["verify"], [])
    pets = tmp_path / "pets"
    for cls in ("cat", "dog"):
        (pets / cls).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (20, 20), (60 * i, 0, 0)).save(pets / cls / f"{i}.png")
    (pets / "dog" / "3.png").write_bytes(b"\x89PNG not an image")  # the last image read
    more = ["evaluate.seeds=2"] if stage == "evaluate" else ["curve.inits=[random]", "curve.epsilons=[4]"]
    sets = "evaluate.sets=[{name: digits, source: digits}, {name: pets, source: folder, path: %s}]"
    with pytest.raises(EvalSetError, match=r"dog/3\.png: cannot read the image"):
        run_stages(work, [stage], [BASELINES, "evaluate.fewshot.shots=[]", sets % pets, *more])
    with pytest.raises(FileNotFoundError, match=r"evaluate\.sets\[pets\]\.path: .*nowhere does not exist"):
        run_stages(work, [stage], [BASELINES, "evaluate.fewshot.shots=[]", sets % (tmp_path / "nowhere"), *more])
    assert len(charged_runs(work)) == 1  # dp-train's run alone
