"""Bootstrap intervals of pipeline/eval/stats.py: they cover the truth at their level, and a paired
difference sees what two overlapping intervals cannot."""

from pathlib import Path

import numpy as np
import pytest

from pipeline.eval.stats import accuracy_ci, difference_ci, normal_quantile, paired_wald

ROOT = Path(__file__).resolve().parent.parent


def test_accuracy_interval_covers_the_true_accuracy_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    covered = []
    for trial in range(200):
        correct = rng.random(300) < 0.7
        lo, hi = accuracy_ci(correct, seed=trial, resamples=400)
        assert lo <= correct.mean() <= hi
        covered.append(lo <= 0.7 <= hi)
    assert 0.88 <= np.mean(covered) <= 0.99


def test_interval_narrows_with_more_test_examples():
    rng = np.random.default_rng(1)
    small, large = (accuracy_ci(rng.random(n) < 0.5) for n in (100, 10_000))
    assert (large[1] - large[0]) < (small[1] - small[0]) / 5


def test_paired_difference_separates_models_whose_intervals_overlap():
    rng = np.random.default_rng(2)
    a = rng.random(500) < 0.6
    b = a.copy()
    b[np.flatnonzero(a)[:20]] = False  # b is a, wrong on 20 more examples: 4 points worse
    ci_a, ci_b = accuracy_ci(a), accuracy_ci(b)
    assert ci_b[1] > ci_a[0]  # the separate intervals overlap...
    d = difference_ci(a, b)
    assert d["diff"] == pytest.approx(0.04) and d["ci"][0] > 0  # ...the paired one excludes 0
    same = difference_ci(a, a)  # no discordance seen: the floor of two models that agree on 500 images
    assert same == {"diff": 0.0, "ci": pytest.approx(paired_wald(0, 0, 500))} and same["ci"][1] < 0.01


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="same test examples"):
        difference_ci(np.ones(3, bool), np.ones(4, bool))
    with pytest.raises(ValueError, match="at least one test example"):
        accuracy_ci(np.array([], bool))


def test_seed_rows_widen_the_interval_when_seeds_disagree():
    """Three training seeds whose accuracies differ by 10 points: the two-level bootstrap's interval
    must cover that spread, where pooling the rows as one long test set would hide it."""
    rng = np.random.default_rng(3)
    rows = np.stack([rng.random(400) < p for p in (0.6, 0.7, 0.8)])
    lo, hi = accuracy_ci(rows)
    pooled_lo, pooled_hi = accuracy_ci(rows.reshape(-1))
    assert lo <= rows.mean() <= hi
    assert (hi - lo) > 1.5 * (pooled_hi - pooled_lo)
    agreeing = np.stack([rows[1]] * 3)  # identical seeds: no seed variation to add
    assert accuracy_ci(agreeing) == accuracy_ci(rows[1])


def test_seed_rows_pair_by_seed_and_against_a_single_row():
    rng = np.random.default_rng(4)
    a = rng.random((3, 500)) < 0.7
    b = a.copy()
    b[:, :40] = False
    d = difference_ci(a, b)
    assert d["diff"] == pytest.approx(a[:, :40].mean() * 40 / 500) and d["ci"][0] > 0
    single = difference_ci(a, a[0])  # e.g. the untrained encoder: one row, against each seed
    assert single["diff"] == pytest.approx(a.mean() - a[0].mean())
    four = rng.random((4, 500)) < 0.6  # unequal counts: the difference is still the means' difference
    assert difference_ci(a[:2], four)["diff"] == pytest.approx(a[:2].mean() - four.mean())
    assert difference_ci(a, four)["diff"] == pytest.approx(a.mean() - four.mean())
    with pytest.raises(ValueError, match="examples"):
        accuracy_ci(np.ones((2, 3, 4), bool))


@pytest.mark.parametrize("fits", [1, 3])
def test_unequal_seed_counts_keep_each_models_own_seed_spread(fits):
    """Two seeds that disagree completely (one right on every example, one wrong) against four that
    agree: the bootstrap draws of the difference must spread as the mean of two fresh seeds would,
    by the standard error s/sqrt(2) = 0.5 (s the seeds' sample sd, 0.707). Repeating the two rows to
    meet the four would draw four of them (sd 0.35 after scaling), and resampling two seeds without
    scaling their spread reads 0.5/sqrt(2) = 0.35: an interval a third too narrow. With refits too."""
    from pipeline.eval.stats import _resampled_means

    two = np.repeat(np.stack([np.ones(200), np.zeros(200)])[:, None], fits, axis=1)
    four = np.zeros((4, fits, 200))
    draws = _resampled_means([two, four], seed=0, resamples=4000)
    assert draws.mean() == pytest.approx(0.5, abs=0.02)
    assert draws.std() == pytest.approx(0.5, abs=0.02)


