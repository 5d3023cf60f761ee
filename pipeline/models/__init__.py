"""Models: ViT encoder, ViP masked autoencoder, DP-Cap captioner, Dp-CLIP.

Every model's ``forward`` returns a per-sample loss of shape (B,).  Every trainable parameter
belongs to a layer with a clipping rule (pipeline/privacy/layer_rules.py) so a per-sample-gradient engine
can hook them; all models also run under torch.func.vmap(grad(...)) with one sample per slice
when masking noise is passed in explicitly.
"""

from pipeline.objectives import OBJECTIVES

from .captioner import Captioner
from .clip import CLIP
from .config import ModelConfig, model_params_read
from .layers import (
    BroadcastParameter,
    ClassToken,
    LogitScale,
    MaskToken,
    TextTransformer,
)
from .mae import MaskedAutoencoder
from .vit import VIT_SIZES, VisionTransformer, build_vit, patchify, random_masking, unpatchify


def build_encoder(cfg: ModelConfig | dict | None = None) -> VisionTransformer:
    cfg = ModelConfig.of(cfg)
    return build_vit(cfg.size, cfg.img_size, cfg.patch_size, cfg.in_chans, pool=cfg.pool)


def build_model(objective: str, cfg: ModelConfig | dict | None = None) -> MaskedAutoencoder | Captioner | CLIP:
    """The model of an objective ("mae", "caption", "clip", "clip-public"); `cfg` a ModelConfig or a partial dict of its fields."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose from {tuple(OBJECTIVES)}")
    cfg = ModelConfig.of(cfg)
    encoder = build_encoder(cfg)
    if objective == "mae":
        return MaskedAutoencoder(encoder, decoder_width=cfg.decoder_width, decoder_depth=cfg.decoder_depth,
                                 decoder_heads=cfg.decoder_heads,
                                 mask_ratio=cfg.training_mask_ratio(objective),
                                 norm_pix_loss=cfg.norm_pix_loss)
    text = dict(vocab_size=cfg.vocab_size, max_len=cfg.max_len, pad_id=cfg.pad_id)
    if objective == "caption":
        return Captioner(encoder, width=cfg.text_width, depth=cfg.text_depth, heads=cfg.text_heads,
                         mask_ratio=cfg.training_mask_ratio(objective), **text)
    # Clipped per example, CLIP is scored against public captions (clip-public): its loss then splits.
    per_sample = OBJECTIVES[objective].clipping == "per_sample"
    return CLIP(encoder, text_width=cfg.text_width, text_depth=cfg.text_depth, text_heads=cfg.text_heads,
                embed_dim=cfg.embed_dim, pool=cfg.pool, public_negatives=cfg.public_negatives if per_sample else 0,
                **text)


__all__ = [
    "BroadcastParameter",
    "CLIP",
    "Captioner",
    "ClassToken",
    "LogitScale",
    "MaskToken",
    "MaskedAutoencoder",
    "ModelConfig",
    "model_params_read",
    "TextTransformer",
    "VIT_SIZES",
    "VisionTransformer",
    "build_encoder",
    "build_model",
    "build_vit",
    "patchify",
    "random_masking",
    "unpatchify",
]
