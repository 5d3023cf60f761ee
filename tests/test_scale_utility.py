"""benchmarks/scale_utility.py: its targets can fail, its sizes keep q and T, and its rows resume."""

import argparse
import functools
import json
import math
import re

import numpy as np
import pytest

from benchmarks.scale_report import FULL, check_targets, combined_figure, paired_gain, probe_ci, report
from benchmarks.scale_utility import (RECIPE, ROOT, SCHEDULES, VALIDATION_FOLDS, Rows, against, recipe_id,
                                      size_params, untrained_id, usable, validation_folds,
                                      with_seeds)
from benchmarks.utility import schedule
from pipeline.config import load_params
from pipeline.eval.stats import difference_ci
from pipeline.privacy.noise_edge import NOISE_EDGE

EPSILONS = [1.0, 8.0, math.inf]


def table(weak, strong, zero_acc=0.5):
    rng = np.random.default_rng(1)
    t = {"synthetic": {"probe": weak}, "pixels": {"probe": strong}}
    for obj in ("mae", "caption", "clip"):
        for eps in EPSILONS:
            t[f"{obj}-n{FULL}-eps{eps:g}"] = {"probe": strong, "zero": rng.random(strong.shape) < zero_acc}
    return t


def outcomes():
    rng = np.random.default_rng(0)
    weak = rng.random((1, 400)) < 0.7
    strong = weak | (rng.random((1, 400)) < 0.6)  # right wherever weak is, and on many more
    return weak, strong


def passed(t, chance=0.1):
    return {k: v["passed"] for k, v in check_targets(t, ("mae", "caption", "clip"), EPSILONS, chance).items()}


def test_a_clear_gain_passes_every_target():
    weak, strong = outcomes()
    result = passed(table(weak, strong))
    assert all(result.values()) and len(result) == 2 + 3 + 3 + 2 + 1  # a: mae, caption (clip has none); d: best, best DP


def test_each_target_fails_when_its_comparison_breaks():
    weak, strong = outcomes()
    t = table(weak, strong)
    t[f"caption-n{FULL}-eps8"]["probe"] = weak  # DP no better than its warm start, and below ε = 1
    r = passed(t)
    assert not r["a_caption_eps8_above_synthetic"] and not r["c_caption_eps8_not_below_eps1"]
    assert r["a_mae_eps8_above_synthetic"]
    t = table(weak, strong)
    t[f"clip-n{FULL}-epsinf"]["probe"] = weak  # the non-private twin learns nothing
    assert not passed(t)["b_clip_eps_inf_above_synthetic"]
    t = table(weak, strong)
    t["pixels"]["probe"] = np.ones_like(strong)  # pixels out of every encoder's reach
    assert not passed(t)["d_best_vs_pixels"] and not passed(t)["d_best_dp_vs_pixels"]
    t = table(weak, strong)
    for eps in (1, 8):  # only the no-DP twins reach the pixels: the DP encoders' own target fails
        t.update({f"{obj}-n{FULL}-eps{eps}": {**t[f"{obj}-n{FULL}-eps{eps}"], "probe": weak} for obj in ("mae", "caption", "clip")})
    t["pixels"]["probe"] = strong
    r = passed(t)
    assert r["d_best_vs_pixels"] and not r["d_best_dp_vs_pixels"]
    assert not passed(table(weak, strong, zero_acc=0.25))["e_caption_zero_shot_3x_chance"]  # 2.5x chance


def test_a_gain_within_the_probe_fit_spread_fails():
    """A DP row 3 points above its warm start with the full probe, where probes refit on resamples of
    probe-train disagree by more than that: over test images alone target (a) passes; with the
    refits it must not."""
    weak = np.random.default_rng(5).random(2000) < 0.7

    def moved(points):  # the warm start's outcomes, `points` better (or worse)
        c = weak.copy()
        k = round(abs(points) * len(c))
        c[np.flatnonzero(~c if points > 0 else c)[:k]] = points > 0
        return c

    strong = moved(0.03)[None]
    weak_fits = np.stack([weak] * 20)[None]  # the warm start's probe barely moves with its images
    strong_fits = np.stack([moved(points) for points in np.linspace(-0.04, 0.10, 20)])[None]
    weak = weak[None]
    t = {"synthetic": {"probe": weak}, "pixels": {"probe": weak},
         f"caption-n{FULL}-eps8": {"probe": strong, "zero": strong}}
    assert check_targets(t, ("caption",), [8.0], 0.1)["a_caption_eps8_above_synthetic"]["passed"]
    t["synthetic"]["refits"], t[f"caption-n{FULL}-eps8"]["refits"] = weak_fits, strong_fits
    target = check_targets(t, ("caption",), [8.0], 0.1)["a_caption_eps8_above_synthetic"]
    assert not target["passed"] and target["diff"]["diff"] == pytest.approx((strong & ~weak).mean())


def test_sizes_keep_the_sampling_rate_and_the_steps():
    params = {"shards": {"private_limit": None}, "dp": {"expected_batch_size": 1024, "steps": 100}}
    full, small = size_params(params, FULL, None), size_params(params, "6000", 60000)
    assert full["dp"]["expected_batch_size"] == 1024 and full["shards"]["private_limit"] is None
    assert small["dp"] == {"expected_batch_size": round(1024 / 10), "steps": 100}
    assert small["shards"]["private_limit"] == 6000
    clip = size_params({**params, "dp": {"expected_batch_size": 256, "steps": 100}}, "2000", 60000)
    assert clip["dp"]["expected_batch_size"] == 9  # 8.53 rounded to the nearest: q stays 0.43%, not 0.40%


def test_validation_rows_are_kept_apart_from_the_probe_test_parts():
    from benchmarks.scale_utility import rows_name

    assert rows_name("abc123", validate=False) == "abc123"
    assert rows_name("abc123", validate=True) == f"abc123-val{VALIDATION_FOLDS}"


