"""Tests for pipeline.models: shapes, sizes, per-sample structure of the losses, DP-hookability
and torch.func per-sample gradients.  Everything runs on tiny models except parameter
counting, which builds the big ones on the meta device (no memory, no compute)."""

import io
import math
import warnings

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

from pipeline.models import (
    CLIP,
    VIT_SIZES,
    BroadcastParameter,
    Captioner,
    MaskedAutoencoder,
    VisionTransformer,
    build_encoder,
    build_model,
    patchify,
    random_masking,
    unpatchify,
)
from pipeline.privacy.layer_rules import SUPPORTED_LAYERS
from pipeline.models.config import NOT_READ, ModelConfig
from pipeline.models.layers import Attention, Block, CrossAttention, sincos_pos_embed_2d

# The CPU SDPA kernel has no vmap batching rule; torch falls back to a loop and warns.
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")

PAD = 0
VOCAB = 50
MICRO = dict(size="micro", img_size=16, patch_size=4, vocab_size=VOCAB, max_len=12, pad_id=PAD)
L_MICRO = (16 // 4) ** 2


def micro(objective: str, **overrides) -> nn.Module:
    torch.manual_seed(0)
    return build_model(objective, {**MICRO, **overrides}).eval()


def images(b: int, seed: int = 1, size: int = 16) -> torch.Tensor:
    return torch.randn(b, 3, size, size, generator=torch.Generator().manual_seed(seed))


def captions(b: int, seed: int = 2, max_len: int = 12) -> torch.Tensor:
    """Right-padded captions of different lengths: BOS=1, words in [3, VOCAB), EOS=2."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((b, max_len), PAD, dtype=torch.long)
    for i in range(b):
        n = 3 + i % (max_len - 4)  # number of words
        out[i, 0] = 1
        out[i, 1 : n + 1] = torch.randint(3, VOCAB, (n,), generator=g)
        out[i, n + 1] = 2
    return out


def mask_noise(b: int, seed: int = 3) -> torch.Tensor:
    return torch.rand(b, L_MICRO, generator=torch.Generator().manual_seed(seed))


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ----------------------------------------------------------------------------- sizes / shapes


def test_size_table_matches_vip_widths():
    widths = {k: v["width"] for k, v in VIT_SIZES.items()}
    assert widths["nano"] == 192 and widths["tiny"] == 384 and widths["small"] == 576
    assert VIT_SIZES["base"] == dict(width=768, depth=12, heads=12)
    assert VIT_SIZES["large"] == dict(width=1024, depth=24, heads=16)
    for name, arch in VIT_SIZES.items():
        assert arch["width"] % arch["heads"] == 0, name
        assert arch["width"] % 4 == 0, name  # 2-D sin-cos embedding


@pytest.mark.parametrize("size", ["nano", "tiny", "small", "base", "large"])
def test_paper_size_shapes_on_meta(size):
    with torch.device("meta"):
        vit = build_encoder({"size": size})
        imgs = torch.empty(2, 3, 224, 224)
        tokens, mask, ids_restore = vit.forward_features(imgs, mask_ratio=0.75, noise=torch.rand(2, 196))
        feats = vit.encode(imgs)
        mae = build_model("mae", {"size": size})
        loss = mae(imgs, noise=torch.rand(2, 196))
    width = VIT_SIZES[size]["width"]
    assert tokens.shape == (2, 1 + 49, width)
    assert mask.shape == ids_restore.shape == (2, 196)
    assert feats.shape == (2, width)
    assert loss.shape == (2,)


@pytest.mark.parametrize("size", ["micro", "pico", "cpu"])
def test_small_size_shapes(size):
    torch.manual_seed(0)
    vit = build_encoder({"size": size})  # micro: 16 px, cpu: 32 px, both patch 4
    imgs = torch.randn(2, 3, vit.img_size, vit.img_size)
    tokens, mask, _ = vit.forward_features(imgs)
    assert tokens.shape == (2, 1 + vit.num_patches, VIT_SIZES[size]["width"])
    assert mask.sum() == 0
    assert vit(imgs).shape == vit.encode(imgs, pool="mean").shape == (2, VIT_SIZES[size]["width"])
    for objective in ("mae", "caption", "clip"):
        model = build_model(objective, {"size": size, "vocab_size": VOCAB})
        args = (imgs,) if objective == "mae" else (imgs, captions(2, max_len=12))
        assert model(*args).shape == (2,)


def test_param_counts_match_published_vits():
    with torch.device("meta"):
        counts = {size: n_params(build_encoder({"size": size})) for size in VIT_SIZES}
    # ViT-B/16 86M and ViT-L/16 304M (Dosovitskiy et al.); no classifier head, fixed pos-embed.
    assert abs(counts["base"] - 86e6) / 86e6 < 0.01, counts["base"]
    assert abs(counts["large"] - 304e6) / 304e6 < 0.01, counts["large"]
    order = ["micro", "pico", "cpu", "nano", "tiny", "small", "base", "large"]
    assert all(counts[a] < counts[b] for a, b in zip(order, order[1:])), counts


def test_paper_default_heads():
    with torch.device("meta"):
        mae = build_model("mae", {"size": "base"})
        cap = build_model("caption", {"size": "base", "vocab_size": 1000})
    assert mae.mask_ratio == 0.75 and len(mae.decoder_blocks) == 4
    assert mae.decoder_embed.out_features == 512
    assert len(cap.decoder.blocks) == 6 and cap.head.in_features == 768
    assert cap.decoder.max_len == 40 and cap.mask_ratio == 0.0
    # DP-Cap decoder: no biases anywhere; the output projection is untied from the embedding.
    assert all("bias" not in name for name, _ in cap.decoder.named_parameters())
    assert cap.head.weight is not cap.decoder.token_embed.weight


# ----------------------------------------------------------------------------- ViT pieces


def test_patchify_roundtrip_and_layout():
    imgs = images(2, size=8)
    x = patchify(imgs, 4)
    assert x.shape == (2, 4, 4 * 4 * 3)
    assert torch.equal(unpatchify(x, 4, 3), imgs)
    # Patch 1 is the top-right 4x4 block; pixels are ordered (row, col, channel).
    assert torch.equal(x[0, 1].view(4, 4, 3), imgs[0, :, :4, 4:].permute(1, 2, 0))


def test_sincos_matches_mae_reference():
    import numpy as np

    def mae_1d(dim, pos):  # MAE's get_1d_sincos_pos_embed_from_grid
        omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    dim, g = 16, 3
    grid = np.stack(np.meshgrid(np.arange(g, dtype=np.float32), np.arange(g, dtype=np.float32)), axis=0)
    ref = np.concatenate([mae_1d(dim // 2, grid[0]), mae_1d(dim // 2, grid[1])], axis=1)
    ref = np.concatenate([np.zeros([1, dim]), ref], axis=0)
    assert torch.allclose(sincos_pos_embed_2d(dim, g), torch.from_numpy(ref).float(), atol=1e-6)


def test_pos_embed_is_fixed_buffer():
    vit = build_encoder(MICRO)
    assert "pos_embed" in dict(vit.named_buffers())
    assert "pos_embed" not in vit.state_dict()
    assert all("pos_embed" not in name for name, _ in vit.named_parameters())


def test_random_masking_uses_given_noise():
    x = torch.arange(2 * 8, dtype=torch.float).view(2, 8, 1)
    noise = torch.tensor([[0.9, 0.1, 0.8, 0.2, 0.7, 0.3, 0.6, 0.4]] * 2)
    noise[1] = noise[1].flip(0)
    kept, mask, ids_restore = random_masking(x, 0.75, noise)
    assert kept.shape == (2, 2, 1)
    assert kept[0].flatten().tolist() == [1.0, 3.0]  # the two smallest noise values
    assert kept[1].flatten().tolist() == [8 + 6.0, 8 + 4.0]
    assert mask.sum(1).tolist() == [6.0, 6.0]
    assert mask[0].tolist() == [1, 0, 1, 0, 1, 1, 1, 1]
    assert torch.equal(torch.gather(torch.argsort(noise, 1), 1, ids_restore), torch.arange(8).expand(2, 8))


def test_the_mask_counts_patches_exactly_in_bf16_activations():
    """MAE's loss is the sum over masked patches over their count: a bf16 mask (the activations'
    dtype under autocast) reads the 271 masked patches of a 19x19 grid as 272."""
    x = torch.zeros(1, 361, 4, dtype=torch.bfloat16)
    _, mask, _ = random_masking(x, 0.75, torch.rand(1, 361))
    assert mask.dtype == torch.float32 and mask.sum().item() == 361 - int(361 * 0.25)


def test_masked_patches_do_not_reach_encoder():
    vit = build_encoder(MICRO)
    imgs, noise = images(1), mask_noise(1)
    out, mask, _ = vit.forward_features(imgs, 0.75, noise)
    hidden = mask[0].bool().view(4, 4).repeat_interleave(4, 0).repeat_interleave(4, 1)
    changed = imgs.clone()
    changed[0, :, hidden] += 5.0
    out2, _, _ = vit.forward_features(changed, 0.75, noise)
    assert torch.allclose(out, out2)
    changed[0, :, ~hidden] += 5.0
    assert not torch.allclose(out, vit.forward_features(changed, 0.75, noise)[0])


# ----------------------------------------------------------------------------- DP structure


def non_dp_parameter_owners(model: nn.Module) -> list[str]:
    """Modules owning parameters directly that a per-sample engine would not know how to hook."""
    return [
        f"{name or '<root>'}:{type(m).__name__}"
        for name, m in model.named_modules()
        if list(m.parameters(recurse=False)) and not isinstance(m, SUPPORTED_LAYERS)
    ]


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_only_allowed_leaf_types_own_parameters(objective):
    model = micro(objective)
    assert non_dp_parameter_owners(model) == []
    owned = sum(p.numel() for m in model.modules() if isinstance(m, SUPPORTED_LAYERS)
                for p in m.parameters(recurse=False))
    assert owned == n_params(model) > 0
    for m in model.modules():  # token leaves hold exactly one parameter
        if isinstance(m, BroadcastParameter):
            assert len(list(m.parameters())) == 1 and len(list(m.children())) == 0


def test_leaf_checker_catches_forbidden_layers():
    bad = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.MultiheadAttention(4, 2))
    bad.extra = nn.Parameter(torch.zeros(1))
    assert non_dp_parameter_owners(bad) == ["<root>:Sequential", "0:Conv2d", "1:BatchNorm2d",
                                            "2:MultiheadAttention"]


def test_mae_losses_are_per_sample():
    model = micro("mae")
    imgs, noise = images(4), mask_noise(4)
    loss = model(imgs, noise=noise)
    assert loss.shape == (4,) and torch.all(loss > 0)
    changed = imgs.clone()
    changed[2] = images(1, seed=9)[0]
    loss2 = model(changed, noise=noise)
    keep = torch.tensor([0, 1, 3])
    assert torch.allclose(loss[keep], loss2[keep], atol=1e-6)
    assert not torch.isclose(loss[2], loss2[2])
    # Each sample's loss is the same alone as in a batch.
    assert torch.allclose(model(imgs[1:2], noise=noise[1:2]), loss[1:2], atol=1e-6)


def test_mae_loss_is_mse_on_masked_patches_only():
    model = micro("mae", norm_pix_loss=True)
    imgs, noise = images(2), mask_noise(2)
    # A nearly flat patch (a uniform background), masked: its ε of 1e-6 sits inside the root, not beside it.
    imgs[0, :, :4, :4] = 0.3 + 1e-4 * torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(4))
    noise[0, 0] = 1.0
    loss, pred, mask = model.reconstruct(imgs, noise)
    target = patchify(imgs, 4)
    target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6) ** 0.5
    per_patch = ((pred - target) ** 2).mean(-1)
    expected = torch.stack([per_patch[i][mask[i].bool()].mean() for i in range(2)])
    assert mask.sum(1).tolist() == [12.0, 12.0] and mask[0, 0] == 1
    assert torch.allclose(loss, expected, atol=1e-6)


def test_captioner_losses_are_per_sample():
    model = micro("caption", mask_ratio=0.5)
    imgs, toks, noise = images(4), captions(4), mask_noise(4)
    loss = model(imgs, toks, noise=noise)
    assert loss.shape == (4,)
    assert torch.allclose(loss, torch.full_like(loss, math.log(VOCAB)), rtol=0.2)  # untrained ~ uniform
    changed_imgs, changed_toks = imgs.clone(), toks.clone()
    changed_imgs[1] = images(1, seed=9)[0]
    changed_toks[1] = captions(4, seed=9)[1]
    loss2 = model(changed_imgs, changed_toks, noise=noise)
    keep = torch.tensor([0, 2, 3])
    assert torch.allclose(loss[keep], loss2[keep], atol=1e-6)
    assert not torch.isclose(loss[1], loss2[1])


def test_captioner_ignores_padding():
    model = micro("caption", max_len=20)
    imgs, toks = images(3), captions(3)
    loss = model(imgs, toks)
    padded = torch.cat([toks, torch.full((3, 8), PAD)], dim=1)
    assert torch.allclose(model(imgs, padded), loss, atol=1e-6)
    # ... whereas a real token in place of a pad does count.
    longer = padded.clone()
    longer[0, -1] = 7
    assert not torch.isclose(model(imgs, longer)[0], loss[0])


def test_captioner_loss_is_token_mean_cross_entropy():
    model = micro("caption")
    imgs, toks = images(2), captions(2)
    logits = model.head(model.decoder(toks[:, :-1], model.encode_image(imgs)))
    for i in range(2):
        real = toks[i, 1:] != PAD
        ce = nn.functional.cross_entropy(logits[i][real], toks[i, 1:][real])
        assert torch.allclose(model(imgs, toks)[i], ce, atol=1e-6)


def test_captioner_score_captions_for_zero_shot():
    model = micro("caption")
    imgs, cands = images(3), captions(5, seed=4)
    scores = model.score_captions(imgs, cands, chunk_size=2)
    assert scores.shape == (3, 5)
    for b in range(3):
        for k in range(5):
            direct = model(imgs[b : b + 1], cands[k : k + 1])[0]
            assert torch.allclose(scores[b, k], direct, atol=1e-5)
    assert torch.equal(model.zero_shot_predict(imgs, cands), scores.argmin(1))


def test_clip_loss_is_batch_coupled():
    model = micro("clip")
    imgs, toks = images(4), captions(4)
    loss = model(imgs, toks)
    assert loss.shape == (4,)
    changed_imgs, changed_toks = imgs.clone(), toks.clone()
    changed_imgs[1] = images(1, seed=9)[0]
    changed_toks[1] = captions(4, seed=9)[1]
    loss2 = model(changed_imgs, changed_toks)
    # Every other sample's loss moves: sample 1 is a negative in all of them.
    assert not torch.isclose(loss[0], loss2[0]) and not torch.isclose(loss[3], loss2[3])


def test_clip_embeddings_and_standard_loss():
    model = micro("clip")
    imgs, toks = images(4), captions(4)
    img, txt = model.encode_image(imgs), model.encode_text(toks)
    assert img.shape == txt.shape == (4, 32)
    assert torch.allclose(img.norm(dim=-1), torch.ones(4)) and torch.allclose(txt.norm(dim=-1), torch.ones(4))
    logits = img @ txt.t() / 0.07
    labels = torch.arange(4)
    standard = (nn.functional.cross_entropy(logits, labels) + nn.functional.cross_entropy(logits.t(), labels)) / 2
    assert torch.allclose(model(imgs, toks).mean(), standard, atol=1e-5)
    # Text pooling reads the last real token, so trailing pads do not change the embedding.
    padded = torch.cat([toks, torch.full((4, 3), PAD)], 1)
    big = micro("clip", max_len=15)
    assert torch.allclose(big.encode_text(padded), big.encode_text(toks), atol=1e-6)


def test_the_clip_scale_is_capped_at_100_in_the_forward_pass_too():
    """A log scale past ln 100 (a checkpoint from elsewhere, a step before the clamp after it) scores as
    ln 100 does, and gets no gradient pushing it further."""
    model = micro("clip")
    imgs, toks = images(4), captions(4)
    losses = {}
    for log_scale in (math.log(100.0), math.log(200.0)):
        model.logit_scale.weight.data.fill_(log_scale)
        losses[log_scale] = model(imgs, toks)
    assert torch.allclose(losses[math.log(200.0)], losses[math.log(100.0)])
    (push,) = torch.autograd.grad(losses[math.log(200.0)].sum(), model.logit_scale.weight)
    assert not push.any()


def test_encode_pools_the_cls_token_or_the_patch_tokens_mean_and_text_reads_each_caption():
    model = micro("clip")
    imgs = images(3)
    with torch.no_grad():
        tokens = model.encoder.forward_features(imgs)[0]
        assert torch.allclose(model.encoder.encode(imgs, "cls"), tokens[:, 0])
        assert torch.allclose(model.encoder.encode(imgs, "mean"), tokens[:, 1:].mean(dim=1))
        text = model.encode_text(captions(4))  # four different captions: four embeddings (not one BOS token's)
    assert all(not torch.allclose(text[i], text[j], atol=1e-3) for i in range(4) for j in range(i))


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_every_trainable_parameter_gets_a_gradient(objective):
    """A parameter no gradient reaches is a part of the model left out of its forward pass (a position
    embedding never added, a layer skipped): one batch's losses must move every trainable one."""
    model = micro(objective)
    batch, kwargs = ((images(4),), {"noise": mask_noise(4)}) if objective == "mae" else ((images(4), captions(4)), {})
    model(*batch, **kwargs).sum().backward()
    dead = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.abs().sum())]
    assert not dead, dead