@pytest.mark.parametrize("seeds", [2, 3, 5])
def test_the_seed_spread_is_the_standard_error_of_their_mean(seeds):
    """Seeds whose accuracies differ (every test image answered alike within a seed, so the test
    images add nothing): the draws of the mean spread by the seeds' sample sd over sqrt(S), what a
    re-run with S fresh seeds would move by. Plain resampling reads sqrt((S-1)/S) of it: at two seeds
    0.71, far outside the tolerance."""
    from pipeline.eval.stats import _resampled_means

    accuracy = np.linspace(0.6, 0.8, seeds)
    rows = np.repeat(accuracy[:, None, None], 300, axis=2)  # (seeds, one fit, examples)
    draws = _resampled_means([rows], seed=1, resamples=20_000)
    assert draws.mean() == pytest.approx(accuracy.mean(), abs=0.003)
    assert draws.std() == pytest.approx(accuracy.std(ddof=1) / np.sqrt(seeds), rel=0.05)


def test_the_draws_spread_by_the_test_images_and_the_seeds_together():
    """Four seeds a point apart, each right on the images easier than its accuracy (the easy images
    are easy for every seed, as in a real sweep): the draws of the mean spread by both sources at once,
    sqrt(var_images + var_seeds), here 1.1 points. Resampling the seeds alone reads 0.5, the images
    alone 1.0."""
    from pipeline.eval.stats import _resampled_means

    difficulty = np.random.default_rng(5).random(2000)
    rows = (difficulty[None] < np.array([0.69, 0.70, 0.71, 0.72])[:, None]).astype(float)
    draws = _resampled_means([rows[:, None]], seed=2, resamples=4000)
    images, seeds = rows.mean(axis=0).var() / 2000, rows.mean(axis=1).var(ddof=1) / 4
    assert draws.std() == pytest.approx(np.sqrt(images + seeds), rel=0.1)


def _probe_draw(rng, w, train_n, test_n):
    """A two-class problem whose linear probe, fit on only `train_n` images, moves by points with
    which images those are: features in 20 dims, labels from a noisy linear rule `w`."""
    x = rng.normal(size=(train_n + test_n, 20)).astype(np.float32)
    y = (x @ w + rng.normal(scale=1.0, size=len(x)) > 0).astype(int)
    return x, y


def test_refits_make_the_interval_cover_the_probe_fit_spread():
    """What a reader takes an accuracy to mean is the accuracy of this encoder's probe, whichever
    probe-train images it happened to be fit on. With 40 of them the fit dominates: an interval over
    test images alone misses that truth far more often than 5%; one with refits covers it."""
    from pipeline.eval.probe import linear_probe, refit_correct

    cfg = {"probe_solver": "logreg", "probe_c": 1.0, "probe_train": None}
    w = np.random.default_rng(0).normal(size=20)
    truth_rng = np.random.default_rng(1)  # the truth: the mean accuracy over fresh probe-train sets
    truth = np.mean([linear_probe(*_probe_draw(truth_rng, w, 40, 4000), (np.arange(40), np.arange(40, 4040)),
                                  cfg, 0).mean() for _ in range(300)])
    rng = np.random.default_rng(2)
    plain, with_refits = [], []
    for trial in range(60):
        x, y = _probe_draw(rng, w, 40, 2000)
        split = (np.arange(40), np.arange(40, 2040))
        correct = linear_probe(x, y, split, cfg, 0)
        refits = refit_correct(x, y, split, cfg, fits=20)
        lo, hi = accuracy_ci(correct, seed=trial, resamples=400)
        plain.append(lo <= truth <= hi)
        lo, hi = accuracy_ci(correct, seed=trial, resamples=400, refits=refits)
        assert lo <= correct.mean() <= hi
        with_refits.append(lo <= truth <= hi)
    assert np.mean(plain) < 0.7
    assert np.mean(with_refits) >= 0.85


