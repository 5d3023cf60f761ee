"""Downstream evaluation: probes, few-shot subsets, zero-shot and the `evaluate` stage (the eval sets:
tests/test_evalsets.py)."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline import checkpoints
from pipeline.data.transforms import to_tensor
from pipeline.errors import VerificationFailed
from pipeline.train import lr_at
from pipeline.eval.evalsets import EvalSet, load_eval_set
from pipeline.eval.fewshot import finetune_accuracy, fewshot_logreg, kshot_subsets
from pipeline.eval.probe import (SOLVERS, auto_folds, extract_features, logreg_estimator, logreg_probe, pool_tokens,
                                 probe_accuracy)
from pipeline.eval.stats import paired_wald
from pipeline.eval.zeroshot import class_scores, zero_shot_accuracy
from pipeline.models import build_encoder, build_model
from pipeline.stages import stage
from recording import RecordingTracker

ROOT = Path(__file__).resolve().parents[1]
MICRO = dict(size="micro", img_size=16, patch_size=4)
DIGITS_SHARDS = {"source": "digits", "path": None, "limit": None, "image_size": 8, "eval_fraction": 0.3}
FAST_TRAIN = {"lars": dict(epochs=60, batch_size=128, lr=10.0, weight_decay=0.0),
              "adamw": dict(epochs=60, batch_size=128, lr=0.05, weight_decay=0.0)}


def blobs(n_per_class=100, classes=10, dim=32, spread=0.3, seed=0):
    """Linearly separable features: well-separated class means plus small noise."""
    rng = np.random.default_rng(seed)
    means = rng.normal(0, 1, (classes, dim))
    y = np.repeat(np.arange(classes), n_per_class)
    return (means[y] + rng.normal(0, spread, (len(y), dim))).astype(np.float32), y


def halves(x, y, seed=0):
    order = np.random.default_rng(seed).permutation(len(y))
    tr, te = order[: len(y) // 2], order[len(y) // 2:]
    return x[tr], y[tr], x[te], y[te]


# -- linear probe ------------------------------------------------------------------------------

@pytest.mark.parametrize("solver", SOLVERS)
def test_probe_is_near_perfect_on_linearly_separable_features(solver):
    x, y = blobs()
    acc = probe_accuracy(*halves(x, y), solver=solver, train_cfg=FAST_TRAIN.get(solver), seed=0)
    assert acc >= 0.98


@pytest.mark.parametrize("solver", SOLVERS)
def test_probe_is_at_chance_on_shuffled_labels(solver):
    x, y = blobs(n_per_class=200)
    y = np.random.default_rng(1).permutation(y)  # labels no longer depend on the features
    acc = probe_accuracy(*halves(x, y), solver=solver, train_cfg=FAST_TRAIN.get(solver), seed=0)
    assert abs(acc - 0.1) < 0.04  # 1000 test points: the std of chance accuracy is 0.0095


def tightly_fit(train_x, train_y, c, row_space: bool, basis=None):
    """logreg_estimator's probe solved to a tolerance far below its default, so two routes to the same
    optimum meet; `basis` replaces the row space's own (a broken projection)."""
    probe = logreg_estimator(train_x, train_y, c, row_space=row_space)
    model = probe.steps[-1][0]
    probe.set_params(**{f"{model}__tol": 1e-12, f"{model}__max_iter": 100_000})
    probe.fit(train_x, train_y)
    if basis is not None:
        probe[1].basis_ = basis
        probe[-1].fit(probe[:-1].transform(train_x), train_y)
    return probe


@pytest.mark.parametrize("c", [0.3, "auto"])
def test_logreg_on_the_training_rows_span_is_the_same_fit_with_fewer_weights(c):
    """Fewer images than features: the probe fits on coordinates in the span of its training rows
    (r <= n weights per class instead of d). The optimum, its test logits and, under auto, every fold's
    accuracy at every C are those of the fit on all d features, measured on fits solved far below the
    default tolerance; a basis that misses part of the span gives other logits."""
    rng = np.random.default_rng(3)
    x, y = blobs(n_per_class=12, classes=3, dim=80, spread=1.5)
    x = x + rng.normal(0, 1, x.shape)  # not separable: a finite optimum; float64, as the span's coordinates are
    train_x, train_y, test_x, _ = halves(x, y)
    spanned, full = tightly_fit(train_x, train_y, c, True), tightly_fit(train_x, train_y, c, False)
    assert [name for name, _ in spanned.steps] == ["standardscaler", "trainingrowspace", full.steps[-1][0]]
    assert spanned[1].basis_.shape == (80, len(train_x) - 1)  # 18 rows, centred by the scaler: r = 17
    if c == "auto":
        assert np.array_equal(spanned[-1].scores_[1], full[-1].scores_[1]) and np.array_equal(spanned[-1].C_, full[-1].C_)
    np.testing.assert_allclose(spanned.decision_function(test_x), full.decision_function(test_x), atol=1e-4)
    half = spanned[1].basis_[:, ::2]  # half of the span: the fit can no longer reach the optimum
    broken = tightly_fit(train_x, train_y, 0.3, True, basis=half)
    assert np.abs(broken.decision_function(test_x) - full.decision_function(test_x)).max() > 0.1


def test_logreg_takes_the_span_only_below_d_images_and_keeps_an_intercept_for_constant_features():
    many, labels = blobs(n_per_class=30, classes=3, dim=80)
    assert logreg_estimator(many, labels).steps[1][0] == "logisticregression"  # 90 images >= 80 features: as before
    flat = logreg_probe(np.ones((6, 20), np.float32), np.array([0, 0, 0, 0, 1, 1]), 1.0)  # a collapsed encoder
    assert (flat.predict(np.ones((2, 20), np.float32)) == 0).all()  # its intercept: the majority class