def test_validation_scores_every_probe_train_image_once_and_never_reads_the_probe_test_part():
    labels = np.repeat(np.arange(10), 30)
    tr, te = np.arange(0, 300, 2), np.arange(1, 300, 2)
    folds = validation_folds((tr, te), labels)
    scored = np.concatenate([val for _, val in folds])
    assert np.array_equal(np.sort(scored), tr)  # all of probe-train, each image once
    for fit, val in folds:
        assert not set(fit) & set(val) and set(fit) | set(val) == set(tr)
        assert len(val) == pytest.approx(len(tr) / VALIDATION_FOLDS, abs=1)
        assert np.bincount(labels[val]).min() >= 4  # stratified: every class scored in every fold
    assert not set(np.concatenate([np.concatenate(f) for f in folds])) & set(te)


def test_rows_are_kept_whole_and_read_back(tmp_path):
    rows = Rows(tmp_path / "rows")
    assert rows.get("mae-nfull-eps8") is None
    probe, zero = np.array([[True, False, True]]), np.array([[False, True, True]])
    refits = np.array([[[True, True, False], [False, False, True]]])
    rows.put("mae-nfull-eps8", probe, zero, refits, {"n": 3, "sigma": 0.5})
    back = rows.get("mae-nfull-eps8")
    assert (back["probe"] == probe).all() and (back["zero"] == zero).all() and back["meta"] == {"n": 3, "sigma": 0.5}
    assert (back["refits"] == refits).all()
    rows.put("pixels", probe, None, None, {})  # kept before refits existed, or --probe-refits 0
    assert rows.get("pixels")["refits"] is None and rows.get("pixels")["zero"] is None
    assert sorted(p.name for p in (tmp_path / "rows").iterdir()) == ["mae-nfull-eps8.npz", "pixels.npz"]  # no temporary left


def test_a_row_whose_write_fails_keeps_its_earlier_version_whole(tmp_path, monkeypatch):
    """A run killed while it writes a row (here the writer fails half-way) leaves the row as it was
    before, never a half-written .npz that the next run would crash on or take as finished."""
    rows = Rows(tmp_path)
    rows.put("mae-nfull-eps8", np.array([[True, False]]), None, None, {"n": 2})

    def half_written(fh, **arrays):
        fh.write(b"PK\x03\x04 half a row")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez_compressed", half_written)
    with pytest.raises(KeyboardInterrupt):
        rows.put("mae-nfull-eps8", np.array([[False, False]]), None, None, {"n": 3})
    with pytest.raises(KeyboardInterrupt):
        rows.put("mae-nfull-eps1", np.array([[False, False]]), None, None, {"n": 3})
    monkeypatch.undo()
    assert rows.get("mae-nfull-eps8")["meta"] == {"n": 2} and rows.get("mae-nfull-eps1") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mae-nfull-eps8.npz"]


def test_refits_join_a_kept_row_only_from_the_model_it_scored(capsys):
    """Scored again to add refits, a kept row's outcomes may differ on a probe's edge (under 1% of the
    images): kept as they were, and said. More than that is another model: refused."""
    from benchmarks.scale_utility import same_model

    kept = np.zeros((1, 1000), bool)
    edge = kept.copy()
    edge[0, :5] = True
    same_model("mae-nfull-eps8", edge, kept)
    assert "0.50% of its outcomes differ" in capsys.readouterr().out
    other = kept.copy()
    other[0, :20] = True
    with pytest.raises(SystemExit, match="mae-nfull-eps8: scored again, 2.0% .* not the model it scored"):
        same_model("mae-nfull-eps8", other, kept)


def test_rows_are_compressed_to_be_kept_in_the_repository(tmp_path):
    """A row of the full table (5,000 test images, 20 refits) is committed under benchmarks/scale_rows
    so the next machine resumes from it: its 0/1 outcomes are stored compressed, not byte per byte."""
    outcomes = np.random.default_rng(0).random((1, 21, 5000)) < 0.8
    Rows(tmp_path).put("mae-nfull-eps8", outcomes[:, 0], None, outcomes[:, 1:], {"n": 60000})
    assert (tmp_path / "mae-nfull-eps8.npz").stat().st_size < outcomes.nbytes / 4


def test_a_kept_row_takes_more_seeds_after_its_own(tmp_path):
    """--seeds 3 on a kept one-seed row trains seeds 1 and 2 only: the kept seed's outcomes stay as
    they were, first, and a row whose parts do not match (refits on one side only) is refused."""
    rng = np.random.default_rng(0)
    rows = Rows(tmp_path)
    kept = rows.put("caption-nfull-eps8", rng.random((1, 50)) < 0.8, rng.random((1, 50)) < 0.7,
                    rng.random((1, 4, 50)) < 0.8, {"n": 60000, "seconds": 100.0})
    probe, zero, refits = rng.random((2, 50)) < 0.8, rng.random((2, 50)) < 0.7, rng.random((2, 4, 50)) < 0.8
    row = rows.put("caption-nfull-eps8", *with_seeds(kept, probe, zero, refits, 250.0))
    back = rows.get("caption-nfull-eps8")
    assert back["probe"].shape == (3, 50) and back["zero"].shape == (3, 50) and back["refits"].shape == (3, 4, 50)
    assert np.array_equal(back["probe"][0], kept["probe"][0]) and np.array_equal(back["probe"][1:], probe)
    assert np.array_equal(back["refits"][1:], refits) and back["meta"]["seconds"] == row["meta"]["seconds"] == 350.0
    with pytest.raises(SystemExit, match="refits"):
        with_seeds(kept, probe, zero, None, 250.0)