def test_refits_pair_resample_by_resample():
    """Two encoders refit on the same resamples: the paired interval of a model against itself is its
    floor alone (no discordance seen), and one whose features are a copy pairs identically; the spread
    only adds to a pair whose probes disagree."""
    from pipeline.eval.probe import linear_probe, refit_correct

    cfg = {"probe_solver": "logreg", "probe_c": 1.0, "probe_train": None}
    rng = np.random.default_rng(3)
    w = rng.normal(size=20)
    x, y = _probe_draw(rng, w, 200, 1000)
    split = (np.arange(200), np.arange(200, 1200))
    a, fa = linear_probe(x, y, split, cfg, 0), refit_correct(x, y, split, cfg, fits=10)
    assert fa.shape == (10, 1000) and (fa != a).any()  # the refits are fits on other images
    assert np.array_equal(refit_correct(x.copy(), y, split, cfg, fits=10), fa)
    # Refit r is the probe fit on resample r alone, whichever core fits it (they run in parallel).
    r3 = np.random.default_rng([200, 3]).choice(split[0], size=200, replace=True)
    assert np.array_equal(fa[3], linear_probe(x, y, (r3, split[1]), cfg, 0))
    assert difference_ci(a, a, refits_a=fa, refits_b=fa) == {"diff": 0.0, "ci": pytest.approx(paired_wald(0, 0, 1000))}
    noisy = x + rng.normal(scale=0.5, size=x.shape).astype(np.float32)
    b, fb = linear_probe(noisy, y, split, cfg, 0), refit_correct(noisy, y, split, cfg, fits=10)
    plain, refit = difference_ci(a, b), difference_ci(a, b, refits_a=fa, refits_b=fb)
    assert plain["diff"] == refit["diff"]
    assert refit["ci"][1] - refit["ci"][0] > plain["ci"][1] - plain["ci"][0]
    with pytest.raises(ValueError, match="both models"):
        difference_ci(a, b, refits_a=fa)
    with pytest.raises(ValueError, match="same resamples"):
        difference_ci(a, b, refits_a=fa, refits_b=fb[:5])
    with pytest.raises(ValueError, match="refits must be"):
        accuracy_ci(a, refits=fa[:, :10])



def test_auto_c_refits_keep_the_c_chosen_on_the_whole_probe_train_part():
    """With probe_c=auto the refits keep the C cross-validation picks on probe-train itself (a
    resample's duplicates would sit on both sides of its folds and pick too weak a penalty)."""
    from pipeline.eval.probe import AUTO_CS, chosen_c, refit_correct

    cfg = {"probe_solver": "logreg", "probe_c": "auto", "probe_train": None}
    rng = np.random.default_rng(6)
    x, y = _probe_draw(rng, rng.normal(size=20), 150, 300)
    split = (np.arange(150), np.arange(150, 450))
    c = chosen_c(x[:150], y[:150])
    assert c in AUTO_CS and c != 1.0  # not the C a fixed-C fallback would use
    auto = refit_correct(x, y, split, cfg, fits=4)
    assert np.array_equal(auto, refit_correct(x, y, split, {**cfg, "probe_c": c}, fits=4))
    other = next(k for k in AUTO_CS if abs(np.log(k / c)) > 2)  # a C far from the chosen one differs
    assert not np.array_equal(auto, refit_correct(x, y, split, {**cfg, "probe_c": other}, fits=4))


@pytest.mark.filterwarnings("ignore::FutureWarning")  # LogisticRegressionCV announcing its 1.10 attributes
def test_auto_c_folds_spread_over_cores_choose_what_folds_in_turn_choose(monkeypatch):
    """A large enough choice of C runs its folds in worker processes (one BLAS thread each, one per thread
    the job was given): the cross-validated accuracies, and so the C, are those of the folds fit one after
    another."""
    import torch
    from threadpoolctl import threadpool_limits

    from pipeline.eval.probe import AUTO_FOLDS, PARALLEL_FOLD_FLOATS, logreg_estimator, logreg_probe

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # a job given two threads, whatever ran before

    rng = np.random.default_rng(7)
    x = rng.normal(size=(2000, 1000)).astype(np.float32)
    y = (x[:, :20] @ rng.normal(size=20) + rng.normal(scale=2.0, size=len(x)) > 0).astype(int)
    assert x.size >= PARALLEL_FOLD_FLOATS
    spread = logreg_probe(x, y, "auto")[-1]
    assert spread.n_jobs == min(AUTO_FOLDS, 2)
    with threadpool_limits(1):
        in_turn = logreg_estimator(x, y, "auto", fold_jobs=1).fit(x, y)[-1]
    assert np.array_equal(spread.scores_[1], in_turn.scores_[1]) and spread.C_[0] == in_turn.C_[0]
    assert logreg_probe(x[:100], y[:100], "auto")[-1].n_jobs == 1  # small: a worker costs more than the fit