def test_features_are_the_encoder_output_and_last_k_blocks_concatenate():
    torch.manual_seed(0)
    enc = build_encoder(MICRO)
    enc.blocks.append(build_encoder(MICRO).blocks[0])  # two blocks, so last_k = 2 is meaningful
    images = np.random.default_rng(0).integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    for pool in ("cls", "mean"):
        one = extract_features(enc, images, pool, last_k=1)
        with torch.no_grad():
            np.testing.assert_allclose(one, enc.encode(to_tensor(images), pool).numpy(), rtol=1e-5, atol=1e-6)
        two = extract_features(enc, images, pool, last_k=2)
        assert two.shape == (5, 2 * enc.width)
        np.testing.assert_allclose(two[:, enc.width:], one, rtol=1e-5, atol=1e-6)
        assert not np.allclose(two[:, :enc.width], one)
        first = []  # the earlier block's tokens, through the encoder's final norm as the last block's are
        hook = enc.blocks[0].register_forward_hook(lambda _m, _i, out: first.append(out))
        with torch.no_grad():
            enc.forward_features(to_tensor(images))
            expected = pool_tokens(enc.norm(first[0]), pool).numpy()
        hook.remove()
        np.testing.assert_allclose(two[:, :enc.width], expected, rtol=1e-5, atol=1e-5)
    both = extract_features(enc, images, "cls+mean", last_k=2)  # per block: its cls token, then its mean
    assert both.shape == (5, 4 * enc.width)
    for block in range(2):
        for k, pool in enumerate(("cls", "mean")):
            np.testing.assert_allclose(both[:, (2 * block + k) * enc.width:(2 * block + k + 1) * enc.width],
                                       extract_features(enc, images, pool, last_k=2)[:, block * enc.width:
                                                                                     (block + 1) * enc.width],
                                       rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="last_k_blocks=3"):
        extract_features(enc, images, "cls", last_k=3)


# -- few-shot ----------------------------------------------------------------------------------

def test_kshot_subsets_are_class_balanced_and_seeded():
    labels = np.random.default_rng(0).integers(0, 7, 400)
    for k in (1, 5, 10):
        subsets = kshot_subsets(labels, k, repeats=4, seed=3)
        assert len(subsets) == 4
        for s in subsets:
            assert len(set(s)) == len(s) == 7 * k
            assert np.bincount(labels[s], minlength=7).tolist() == [k] * 7
        again = kshot_subsets(labels, k, repeats=6, seed=3)  # same seed: same subsets, more repeats extend
        assert all(np.array_equal(a, b) for a, b in zip(subsets, again))
        assert len({tuple(s) for s in again}) == 6  # repeats differ from each other
        other = kshot_subsets(labels, k, repeats=4, seed=4)
        assert not all(np.array_equal(a, b) for a, b in zip(subsets, other))


def test_kshot_names_the_short_class():
    labels = np.array([0] * 10 + [1] * 3)
    with pytest.raises(ValueError, match=r"5-shot .* classes \[1\]"):
        kshot_subsets(labels, 5, 1, 0)
    with pytest.raises(ValueError, match=r"4-shot .* classes \[1\] have only 3"):  # one short
        kshot_subsets(labels, 4, 1, 0)
    assert len(kshot_subsets(labels, 3, 1, 0)[0]) == 6  # just enough


def test_fewshot_logreg_reports_mean_and_std_over_repeats():
    x, y = blobs(n_per_class=40)
    out = fewshot_logreg(*halves(x, y), shots=[1, 5], repeats=3, c=1.0, seed=0)
    assert set(out) == {"1", "5"}
    for r in out.values():
        assert len(r["runs"]) == 3
        assert r["mean"] == pytest.approx(np.mean(r["runs"])) and r["std"] == pytest.approx(np.std(r["runs"], ddof=1))
    assert out["5"]["mean"] >= 0.95
    from pipeline.eval.fewshot import summarise  # every run above scores 1.0: the spread is read here

    spread = summarise([0.8, 0.9, 1.0])
    assert spread == {"mean": pytest.approx(0.9), "std": pytest.approx(0.1), "runs": [0.8, 0.9, 1.0]}
    assert summarise([0.7])["std"] is None


def test_fewshot_fits_one_per_core_keep_each_run_with_its_own_subset(monkeypatch):
    """c="auto" cross-validates every fit, so they run in worker processes: each K's runs must still be the
    fits of its own subsets, in order."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # two workers, whatever this machine has
    x, y = blobs(n_per_class=40, spread=2.5)
    (train_x, train_y), (test_x, test_y) = (x[::2], y[::2]), (x[1::2], y[1::2])
    out = fewshot_logreg(train_x, train_y, test_x, test_y, shots=[1, 3], repeats=3, c="auto", seed=0)
    for k in (1, 3):
        expected = [logreg_probe(train_x[s], train_y[s], "auto", 0).score(test_x, test_y)
                    for s in kshot_subsets(train_y, k, 3, 0)]
        assert out[str(k)]["runs"] == pytest.approx(expected)
    assert out["1"]["runs"] != out["3"]["runs"]


def colour_images(labels, rng, size=16):
    palette = np.array([(220, 30, 30), (30, 200, 40), (30, 40, 220), (230, 220, 30)])
    base = palette[labels][:, None, None, :]
    return np.clip(base + rng.normal(0, 25, (len(labels), size, size, 3)), 0, 255).astype(np.uint8)


def test_finetune_learns_a_toy_task_and_leaves_the_encoder_untouched():
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    enc = build_encoder(MICRO)
    before = {k: v.clone() for k, v in enc.state_dict().items()}
    y_tr, y_te = np.repeat(np.arange(4), 5), rng.integers(0, 4, 80)
    for pool in ("cls", "cls+mean"):
        acc = finetune_accuracy(enc, colour_images(y_tr, rng), y_tr, colour_images(y_te, rng), y_te, 4, pool=pool,
                                epochs=15, batch_size=10, lr=3e-3, weight_decay=0.0)
        assert acc >= 0.9
    assert all(torch.equal(before[k], v) for k, v in enc.state_dict().items())


def test_finetune_trains_encoder_and_head_for_its_epochs_at_its_rate_and_decay(monkeypatch):
    """What the fine-tune row says it ran: every encoder weight and the head in the optimiser (not a
    probe on frozen features), epochs × ⌈N/B⌉ steps, the schedule's peak at `lr`, the given decay, and
    one K-shot subset per repeat (kshot_subsets', each its own)."""
    from pipeline.eval import fewshot

    made = []

    class RecordingAdamW(torch.optim.AdamW):
        def __init__(self, params, **kw):
            params = list(params)
            super().__init__(params, **kw)
            self.given, self.lrs = params, []
            made.append(self)

        def step(self, closure=None):
            self.lrs.append(self.param_groups[0]["lr"])
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "AdamW", RecordingAdamW)
    rng = np.random.default_rng(0)
    enc = build_encoder(MICRO)
    y_tr, y_te = np.repeat(np.arange(4), 5), rng.integers(0, 4, 8)
    finetune_accuracy(enc, colour_images(y_tr, rng), y_tr, colour_images(y_te, rng), y_te, 4, pool="cls",
                      epochs=4, batch_size=8, lr=2e-3, weight_decay=0.05)
    [opt] = made
    assert len(opt.given) == len(list(enc.parameters())) + 2  # + the head's weight and bias
    assert len(opt.lrs) == 4 * 3 and max(opt.lrs) == pytest.approx(2e-3) and opt.lrs[-1] < 2e-3 / 10
    assert opt.lrs == pytest.approx([lr_at(s, 2e-3, 1, 12) for s in range(12)])  # training's one schedule
    assert opt.param_groups[0]["weight_decay"] == 0.05

    subsets = []
    monkeypatch.setattr(fewshot, "finetune_accuracy", lambda enc, images, y, *a, **k: subsets.append(images) or 0.5)
    images = np.arange(len(y_tr))
    out = fewshot.fewshot_finetune(enc, images, y_tr, None, None, 4, [2], 3,
                                   {"epochs": 1, "batch_size": 8, "lr": 1e-3, "weight_decay": 0.0}, "cls", 5)
    assert [s.tolist() for s in subsets] == [s.tolist() for s in kshot_subsets(y_tr, 2, 3, 5)]
    assert len({tuple(s) for s in subsets}) == 3 and out["2"]["runs"] == [0.5] * 3