def test_a_kept_dp_row_that_drew_fp32_noise_is_trained_again(tmp_path):
    """A DP row kept before rows recorded the noise's edge drew torch's fp32 normals: its δ did not
    hold, so it is trained again; its ε = ∞ twin, and a row that drew dp-train's noise, are kept."""
    rows, outcome = Rows(tmp_path), np.ones((1, 5), bool)
    old = rows.put("mae-nfull-eps8", outcome, None, None, {"n": 60000})
    new = rows.put("mae-nfull-eps1", outcome, None, None, {"n": 60000, "noise_edge": NOISE_EDGE})
    nonprivate = rows.put("mae-nfull-epsinf", outcome, None, None, {"n": 60000})
    assert usable(old, "mae-nfull-eps8", 8.0) is None and usable(old, "mae-nfull-eps8", 8.0, reuse_fp32=True) is old
    assert usable(new, "mae-nfull-eps1", 1.0) is new and usable(nonprivate, "mae-nfull-epsinf", math.inf) is nonprivate
    params = load_params(str(ROOT / "params.yaml"), [*RECIPE, *SCHEDULES["mae"], "dp.objective=mae", "dp.epsilon=8"])
    assert schedule(params, 60000, 8.0)["noise_edge"] == NOISE_EDGE  # what a new row records


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_noise_per_coordinate_falls_with_n_per_example_but_not_per_batch(objective):
    """The scaling figure's second panel: at fixed q and T, σ barely moves (δ = 1/2n does), so per-example noise on the
    averaged gradient (σC/B) falls 10x from 6k to 60k; Dp-CLIP's clipped batch mean carries 2σC at every n."""
    params = load_params(str(ROOT / "params.yaml"), [*RECIPE, *SCHEDULES[objective], f"dp.objective={objective}",
                                                          "dp.epsilon=8"])
    small, full = (schedule(size_params(params, size, 60000), n, 8.0) for size, n in (("6000", 6000), (FULL, 60000)))
    assert small["sigma"] == pytest.approx(full["sigma"], rel=0.1)  # only δ = 1/2n moves it
    ratio = (small["noise_per_coordinate"] / full["noise_per_coordinate"]) / (small["sigma"] / full["sigma"])
    if objective == "clip":
        assert ratio == pytest.approx(1.0, rel=1e-6)
        assert full["noise_per_coordinate"] == pytest.approx(2 * full["sigma"] * params["dp"]["clip_norm"])
    else:
        assert ratio == pytest.approx(10.0, rel=0.01)
        assert full["noise_per_coordinate"] == pytest.approx(full["sigma"] * params["dp"]["clip_norm"] / params["dp"]["expected_batch_size"])
    assert schedule(params, 60000, math.inf)["noise_per_coordinate"] == 0.0


def test_one_figure_from_several_runs(tmp_path):
    """Each objective's own schedule is its own recipe (its own run); --figure-from draws them together."""
    def output(obj, noise):
        rows = [{"objective": None, "init": "synthetic", "epsilon": None, "n": None}]
        rows += [{"objective": obj, "epsilon": 8.0, "n": n, "batch": n // 60, "steps": 300, "noise_per_coordinate": noise(n),
                  "gain_over_synthetic": {"diff": 0.01, "ci": [0.0, 0.02]}} for n in (2000, 60000)]
        rows.append({**rows[-1], "epsilon": "inf"})  # a twin at one n only: not drawn
        path = tmp_path / f"{obj}.out"
        stale = [{k: v for k, v in r.items() if k != "noise_per_coordinate"} for r in rows]  # a run before, resumed
        path.write_text("".join(json.dumps({"benchmark": "scale_utility", "rows": r}) + "\nprogress lines\n"
                                for r in (stale, rows)))
        return path

    outputs = [output("mae", lambda n: 60 / n), output("clip", lambda n: 1.2)]
    combined_figure(outputs, tmp_path / "fig")
    assert (tmp_path / "fig" / "scaling.png").stat().st_size > 10_000
    (tmp_path / "empty.out").write_text("killed before the end\n")
    with pytest.raises(SystemExit, match="empty.out: no scale_utility JSON line"):
        combined_figure([outputs[0], tmp_path / "empty.out"], tmp_path / "fig")


def test_the_report_prints_the_table_and_one_json_line_with_refit_intervals(tmp_path, capsys):
    """What a run ends with, from kept rows: the JSON line's intervals are the refit ones, and the
    exit code says whether every target passed."""
    weak, strong = outcomes()
    meta = {"n": 59876, "batch": 1024, "steps": 600, "sigma": 0.7, "sigma_over_b": 6.8e-4,
            "noise_per_coordinate": 5.1e-4, "epsilon_spent": 7.99, "seconds": 10.0}  # n: the usable count
    t = {"pixels": {"probe": weak, "zero": None, "refits": np.stack([weak] * 4, axis=1), "meta": {}},
         "synthetic": {"probe": weak, "zero": None, "refits": np.stack([weak] * 4, axis=1), "meta": {}},
         f"caption-n{FULL}-eps8": {"probe": strong, "zero": strong, "meta": meta,
                                   "refits": np.stack([strong, weak, strong, weak], axis=1)}}
    args = argparse.Namespace(objectives=["caption"], seeds=1, probe_refits=4)
    with pytest.raises(SystemExit) as exit_code:
        report(t, args, [8.0], [FULL], 0.1, 400, tmp_path, 1.0, "cpu", "fashion-mnist", {})
    printed = capsys.readouterr().out
    out = json.loads(printed.strip().splitlines()[-1])
    row = next(r for r in out["rows"] if r["objective"] == "caption")
    assert out["probe_refits"] == 4 and row["n"] == 59876 and row["sigma_over_b"] == 6.8e-4
    assert row["noise_per_coordinate"] == 5.1e-4 and row["noise_over_run"] == pytest.approx(5.1e-4 / math.sqrt(600))
    assert row["seeds"] == 1 and out["chance"] == 0.1 and row["batch"] == 1024 and row["steps"] == 600
    assert row["fp32_noise"] and "fp32 noise: ε not at its δ" in printed  # its meta records no noise edge
    refit = difference_ci(strong, weak, refits_a=t[f"caption-n{FULL}-eps8"]["refits"], refits_b=t["synthetic"]["refits"])
    plain = difference_ci(strong, weak)
    assert row["gain_over_synthetic"]["ci"] == [round(x, 4) for x in refit["ci"]]
    assert refit["ci"][1] - refit["ci"][0] > 2 * (plain["ci"][1] - plain["ci"][0])  # half the refits gain nothing
    assert out["targets"] == {"a_caption_eps8_above_synthetic": True, "d_best_vs_pixels": True,
                              "d_best_dp_vs_pixels": True, "e_caption_zero_shot_3x_chance": True}
    assert exit_code.value.code == 0
    assert (tmp_path / "scaling.png").exists()
    t[f"caption-n{FULL}-eps8"].update(probe=weak, refits=np.stack([weak] * 4, axis=1))  # no gain: target a fails
    with pytest.raises(SystemExit) as exit_code:
        report(t, args, [8.0], [FULL], 0.1, 400, tmp_path, 1.0, "cpu", "fashion-mnist", {})
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not out["targets"]["a_caption_eps8_above_synthetic"] and out["targets"]["e_caption_zero_shot_3x_chance"]
    assert exit_code.value.code == 1