def test_auto_c_is_chosen_once_per_encoder_for_its_probe_and_its_refits(monkeypatch):
    """Choosing C costs about ten fits (two minutes on 3,072 pixel features): the evaluate stage
    cross-validates once per encoder and hands the probe and its refits the C it chose."""
    import yaml
    from sklearn.linear_model import LogisticRegressionCV

    from pipeline.eval import probe
    from pipeline.eval.evalsets import EvalSet
    from pipeline.stages.evaluate import Candidate, evaluate_set

    searches = []

    class Counted(LogisticRegressionCV):
        def fit(self, *a, **k):
            searches.append(1)
            return super().fit(*a, **k)

    monkeypatch.setattr(probe, "LogisticRegressionCV", Counted)
    rng = np.random.default_rng(6)
    labels = np.repeat(np.arange(3), 20)
    images = (rng.random((60, 8, 8, 3)) * 60 + labels[:, None, None, None] * 60).astype(np.uint8)
    es = EvalSet("toy", images, labels, ["a", "b", "c"], ("{c}",))
    cfg = yaml.safe_load((ROOT / "params.yaml").read_text())["evaluate"]
    cfg.update(probe_c="auto", probe_refits=3, fewshot={"shots": [], "repeats": 1}, zero_shot=False,
               finetune={**cfg["finetune"], "enabled": False})
    evaluate_set(es, [Candidate("dp", "raw pixels", "-", None), Candidate("pixels", "raw pixels", "-", None)],
                 cfg, 0, "cpu", None)
    assert len(searches) == 2  # one choice per encoder, none in the refits


def test_chance_is_the_majority_share_of_the_images_scored_not_of_the_whole_set():
    """An official split's test part can be balanced otherwise than the whole set: chance (the line an
    accuracy is read against in metrics.json and the report) was the whole set's majority share."""
    import yaml

    from pipeline.eval.evalsets import EvalSet
    from pipeline.stages.evaluate import Candidate, evaluate_set

    rng = np.random.default_rng(7)
    labels = np.array([0] * 60 + [1] * 10 + [0] * 10 + [1] * 10)  # train part 60:10, test part 10:10
    images = (rng.random((90, 8, 8, 3)) * 60 + labels[:, None, None, None] * 60).astype(np.uint8)
    es = EvalSet("toy", images, labels, ["a", "b"], ("{c}",), parts=(np.arange(70), np.arange(70, 90)))
    cfg = yaml.safe_load((ROOT / "params.yaml").read_text())["evaluate"]
    cfg.update(probe_refits=0, fewshot={"shots": [], "repeats": 1}, zero_shot=False,
               finetune={**cfg["finetune"], "enabled": False})
    out = evaluate_set(es, [Candidate(name, "raw pixels", "-", None) for name in ("dp", "pixels")], cfg, 0, "cpu", None)
    assert out["n_probe_test"] == 20 and out["chance"] == 0.5  # the whole set's would be 70/90


def test_an_accuracy_near_100_percent_keeps_its_level():
    """A bootstrap of the test images alone reads 100.0–100.0% where a model makes no error on them
    (at 99.5% over 270 images: a quarter of its intervals, 76% coverage); the Wilson floor keeps 95%."""
    from pipeline.eval.stats import wilson

    assert wilson(0.5, 100) == pytest.approx([0.4038, 0.5962], abs=1e-4)  # the textbook figure
    rng = np.random.default_rng(7)
    covered, widths = [], []
    for trial in range(200):
        correct = rng.random(270) < 0.995
        lo, hi = accuracy_ci(correct, seed=trial, resamples=400)
        covered.append(lo <= 0.995 <= hi)
        widths.append(hi - lo)
    assert np.mean(covered) >= 0.9 and min(widths) > 0.005
    lo, hi = accuracy_ci(np.ones(270, bool))
    assert hi == 1.0 and lo == pytest.approx(wilson(1.0, 270)[0]) and lo < 0.99