def test_lars_scales_a_matrix_step_to_trust_times_its_weight_norm_and_steps_a_bias_plainly():
    """One step from rest: a weight matrix moves by lr·trust·‖w‖ along g + wd·w (its own norm whatever
    the gradient's), a bias by lr·g; momentum then adds the previous step."""
    from pipeline.eval.probe import LARS

    w, b = torch.nn.Parameter(torch.full((2, 3), 2.0)), torch.nn.Parameter(torch.zeros(3))
    w.grad, b.grad = torch.arange(6.0).reshape(2, 3), torch.ones(3)
    opt = LARS([w, b], lr=0.5, weight_decay=0.1, trust=0.01)
    start = w.detach().clone()
    opt.step()
    d = w.grad + 0.1 * start
    assert torch.allclose(start - w.detach(), 0.5 * 0.01 * start.norm() * d / d.norm(), rtol=1e-3)
    assert float((start - w.detach()).norm()) == pytest.approx(0.5 * 0.01 * float(start.norm()), rel=1e-3)
    assert torch.allclose(b.detach(), torch.full((3,), -0.5))
    opt.step()
    assert torch.allclose(b.detach(), torch.full((3,), -0.5 - 0.5 * 1.9))  # momentum 0.9: 1 + 0.9


@pytest.mark.parametrize("batch_size", [64, 512])
def test_a_probes_rate_grows_with_its_batch_from_the_base_rate_per_256_examples(batch_size):
    """evaluate.probe.lr is the rate per 256 examples (the MAE/ViP probe recipe), scaled linearly with the
    batch. One AdamW step from rest moves each bias by its rate (Adam's first step is lr·g/|g|): a rate
    scaled the wrong way would move it 1/16 or 16 times as far at these batches."""
    from pipeline.eval.probe import train_linear_head

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(batch_size, 4)).astype(np.float32), np.arange(batch_size) % 3
    head = train_linear_head(x, y, 3, "adamw", epochs=1, batch_size=batch_size, lr=0.1, weight_decay=0.0)
    assert head[1].bias.detach().abs().numpy() == pytest.approx(np.full(3, 0.1 * batch_size / 256), rel=1e-3)


# -- zero-shot ---------------------------------------------------------------------------------

class StubCaptioner:
    """Caption loss = |prompt id - image brightness class|: the right prompt has the lowest loss."""

    def eval(self):
        return self

    def to(self, device):
        return self

    def score_captions(self, imgs, tokens):
        brightness = imgs.mean(dim=(1, 2, 3))
        cls = torch.bucketize(brightness, torch.tensor([-1.0, 0.0, 1.0]))
        return (tokens[:, 0][None, :].float() - cls[:, None].float()).abs()


def test_zero_shot_takes_the_lowest_loss_class_for_a_captioner():
    images = np.stack([np.full((4, 4, 3), v, np.uint8) for v in (0, 90, 160, 255)])
    cls = torch.bucketize(to_tensor(images).mean(dim=(1, 2, 3)), torch.tensor([-1.0, 0.0, 1.0])).numpy()
    # Two templates per class; the token id of each prompt is its class.
    prompts = [[f"{c}", f"{c}"] for c in range(4)]
    tokenize = lambda caps: torch.tensor([[int(c)] for c in caps])  # noqa: E731
    scores = class_scores(StubCaptioner(), "caption", images, prompts, tokenize)
    assert (scores.argmax(1) == cls).all()
    assert zero_shot_accuracy(StubCaptioner(), "caption", images, cls, prompts, tokenize) == 1.0


class FixedTowers:
    """A text tower with one fixed loss (captioner) or unit embedding (CLIP) per prompt, in prompt order,
    and an image tower that maps every image to one unit vector."""

    def __init__(self, per_prompt, image=None):
        self.per_prompt, self.image = torch.tensor(per_prompt), image

    def eval(self):
        return self

    def to(self, device):
        return self

    def score_captions(self, imgs, tokens):
        return self.per_prompt[None].expand(len(imgs), -1)

    def encode_text(self, tokens):
        return self.per_prompt

    def encode_image(self, imgs):
        return torch.tensor(self.image)[None].expand(len(imgs), -1)


def test_zero_shot_averages_every_template_of_a_class():
    """Class 0's prompts score 1 and 5, class 1's 2 and 2 (caption loss): the mean picks class 1, the
    first template alone class 0. For CLIP, class 1's two prompts lie 60° either side of the image and
    class 0's close together 30° from it: normalised, class 1's mean points at the image (cosine 1 against
    0.87); unnormalised its shorter mean (length 0.5) would lose to class 0's."""
    images = np.zeros((3, 4, 4, 3), np.uint8)
    prompts = [["a", "b"], ["c", "d"]]
    tokenize = lambda caps: torch.zeros(len(caps), 1, dtype=torch.long)  # noqa: E731
    scores = class_scores(FixedTowers([1.0, 5.0, 2.0, 2.0]), "caption", images, prompts, tokenize)
    assert (scores.argmax(1) == 1).all() and np.allclose(scores, [[-3.0, -2.0]] * 3)
    angle = np.radians([55.0, 65.0, 30.0, 150.0])  # class 0 near 60°, class 1 at 30° and 150°: mean 90°
    image = [0.0, 1.0]  # at 90°: class 1's mean direction
    towers = FixedTowers(np.c_[np.cos(angle), np.sin(angle)].astype(np.float32).tolist(), image)
    scores = class_scores(towers, "clip", images, prompts, tokenize)
    assert np.allclose(scores, [[np.cos(np.radians(30)), 1.0]] * 3, atol=1e-3)  # the cosines of unit means
    assert (scores.argmax(1) == 1).all()