def test_a_scaling_point_with_its_no_dp_twin_reports_what_privacy_costs_there(tmp_path, capsys):
    """--scaling-epsilons 8 inf: each point's twin is reported beside it, and the twin minus the DP row,
    paired image by image, is what privacy costs at that n (here the twin is right wherever DP is)."""
    weak, strong = outcomes()
    meta = {"n": 2000, "batch": 34, "steps": 1200, "sigma": 0.8, "sigma_over_b": 2.4e-2, "noise_per_coordinate": 2.4e-2,
            "epsilon_spent": 8.0, "seconds": 1.0, "noise_edge": NOISE_EDGE}
    t = {name: {"probe": probe, "zero": None, "refits": None, "meta": m} for name, probe, m in (
        ("pixels", weak, {}), ("synthetic", weak, {}), ("mae-n2000-eps8", weak, meta),
        ("mae-n2000-epsinf", strong, {**{k: v for k, v in meta.items() if k != "noise_edge"}, "sigma": 0.0,
                                      "sigma_over_b": 0.0, "noise_per_coordinate": 0.0}),
        (f"mae-n{FULL}-eps8", strong, {**meta, "n": 60000}))}
    args = argparse.Namespace(objectives=["mae"], seeds=1, probe_refits=0)
    with pytest.raises(SystemExit):
        report(t, args, [8.0], ["2000", FULL], 0.1, 400, tmp_path, 1.0, "cpu", "fashion-mnist", {})
    printed = capsys.readouterr().out
    rows = {r["epsilon"]: r for r in json.loads(printed.strip().splitlines()[-1])["rows"] if r["n"] == 2000}
    price = difference_ci(strong, weak)
    assert price["diff"] > 0.1 and rows[8.0]["price_of_privacy"]["diff"] == pytest.approx(price["diff"], abs=1e-4)
    assert rows[8.0]["price_of_privacy"]["ci"] == [round(x, 4) for x in price["ci"]]
    assert "price_of_privacy" not in rows["inf"]
    assert not rows[8.0]["fp32_noise"] and not rows["inf"]["fp32_noise"]  # a twin draws no noise to check
    assert f"privacy costs {100 * price['diff']:+.1f}" in printed and "ε=∞" in printed


def test_rows_set_against_another_recipes_kept_rows_pair_image_by_image(tmp_path):
    """--against: a trained row minus the same row of another recipe, paired (refits only where both
    rows have as many); untrained rows and rows the other recipe never ran are left out."""
    weak, strong = outcomes()
    other = Rows(tmp_path / "other")
    name = f"mae-n{FULL}-eps8"
    other.put(name, weak, None, np.stack([weak] * 3, axis=1), {})
    other.put("synthetic", weak, None, None, {})
    rows = {name: {"probe": strong, "refits": np.stack([strong, weak, strong], axis=1)},
            f"mae-n{FULL}-epsinf": {"probe": strong, "refits": None},
            "synthetic": {"probe": strong, "refits": None}}
    out = against(rows, other)
    assert set(out) == {name}
    expected = difference_ci(strong, weak, refits_a=rows[name]["refits"], refits_b=np.stack([weak] * 3, axis=1))
    assert out[name]["diff"] == round(expected["diff"], 4) > 0 and out[name]["refits"]
    assert out[name]["ci"] == [round(x, 4) for x in expected["ci"]]
    rows[name]["refits"] = rows[name]["refits"][:, :2]  # another refit count: paired on images and seeds alone
    plain = against(rows, other)[name]
    assert not plain["refits"] and plain["ci"] == [round(x, 4) for x in difference_ci(strong, weak)["ci"]]
    assert against(rows, Rows(tmp_path / "never-run")) == {}


def test_recipes_that_differ_only_in_the_dp_schedule_share_their_untrained_rows():
    """pixels, random init and the warm start do not depend on the DP schedule: one copy serves
    every such recipe (MAE's and the captioner's), while another model or another eval protocol gets its own."""
    from benchmarks.scale_utility import recipe_id, untrained_id

    def params(*extra):
        return load_params(str(ROOT / "params.yaml"), [*RECIPE, *SCHEDULES["mae"], *extra])

    base = params()
    for dp_only in (params("dp.steps=100"), params("dp.expected_batch_size=512"), params("dp.epsilon=1"),
                    params("model.caption_mask_ratio=0.5")):  # a knob of the captioner's training alone
        assert untrained_id(dp_only) == untrained_id(base) and recipe_id(dp_only) != recipe_id(base)
    for other in (params("model.size=pico"), params("evaluate.pool=cls"), params("pretrain.steps=10"),
                  params("synthetic.num_programs=200"), params("shards.eval_fraction=0.2")):
        assert untrained_id(other) != untrained_id(base) and recipe_id(other) != recipe_id(base)
    for privacy in (params("privacy.adjacency=add_remove"), params("dp.delta=1e-6")):  # another ε for one σ
        assert recipe_id(privacy) != recipe_id(base)
    assert untrained_id(params("evaluate.probe_refits=3")) == untrained_id(base)  # the rows keep their own
    # How the numbers are computed is not the recipe: a GPU run's workers and micro-batch keep its rows.
    how = params("dp.data_workers=12", "dp.physical_batch_size=1024", "pretrain.data_workers=4", "dp.compile=true")
    assert recipe_id(how) == recipe_id(base) and untrained_id(how) == untrained_id(base)


