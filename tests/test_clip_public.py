"""clip-public (Dp-CLIP's model scored against public captions): its loss splits per sample, which
is what lets per-example clipping bound one example's effect by C; its text tower stays at its seeded
init; a public caption equal to the example's own is not its negative."""

import torch
import torch.nn as nn
import stage_runs
import yaml

from pipeline.config import apply_overrides
from pipeline.data.tokenizer import Tokenizer, public_captions
from pipeline.models import ModelConfig, build_model
from pipeline.privacy.training import public_negative_tokens

PAD = 0
MICRO = dict(size="micro", img_size=16, patch_size=4, vocab_size=50, max_len=12, pad_id=PAD, public_negatives=6)


def micro(**overrides) -> nn.Module:
    torch.manual_seed(0)
    return build_model("clip-public", {**MICRO, **overrides}).eval()


def images(b: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def captions(b: int, seed: int = 2) -> torch.Tensor:
    """Right-padded captions of different lengths: BOS, words, EOS."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((b, 12), PAD, dtype=torch.long)
    for i in range(b):
        n = 3 + i % 8
        out[i, 0], out[i, n + 1] = 1, 2
        out[i, 1:n + 1] = torch.randint(4, 50, (n,), generator=g)
    return out


def test_clip_public_loss_splits_per_sample():
    """clip-public scores each image against its own caption and the public captions only: another
    example changing moves no other example's loss or gradient (the coupling clip has, above)."""
    model = micro()
    imgs, toks = images(4), captions(4)
    changed_imgs, changed_toks = imgs.clone(), toks.clone()
    changed_imgs[1], changed_toks[1] = images(1, seed=9)[0], captions(4, seed=9)[1]
    params = [p for p in model.parameters() if p.requires_grad]
    assert not any(p.requires_grad for p in [*model.text.parameters(), *model.text_proj.parameters()])

    def loss_and_grad(i, x, t):
        loss = model(x, t)
        return loss[i], torch.autograd.grad(loss[i], params, allow_unused=True)

    for i in (0, 2, 3):
        (a, ga), (b, gb) = loss_and_grad(i, imgs, toks), loss_and_grad(i, changed_imgs, changed_toks)
        assert torch.equal(a, b)
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(ga, gb))
    assert not torch.isclose(model(imgs, toks)[1], model(changed_imgs, changed_toks)[1])
    # Its own caption among the public ones is left out of its row (not a negative of itself).
    own = model.public_negatives[2:3]
    with torch.no_grad():
        img, negatives = model.encode_image(imgs[:1]), model.encode_text(model.public_negatives)
        logits = model._scale(img) * torch.cat([img @ negatives[2:3].t(), img @ negatives.t()], 1)
        left_out = torch.cat([logits[:, :3], logits[:, 4:]], 1)  # its own caption, then the others
        assert torch.allclose(model(imgs[:1], own), nn.functional.cross_entropy(left_out, torch.zeros(1, dtype=torch.long)))
        assert not torch.allclose(model(imgs[:1], own), nn.functional.cross_entropy(logits, torch.zeros(1, dtype=torch.long)))


def test_a_public_caption_that_shares_tokens_with_the_examples_own_stays_its_negative():
    """Captions all begin with BOS and end in padding: only a caption equal at every position is left out
    of a row. One left out for sharing any token would leave no negative, a loss of 0 and nothing to learn."""
    model = micro()
    model.set_public_negatives(captions(6, seed=5))
    toks = captions(2, seed=7)
    assert (toks[:, :1] == model.public_negatives[:, 0]).all()  # the same BOS in every caption
    with torch.no_grad():
        img, txt = model.encode_image(images(2)), model.encode_text(toks)
        negatives = model.encode_text(model.public_negatives)
        logits = model._scale(img).unsqueeze(1) * torch.cat([(img * txt).sum(-1, keepdim=True), img @ negatives.t()], 1)
        want = nn.functional.cross_entropy(logits, torch.zeros(2, dtype=torch.long), reduction="none")
        assert torch.allclose(model(images(2), toks), want) and (want > 0).all()


def test_the_public_negatives_are_k_captions_the_same_on_every_call_labelled_ones_first(data_dir):
    """Every rank and every run scores images against the same K public captions (a seeded draw): another
    set on one rank would be another loss, another gradient than the one clipped elsewhere."""
    params = apply_overrides(yaml.safe_load((data_dir / "params.yaml").read_text()), stage_runs.MICRO)
    tokenizer = Tokenizer(data_dir / "models/tokenizer")
    labelled, _ = public_captions()
    for k in (len(labelled) // 2, len(labelled) + 40):
        cfg = ModelConfig.from_params({**params["model"], "public_negatives": k}, "clip-public", tokenizer.vocab_size)
        tokens = public_negative_tokens(tokenizer, cfg)
        assert tokens.shape == (k, cfg.max_len) and torch.equal(tokens, public_negative_tokens(tokenizer, cfg))
        first = labelled[:min(k, len(labelled))]
        assert torch.equal(tokens[:len(first)], tokenizer.encode(list(first), cfg.max_len))