def test_a_diverged_model_is_named_never_scored():
    """NaN weights give NaN features and scores: a probe fit on them (the GPU solver answers one class,
    sklearn a LinAlgError) and an argmax over them (class 0) would each print an accuracy."""
    from pipeline.errors import Diverged
    from pipeline.eval.probe import features

    images = np.stack([np.full((16, 16, 3), v, np.uint8) for v in (0, 90, 160, 255)])
    enc = build_encoder(MICRO)
    cfg = {"pool": "cls", "last_k_blocks": 1}
    assert features(enc, images, cfg).shape[0] == 4
    with torch.no_grad():
        enc.blocks[-1].mlp.fc2.bias[3] = float("nan")
    with pytest.raises(Diverged, match="the features of the dp model on digits: 4 of 4 rows are not finite"):
        features(enc, images, cfg, what="the dp model on digits")
    assert np.isfinite(features(None, images, cfg)).all()  # the pixels need no check, and pass one

    class Broken(StubCaptioner):
        def score_captions(self, imgs, tokens):
            out = super().score_captions(imgs, tokens)
            out[1] = float("inf")
            return out

    prompts, tokenize = [[f"{c}"] for c in range(4)], lambda caps: torch.tensor([[int(c)] for c in caps])
    with pytest.raises(Diverged, match="zero-shot scores of the caption model: 1 of 4 rows"):
        class_scores(Broken(), "caption", images, prompts, tokenize)


def test_zero_shot_refuses_a_model_without_text_tower():
    with pytest.raises(ValueError, match="text tower"):
        class_scores(None, "mae", np.zeros((1, 4, 4, 3), np.uint8), [["a"]], lambda c: None)


def test_a_zero_shot_prompt_the_caption_length_cuts_is_named_in_a_warning(tmp_path):
    """A prompt cut before its class name cannot be classified: the warning says which and by how much."""
    from pipeline.data.tokenizer import CaptionsTruncated, Tokenizer

    make_tokenizer(tmp_path / "tokenizer")
    tokenizer = Tokenizer(tmp_path / "tokenizer")
    templates = ("a handwritten digit {c}", "the digit {c} in white ink on a black background")
    prompts = [[t.format(c=c) for t in templates] for c in ("one", "two")]
    max_len = max(len(tokenizer.sp.encode(ps[0])) for ps in prompts) + 2  # the short prompts just fit
    long = len(tokenizer.sp.encode(prompts[0][1]))
    images = np.zeros((2, 4, 4, 3), np.uint8)
    with pytest.warns(CaptionsTruncated, match=rf"2 of 4 texts .* max_len={max_len} .*"
                                               rf"'{prompts[0][1]}' \({long} pieces\)"):
        class_scores(StubCaptioner(), "caption", images, prompts, lambda caps: tokenizer.encode(caps, max_len, public=True))


WORDS = ["<pad>", "<unk>", "<bos>", "<eos>", "a", "square", "picture", "of", "colour", "red", "green", "blue", "yellow"]


def word_tokenize(captions, max_len=8):
    ids = torch.zeros(len(captions), max_len, dtype=torch.long)
    for i, c in enumerate(captions):
        row = [2] + [WORDS.index(w) for w in c.split()] + [3]
        ids[i, :len(row)] = torch.tensor(row)
    return ids


@pytest.mark.parametrize("objective", ["caption", "clip"])
def test_zero_shot_picks_the_right_prompt_on_a_toy_trained_to_do_so(objective):
    names, templates = ["red", "green", "blue", "yellow"], ["a {c} square", "picture of colour {c}"]
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    model = build_model(objective, {**MICRO, "vocab_size": len(WORDS), "max_len": 8, "text_width": 32,
                                    "text_depth": 1, "text_heads": 2, "embed_dim": 32})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        y = rng.integers(0, 4, 32)
        captions = [templates[rng.integers(2)].format(c=names[i]) for i in y]
        loss = model(to_tensor(colour_images(y, rng)), word_tokenize(captions)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    y = rng.integers(0, 4, 100)
    prompts = [[t.format(c=c) for t in templates] for c in names]
    assert zero_shot_accuracy(model, objective, colour_images(y, rng), y, prompts, word_tokenize) >= 0.95


# -- eval sets ---------------------------------------------------------------------------------

def make_tokenizer(directory):
    import sentencepiece as spm

    from pipeline.data.labelled_sets import DIGITS
    from pipeline.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID

    directory.mkdir(parents=True)
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(DIGITS.captions()))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(directory / "spm"), vocab_size=60,
                                   pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                                   hard_vocab_limit=False, minloglevel=2)
    from pipeline.data.tokenizer import Tokenizer

    return Tokenizer(directory).vocab_size


def make_project(root, objective="caption", nonprivate=True, steps=3):
    """The inputs of `evaluate` on micro models: eval shards, tokenizer, checkpoints, verification."""
    from pipeline.data.shards import ShardWriter, encode_png
    from pipeline.io import write_json

    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 12)
    with ShardWriter(root / "data/shards/eval", prefix="eval", samples_per_shard=50) as w:
        for i, label in enumerate(labels):
            w.write(f"eval-{i:06d}", encode_png(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)), "x",
                    {"label": int(label)})
    write_json(root / "data/shards/stats.json", {"source": "digits"})  # so the digits set is this eval split
    vocab = make_tokenizer(root / "models/tokenizer")
    cfg = {**MICRO, "vocab_size": vocab, "max_len": 12, "text_width": 32, "text_depth": 1, "text_heads": 2,
           "embed_dim": 32}
    torch.manual_seed(1)
    model = build_model(objective, cfg)
    checkpoints.save(root / "models/dp/checkpoint.pt", model, objective=objective, model_cfg=cfg, steps=steps,
                     private=True, config={})
    if nonprivate:
        checkpoints.save(root / "models/dp/nonprivate.pt", model, objective=objective, model_cfg=cfg, steps=steps,
                         private=False, config={})
    checkpoints.save(root / "models/pretrain/checkpoint.pt", build_model("mae", cfg), objective="mae", model_cfg=cfg,
                     steps=0, private=False, config={})
    write_json(root / "models/dp/ledger.json", {"run": "r1", "steps": steps, "epsilon": 3.0})
    write_json(root / "results/privacy/verification.json",
               {"passed": True, "checks": [], "run": "r1", "epsilon": {"pld": 3.0}, "epsilon_reported": 3.0,
                "accountant": "pld", "delta": 1e-5, "steps": steps, "sigma": 1.0, "sample_rate": 0.1, "n": 100})


