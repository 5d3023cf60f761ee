"""benchmarks/scale_utility.py run whole, as a GPU lease runs it: every objective's rows trained and
scored with the logreg probe on the device route (device_logreg, taken here on the CPU), stopped by a
fault in a training and run again, which trains and scores only what was not finished."""

import json
import sys

import pytest

from benchmarks import scale_utility
from pipeline.eval import device_logreg, probe
from pipeline.privacy import training

# The 224 px table's recipe (model.img_size 224, patch 16, shader images at 224 px), shrunk to seconds:
# digits, a micro ViT, a few steps.
TINY = ["shards.source=digits", "shards.eval_fraction=0.3", "evaluate.sets=[{name: digits, source: digits}]",
        "model.size=micro", "model.img_size=224", "model.patch_size=16", "synthetic.resolution=224",
        "synthetic.num_programs=20", "synthetic.frames_per_program=2", "pretrain.steps=4", "dp.steps=3",
        "dp.expected_batch_size=64", "dp.eval_every=3", "dp.warmup_steps=1", "dp.checkpoint_every=2",
        # A known sampling key: the batch sizes, and so verify's Binomial test at α, are the same every run.
        "privacy.testing=true", "dp.noise_seed=11"]
REFITS = 2


class Stopped(Exception):
    """The fault the test sets off in a training."""


def run(work, capsys, objectives=("mae", "caption", "clip"), sizes=("full",), refits=REFITS) -> dict:
    argv = ["scale_utility", "--dir", str(work), "--objectives", *objectives, "--sizes", *sizes,
            "--epsilons", "8", "--probe-refits", str(refits)]
    for knob in TINY:
        argv += ["--set", knob]
    sys.argv = argv
    with pytest.raises(SystemExit) as exited:  # its status says whether the targets were met: on seconds of
        scale_utility.main()                   # training they are not
    assert exited.value.code in (0, 1)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_table_runs_whole_on_the_device_probe_and_resumes_where_a_fault_stopped_it(tmp_path, monkeypatch,
                                                                                         capsys):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(probe, "on_gpu", lambda device: True)
    calls = {"choose_c": 0, "refits": 0, "trained": []}
    choose_c, fit, train_point = device_logreg.choose_c, device_logreg.fit, training.train_point

    def counted_choose_c(*a, **kw):
        calls["choose_c"] += 1
        return choose_c(*a, **kw)

    def counted_fit(*a, rows=None, **kw):
        calls["refits"] += rows is not None
        return fit(*a, rows=rows, **kw)

    def faulty_train_point(params, *a, **kw):
        calls["trained"].append(params["dp"]["objective"])
        if fault["on"] == params["dp"]["objective"]:
            raise Stopped(params["dp"]["objective"])
        return train_point(params, *a, **kw)

    monkeypatch.setattr(device_logreg, "choose_c", counted_choose_c)
    monkeypatch.setattr(device_logreg, "fit", counted_fit)
    monkeypatch.setattr(training, "train_point", faulty_train_point)

    fault = {"on": "clip"}  # the last objective's training: mae's and caption's rows are finished by then
    with pytest.raises(Stopped):
        run(tmp_path, capsys)
    # Every finished row was scored on the device route: pixels, random init, synthetic-only, mae, caption.
    assert calls["choose_c"] == 5 and calls["refits"] == 5
    assert calls["trained"] == ["mae", "caption", "clip"]

    fault["on"] = None
    calls.update(choose_c=0, refits=0, trained=[])
    out = run(tmp_path, capsys)
    assert calls["trained"] == ["clip"], "the second run trains only the row the fault stopped"
    assert calls["choose_c"] == 1 and calls["refits"] == 1, "and scores only that row"

    rows = {(r["objective"], r["init"]): r for r in out["rows"]}
    assert set(rows) == {(None, "pixels"), (None, "random"), (None, "synthetic"),
                         ("mae", "synthetic"), ("caption", "synthetic"), ("clip", "synthetic")}
    assert out["probe_refits"] == REFITS and out["device"] == "cpu"
    for (obj, init), row in rows.items():
        # every row's accuracy well above chance: the device probe fit each one
        assert row["acc"] > 3 * out["chance"], (obj, init, row["acc"])
        lo, hi = row["ci"]
        assert lo <= row["acc"] <= hi
        if obj is not None:
            assert row["epsilon"] == 8 and row["n"] > 0 and row["sigma_over_b"] > 0
            assert row["epsilon_spent"] <= 8 + 1e-9
    for obj in ("caption", "clip"):  # the objectives with zero-shot have it scored
        assert "zero_shot" in rows[(obj, "synthetic")], rows[(obj, "synthetic")]

    # Run again asking for more refits and a smaller private split: the kept rows take the new refits
    # and keep their outcomes (and their training seconds); the smaller split is a point of its own.
    [kept_dir] = {p.parent for p in tmp_path.glob("rows/*/mae-nfull-eps8.npz")}
    before = scale_utility.Rows(kept_dir).get("mae-nfull-eps8")
    out = run(tmp_path, capsys, objectives=["mae"], sizes=["300", "full"], refits=REFITS + 1)
    after = scale_utility.Rows(kept_dir).get("mae-nfull-eps8")
    assert (after["probe"] == before["probe"]).all() and after["meta"] == before["meta"]
    assert after["refits"].shape[1] == REFITS + 1 and (after["refits"].shape[0], after["refits"].shape[2]) == \
        (before["refits"].shape[0], before["refits"].shape[2])
    small = scale_utility.Rows(kept_dir).get("mae-n300-eps8")
    assert small["meta"]["n"] == 300 and small["meta"]["batch"] < before["meta"]["batch"]
    assert small["refits"].shape[1] == REFITS + 1
    by_n = {r["n"]: r for r in out["rows"] if r["objective"] == "mae"}
    assert set(by_n) == {300, before["meta"]["n"]} and before["meta"]["n"] > 300