def test_the_encoder_sees_where_each_patch_is():
    """The image shifted by one patch (a cyclic permutation of its patches) reads differently: without
    the position embedding attention is blind to order and the cls token would not move."""
    encoder = micro("mae").encoder
    imgs = images(2)
    with torch.no_grad():
        moved = (encoder.encode(imgs, "cls") - encoder.encode(torch.roll(imgs, 4, dims=3), "cls")).abs().max()
    assert moved > 1e-2


def test_the_mae_decoder_puts_each_token_at_its_own_patch():
    """Without decoder blocks (nothing mixes positions) the prediction at patch j is the head on patch j's
    own input: the kept token from patch j, or the mask token, plus position j's embedding. A missing
    unshuffle or position embedding, or predictions one slot off, move it."""
    model = micro("mae")
    model.decoder_blocks = nn.ModuleList()
    with torch.no_grad():
        latent, mask, ids_restore = model.encoder.forward_features(images(2), model.mask_ratio, mask_noise(2))
        pred = model.forward_decoder(latent, ids_restore)
        kept = torch.argsort(ids_restore, dim=1)[:, :latent.shape[1] - 1]  # the patch of each kept token, in order
        inputs = model.mask_token(latent).expand(2, L_MICRO, -1).clone()
        for b in range(2):
            inputs[b, kept[b]] = model.decoder_embed(latent[b, 1:])
            assert not mask[b, kept[b]].any() and mask[b].sum() == L_MICRO - kept.shape[1]
        expected = model.decoder_pred(model.decoder_norm(inputs + model.decoder_pos_embed[:, 1:]))
    assert torch.allclose(pred, expected, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_is_the_softmax_of_scaled_dot_products(causal):
    torch.manual_seed(0)
    B, L, D, H = 2, 5, 16, 4
    attn, x = Attention(D, H, causal=causal), torch.randn(B, L, D)
    with torch.no_grad():
        q, k, v = attn.qkv(x).reshape(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D // H)
        if causal:  # a token sees itself and the ones before it
            scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        expected = attn.proj((scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, L, D))
        assert torch.allclose(attn(x), expected, atol=1e-5)


def test_a_block_adds_to_its_input_and_normalises_only_what_it_adds():
    """Pre-norm: with the attention's and the MLP's output projections at zero, a block is the identity
    (post-norm would return the input normalised)."""
    block = Block(16, 4)
    with torch.no_grad():
        for layer in (block.attn.proj, block.mlp.fc2):
            layer.weight.zero_()
            layer.bias.zero_()
        x = torch.randn(2, 5, 16) * 3 + 1
        assert torch.equal(block(x), x)


# ----------------------------------------------------------------------------- checkpoints


def test_mae_encoder_loads_into_captioner_and_clip():
    mae = micro("mae")
    buffer = io.BytesIO()
    torch.save(mae.encoder.state_dict(), buffer)
    for objective in ("caption", "clip"):
        torch.manual_seed(123)  # a different init than the MAE
        model = build_model(objective, MICRO)
        imgs = images(2)
        assert not torch.allclose(model.encoder.encode(imgs), mae.encoder.encode(imgs))
        buffer.seek(0)
        model.encoder.load_state_dict(torch.load(buffer), strict=True)
        assert isinstance(model.encoder, VisionTransformer)
        assert torch.allclose(model.encoder.encode(imgs), mae.encoder.encode(imgs))


def test_build_model_rejects_unknown_names():
    with pytest.raises(ValueError):
        build_model("simclr", MICRO)
    with pytest.raises(ValueError):
        build_encoder({"size": "huge"})
    assert isinstance(micro("mae"), MaskedAutoencoder)
    assert isinstance(micro("caption"), Captioner) and isinstance(micro("clip"), CLIP)


# ----------------------------------------------------------------------------- torch.func


def per_sample_grads_vmap(model, batch, kwargs):
    """The first DP engine's recipe: functional_call on a batch of one inside vmap(grad)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())
    arg_names = list(kwargs)

    def loss_one(p, *sample):
        args = [s.unsqueeze(0) for s in sample[: len(batch)]]
        kw = {k: s.unsqueeze(0) for k, s in zip(arg_names, sample[len(batch):])}
        return functional_call(model, (p, buffers), tuple(args), kw).squeeze(0)

    in_dims = (None,) + (0,) * (len(batch) + len(kwargs))
    return vmap(grad(loss_one), in_dims=in_dims)(params, *batch, *kwargs.values())


def per_sample_grads_loop(model, batch, kwargs):
    grads = {k: [] for k, _ in model.named_parameters()}
    for i in range(batch[0].shape[0]):
        model.zero_grad()
        args = [b[i : i + 1] for b in batch]
        kw = {k: v[i : i + 1] for k, v in kwargs.items()}
        model(*args, **kw).sum().backward()
        for k, p in model.named_parameters():
            grads[k].append(p.grad.clone() if p.grad is not None else torch.zeros_like(p))
    return {k: torch.stack(v) for k, v in grads.items()}


@pytest.mark.parametrize("objective", ["mae", "caption"])
def test_vmap_per_sample_grads_match_loop(objective):
    if objective == "mae":
        model, batch = micro("mae"), (images(3),)
    else:
        model, batch = micro("caption", mask_ratio=0.25), (images(3), captions(3))
    kwargs = {"noise": mask_noise(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = per_sample_grads_vmap(model, batch, kwargs)
    slow = per_sample_grads_loop(model, batch, kwargs)
    assert fast.keys() == slow.keys()
    for name in fast:
        assert fast[name].shape == slow[name].shape
        assert torch.allclose(fast[name], slow[name], atol=1e-5, rtol=1e-4), name
    # Non-trivial: samples differ, and the token leaves receive gradient.
    token = "mask_token.weight" if objective == "mae" else "encoder.cls_token.weight"
    assert fast[token].abs().sum() > 0
    assert not torch.allclose(fast[token][0], fast[token][1])


def test_broadcast_parameter_grad_output_is_per_sample_grad():
    """The contract a hook-based engine relies on: for a token leaf, grad_sample = grad_output."""
    model = micro("mae")
    imgs, noise = images(3), mask_noise(3)
    captured = {}

    def keep_grad(name):
        def hook(module, inputs, output):
            output.register_hook(lambda g: captured.__setitem__(name, g))
        return hook

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = per_sample_grads_vmap(model, (imgs,), {"noise": noise})
    model.mask_token.register_forward_hook(keep_grad("mask_token"))
    model.encoder.cls_token.register_forward_hook(keep_grad("encoder.cls_token"))
    model(imgs, noise=noise).sum().backward()
    assert set(captured) == {"mask_token", "encoder.cls_token"}
    for name, g in captured.items():
        assert torch.allclose(g, ref[f"{name}.weight"], atol=1e-6), name


def test_the_params_model_section_is_checked_against_the_model_config():
    """One place for model defaults: every `model` key of params.yaml and of its schema is a
    ModelConfig field (under its params name), and the defaults of a size come from ModelConfig."""
    import dataclasses
    from pathlib import Path

    import yaml

    from pipeline.models.config import FROM_PARAMS, ModelConfig

    root = Path(__file__).resolve().parents[1]
    schema = yaml.safe_load((root / "schemas/params.schema.yaml").read_text())["properties"]["model"]
    params = yaml.safe_load((root / "params.yaml").read_text())["model"]
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(schema["properties"]) == set(schema["required"]) == set(params)
    assert {FROM_PARAMS.get(k, k) for k in params} <= fields
    cfg = ModelConfig.from_params(params, "caption", vocab_size=77)
    assert (cfg.max_len, cfg.vocab_size, cfg.mask_ratio) == (params["max_caption_len"], 77, 0.0)
    assert ModelConfig.of({"size": "micro"}).decoder_width == 32 and ModelConfig().decoder_width == 512
    with pytest.raises(ValueError, match="unknown model settings \\['depth'\\]"):
        ModelConfig.of({"depth": 3})


def test_validate_refuses_exactly_the_model_settings_no_model_builds_from():
    """`dpfm validate` (and Snakemake's config check) names each model setting that would crash in a
    stage, and no other: over random settings the schema takes, a refusal by shape iff building the
    MAE (the warm start) or the objective's model and running it fails, the one exception being a
    masking ratio that leaves no patch, which runs but shows the encoder none of the image."""
    import random

    from pipeline.config import model_shape_problems
    from pipeline.models.config import ModelConfig

    rng, seen = random.Random(0), {"refused": 0, "built": 0, "empty": 0}
    for _ in range(80):
        section = dict(size="micro", img_size=rng.choice([8, 12, 16]), patch_size=rng.choice([2, 3, 4, 5, 8]),
                       mask_ratio=rng.choice([0.5, 0.75, 0.95]), caption_mask_ratio=rng.choice([0.0, 0.9]),
                       decoder_width=rng.choice([30, 32, 36]), decoder_heads=rng.choice([1, 2, 3]),
                       text_width=rng.choice([30, 32]), text_heads=rng.choice([2, 3]), max_caption_len=12)
        objective = rng.choice(["mae", "caption", "clip"])
        problems = model_shape_problems(section, objective)
        try:
            for name in {"mae", objective}:
                cfg = ModelConfig.from_params(section, name, vocab_size=VOCAB)
                model, side = build_model(name, cfg), section["img_size"]
                noise = torch.rand(2, (side // section["patch_size"]) ** 2)
                args = (images(2, size=side),) + (() if name == "mae" else (captions(2),))
                model(*args, **({"noise": noise} if cfg.reads_masks(name) else {}))
        except (AssertionError, RuntimeError) as e:
            assert problems, f"{section} {objective} passed validation and crashed: {e!r}"
            seen["refused"] += 1
            continue
        empty = [p for p in problems if "keeps no patch" in p]
        assert problems == empty, f"{section} {objective} builds and runs, but was refused: {problems}"
        seen["empty" if empty else "built"] += 1
    assert min(seen.values()) >= 5, seen  # the draw reaches every outcome


def test_each_objective_masks_by_its_own_ratio():
    """`model.mask_ratio` is the MAE's and `model.caption_mask_ratio` the captioner's; CLIP reads whole
    images whatever they say. The model built drops that share, and takes masks iff it drops any."""
    from pipeline.models.config import ModelConfig
    from pipeline.objectives import OBJECTIVES

    section = {"size": "micro", "mask_ratio": 0.6, "caption_mask_ratio": 0.5}
    ratios = {}
    for name in OBJECTIVES:
        cfg = ModelConfig.from_params(section, name, vocab_size=VOCAB)
        ratios[name] = cfg.training_mask_ratio(name)
        assert cfg.reads_masks(name) == (ratios[name] > 0)
        assert getattr(build_model(name, cfg), "mask_ratio", 0.0) == ratios[name]
    assert ratios == {"mae": 0.6, "caption": 0.5, "clip": 0.0, "clip-public": 0.0}
    cap = build_model("caption", ModelConfig.from_params(section, "caption", vocab_size=VOCAB))
    imgs = images(2)
    assert cap.encode_image(imgs, mask_noise(2)).shape[1] == 1 + cap.encoder.num_patches // 2  # half the patches
    whole = ModelConfig.from_params({**section, "caption_mask_ratio": 0.0}, "caption", vocab_size=VOCAB)
    unmasked = build_model("caption", whole)
    assert not whole.reads_masks("caption")
    assert unmasked.encode_image(imgs).shape[1] == 1 + unmasked.encoder.num_patches


@pytest.mark.parametrize("objective", ["mae", "caption", "clip", "clip-public"])
def test_the_model_keys_an_objective_is_said_never_to_read_change_nothing_it_builds_or_computes(objective):
    """models.config.NOT_READ leaves these keys out of a DP run's identity (a change resumes the run, not
    charges it again): measured, each changed alone gives the same weights and the same losses. And its
    converse: each key left out of it changes one or the other, or a key said to be read would key the run
    by it, and changing it would train the same model again and charge the budget twice."""
    base = {"size": "micro", "img_size": 16, "patch_size": 4, "mask_ratio": 0.75, "caption_mask_ratio": 0.0,
            "norm_pix_loss": True, "decoder_width": 32, "decoder_depth": 1, "decoder_heads": 2, "text_width": 32,
            "text_depth": 1, "text_heads": 2, "max_caption_len": 12, "public_negatives": 4}
    other = {"mask_ratio": 0.5, "caption_mask_ratio": 0.5, "norm_pix_loss": False, "decoder_width": 64,
             "decoder_depth": 2, "decoder_heads": 4, "text_width": 64, "text_depth": 2, "text_heads": 4,
             "max_caption_len": 10, "public_negatives": 7}
    imgs, tokens = torch.randn(3, 3, 16, 16), torch.randint(4, VOCAB, (3, 12))

    def built(model_params):
        torch.manual_seed(0)
        cfg = ModelConfig.from_params(model_params, objective, vocab_size=VOCAB)
        model = build_model(objective, cfg).train()
        torch.manual_seed(1)  # captions padded to max_len, as the tokenizer pads them (clip-public compares them)
        losses = model(imgs) if objective == "mae" else model(imgs, tokens[:, :cfg.max_len])
        return model.state_dict(), losses

    weights, losses = built(base)
    assert NOT_READ[objective]
    for key in NOT_READ[objective]:
        got_weights, got_losses = built({**base, key: other[key]})
        assert got_weights.keys() == weights.keys(), key
        assert all(torch.equal(got_weights[k], weights[k]) for k in weights), key
        assert torch.equal(got_losses, losses), key
    def moved(key):
        got_weights, got_losses = built({**base, key: other[key]})
        return (got_weights.keys() != weights.keys() or not torch.equal(got_losses, losses)
                or any(got_weights[k].shape != weights[k].shape or not torch.equal(got_weights[k], weights[k])
                       for k in weights))

    read = sorted(set(other) - set(NOT_READ[objective]))
    unmoved = [key for key in read if not moved(key)]
    assert read and not unmoved, f"{objective} is said to read {unmoved}, but changing them changes nothing"


# -- what each embedding and pooling adds, read with the blocks taken out --------------------------------

def test_each_patch_gets_its_own_position_and_the_cls_token_the_first_slot():
    """Patch j is its embedding plus row j + 1 of the sin-cos table (row 0 is the cls token's): the MAE
    decoder adds the same rows, so an encoder off by one would read every position shifted."""
    from pipeline.models.vit import patchify

    vit = build_encoder({"size": "micro", "img_size": 16, "patch_size": 4})
    vit.blocks = nn.ModuleList()
    imgs = images(2)
    tokens, _, _ = vit.forward_features(imgs)
    with torch.no_grad():
        patches = vit.patch_embed(patchify(imgs, 4)) + vit.pos_embed[:, 1:]
        cls = vit.cls_token(patches) + vit.pos_embed[:, :1]
        assert torch.allclose(tokens, vit.norm(torch.cat([cls, patches], dim=1)), atol=1e-6)


def test_each_caption_token_gets_the_position_it_stands_at():
    """The text tower adds row i of its position table to token i (not one row to all: then only the causal
    mask would carry word order)."""
    text = micro("caption").decoder
    text.blocks = nn.ModuleList()
    toks = captions(3)
    with torch.no_grad():
        want = text.norm(text.token_embed(toks) + text.pos_embed.weight[:toks.shape[1]])
        assert torch.allclose(text(toks), want, atol=1e-6)


def test_clip_reads_a_caption_at_its_eos_token():
    """The text embedding is the text tower's output at the last real token (EOS), projected and normalised,
    wherever each caption ends."""
    model = micro("clip")
    toks = captions(4)
    with torch.no_grad():
        x = model.text(toks)
        eos = [int((row != PAD).nonzero().max()) for row in toks]
        assert len(set(eos)) == 4 and all(toks[i, e] == 2 for i, e in enumerate(eos))
        want = nn.functional.normalize(model.text_proj(x[torch.arange(4), eos]), dim=-1)
        assert torch.allclose(model.encode_text(toks), want, atol=1e-6)


def test_clips_log_scale_is_held_between_0_and_ln_100_after_each_step():
    """A temperature between 1 and 1/100, as open_clip holds it: above 1 (a log scale below 0) the
    logits would be flattened, past 100 the scale gets no gradient and noise walks it unseen."""
    model = micro("clip")
    for start, held in ((-1.0, 0.0), (10.0, math.log(100.0)), (2.0, 2.0)):
        with torch.no_grad():
            model.logit_scale.weight.fill_(start)
        model.after_optimizer_step()
        assert torch.allclose(model.logit_scale.weight, torch.tensor(held))


def test_zero_shot_scores_read_every_patch_whatever_the_training_mask_ratio():
    """A captioner trained dropping patches (caption_mask_ratio) is scored on whole images: the same scores
    on every call, those of the same weights at ratio 0."""
    model = micro("caption", mask_ratio=0.5)
    unmasked = micro("caption")
    unmasked.load_state_dict(model.state_dict())
    imgs, toks = images(2), captions(3)
    with torch.no_grad():
        first = model.score_captions(imgs, toks)
        assert torch.equal(first, model.score_captions(imgs, toks))
        assert torch.allclose(first, unmasked.score_captions(imgs, toks), atol=1e-6)


def test_masks_drawn_without_given_noise_are_each_samples_own():
    """Without given noise (outside vmap) each sample still draws its own mask, of the same size."""
    from pipeline.models.vit import random_masking

    torch.manual_seed(5)
    _, mask, _ = random_masking(torch.zeros(16, 16, 1), 0.75)
    assert mask.sum(1).tolist() == [12.0] * 16 and len({tuple(m.tolist()) for m in mask}) > 8


def test_layers_start_as_maes_do():
    """xavier-uniform Linear weights with zero biases, unit LayerNorms (ε 1e-6), N(0, 0.02) tokens: the
    reference implementation's start, which the warm start's recipe was tuned on."""
    for objective in ("mae", "caption", "clip"):
        model = micro(objective)
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                assert not module.bias.any(), name
            if isinstance(module, nn.LayerNorm):
                assert module.eps == 1e-6 and (module.weight == 1).all(), name
                assert module.bias is None or not module.bias.any(), name
    vit = build_encoder({"size": "small"})
    assert 0.015 < float(vit.cls_token.weight.std()) < 0.025  # 384 values
    mae = build_model("mae", {"size": "small"})
    assert 0.015 < float(mae.mask_token.weight.std()) < 0.025


def test_the_mlp_is_fc2_of_gelu_of_fc1():
    from pipeline.models.layers import Mlp

    mlp, x = Mlp(8, 32), torch.randn(4, 8)
    assert torch.allclose(mlp(x), mlp.fc2(nn.functional.gelu(mlp.fc1(x))))


def test_a_block_adds_self_attention_cross_attention_and_mlp_each_on_its_own_pre_norm():
    """x + attn(norm1 x), then + cross_attn(norm_cross x, context) with the context as given (the
    captioner's projected image tokens), then + mlp(norm2 x): each part checked with the others' outputs
    zeroed."""
    torch.manual_seed(6)
    block = Block(8, 2, cross_attention=True, context_dim=8)
    for module in block.modules():  # non-trivial norms: a norm applied where none belongs shows
        if isinstance(module, nn.LayerNorm):
            nn.init.normal_(module.weight, 1.0, 0.3), nn.init.normal_(module.bias, 0.0, 0.3)
    x, context = torch.randn(2, 3, 8), 5 * torch.randn(2, 4, 8) + 2
    parts = {"self": block.attn.proj, "cross": block.cross_attn.proj, "mlp": block.mlp.fc2}
    want = {"self": lambda: block.attn(block.norm1(x)),
            "cross": lambda: block.cross_attn(block.norm_cross(x), context),
            "mlp": lambda: block.mlp(block.norm2(x))}
    with torch.no_grad():
        for kept in parts:
            for name, proj in parts.items():
                nn.init.zeros_(proj.weight), nn.init.zeros_(proj.bias)
                if name == kept:
                    nn.init.normal_(proj.weight), nn.init.normal_(proj.bias)
            assert torch.allclose(block(x, context), x + want[kept](), atol=1e-5), kept


def test_clip_on_one_rank_of_several_finds_each_pair_at_its_offset_in_the_gathered_batch():
    """Under torchrun the batch is gathered from every rank and this rank's rows start at its offset: image
    i's caption is column offset + i (the two-rank engine test covers it end to end, this one rank alone)."""
    model = micro("clip")
    imgs, toks = images(4), captions(4)

    def gather(x):  # another rank's two rows first
        return torch.cat([x[2:] + 1.0, x]), 2

    with torch.no_grad():
        img, txt = model.encode_image(imgs), model.encode_text(toks)
        all_img, all_txt = gather(img)[0], gather(txt)[0]
        scale, labels = model._scale(img).unsqueeze(1), torch.arange(2, 6)
        ce = nn.functional.cross_entropy
        want = 0.5 * (ce(scale * img @ all_txt.t(), labels, reduction="none")
                      + ce(scale * txt @ all_img.t(), labels, reduction="none"))
        assert torch.allclose(model(imgs, toks, gather=gather), want, atol=1e-6)


def test_every_paper_size_has_64_wide_heads_and_the_vip_sizes_twelve_blocks():
    """ViT-Ti/S/B/L attend in heads of 64 channels, and the table assumes ViP's nano/tiny/small do too,
    at ViT-B's depth of 12: a head count off by a factor reads other attention patterns at the same
    parameter count, which no parameter count catches (kills mutant 11)."""
    with torch.device("meta"):
        for size in ("nano", "tiny", "small", "base", "large"):
            vit = build_encoder({"size": size})
            assert all(blk.attn.heads * 64 == vit.width for blk in vit.blocks), size
            if size != "large":
                assert len(vit.blocks) == 12, size


def test_pico_is_the_cpu_size_at_two_thirds_of_its_width():
    """pico was the CPU recipe made narrower and nothing else (docs/results.md, "Wall time"): same depth,
    same images and patches, two thirds of the width (kills mutant 12)."""
    pico, cpu = build_encoder({"size": "pico"}), build_encoder({"size": "cpu"})
    assert len(pico.blocks) == len(cpu.blocks)
    assert 3 * pico.width == 2 * cpu.width
    assert (pico.img_size, pico.patch_size) == (cpu.img_size, cpu.patch_size)


def test_a_text_tower_left_at_its_default_heads_attends_in_heads_of_64():
    """text_heads 0 means "as the encoders do": heads of 64 channels (DP-Cap's 768-wide decoder: 12 heads),
    at least one for a narrow tower (kills mutant 42)."""
    with torch.device("meta"):
        cap = build_model("caption", {"size": "base", "vocab_size": 1000})
    assert cap.decoder.blocks[0].attn.heads == 12
    for width in (64, 256, 768, 1024):
        assert ModelConfig.of({"text_width": width}).text_heads * 64 == width
    assert ModelConfig.of({"text_width": 32}).text_heads == 1


def test_the_encoder_pools_as_its_model_config_says():
    """ModelConfig.pool is the pooled feature of the encoder built from it: with pool "mean" the encoder's
    own forward returns the patch tokens' mean, not the cls token (kills mutant 47)."""
    imgs = images(2)
    for pool, want in (("cls", lambda t: t[:, 0]), ("mean", lambda t: t[:, 1:].mean(dim=1))):
        torch.manual_seed(0)
        vit = build_encoder({**MICRO, "pool": pool})
        with torch.no_grad():
            assert torch.allclose(vit(imgs), want(vit.forward_features(imgs)[0]), atol=1e-6), pool


def test_cross_attention_lets_every_text_position_read_every_image_token():
    """The captioner's decoder reads the image through cross-attention: softmax(q k^T / sqrt(d)) v over all
    the context tokens, keys from the first half of kv and values from the second. Causal is the text's
    self-attention alone; a causal cross-attention would hide from caption token t all image tokens past t
    (mutant 18, which the suite caught only by its untrained loss drifting from log V)."""
    torch.manual_seed(0)
    B, L, M, D, H = 2, 3, 5, 8, 2
    attn, x, context = CrossAttention(D, H, context_dim=6), torch.randn(B, L, D), torch.randn(B, M, 6)
    with torch.no_grad():
        q = attn.q(x).reshape(B, L, H, D // H).transpose(1, 2)
        k, v = attn.kv(context).reshape(B, M, 2, H, D // H).permute(2, 0, 3, 1, 4)
        weights = (q @ k.transpose(-1, -2) / math.sqrt(D // H)).softmax(dim=-1)
        assert (weights > 0).all()  # every text position reads every image token
        expected = attn.proj((weights @ v).transpose(1, 2).reshape(B, L, D))
        assert torch.allclose(attn(x, context), expected, atol=1e-5)


def test_linear_layers_start_xavier_uniform_and_embeddings_at_std_002():
    """test_layers_start_as_maes_do reads the biases, norms and tokens; this reads the rest of MAE's init:
    Linear weights uniform over the xavier bound sqrt(6 / (fan_in + fan_out)), token and position
    embeddings N(0, 0.02) (mutants 19 and 20 were caught only through the untrained caption loss)."""
    model = micro("caption", text_width=192, text_heads=3)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.weight.numel() >= 4096:
            bound = math.sqrt(6.0 / (module.in_features + module.out_features))
            w = module.weight.detach().abs()
            assert float(w.max()) <= bound and float(w.max()) > 0.95 * bound, name
        if isinstance(module, nn.Embedding):
            assert 0.017 < float(module.weight.std()) < 0.023, name