def evaluate_ctx(tracker=None) -> SimpleNamespace:
    """The evaluate stage's context on the CPU, its MLflow calls recorded."""
    return SimpleNamespace(stage=stage("evaluate"), tracker=tracker if tracker is not None else RecordingTracker(),
                           device="cpu", threads=1)


def eval_params(**overrides):
    import yaml

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    cfg = params["evaluate"]
    cfg.update(fewshot={"shots": [1, 5], "repeats": 2}, **overrides)
    return {"run": {"seed": 0}, "evaluate": cfg, "dp": params["dp"], "privacy": params["privacy"]}


def test_stage_evaluates_dp_model_beside_every_baseline(tmp_path, monkeypatch):
    from pipeline.stages import evaluate

    monkeypatch.chdir(tmp_path)
    make_project(tmp_path)
    tracker = RecordingTracker()
    evaluate.run(eval_params(), evaluate_ctx(tracker))
    metrics = json.loads((tmp_path / "results/eval/metrics.json").read_text())
    assert metrics["model_order"] == ["dp", "nonprivate", "synthetic", "pixels", "random"]
    digits = metrics["sets"]["digits"]
    assert digits["n_probe_train"] + digits["n_probe_test"] == 120 and len(digits["classes"]) == 10
    for name, r in digits["results"].items():
        lo, hi = r["linear_probe_ci"]  # a 95% interval over the 60 test images around the accuracy
        assert 0 <= lo <= r["linear_probe"] <= hi <= 1 and hi - lo > 0.05
        assert set(r["fewshot_logreg"]) == {"1", "5"} and len(r["fewshot_logreg"]["5"]["runs"]) == 2
        assert "fewshot_finetune" not in r  # off by default
        # Zero-shot needs a text tower: the synthetic-only encoder and the pixels have none.
        assert ("zero_shot" in r) == (name not in ("synthetic", "pixels"))
        assert ("zero_shot_ci" in r) == ("zero_shot" in r)
    # The DP model against each baseline, paired on the same test images; against itself nothing.
    assert set(digits["dp_versus"]) == {"nonprivate", "synthetic", "pixels", "random"}
    pixels = digits["dp_versus"]["pixels"]
    assert pixels["diff"] == pytest.approx(digits["results"]["dp"]["linear_probe"]
                                           - digits["results"]["pixels"]["linear_probe"])
    assert pixels["ci"][0] <= pixels["diff"] <= pixels["ci"][1]
    # The same checkpoint here: no discordance seen, the floor of two models that agree on every image
    floor = paired_wald(0, 0, digits["n_probe_test"])
    assert digits["dp_versus"]["nonprivate"] == {"diff": 0.0, "ci": pytest.approx(floor)}
    assert tracker.metrics["digits.dp.linear_probe_ci_lo"] == digits["results"]["dp"]["linear_probe_ci"][0]
    assert tracker.metrics["digits.dp.zero_shot"] == digits["results"]["dp"]["zero_shot"]
    assert tracker.metrics["dp_linear_probe_acc"] == digits["results"]["dp"]["linear_probe"]
    assert tracker.metrics["epsilon"] == 3.0 and tracker.tags["dpfm.objective"] == "caption"
    assert tracker.tags["dpfm.model_private"] == "true"  # the checkpoint's own flag (a test run's is false)
    # ε is the DP model's own; how many DP trainings the row pools, and where their composition is, beside it
    assert metrics["privacy"]["dp_trainings"] == 1 and metrics["privacy"]["epsilon_composed_in"].endswith("privacy.json")
    # What is known by now to leave ε (the final verdict is the report's): nothing here; a curve's ε = ∞
    # point, an earlier release on the budget (as verify found it) would be named beside the ε logged.
    assert metrics["privacy"]["not_private"] == [] and "dpfm.private" not in tracker.tags
    from pipeline.io import write_json

    write_json(tmp_path / "results/curve/curve.json", {"points": [{"init": "pretrain", "epsilon": 8.0},
                                                                 {"init": "pretrain", "epsilon": "inf"}]})
    ver = {"composition_at_verify": {"outside_dp": ["a twin"]}}
    assert evaluate.known_not_private(eval_params(), tmp_path / "data/shards/stats.json",
                                      tmp_path / "results/curve/curve.json", ver) == [
        "data/budget records releases of its examples made without DP, here or in an earlier run (a twin): every ε "
        "composed over it is ∞", "the curve's ε = ∞ point trains without DP on the private shards"]


def test_an_evaluate_run_of_a_test_run_is_tagged_not_private_beside_the_epsilon_it_logs(tmp_path, monkeypatch):
    """evaluate logged the model's ε with nothing beside it to say the run is NOT PRIVATE."""
    from pipeline.stages import evaluate

    monkeypatch.chdir(tmp_path)
    make_project(tmp_path)
    tracker, params = RecordingTracker(), eval_params()
    params["privacy"] = {**params["privacy"], "testing": True}
    evaluate.run(params, evaluate_ctx(tracker))
    assert "epsilon" in tracker.metrics and tracker.tags["dpfm.private"] == "false"
    assert "a test run" in tracker.tags["dpfm.not_private"]
    metrics = json.loads((tmp_path / "results/eval/metrics.json").read_text())
    assert metrics["privacy"]["not_private"] == [tracker.tags["dpfm.not_private"]]