def test_a_dir_whose_warm_start_another_recipe_made_is_refused_by_name(tmp_path):
    """DIR makes its warm start once: a 224 px recipe run in a 32 px DIR would read it (and crash deep in
    load_state_dict, or train on 32 px shaders). How it was made, and knobs added since, are no reason."""
    from benchmarks.scale_utility import check_warm_start

    def params(*extra):
        return load_params(str(ROOT / "params.yaml"), [*RECIPE, *SCHEDULES["mae"], *extra])

    made = params()
    for same in (params("pretrain.data_workers=4", "synthetic.workers=8", "model.caption_mask_ratio=0.5"),
                 params("dp.steps=9")):
        check_warm_start(made, same, tmp_path)
    older = {s: dict(made[s]) for s in made}
    del older["model"]["public_negatives"]  # a warm start made before the knob existed
    check_warm_start(older, params("model.public_negatives=64"), tmp_path)
    for other, named in ((("model.img_size=224", "model.patch_size=16"), "model.img_size: 32 there, 224 here"),
                         (("synthetic.resolution=224",), "synthetic.resolution"),
                         (("pretrain.steps=7",), "pretrain.steps")):
        with pytest.raises(SystemExit, match=f"{tmp_path}'s warm start was made for another recipe .*{named}"):
            check_warm_start(made, params(*other), tmp_path)


@pytest.mark.parametrize("knob, value", [("encoder_clip_share", "0.5"), ("mask_views", "2"), ("ema_decay", "0.995"),
                                         ("frozen", "[encoder.blocks.3]")])
def test_a_knob_added_later_keeps_the_rows_at_its_neutral_value_only(knob, value):
    """Adding a dp knob (at its neutral value: what the recipe did before it existed) left every
    recipe id as it was; setting it is another recipe."""
    import copy

    from benchmarks.scale_utility import recipe_id

    base = load_params(str(ROOT / "params.yaml"), [*RECIPE, *SCHEDULES["mae"]])
    before = copy.deepcopy(base)
    del before["dp"][knob]  # the params as they were before the knob
    assert recipe_id(base) == recipe_id(before)
    changed = load_params(str(ROOT / "params.yaml"), [*RECIPE, *SCHEDULES["mae"], f"dp.{knob}={value}"])
    assert recipe_id(changed) != recipe_id(base)


# README's scale table, checked against the committed rows it was printed from: a figure edited by
# hand, or a row re-run without the table following, fails here.
README_LABELS = {"raw pixels": "pixels", "random init": "random", "synthetic only": "synthetic",  # first match wins
                 "MAE": "mae", "captioner": "caption", "public captions": "clip-public", "CLIP": "clip"}
SEEDS_IN_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5}
PERCENT_CI = re.compile(r"([\d.]+)% \(([\d.]+)–([\d.]+)\)")
GAIN_CI = re.compile(r"([+−-][\d.]+) \(([+−-][\d.]+) to ([+−-][\d.]+)\)")


def number(text: str) -> float:
    return float(text.replace("−", "-"))


UNTRAINED = ("pixels", "random", "synthetic")


def kept_row(name: str, objective: str) -> dict | None:
    """The committed row `name`, or None; where several recipes keep one, the folder the benchmark
    itself reads for `objective` (the untrained rows: any objective's, they are shared)."""
    base = ROOT / "benchmarks" / "scale_rows"
    found = sorted(base.glob(f"*/{name}.npz"))
    if len(found) > 1:
        untrained, trained = rows_folders(objective)
        found = [p for p in found if p.parent.name == (untrained if name in UNTRAINED else trained)]
    return Rows(found[0].parent).get(name) if len(found) == 1 else None


@functools.cache
def rows_folders(objective: str) -> tuple[str, str]:
    """The folders the benchmark keeps `objective`'s untrained and trained rows in (reading params.yaml
    once, not once a row)."""
    params = load_params(str(ROOT / "params.yaml"), [*RECIPE, *SCHEDULES[objective]])
    return untrained_id(params), recipe_id(params)


def readme_scale_section(text: str) -> str:
    return text.split("## Results at scale", 1)[1].split("\n## ", 1)[0]


def readme_scale_rows(text: str) -> list[list[str]]:
    lines = [line for line in readme_scale_section(text).splitlines() if line.startswith("| ") and "---" not in line]
    return [[cell.strip().replace("**", "") for cell in line.strip("|").split("|")] for line in lines[1:]]


def as_printed(value: float, text: str) -> float:
    """`value` rounded the way `text` prints it: to its decimals, or to its mantissa in 5.8e-4 form."""
    if "e" in text:
        return float(f"{value:.{len(text.split('e')[0].split('.')[-1])}e}")
    return round(value, len(text.split(".")[1]) if "." in text else 0)


def noise_mismatches(label: str, sigma_text: str, noise_text: str, meta: dict) -> list[str]:
    """σ and the noise per averaged coordinate (σ/B, or Dp-CLIP's 2σC) as the kept row's run drew them."""
    wrong = []
    noise_text = noise_text.removeprefix("2σC = ")
    for column, printed, value in (("σ", sigma_text, meta["sigma"]), ("σ/B", noise_text, meta["noise_per_coordinate"])):
        if number(printed) != as_printed(value, printed):
            wrong.append(f"{label}: {column} {printed} against {value:.4g}")
    return wrong


