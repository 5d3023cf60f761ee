"""The logreg probe solved with torch (a GPU's route) finds scikit-learn's probe: the same optimum,
the same C on the same folds, the same outcomes through the whole probe path."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from pipeline.eval import device_logreg, probe
from pipeline.eval.probe import AUTO_CS, auto_folds, logreg_estimator

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # LogisticRegressionCV's 1.10 attributes


def draw(rng, n: int, d: int, k: int, signal: float = 1.5, dtype=np.float64):
    """Classes shifted apart along k directions, off-centre and on unequal scales, with one constant
    feature (float64 unless asked: scikit-learn keeps float32 features in float32, 1e-4 off the optimum)."""
    y = rng.integers(0, k, n)
    x = rng.normal(size=(n, d)) * rng.uniform(0.5, 3.0, d) + signal * np.eye(k, d)[y] + 4.0
    x[:, -1] = 7.0
    return x.astype(dtype), y


@pytest.mark.parametrize("k,n,d", [(2, 200, 30), (5, 200, 30), (5, 80, 300)], ids=["binary", "n>d", "n<d"])
@pytest.mark.parametrize("c", [0.01, 1.0])
def test_the_device_solver_finds_scikit_learns_optimum(k, n, d, c):
    """Both solved tightly: the class probabilities agree to 1e-5 (a penalised intercept, C read as a
    strength, a softmax of two columns for two classes or unstandardised features each move them by
    more), on the training rows and on new ones, whatever the labels' values."""
    rng = np.random.default_rng(k * n + d)
    x, y = draw(rng, n, d, k)
    new, _ = draw(rng, 100, d, k)
    ours = device_logreg.fit(x, y + 3, c, "cpu", tol=1e-10)
    theirs = make_pipeline(StandardScaler(), LogisticRegression(C=c, tol=1e-12, max_iter=100_000)).fit(x, y + 3)
    for rows in (x, new):
        gap = np.abs(torch.softmax(ours.logits(rows)[0], 1).numpy() - theirs.predict_proba(rows)).max()
        assert gap < 1e-5, gap
        assert np.array_equal(ours.predict(rows), theirs.predict(rows))
    assert ours.C_ == c


def test_a_batch_of_resamples_is_each_resample_fit_alone():
    """Problems in one batch weigh the rows by their resample's counts and standardise on them: each
    one's logits are those of its resample's duplicated rows fit alone, to 1e-6."""
    rng = np.random.default_rng(4)
    x, y = draw(rng, 150, 20, 3)
    picks = [rng.choice(len(x), len(x)) for _ in range(3)]
    counts = np.stack([np.bincount(p, minlength=len(x)) for p in picks])
    probes = device_logreg.fit(x, y, 0.5, "cpu", rows=counts, tol=1e-10)
    batch = probes.logits(x)
    for j, p in enumerate(picks):
        alone = device_logreg.fit(x[p], y[p], 0.5, "cpu", tol=1e-10).logits(x)[0]
        assert (batch[j] - alone).abs().max() < 1e-6
    # scored a few rows at a time (the test part's rows bounded in memory): every probe's classes as at once
    whole = probes.classes[batch.argmax(2).numpy()]
    assert np.array_equal(probes.predict_all(x, chunk=7), whole) and probes.predict_all(x[:0]).shape == (3, 0)


def test_the_device_solver_chooses_c_as_scikit_learn_does_on_the_same_folds():
    """auto: the held-out accuracy of every fold and candidate C within one image of
    LogisticRegressionCV's, the same C chosen, and the same predictions from the final fit."""
    rng = np.random.default_rng(1)
    x, y = draw(rng, 600, 40, 5, signal=1.2)
    test_x, test_y = draw(rng, 400, 40, 5, signal=1.2)
    folds = list(auto_folds(y, 0).split(x, y))
    ours = device_logreg.fit(x, y, None, "cpu", folds, AUTO_CS)
    theirs = logreg_estimator(x, y, "auto", fold_jobs=1).fit(x, y)
    sk = theirs[-1]
    held = np.array([len(h) for _, h in folds])[:, None]
    assert np.abs(ours.scores_ - sk.scores_[0]).max() * held.min() <= 1 + 1e-9, (ours.scores_, sk.scores_[0])
    assert ours.C_ == sk.C_[0]
    assert sk.scores_[0].mean(0).max() - np.sort(sk.scores_[0].mean(0))[-2] > 1 / held.sum()  # not a tie
    assert (ours.predict(test_x) != theirs.predict(test_x)).sum() <= 1
    assert (ours.predict(test_x) == test_y).mean() > 0.3  # it learnt something (chance: 0.2)