def test_stage_intervals_cover_the_probe_refits_and_keep_the_accuracies(tmp_path, monkeypatch):
    """evaluate.probe_refits: the same accuracies, intervals that also cover which images the probe
    was fit on (wider), and the DP model against a copy of itself still only the floor of models that
    agree on every test image (refit r of each is fit on the same images)."""
    from pipeline.stages import evaluate

    monkeypatch.chdir(tmp_path)
    make_project(tmp_path)
    runs = {}
    for refits in (0, 8):
        # probe_c fixed: auto picks a C at which noise images fit alike
        evaluate.run(eval_params(probe_refits=refits, probe_c=1.0), evaluate_ctx())
        runs[refits] = json.loads((tmp_path / "results/eval/metrics.json").read_text())
    assert runs[8]["protocol"]["probe_refits"] == 8
    plain, refit = (runs[k]["sets"]["digits"] for k in (0, 8))
    width = lambda ci: ci[1] - ci[0]  # noqa: E731
    for name, r in refit["results"].items():
        assert r["linear_probe"] == plain["results"][name]["linear_probe"]
        lo, hi = r["linear_probe_ci"]
        assert lo <= r["linear_probe"] <= hi
    assert (sum(width(r["linear_probe_ci"]) for r in refit["results"].values())
            > sum(width(r["linear_probe_ci"]) for r in plain["results"].values()))
    floor = paired_wald(0, 0, refit["n_probe_test"])
    assert refit["dp_versus"]["nonprivate"] == {"diff": 0.0, "ci": pytest.approx(floor)}
    pixels = refit["dp_versus"]["pixels"]
    assert pixels["diff"] == plain["dp_versus"]["pixels"]["diff"]
    assert width(pixels["ci"]) > width(plain["dp_versus"]["pixels"]["ci"])


def test_stage_refuses_a_checkpoint_the_verification_does_not_cover(tmp_path, monkeypatch):
    from pipeline.io import write_json
    from pipeline.stages import evaluate

    monkeypatch.chdir(tmp_path)
    make_project(tmp_path, objective="mae", nonprivate=False, steps=3)
    ver = json.loads((tmp_path / "results/privacy/verification.json").read_text())
    (tmp_path / "results/privacy/verification.json").write_text(json.dumps({**ver, "steps": 2}))
    with pytest.raises(VerificationFailed, match="2 verified steps vs 3 applied"):
        evaluate.run(eval_params(), evaluate_ctx())
    # dp-train run again at another ε, the same steps, and evaluate run by hand before verify: the
    # verification left is the earlier run's, and its ε would be logged beside the new model.
    (tmp_path / "results/privacy/verification.json").write_text(json.dumps({**ver, "run": "r0"}))
    with pytest.raises(VerificationFailed, match="another DP run"):
        evaluate.run(eval_params(), evaluate_ctx())
    # ... and so is the curve left by the earlier run (another recipe's points), published beside the new
    # model's accuracies: curve.json names the run it was made beside.
    (tmp_path / "results/privacy/verification.json").write_text(json.dumps(ver))
    write_json(tmp_path / "results/curve/curve.json", {"run": "r0", "points": []})
    with pytest.raises(VerificationFailed, match=r"curve.json was made for another DP run .* run `dpfm curve`"):
        evaluate.run(eval_params(), evaluate_ctx())


def test_evaluate_set_gives_the_same_results_streamed_as_in_memory(tmp_path, monkeypatch):
    from pipeline.data.tokenizer import Tokenizer
    from pipeline.stages import evaluate

    monkeypatch.chdir(tmp_path)
    make_project(tmp_path)
    finetune = {"enabled": True, "shots": [1], "repeats": 1, "epochs": 2, "batch_size": 8, "lr": 1e-3,
                "weight_decay": 0.0}
    cfg = eval_params(finetune=finetune)["evaluate"]
    candidates = evaluate.load_candidates(stage("evaluate"), ["random"], 0, with_text=True)
    tokenizer = Tokenizer("models/tokenizer")
    tokenize = lambda cand: lambda captions: tokenizer.encode(captions, cand.max_len)  # noqa: E731
    streamed = load_eval_set({"name": "digits", "source": "digits"}, 16)
    in_memory = EvalSet(streamed.name, streamed.images[:], streamed.labels, streamed.classes, streamed.templates)
    streamed_r, in_memory_r = (evaluate.evaluate_set(es, candidates, cfg, 0, "cpu", tokenize)
                               for es in (streamed, in_memory))
    assert set(streamed_r["results"]["dp"]) == {"linear_probe", "linear_probe_ci", "fewshot_logreg",
                                                  "fewshot_finetune", "zero_shot", "zero_shot_ci", "seeds"}
    assert streamed_r == in_memory_r
    # Integer labels no `classes` names: prompts would name bare numbers, so no zero-shot is scored.
    unnamed = EvalSet(streamed.name, streamed.images[:200], streamed.labels[:200], streamed.classes,
                      streamed.templates, named=False)
    cfg = {**cfg, "fewshot": {**cfg["fewshot"], "shots": []}, "finetune": {**finetune, "enabled": False}}
    assert "zero_shot" not in evaluate.evaluate_set(unnamed, candidates, cfg, 0, "cpu", tokenize)["results"]["dp"]


def test_pixel_baseline_features_are_the_normalised_pixels_at_most_32_px():
    from pipeline.eval.probe import pixel_features

    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    assert np.allclose(pixel_features(small), to_tensor(small).flatten(1).numpy())
    large = np.repeat(np.repeat(rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8), 2, axis=1), 2, axis=2)
    x = pixel_features(large)  # 64 px of 2x2 blocks: area pooling to 32 px gives back the blocks
    assert x.shape == (5, 3 * 32 * 32)
    assert np.allclose(x, to_tensor(large[:, ::2, ::2]).flatten(1).numpy(), atol=1e-5)
    noisy = rng.integers(0, 256, (5, 64, 64, 3), dtype=np.uint8)  # area pooling, not a pick of one pixel in four
    expected = torch.nn.functional.avg_pool2d(to_tensor(noisy), 2).flatten(1).numpy()
    assert np.allclose(pixel_features(noisy), expected, atol=1e-5)


