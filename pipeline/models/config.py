"""`ModelConfig`: every architecture setting of the four models, with its default. The one place
model defaults live: params.yaml's `model` section supplies values (its schema is checked against
these fields by tests/test_models.py), checkpoints store `to_dict()`, and build_model takes it.

The paper sizes follow the papers (MAE decoder 512/4/16, DP-Cap text decoder 768/6 without bias and
captions of 40 tokens, ViT at 224 px / patch 16). The test and CPU sizes come with matching small
heads and images (`SIZE_DEFAULTS`), so `ModelConfig.of({"size": "cpu"})` alone trains on a laptop.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from pipeline.objectives import OBJECTIVES

SIZE_DEFAULTS = {
    "micro": dict(img_size=16, patch_size=4, decoder_width=32, decoder_depth=1, decoder_heads=2,
                  text_width=32, text_depth=1, text_heads=2, embed_dim=32),
    "cpu": dict(img_size=32, patch_size=4, decoder_width=64, decoder_depth=2, decoder_heads=4,
                text_width=96, text_depth=2, text_heads=3, embed_dim=96),
}
SIZE_DEFAULTS["pico"] = SIZE_DEFAULTS["cpu"]  # the CPU size's images and heads, a narrower encoder
# params.yaml names that differ from the field names
FROM_PARAMS = {"max_caption_len": "max_len"}


# params.yaml `model` keys an objective's model never reads: a change to them is not a change of its DP
# run, which must resume, not train and be charged again. Listed as what is left out, so that a key added
# later counts for every objective until it is listed here.
_MAE_ONLY = ("mask_ratio", "norm_pix_loss", "decoder_width", "decoder_depth", "decoder_heads")
NOT_READ = {"mae": ("caption_mask_ratio", "text_width", "text_depth", "text_heads", "max_caption_len",
                    "public_negatives"),
            "caption": (*_MAE_ONLY, "public_negatives"), "clip": (*_MAE_ONLY, "caption_mask_ratio", "public_negatives"),
            "clip-public": (*_MAE_ONLY, "caption_mask_ratio")}


def model_params_read(model_params: dict, objective: str) -> dict:
    """params.yaml's `model` section less the keys `objective`'s model never reads."""
    return {k: v for k, v in model_params.items() if k not in NOT_READ[objective]}


@dataclass(frozen=True)
class ModelConfig:
    size: str = "base"            # ViT size (pipeline.models.VIT_SIZES)
    img_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    pool: str = "cls"             # cls | mean: the encoder's pooled feature
    mask_ratio: float | None = None  # patches dropped in training; None: MAE's 0.75, none for the others
    caption_mask_ratio: float = 0.0  # params.yaml's ratio for the captioner (DP-Cap: none); from_params
                                     # makes it the captioner's mask_ratio
    norm_pix_loss: bool = False
    decoder_width: int = 512      # MAE decoder
    decoder_depth: int = 4
    decoder_heads: int = 16
    vocab_size: int = 49408       # set from the tokenizer
    text_width: int = 768         # captioner decoder / CLIP text tower
    text_depth: int = 6
    text_heads: int = 0           # 0: text_width // 64
    max_len: int = 40             # caption tokens
    pad_id: int = 0
    embed_dim: int = 512          # CLIP's joint embedding
    public_negatives: int = 256   # clip-public: public captions each image is scored against

    def __post_init__(self):
        if self.text_heads == 0:
            object.__setattr__(self, "text_heads", max(1, self.text_width // 64))

    @classmethod
    def of(cls, values: dict | "ModelConfig" | None = None) -> "ModelConfig":
        """From a (partial) dict: the size's defaults first, then the values given."""
        if isinstance(values, ModelConfig):
            return values
        values = dict(values or {})
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown model settings {unknown} (known: {', '.join(f.name for f in fields(cls))})")
        return cls(**{**SIZE_DEFAULTS.get(values.get("size", cls.size), {}), **values})

    @classmethod
    def from_params(cls, model_params: dict, objective: str, vocab_size: int | None = None) -> "ModelConfig":
        """From params.yaml's `model` section for one objective (and the tokenizer's vocabulary)."""
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {objective!r}; choose from {tuple(OBJECTIVES)}")
        cfg = cls.of({FROM_PARAMS.get(k, k): v for k, v in model_params.items()})
        # `mask_ratio` is the MAE's; the captioner drops its own share (none unless set); CLIP none
        ratio = {"mae": cfg.mask_ratio, "caption": cfg.caption_mask_ratio}.get(objective, 0.0)
        cfg = replace(cfg, mask_ratio=ratio)
        return replace(cfg, vocab_size=vocab_size) if vocab_size is not None else cfg

    def training_mask_ratio(self, objective: str) -> float:
        """The share of image patches `objective`'s model drops in training (features and zero-shot
        always read whole images): the MAE 0.75 unless set, the captioner none unless set, CLIP none."""
        if objective == "mae":
            return 0.75 if self.mask_ratio is None else self.mask_ratio
        return (self.mask_ratio or 0.0) if objective == "caption" else 0.0

    def reads_masks(self, objective: str) -> bool:
        """Whether `objective`'s model takes per-example masking noise as its last input (drawn per
        logical batch by the caller, so per-example calls and any split of a batch mask alike)."""
        return self.training_mask_ratio(objective) > 0

    def to_dict(self) -> dict:
        return asdict(self)