def scale_table_mismatches(text: str) -> list[str]:
    """Every figure of README's scale table that the committed rows do not give (rounded as printed)."""
    wrong = []
    synthetic = kept_row("synthetic", "mae")
    for label, eps_text, sigma_text, noise_text, acc_text, gain_text in readme_scale_rows(text):
        objective = next((v for k, v in README_LABELS.items() if k in label), None)
        assert objective is not None, f"README scale table: no row for {label!r}"
        if objective in UNTRAINED:
            name, objective = objective, "mae"
        else:
            name = f"{objective}-n{FULL}-eps{eps_text.replace('∞', 'inf')}"
        row = kept_row(name, objective)
        if row is None:
            wrong.append(f"{label}: no one kept row {name} under benchmarks/scale_rows")
            continue
        if name not in UNTRAINED and eps_text != "∞" and "noise_edge" not in row["meta"] and "fp32 noise" not in label:
            wrong.append(f"{label}: drew fp32 noise (its ε does not hold at its δ) and does not say so")
        if name not in UNTRAINED:
            wrong += noise_mismatches(label, sigma_text, noise_text, row["meta"])
        seeds = re.search(r"\((\w+) seeds?\)", label)
        if seeds and SEEDS_IN_WORDS[seeds.group(1)] != len(row["probe"]):
            wrong.append(f"{label}: {len(row['probe'])} kept seeds")
        acc, lo, hi = map(number, PERCENT_CI.search(acc_text).groups())
        ci = probe_ci(row)
        if max(abs(acc - 100 * row["probe"].mean()), abs(lo - 100 * ci[0]), abs(hi - 100 * ci[1])) > 0.051:
            wrong.append(f"{label}: {acc_text} against {100 * row['probe'].mean():.1f}% "
                         f"({100 * ci[0]:.1f}–{100 * ci[1]:.1f})")
        zero = re.search(r"zero-shot ([\d.]+)%", acc_text)
        if zero and abs(number(zero.group(1)) - 100 * row["zero"].mean()) > 0.051:
            wrong.append(f"{label}: zero-shot {zero.group(1)}% against {100 * row['zero'].mean():.1f}%")
        if gain_text:
            gain = paired_gain(row, synthetic)
            printed = list(map(number, GAIN_CI.search(gain_text).groups()))
            if max(abs(p - 100 * g) for p, g in zip(printed, [gain["diff"], *gain["ci"]])) > 0.051:
                wrong.append(f"{label}: gain {gain_text} against {100 * gain['diff']:+.1f} "
                             f"({100 * gain['ci'][0]:+.1f} to {100 * gain['ci'][1]:+.1f})")
    return wrong


def test_the_readme_scale_table_is_what_the_committed_rows_give(monkeypatch):
    text = (ROOT / "README.md").read_text()
    assert len(readme_scale_rows(text)) >= 9  # pixels, random, synthetic and the trained rows
    assert scale_table_mismatches(text) == []
    # The check can fail: one figure moved by a tenth, or a seed count that is not the rows', is caught.
    first_gain_moved = re.sub(r"\| \+(\d)\.(\d) \(", lambda m: f"| +{m[1]}.{(int(m[2]) + 1) % 10} (", text, count=1)
    assert any("gain" in m for m in scale_table_mismatches(first_gain_moved))
    assert any("kept seeds" in m for m in scale_table_mismatches(re.sub(r"\(two seeds\)", "(one seed)", text, count=1)))
    # ... and so is a σ or σ/B the run did not draw: MAE's 1.1977 / 2,048 = 5.85e-4 prints as 5.8e-4, not
    # as σ rounded first (1.20 / 2,048 = 5.9e-4), and Dp-CLIP's 2σC is checked beside its σ.
    assert any("σ/B 5.9e-4" in m for m in scale_table_mismatches(text.replace("| 5.8e-4 |", "| 5.9e-4 |", 1)))
    assert any("σ 0.46" in m for m in scale_table_mismatches(text.replace("| 0.44 | 2σC", "| 0.46 | 2σC", 1)))
    assert any("σ/B 0.91" in m for m in scale_table_mismatches(text.replace("2σC = 0.89", "2σC = 0.91", 1)))
    # ... and so is a row that drew fp32 noise without saying so: a kept row without its noise's edge
    def without_edge(name, objective, kept=kept_row):
        row = kept(name, objective)
        if name == f"mae-n{FULL}-eps8":
            row = {**row, "meta": {k: v for k, v in row["meta"].items() if k != "noise_edge"}}
        return row
    monkeypatch.setitem(globals(), "kept_row", without_edge)
    assert any("drew fp32 noise" in m for m in scale_table_mismatches(text))


# README's scaling sentence, checked against the committed scaling points (ε = 8): a gain that is said
# to grow must grow, and the figure's hollow (fp32-noise) points are named exactly when there are some.
SCALING_SIZES = ("2000", "6000", "20000", FULL)
SIGNED = r"([+−-][\d.]+)"


def scaling_points(objective: str) -> list[dict]:
    return [kept_row(f"{objective}-n{size}-eps8", objective) for size in SCALING_SIZES]


def scaling_gains(objective: str, eps: str = "8") -> list[float]:
    """Each scaling point's gain over synthetic-only, in points, paired."""
    synthetic = kept_row("synthetic", "mae")
    return [100 * paired_gain(kept_row(f"{objective}-n{size}-eps{eps}", objective), synthetic)["diff"]
            for size in SCALING_SIZES]


def prices_of_privacy(objective: str, sizes=SCALING_SIZES) -> list[float]:
    """What privacy costs at each point, in points: its no-DP twin minus DP at ε = 8, paired."""
    return [100 * paired_gain(kept_row(f"{objective}-n{size}-epsinf", objective),
                              kept_row(f"{objective}-n{size}-eps8", objective))["diff"] for size in sizes]