def test_the_probe_path_on_the_device_route_gives_the_cpu_routes_outcomes(monkeypatch):
    """probe_outcomes through the device route (taken here on the CPU, as a GPU would take it: C chosen
    once, the probe, then its refits as one batch weighing the rows by their resamples' counts) reads
    the same per-image outcomes as scikit-learn's route, and the same C. The parts are interleaved, as
    evaluate's split is: a refit that weighed the first rows instead of probe-train's would still agree
    on a split into halves."""
    rng = np.random.default_rng(7)  # its C wins cross-validation by 14 images, not a near-tie the solvers' tolerances could flip
    drawn, labels = draw(rng, 600, 60, 4, signal=1.5, dtype=np.float32)
    split = np.random.default_rng(0).permutation(600).reshape(2, 300)  # drawn row i at row split.flat[i]
    x, y = np.empty_like(drawn), np.empty_like(labels)
    x[split.ravel()], y[split.ravel()] = drawn, labels
    cfg = {"probe_solver": "logreg", "probe_c": "auto", "probe_train": None, "probe_refits": 4}
    c_cpu = probe.chosen_c(x[split[0]], y[split[0]])
    cpu = probe.probe_outcomes(x, y, split, cfg)
    monkeypatch.setattr(probe, "on_gpu", lambda device: True)
    assert probe.chosen_c(x[split[0]], y[split[0]], 0, "cpu") == c_cpu
    dev = probe.probe_outcomes(x, y, split, cfg)
    assert (cpu[0] != dev[0]).sum() <= 1 and (cpu[1] != dev[1]).sum() <= 4
    assert cpu[0].mean() > 0.4  # chance 0.25: a probe that learnt something, so agreement is not chance


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_the_probe_on_a_gpu_is_the_cpu_probe():
    rng = np.random.default_rng(3)
    x, y = draw(rng, 400, 50, 3)
    split = (np.arange(200), np.arange(200, 400))
    cfg = {"probe_solver": "logreg", "probe_c": "auto", "probe_train": None, "probe_refits": 3}
    cpu, gpu = probe.probe_outcomes(x, y, split, cfg), probe.probe_outcomes(x, y, split, cfg, 0, "cuda")
    assert (cpu[0] != gpu[0]).sum() <= 1 and (cpu[1] != gpu[1]).sum() <= 3


def test_probe_speeds_gpu_comparison_runs_its_device_route(monkeypatch, capsys):
    """`probe_speed --device cuda`'s path, its device route taken on the CPU: it compares the two
    routes' solutions at one C (the objectives equal to 1e-3, the outcomes within one image)."""
    import json
    import sys

    from benchmarks import probe_speed

    calls = []

    def on_the_device(train_x, train_y, c):  # logreg_probe's GPU route, taken on the CPU
        calls.append(c)
        with monkeypatch.context() as m:
            m.setattr(probe, "on_gpu", lambda device: True)
            return probe.logreg_probe(train_x, train_y, c)

    monkeypatch.setattr(probe_speed, "on_gpu", lambda device: True)
    monkeypatch.setattr(probe_speed, "partial", lambda *a, **kw: on_the_device)
    monkeypatch.setattr(sys, "argv", ["probe_speed", "--set", "digits", "--n", "240", "--features", "pixels"])
    probe_speed.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["pixels"]
    assert calls == ["auto", out["now"]["c"]]  # the new probe's two fits went the device route
    assert out["now"]["c"] == out["before"]["c"]
    assert abs(out["now"]["objective"] - out["before"]["objective"]) < 1e-3 * out["before"]["objective"]
    assert out["outcomes_differ"] * 120 <= 1