def test_an_interval_holds_its_own_estimate_when_one_refit_collapsed():
    """49 refits as good as the full fit and one that collapsed (every answer wrong): the shift to the
    full fit carries the bootstrap's main mode past the estimate, which the interval must still hold."""
    rng = np.random.default_rng(8)
    full = rng.random(4000) < 0.9
    refits = np.stack([full] * 49 + [np.zeros(4000, bool)])
    lo, hi = accuracy_ci(full, refits=refits)
    assert lo <= full.mean() <= hi
    other = rng.random(4000) < 0.85
    d = difference_ci(full, other, refits_a=refits, refits_b=np.stack([other] * 50))
    assert d["ci"][0] <= d["diff"] <= d["ci"][1]


def test_a_paired_difference_where_the_models_rarely_disagree_keeps_its_level():
    """Two models that disagree on few test images: a bootstrap of the images cannot move a discordance
    it never drew, so where a wins on 0.4% of 270 images and b on none it read 0.0–0.0 in 83 trials of
    200 and covered the true +0.4 points in 58%; the adjusted Wald floor keeps 95%."""
    # 15 examples only a gets right, 5 only b, of 50: 10/52 ± 1.96·√((22/52 - (10/52)²)/52)
    assert paired_wald(15, 5, 50) == pytest.approx([0.0234, 0.3612], abs=1e-4)
    rng = np.random.default_rng(9)
    covered, widths = [], []
    for trial in range(200):
        draw = rng.random(270)
        b = draw > 0.1  # right on 90%
        a = b | (draw < 0.004)  # and a also on 0.4% that b gets wrong
        d = difference_ci(a, b, seed=trial, resamples=400)
        covered.append(d["ci"][0] <= 0.004 <= d["ci"][1])
        widths.append(d["ci"][1] - d["ci"][0])
    assert np.mean(covered) >= 0.9 and min(widths) > 0.005
    same = rng.random((2, 270)) < 0.8
    d = difference_ci(same, same)  # two seeds each, agreeing everywhere
    assert d["diff"] == 0 and d["ci"] == pytest.approx(paired_wald(0, 0, 270)) and d["ci"][1] > 0.005


def test_the_bootstrap_draws_every_test_example_alike_the_last_as_the_first():
    """A resample of the test images must reach each of them with the same odds: a draw that never
    reached the last example (an off-by-one in its range) reads a model right on it alone as 0% right."""
    from pipeline.eval.stats import _resampled_means

    for hit in (0, 9):
        only = np.zeros((1, 1, 10))
        only[0, 0, hit] = 1.0  # right on one of ten images: every draw's mean is its count of that image / 10
        draws = _resampled_means([only], seed=0, resamples=4000)
        assert draws.mean() == pytest.approx(0.1, abs=0.01)


def test_the_seed_chooses_which_test_images_the_bootstrap_draws():
    """`seed` is the bootstrap's own stream: the same seed gives the same draws, another seed others (a
    stream seeded without it gives every caller, and every trial of a coverage run, the same draws)."""
    from pipeline.eval.stats import _resampled_means

    correct = (np.random.default_rng(13).random(300) < 0.7)[None, None].astype(float)
    first, again, other = (_resampled_means([correct], seed=s, resamples=200) for s in (0, 0, 1))
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_a_difference_over_unequal_seed_counts_is_centred_on_the_difference():
    """Two seeds of one model against four of another are resampled each on their own: the draws are of
    the difference of the two means, so the interval lies a few points either side of it, not around
    their sum (a sign lost between the two models)."""
    rng = np.random.default_rng(14)
    a, b = rng.random((2, 500)) < 0.7, rng.random((4, 500)) < 0.6
    d = difference_ci(a, b)
    assert d["ci"][0] < d["diff"] < d["ci"][1]
    assert d["ci"][1] - d["diff"] < 0.1 and d["diff"] - d["ci"][0] < 0.1