def scaling_sentence_mismatches(text: str) -> list[str]:
    wrong = []
    gains = {obj: scaling_gains(obj) for obj in ("caption", "mae")}
    caption = re.search(rf"the captioner's gain grows from {SIGNED} to {SIGNED}, its zero-shot from (\d+)% to (\d+)%", text)
    if caption is None:
        return ["README: no sentence on the captioner's scaling points"]
    zero = [100 * row["zero"].mean() for row in scaling_points("caption")]
    printed = [number(caption.group(i)) for i in range(1, 5)]
    if max(abs(printed[0] - gains["caption"][0]), abs(printed[1] - gains["caption"][-1])) > 0.051:
        wrong.append(f"captioner's gain {printed[:2]} against {gains['caption'][0]:+.1f} to {gains['caption'][-1]:+.1f}")
    if max(abs(printed[2] - zero[0]), abs(printed[3] - zero[-1])) > 0.51:
        wrong.append(f"captioner's zero-shot {printed[2:]} against {zero[0]:.0f}% to {zero[-1]:.0f}%")
    if any(b <= a for a, b in zip(gains["caption"], gains["caption"][1:])):
        wrong.append(f"captioner's gain does not grow with n: {[round(g, 1) for g in gains['caption']]}")
    # MAE's four points, n by n, and whether they are said to grow: only if each is above the one before.
    mae = re.search(rf"MAE's (grows|does not grow cleanly), {', '.join([SIGNED] * 4)}, (\w+) seeds? each below 60,000 "
                    "for both", text)
    if mae is None or max(abs(number(p) - g) for p, g in zip(mae.groups()[1:5], gains["mae"])) > 0.051:
        wrong.append(f"MAE's scaling points read {', '.join(f'{g:+.1f}' for g in gains['mae'])}")
    elif (mae.group(1) == "grows") != all(b > a for a, b in zip(gains["mae"], gains["mae"][1:])):
        wrong.append(f"MAE's gain, said to be '{mae.group(1)}', reads {[round(g, 1) for g in gains['mae']]}")
    else:  # "for both": the captioner's points as well as MAE's
        below = [row for obj in ("caption", "mae") for row in scaling_points(obj)[:-1]]
        if {len(row["probe"]) for row in below} != {SEEDS_IN_WORDS.get(mae.group(6))}:
            wrong.append(f"the scaling points below 60,000 keep {[len(row['probe']) for row in below]} seeds")
    fp32 = [f"{obj} n = {size}" for obj in ("caption", "mae", "clip", "clip-public")
            for size, row in zip(SCALING_SIZES, scaling_points(obj)) if "noise_edge" not in row["meta"]]
    if bool(fp32) != ("hollow" in readme_scale_section(text)):
        wrong.append(f"README's hollow points do not match the fp32-noise scaling points {fp32}")
    return wrong


def test_the_readme_scaling_sentence_is_what_the_committed_scaling_points_give(monkeypatch):
    text = (ROOT / "README.md").read_text()
    assert scaling_sentence_mismatches(text) == []
    # The check can fail: a figure that is not the rows', a point trained again that no longer grows,
    # or a point that drew fp32 noise while README names no hollow point.
    assert any("zero-shot" in m for m in scaling_sentence_mismatches(text.replace("its zero-shot from ", "its zero-shot from 1", 1)))
    assert any("MAE's scaling" in m for m in scaling_sentence_mismatches(text.replace("cleanly, ", "cleanly, +9.9, ", 1)))
    assert any("said to be 'grows'" in m for m in scaling_sentence_mismatches(text.replace("does not grow cleanly", "grows", 1)))
    assert any("keep" in m for m in scaling_sentence_mismatches(text.replace("+1.4, two seeds each", "+1.4, three seeds each", 1)))
    def changed(name, objective, kept=kept_row):
        row = kept(name, objective)
        if name == "caption-n20000-eps8":
            row = {**row, "probe": np.zeros_like(row["probe"])}
        if name == "mae-n6000-eps8":
            row = {**row, "meta": {k: v for k, v in row["meta"].items() if k != "noise_edge"}}
        if name == "caption-n2000-eps8":
            row = {**row, **{k: row[k][:1] for k in ("probe", "zero", "refits") if k in row}}
        return row
    monkeypatch.setitem(globals(), "kept_row", changed)
    assert any("does not grow" in m for m in scaling_sentence_mismatches(text))
    assert any("hollow" in m for m in scaling_sentence_mismatches(text))
    # ... and a captioner's point cut to one seed fails the sentence's "two seeds ... for both"
    assert any("keep [1, 2, 2, 2, 2, 2] seeds" in m for m in scaling_sentence_mismatches(text))


# README's sentence on the no-DP twins along n, checked against the committed twins: the captioner's
# twin's gain at the ends, and the range of what privacy costs (twin minus DP, paired) from 6,000 on.
def twin_sentence_mismatches(text: str) -> list[str]:
    found = re.search(rf"twins \(dashed\) grow too, the captioner's from {SIGNED} to {SIGNED}: what privacy costs, "
                      rf"twin minus DP, stays\s+{SIGNED} to {SIGNED} points from n = 6,000 to 60,000", text)
    if found is None:
        return ["README: no sentence on the no-DP twins along n"]
    printed = [number(found.group(i)) for i in range(1, 5)]
    twin = scaling_gains("caption", "inf")
    price = prices_of_privacy("mae", SCALING_SIZES[1:]) + prices_of_privacy("caption", SCALING_SIZES[1:])
    wrong = []
    if max(abs(printed[0] - twin[0]), abs(printed[1] - twin[-1])) > 0.051:
        wrong.append(f"the captioner's twin reads {twin[0]:+.1f} to {twin[-1]:+.1f}")
    if max(abs(printed[2] - min(price)), abs(printed[3] - max(price))) > 0.051:
        wrong.append(f"what privacy costs reads {min(price):+.1f} to {max(price):+.1f}")
    # The twins clipped without noise: their own recipes, so their own folders of rows. Each is said to
    # read above, level with or below its unclipped twin: the paired interval above 0, around it, below.
    verdict_words = r"(above|level with|below)"
    said = re.search(rf"clipped without noise, the\s+captioner's twin reads ([\d.]+)%, {verdict_words} the\s+unclipped "
                     rf"one,\s+and\s+MAE's ([\d.]+)%, {verdict_words}\s+its own", text)
    for obj, group in (("caption", 1), ("mae", 3)):
        params = load_params(str(ROOT / "params.yaml"), [*RECIPE, *SCHEDULES[obj], "dp.nonprivate_clipped=true"])
        clipped = Rows(ROOT / "benchmarks" / "scale_rows" / recipe_id(params)).get(f"{obj}-n{FULL}-epsinf")
        low, high = paired_gain(clipped, kept_row(f"{obj}-n{FULL}-epsinf", obj))["ci"] if clipped else (0, 0)
        verdict = "above" if low > 0 else "below" if high < 0 else "level with"
        if clipped is None or said is None or abs(float(said.group(group)) - 100 * clipped["probe"].mean()) > 0.051 \
                or verdict != said.group(group + 1):
            wrong.append(f"the {obj} clipped twin's sentence is not what its kept row gives")
    return wrong