def test_a_feature_constant_on_a_resamples_rows_is_left_unscaled_in_its_refit():
    """A feature that takes one value on every row a resample holds (a millionth more on rows it left out)
    is constant to that refit: scaled by 1 as scikit-learn's on the resample's rows, not by the rounding of
    its variance, which would blow up its logits on the rows left out."""
    rng = np.random.default_rng(4)
    x, y = draw(rng, 150, 6, 3)
    pick = rng.choice(75, 150)  # from the first half only
    x[:, -1] = np.where(np.arange(150) < 75, 7.0, 7.000001)
    probes = device_logreg.fit(x, y, 0.5, "cpu", rows=np.bincount(pick, minlength=150)[None], tol=1e-10)
    assert probes.scale[0, -1].item() == 1.0
    alone = device_logreg.fit(x[pick], y[pick], 0.5, "cpu", tol=1e-10)
    assert (probes.logits(x)[0] - alone.logits(x)[0]).abs().max() < 1e-6


def test_features_far_from_zero_are_fit_at_full_precision():
    """Features on a large common offset (raw pixel sums, unnormalised embeddings) are read in float64:
    rounded to float32 first, their spread would move by a percent and the probe off scikit-learn's."""
    rng = np.random.default_rng(5)
    x, y = draw(rng, 200, 20, 3)
    x += 1e5
    ours = device_logreg.fit(x, y, 1.0, "cpu", tol=1e-10)
    theirs = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, tol=1e-12, max_iter=100_000)).fit(x, y)
    assert np.abs(torch.softmax(ours.logits(x)[0], 1).numpy() - theirs.predict_proba(x)).max() < 1e-5


@pytest.mark.parametrize("left_out, held", [(100.001, 100.0), (3.0, 0.1)])
def test_a_feature_constant_on_a_resamples_rows_scores_the_rows_left_out_as_scikit_learn_does(left_out, held):
    """A feature constant on a resample's rows and different on rows it left out: the refit's one-pass
    variance kept its rounding and scaled the feature by 1e-11 where scikit-learn keeps 1, so the logits on
    the rows left out (the probe-test rows, at evaluation) were far from scikit-learn's."""
    rng = np.random.default_rng(4)
    x, y = draw(rng, 150, 6, 3)
    pick = rng.choice(75, 150)  # from the first half only
    x[:, -1] = np.where(np.arange(150) < 75, held, left_out)
    probes = device_logreg.fit(x, y, 0.5, "cpu", rows=np.bincount(pick, minlength=150)[None], tol=1e-10)
    theirs = make_pipeline(StandardScaler(), LogisticRegression(C=0.5, tol=1e-12, max_iter=100_000))
    theirs.fit(x[pick], y[pick])
    assert probes.scale[0, -1].item() == 1.0
    assert np.abs(torch.softmax(probes.logits(x)[0], 1).numpy() - theirs.predict_proba(x)).max() < 1e-5


def test_standardisers_give_the_same_scales_whatever_rows_and_problems_they_hold_at_once(monkeypatch):
    """The second pass runs a block of rows and problems at a time (memory flat in both): blocks that
    split rows and problems unevenly sum to the whole."""
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.normal(size=(1000, 7)) * rng.uniform(0.1, 5, 7) + 50)
    rows = torch.tensor(rng.integers(0, 3, (9, 1000)), dtype=torch.float64)
    whole = device_logreg.standardisers(x, rows)
    for held in (20, 7 * 999, 7 * 1000 * 4):  # 2 rows; 999 rows (a ragged last chunk); every row, 4 problems
        monkeypatch.setattr(device_logreg, "STANDARDISE_ELEMENTS", held)
        for ours, theirs in zip(device_logreg.standardisers(x, rows), whole):
            assert torch.allclose(ours, theirs, rtol=1e-12, atol=0)