def test_every_protocol_fits_on_probe_train_and_scores_probe_test(monkeypatch):
    """Each image carries its own index (in its first pixel and its features' first column), so every
    protocol can be asked which images it was handed: auto's C, the probe, its refits and the K-shot fits
    on probe-train only; every score on all of probe-test, against its own labels; zero-shot on the
    probe-test images. Fitting on test rows or scoring the wrong part read near-perfect here unnoticed."""
    from pipeline.eval import probe
    from pipeline.stages import evaluate

    rng = np.random.default_rng(0)
    n, classes = 160, 4
    labels = rng.permutation(np.arange(n) % classes)
    images = rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)
    images[:, 0, 0, 0] = np.arange(n)  # the image's index
    es = EvalSet("toy", images, labels, [f"c{i}" for i in range(classes)], ("a photo of a {c}.",))
    tr, te = es.split(0.5, 0)
    x = np.c_[np.arange(n), np.eye(classes)[labels] + rng.normal(scale=0.8, size=(n, classes))].astype(np.float32)
    monkeypatch.setattr(evaluate, "features", lambda *a, **k: x)
    seen = {"c": [], "fit": [], "scored": [], "few": [], "zero": [], "tuned": []}
    chosen_c, probe_correct, fewshot = probe.chosen_c, probe.probe_correct, evaluate.fewshot_logreg
    monkeypatch.setattr(probe, "chosen_c", lambda train_x, *a, **k: seen["c"].append(train_x[:, 0])
                        or chosen_c(train_x, *a, **k))

    def probe_spy(train_x, train_y, test_x, test_y, **kw):
        seen["fit"].append(train_x[:, 0])
        seen["scored"].append((test_x[:, 0], test_y))
        return probe_correct(train_x, train_y, test_x, test_y, **kw)

    def few_spy(train_x, train_y, test_x, test_y, *a):
        seen["few"].append((train_x[:, 0], test_x[:, 0], test_y))
        return fewshot(train_x, train_y, test_x, test_y, *a)

    def zero_spy(model, objective, part, prompts, tokens, device):
        index = part[:][:, 0, 0, 0].astype(int)
        seen["zero"].append(index)
        return np.eye(classes)[labels[index]]  # a text tower right on every image it is shown

    def finetune_spy(encoder, train_images, train_y, test_images, test_y, num_classes, shots, repeats, train_cfg,
                     *a):
        seen["tuned"].append((train_images[:][:, 0, 0, 0], train_y, test_images[:][:, 0, 0, 0], test_y,
                              (num_classes, shots, repeats, train_cfg)))
        return {}

    monkeypatch.setattr(probe, "probe_correct", probe_spy)
    monkeypatch.setattr(evaluate, "fewshot_logreg", few_spy)
    monkeypatch.setattr(evaluate, "class_scores", zero_spy)
    monkeypatch.setattr(evaluate, "fewshot_finetune", finetune_spy)
    finetune = {"enabled": True, "shots": [2, 5], "repeats": 3, "epochs": 7, "batch_size": 6, "lr": 2e-4,
                "weight_decay": 0.3}
    cfg = {**eval_params(probe_c="auto", probe_refits=3)["evaluate"], "finetune": finetune}
    candidates = [evaluate.Candidate("dp", "DP", "x", object(), text_model=object(), objective="caption"),
                  evaluate.Candidate("random", "Random", "x", None)]
    result = evaluate.evaluate_set(es, candidates, cfg, 0, "cpu", lambda cand: None)
    train, test = set(tr.tolist()), te.tolist()
    assert seen["c"] and all(c.tolist() == tr.tolist() for c in seen["c"])
    assert len(seen["fit"]) == 2 * (1 + 3) and all(set(f.tolist()) <= train for f in seen["fit"])
    assert all(s.tolist() == test and np.array_equal(y, labels[te]) for s, y in seen["scored"])
    assert len(seen["few"]) == 2
    assert all(set(f.tolist()) <= train and s.tolist() == test and np.array_equal(y, labels[te])
               for f, s, y in seen["few"])
    assert [z.tolist() for z in seen["zero"]] == [test] and result["results"]["dp"]["zero_shot"] == 1.0
    [(tuned_on, tuned_y, tuned_test, tuned_test_y, how)] = seen["tuned"]  # the encoder's own model only
    assert tuned_on.tolist() == tr.tolist() and np.array_equal(tuned_y, labels[tr])
    assert tuned_test.tolist() == test and np.array_equal(tuned_test_y, labels[te])
    assert how == (classes, [2, 5], 3, {k: finetune[k] for k in ("epochs", "batch_size", "lr", "weight_decay")})
    assert 0.5 < result["results"]["dp"]["linear_probe"] < 0.95  # a probe of these noisy features, not of the index


def test_the_synthetic_baseline_is_the_warm_starts_encoder_and_random_init_follows_its_seed(tmp_path, monkeypatch):
    """Synthetic-only (Syn-ViP) is the pretrain checkpoint's encoder, not the DP model's; random init is a
    function of its seed alone, whatever the global stream did before."""
    from pipeline.stages import evaluate

    monkeypatch.chdir(tmp_path)
    make_project(tmp_path)
    candidates = evaluate.load_candidates(stage("evaluate"), ["synthetic"], 0, with_text=False)
    [synthetic] = [c for c in candidates if c.name == "synthetic"]
    warm = checkpoints.load(tmp_path / "models/pretrain/checkpoint.pt").encoder
    dp = checkpoints.load(tmp_path / "models/dp/checkpoint.pt").encoder
    got = synthetic.encoder.state_dict()
    assert set(got) == set(warm) and all(torch.equal(got[k], warm[k]) for k in warm)
    assert not all(torch.equal(got[k], dp[k]) for k in warm)

    def random_weights(seed):
        torch.rand(7)  # whatever ran before
        encoder = evaluate.random_candidate("mae", MICRO, seed, False).encoder
        return torch.cat([v.flatten() for v in encoder.state_dict().values()])
    assert torch.equal(random_weights(3), random_weights(3)) and not torch.equal(random_weights(3), random_weights(4))


def test_stage_refuses_a_verification_whose_checks_failed(tmp_path, monkeypatch):
    """A verification of the very steps applied, but failed: it vouches for nothing, and evaluate would log
    its ε beside the model."""
    from pipeline.stages import evaluate

    monkeypatch.chdir(tmp_path)
    make_project(tmp_path, objective="mae", nonprivate=False)
    ver = json.loads((tmp_path / "results/privacy/verification.json").read_text())
    (tmp_path / "results/privacy/verification.json").write_text(json.dumps({**ver, "passed": False}))
    with pytest.raises(VerificationFailed, match="passed=False"):
        evaluate.run(eval_params(), evaluate_ctx())
    assert not (tmp_path / "results/eval/metrics.json").exists()


