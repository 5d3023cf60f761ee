"""From the `model` params section to the keyword config of pipeline.models.build_model."""

from __future__ import annotations


def model_config(model_params: dict, objective: str = "mae", vocab_size: int | None = None) -> dict:
    cfg = {k: model_params[k] for k in ("size", "img_size", "patch_size", "norm_pix_loss", "decoder_width",
                                        "decoder_depth", "decoder_heads", "text_width", "text_depth", "text_heads")}
    cfg["max_len"] = model_params["max_caption_len"]
    # The MAE masks; the captioner and CLIP see whole images by default (DP-Cap's mask ratio is 0).
    cfg["mask_ratio"] = model_params["mask_ratio"] if objective == "mae" else 0.0
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    return cfg