def test_an_interval_never_reaches_past_what_an_accuracy_or_a_difference_can_be():
    """The shift to the full fit moves the refits' draws by the gap between the full probe and its refits:
    a probe right on every image whose refits are right on half would read up to 105%, a difference up
    to +1.05, without the bounds."""
    rng = np.random.default_rng(15)
    right, wrong = np.ones(400, bool), np.zeros(400, bool)
    half = rng.random((20, 400)) < 0.5
    lo, hi = accuracy_ci(right, refits=half)
    assert 0.9 < lo <= hi == 1.0
    d = difference_ci(right, wrong, refits_a=half, refits_b=np.zeros((20, 400), bool))
    assert d["diff"] == 1.0 and 0.9 < d["ci"][0] <= d["ci"][1] == 1.0


def _seed_rows(rng, difficulty, centre, seeds=20):
    """`seeds` trainings whose accuracies spread by 5 points around `centre`, each right on the images
    easier than its accuracy (the easy images are easy for every seed, as in a real sweep)."""
    return difficulty[None] < rng.normal(centre, 0.05, seeds)[:, None]


@pytest.mark.parametrize("level", [0.5, 0.95])
def test_the_interval_reaches_its_levels_normal_quantile_of_standard_errors_either_side(level):
    """Twenty seeds on 2,000 images: the draws of the mean are near normal, so the interval at `level`
    reaches z standard errors either side (z the level's two-sided normal quantile). A percentile
    interval read at the wrong quantiles (90% for 95%) or a bootstrap blind to `level` reads another width."""
    rng = np.random.default_rng(11)
    difficulty = rng.random(2000)
    rows = _seed_rows(rng, difficulty, 0.7)
    se = np.sqrt(rows.mean(axis=0).var() / 2000 + rows.mean(axis=1).var(ddof=1) / 20)
    lo, hi = accuracy_ci(rows, level=level)
    assert (hi - lo) / 2 == pytest.approx(normal_quantile((1 + level) / 2) * se, rel=0.06)
    assert (lo + hi) / 2 == pytest.approx(rows.mean(), abs=0.1 * se)


@pytest.mark.parametrize("level", [0.5, 0.95])
def test_a_paired_interval_reaches_its_levels_normal_quantile_of_standard_errors_either_side(level):
    """Two models paired seed by seed over twenty seeds: the paired interval at `level` reaches z standard
    errors of the difference either side, with the test images and the seeds' differences together."""
    rng = np.random.default_rng(12)
    difficulty = rng.random(2000)
    a, b = _seed_rows(rng, difficulty, 0.72), _seed_rows(rng, difficulty, 0.68)
    per_image = (a.astype(float) - b).mean(axis=0)
    se = np.sqrt(per_image.var() / 2000 + (a.mean(axis=1) - b.mean(axis=1)).var(ddof=1) / 20)
    lo, hi = difference_ci(a, b, level=level)["ci"]
    assert (hi - lo) / 2 == pytest.approx(normal_quantile((1 + level) / 2) * se, rel=0.08)


def test_one_set_of_refits_serves_every_seed_of_a_model():
    """refits may be (fits, examples), one set shared by every seed (the probe-train part and its
    resamples do not depend on the training seed): an interval over three seeds takes them as they are."""
    rng = np.random.default_rng(16)
    rows = rng.random((3, 300)) < 0.7
    refits = rng.random((5, 300)) < 0.68
    lo, hi = accuracy_ci(rows, refits=refits)
    assert lo <= rows.mean() <= hi and hi - lo < 0.2
    assert (lo, hi) == tuple(accuracy_ci(rows, refits=np.stack([refits] * 3)))


def test_a_difference_against_a_model_wrong_everywhere_reads_the_models_own_refit_interval():
    """Refit r of a is paired with refit r of b. Against a model wrong on every image in every refit, the
    paired draws are a's own: where the bootstrap sets the top of a's interval (49 refits near 90% and one
    collapsed, which skews the draws) the difference's top is the same, not its mirror about the estimate
    (the two models' refits swapped)."""
    rng = np.random.default_rng(17)
    full = rng.random(4000) < 0.9
    refits = np.concatenate([rng.random((49, 4000)) < 0.9, np.zeros((1, 4000), bool)])
    wrong = np.zeros(4000, bool)
    lo, hi = accuracy_ci(full, refits=refits)
    d = difference_ci(full, wrong, refits_a=refits, refits_b=np.zeros((50, 4000), bool))
    assert d["diff"] == pytest.approx(full.mean())
    assert d["ci"][1] == pytest.approx(hi, abs=1e-9) and d["ci"][0] == pytest.approx(lo, abs=0.002)