def test_evaluate_tags_not_private_what_verify_found_outside_dp_and_a_model_saved_not_private(tmp_path, monkeypatch):
    """The ε evaluate logs must carry what is known to leave it: a release outside DP that verify found on the
    budget (not only the params'), and the checkpoint's own `private: false` (a test run's model)."""
    from pipeline.stages import evaluate

    monkeypatch.chdir(tmp_path)
    make_project(tmp_path, objective="mae", nonprivate=False)
    ver = json.loads((tmp_path / "results/privacy/verification.json").read_text())
    ver["composition_at_verify"] = {"outside_dp": ["a twin"]}
    (tmp_path / "results/privacy/verification.json").write_text(json.dumps(ver))
    ckpt = checkpoints.load(tmp_path / "models/dp/checkpoint.pt")
    checkpoints.save(tmp_path / "models/dp/checkpoint.pt", ckpt.build_model(), objective="mae",
                     model_cfg=ckpt.model_cfg, steps=ckpt.steps, private=False, config={})
    tracker = RecordingTracker()
    evaluate.run(eval_params(), evaluate_ctx(tracker))
    assert tracker.tags["dpfm.private"] == "false" and "(a twin)" in tracker.tags["dpfm.not_private"]
    assert tracker.tags["dpfm.model_private"] == "false"
    metrics = json.loads((tmp_path / "results/eval/metrics.json").read_text())
    assert any("(a twin)" in reason for reason in metrics["privacy"]["not_private"])


def test_extra_seeds_are_the_recipes_trainings_at_each_seed_and_the_tables_rest_stays_the_first_seeds(tmp_path,
                                                                                                    monkeypatch):
    """train_point stubbed (a fresh model per call), so the stage's own handling is measured: each extra
    seed trains the DP recipe (its init and ε) and its twin at that seed, each under its own metric names;
    the rows probe and zero-shot those models, not the first seed's again; few-shot, the table's models and
    their order stay the released checkpoints'; the metrics count every DP training the row pools."""
    from pipeline.privacy import training
    from pipeline.stages import evaluate

    monkeypatch.chdir(tmp_path)
    make_project(tmp_path)  # caption, with a non-private twin
    mcfg = checkpoints.load(tmp_path / "models/dp/checkpoint.pt").model_cfg
    trained, models = [], []

    def stub(p, ctx, init, epsilon, metrics_as):
        trained.append((p["run"]["seed"], init, epsilon, metrics_as))
        torch.manual_seed(100 + len(trained))
        models.append(build_model("caption", mcfg))
        return models[-1], None if math.isinf(epsilon) else 3.0, True
    monkeypatch.setattr(training, "train_point", stub)
    featurized, scored, features, class_scores = [], [], evaluate.features, evaluate.class_scores
    monkeypatch.setattr(evaluate, "features", lambda encoder, *a, **k: featurized.append(encoder)
                        or features(encoder, *a, **k))
    monkeypatch.setattr(evaluate, "class_scores", lambda model, *a: scored.append(model) or class_scores(model, *a))
    runs = {}
    for seeds in (1, 3):
        params = eval_params(seeds=seeds)
        evaluate.run(params, evaluate_ctx())
        runs[seeds] = json.loads((tmp_path / "results/eval/metrics.json").read_text())
    dp = params["dp"]
    assert [t[:3] for t in trained] == [(1, dp["init"], dp["epsilon"]), (1, dp["init"], math.inf),
                                        (2, dp["init"], dp["epsilon"]), (2, dp["init"], math.inf)]
    assert trained[0][3] != trained[2][3]  # each seed's per-step metrics under its own names
    assert all(any(f is m.encoder for f in featurized) for m in models)
    assert all(any(s is m for s in scored) for m in models)
    one, three = runs[1], runs[3]
    assert three["model_order"] == one["model_order"] and three["models"] == one["models"]
    assert three["privacy"]["dp_trainings"] == 1 + sum(math.isfinite(t[2]) for t in trained)
    for name, r in three["sets"]["digits"]["results"].items():
        assert r["fewshot_logreg"] == one["sets"]["digits"]["results"][name]["fewshot_logreg"], name


def test_chance_is_the_majority_share_of_the_images_scored(monkeypatch):
    """An official split whose test part is not balanced as its train part is: chance, the floor each
    accuracy is read against, is the most frequent class's share of the images scored (probe-test)."""
    from pipeline.stages import evaluate

    rng = np.random.default_rng(0)
    labels = np.r_[np.arange(40) % 2, np.zeros(15, int), np.ones(5, int)]  # train part 50/50, test part 75/25
    es = EvalSet("toy", rng.integers(0, 256, (60, 8, 8, 3), dtype=np.uint8), labels, ["a", "b"],
                 ("a photo of a {c}.",), parts=(np.arange(40), np.arange(40, 60)))
    monkeypatch.setattr(evaluate, "features", lambda *a, **k: rng.normal(size=(60, 4)).astype(np.float32))
    cfg = {**eval_params()["evaluate"], "fewshot": {"shots": [], "repeats": 1}, "zero_shot": False}
    result = evaluate.evaluate_set(es, [evaluate.Candidate("dp", "DP", "x", object())], cfg, 0, "cpu", lambda c: None)
    assert result["n_probe_test"] == 20 and result["chance"] == pytest.approx(15 / 20)


def test_two_images_of_the_rarest_class_are_enough_to_cross_validate_c():
    """auto chooses C on stratified folds of probe-train, each holding out an image of every class: two
    images of the rarest class make two such folds, and only a class of one (1-shot) leaves C at 1."""
    y = np.array([0, 0, 1, 1, 1, 1, 2, 2, 2])
    folds = auto_folds(y, 0)
    assert folds is not None and folds.get_n_splits() == 2
    assert all(set(y[held]) == {0, 1, 2} for _, held in folds.split(y, y))
    assert auto_folds(y[1:], 0) is None


def test_auto_cs_folds_follow_the_seed():
    """The folds C is chosen on are shuffled by the evaluation's seed: the same seed the same folds, another
    seed others, as every other draw of the protocol follows it."""
    y = np.arange(60) % 3
    held = {s: [tuple(h) for _, h in auto_folds(y, s).split(y, y)] for s in (0, 1)}
    assert held[0] == [tuple(h) for _, h in auto_folds(y, 0).split(y, y)]
    assert held[0] != held[1]