def test_the_readme_twin_sentence_is_what_the_committed_twins_give():
    text = (ROOT / "README.md").read_text()
    assert twin_sentence_mismatches(text) == []
    def moved(pattern: str, new: str) -> list[str]:
        return twin_sentence_mismatches(re.sub(pattern, new, text, count=1))
    assert any("twin reads" in m for m in moved(rf"captioner's from {SIGNED}", "captioner's from +9.9"))
    assert any("privacy costs" in m for m in moved(rf"to {SIGNED} points from n = 6,000", "to +9.9 points from n = 6,000"))
    assert any("caption clipped twin" in m for m in moved(r"twin reads [\d.]+%", "twin reads 99.9%"))
    # ... and so is a verdict the paired interval does not give
    assert any("caption clipped twin" in m for m in moved(r"reads ([\d.]+)%, level with the", r"reads \1%, above the"))
    assert any("mae clipped twin" in m for m in moved(r"MAE's [\d.]+%, ", "MAE's 99.9%, "))


# docs/results.md's "Where it stands" restates the scaling points, the twins and the price of privacy
# for readers who skip README: held to the same committed rows, point by point.
def results_summary_figures() -> dict:
    """What results.md's summary says, from the committed rows: computed once for the checks of every
    moved text (each is 24 paired bootstraps)."""
    return {"caption": scaling_gains("caption"), "mae": scaling_gains("mae"), "clip": scaling_gains("clip"),
            "zero": [100 * kept_row(f"caption-n{size}-eps8", "caption")["zero"].mean() for size in SCALING_SIZES],
            "twin": scaling_gains("caption", "inf"), "mae_price": prices_of_privacy("mae"),
            "caption_price": prices_of_privacy("caption"),
            "full": [100 * kept_row(f"{obj}-n{FULL}-epsinf", obj)["probe"].mean() for obj in ("caption", "mae", "clip")]}


def results_summary_mismatches(text: str, figures: dict) -> list[str]:
    section = text.split("### Where it stands", 1)[1].split("\n### ", 1)[0]

    def off(printed, given, tolerance=0.051) -> bool:
        return len(printed) != len(given) or max(abs(number(p) - g) for p, g in zip(printed, given)) > tolerance

    four, four_percent = ", ".join([SIGNED] * 4), ", ".join([r"(\d+)%"] * 4)
    wrong = []
    points = re.search(rf"the captioner's gain grows {four},\s+its zero-shot {four_percent}; "
                       rf"MAE's reads {four}", section)
    if points is None:
        return ["results.md: no sentence on the scaling points in 'Where it stands'"]
    for what, printed, given, tolerance in (("captioner's gains", points.groups()[:4], figures["caption"], 0.051),
                                            ("captioner's zero-shot", points.groups()[4:8], figures["zero"], 0.51),
                                            ("MAE's gains", points.groups()[8:], figures["mae"], 0.051)):
        if off(printed, given, tolerance):
            wrong.append(f"{what} {list(printed)} against {[round(g, 1) for g in given]}")
    clip, clip_gains = re.search(rf"CLIP's stays flat \({SIGNED} to {SIGNED}", section), figures["clip"]
    if clip is None or off(clip.groups(), [min(clip_gains), max(clip_gains)]):
        wrong.append(f"CLIP's gains read {min(clip_gains):+.1f} to {max(clip_gains):+.1f}")
    twins = re.search(rf"no-DP twin grows with n as well \(the captioner's {SIGNED} to {SIGNED}\).*?"
                      rf"{SIGNED} to {SIGNED} points for MAE,\s+{SIGNED} to {SIGNED} for the\s+captioner", section, re.S)
    if twins is None:
        return wrong + ["results.md: no sentence on the twins and the price of privacy in 'Where it stands'"]
    twin, mae_price, caption_price = figures["twin"], figures["mae_price"], figures["caption_price"]
    for what, printed, given in (("captioner's twin", twins.groups()[:2], [twin[0], twin[-1]]),
                                 ("MAE's price", twins.groups()[2:4], [min(mae_price), max(mae_price)]),
                                 ("captioner's price", twins.groups()[4:], [min(caption_price), max(caption_price)])):
        if off(printed, given):
            wrong.append(f"{what} {list(printed)} against {[round(g, 1) for g in given]}")
    full = re.search(r"the ε = ∞ twins read ([\d.]+)% \(captioner\), ([\d.]+)% \(MAE\) and ([\d.]+)% \(CLIP\)", section)
    accuracies = figures["full"]
    if full is None or off(full.groups(), accuracies):
        wrong.append(f"the ε = ∞ twins at 60,000 read {[round(a, 1) for a in accuracies]}")
    return wrong


def test_the_results_summary_is_what_the_committed_rows_give():
    text, figures = (ROOT / "docs" / "results.md").read_text(), results_summary_figures()
    assert results_summary_mismatches(text, figures) == []
    # The check can fail: each kind of figure, moved, is caught by name.
    section = text.split("### Where it stands", 1)[1].split("\n### ", 1)[0]
    def moved(pattern: str, new: str) -> list[str]:
        return results_summary_mismatches(text.replace(section, re.sub(pattern, new, section, count=1)), figures)
    assert any("captioner's gains" in m for m in moved(rf"grows {SIGNED},", "grows +9.9,"))
    assert any("zero-shot" in m for m in moved(r"zero-shot (\d+)%", "zero-shot 99%"))
    assert any("MAE's gains" in m for m in moved(rf"MAE's reads {SIGNED},", "MAE's reads +9.9,"))
    assert any("CLIP's gains" in m for m in moved(rf"flat \({SIGNED} to", "flat (+9.9 to"))
    assert any("captioner's twin" in m for m in moved(rf"\(the captioner's {SIGNED} to", "(the captioner's +9.9 to"))
    assert any("MAE's price" in m for m in moved(rf"{SIGNED} to {SIGNED} points for MAE", "+9.9 to +9.9 points for MAE"))
    assert any("captioner's price" in m for m in moved(rf"{SIGNED} to {SIGNED} for the(\s+)captioner", r"+9.9 to +9.9 for the\3captioner"))
    assert any("ε = ∞ twins" in m for m in moved(r"([\d.]+)% \(MAE\)", "99.9% (MAE)"))
