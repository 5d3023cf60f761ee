"""Models: ViT encoder, ViP masked autoencoder, DP-Cap captioner, Dp-CLIP.

Every model's ``forward`` returns a per-sample loss of shape (B,).  Every trainable parameter
belongs to a leaf of ``ALLOWED_LEAF_TYPES`` (see layers.py) so a per-sample-gradient engine
can hook them; all models also run under torch.func.vmap(grad(...)) with one sample per slice
when masking noise is passed in explicitly.
"""

from .captioner import Captioner
from .clip import CLIP
from .layers import (
    ALLOWED_LEAF_TYPES,
    BroadcastParameter,
    ClassToken,
    LogitScale,
    MaskToken,
    TextTransformer,
)
from .mae import MaskedAutoencoder
from .vit import VIT_SIZES, VisionTransformer, build_vit, patchify, random_masking, unpatchify

# Defaults for keys missing from cfg.  Paper sizes follow the papers (MAE decoder 512/4/16,
# DP-Cap decoder 768/6 without bias and captions of 40 tokens, ViT at 224 px / patch 16).
DEFAULTS = dict(
    size="base",
    img_size=224,
    patch_size=16,
    in_chans=3,
    pool="cls",
    mask_ratio=None,  # per objective: 0.75 for mae, 0.0 otherwise
    norm_pix_loss=False,
    decoder_width=512,
    decoder_depth=4,
    decoder_heads=16,
    vocab_size=49408,  # CLIP BPE size; the tokenizer should set this
    text_width=768,
    text_depth=6,
    text_heads=None,  # width // 64
    max_len=40,
    pad_id=0,
    embed_dim=512,  # CLIP joint embedding
)

# The test/CPU sizes get matching tiny heads and images, so {"size": "cpu"} alone is trainable
# on a laptop (32x32 images, patch 4 -> 64 patches).
SMALL_SIZE_DEFAULTS = {
    "micro": dict(img_size=16, patch_size=4, decoder_width=32, decoder_depth=1, decoder_heads=2,
                  text_width=32, text_depth=1, text_heads=2, embed_dim=32),
    "cpu": dict(img_size=32, patch_size=4, decoder_width=64, decoder_depth=2, decoder_heads=4,
                text_width=96, text_depth=2, text_heads=3, embed_dim=96),
}

OBJECTIVES = ("mae", "caption", "clip")


def resolve_config(cfg: dict | None = None) -> dict:
    """cfg with every missing key filled from the size-aware defaults."""
    cfg = dict(cfg or {})
    size = cfg.get("size", DEFAULTS["size"])
    if size not in VIT_SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(VIT_SIZES)}")
    full = {**DEFAULTS, **SMALL_SIZE_DEFAULTS.get(size, {}), **cfg}
    if full["text_heads"] is None:
        full["text_heads"] = max(1, full["text_width"] // 64)
    return full


def build_encoder(cfg: dict | None = None) -> VisionTransformer:
    cfg = resolve_config(cfg)
    return build_vit(cfg["size"], cfg["img_size"], cfg["patch_size"], cfg["in_chans"], pool=cfg["pool"])


def build_model(objective: str, cfg: dict | None = None) -> MaskedAutoencoder | Captioner | CLIP:
    """objective in {"mae", "caption", "clip"}; cfg keys as in ``DEFAULTS`` (all optional)."""
    cfg = resolve_config(cfg)
    encoder = build_encoder(cfg)
    if objective == "mae":
        return MaskedAutoencoder(
            encoder,
            decoder_width=cfg["decoder_width"],
            decoder_depth=cfg["decoder_depth"],
            decoder_heads=cfg["decoder_heads"],
            mask_ratio=0.75 if cfg["mask_ratio"] is None else cfg["mask_ratio"],
            norm_pix_loss=cfg["norm_pix_loss"],
        )
    if objective == "caption":
        return Captioner(
            encoder,
            vocab_size=cfg["vocab_size"],
            width=cfg["text_width"],
            depth=cfg["text_depth"],
            heads=cfg["text_heads"],
            max_len=cfg["max_len"],
            pad_id=cfg["pad_id"],
            mask_ratio=cfg["mask_ratio"] or 0.0,
        )
    if objective == "clip":
        return CLIP(
            encoder,
            vocab_size=cfg["vocab_size"],
            text_width=cfg["text_width"],
            text_depth=cfg["text_depth"],
            text_heads=cfg["text_heads"],
            max_len=cfg["max_len"],
            embed_dim=cfg["embed_dim"],
            pad_id=cfg["pad_id"],
            pool=cfg["pool"],
        )
    raise ValueError(f"unknown objective {objective!r}; choose from {OBJECTIVES}")


__all__ = [
    "ALLOWED_LEAF_TYPES",
    "BroadcastParameter",
    "CLIP",
    "Captioner",
    "ClassToken",
    "DEFAULTS",
    "LogitScale",
    "MaskToken",
    "MaskedAutoencoder",
    "OBJECTIVES",
    "SMALL_SIZE_DEFAULTS",
    "TextTransformer",
    "VIT_SIZES",
    "VisionTransformer",
    "build_encoder",
    "build_model",
    "build_vit",
    "patchify",
    "random_masking",
    "resolve_config",
    "unpatchify",
]
