"""The training objectives in one table (the three recipes and `clip-public`): what each model
reads, how DP-SGD clips it, and how it classifies zero-shot. Code asks this table instead of testing
the objective's name."""

from __future__ import annotations

from dataclasses import dataclass


# L2 sensitivity of one DP step in units of C, by clipping mode (the proofs: privacy/engine.py's
# docstring; the worst-case audit, privacy/tools/step_audit.py, measures it): per example one
# clipped term enters or leaves the sum; per batch the clipped mean moves from one point of the
# C-ball to another, up to 2C apart.
SENSITIVITY = {"per_sample": 1.0, "per_batch": 2.0}


@dataclass(frozen=True)
class Objective:
    name: str
    recipe: str            # the paper's name for the DP recipe
    description: str       # what it trains, in a few words
    tokens: bool           # reads caption tokens (needs the tokenizer)
    clipping: str          # "per_sample" (the loss splits per example) | "per_batch" (batch-coupled loss)
    zero_shot: str | None  # how classes are scored from prompts: None | "caption_loss" | "embedding"

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the step in units of C (2 for per-batch clipping)."""
        return SENSITIVITY[self.clipping]


OBJECTIVES = {o.name: o for o in (
    Objective("mae", "ViP", "DP masked autoencoder", tokens=False, clipping="per_sample", zero_shot=None),
    Objective("caption", "DP-Cap", "DP image captioner", tokens=True, clipping="per_sample", zero_shot="caption_loss"),
    Objective("clip", "Dp-CLIP", "DP contrastive, per-batch clipping", tokens=True, clipping="per_batch", zero_shot="embedding"),
    # Dp-CLIP's model scored against public captions instead of the batch: the loss splits per sample.
    Objective("clip-public", "Dp-CLIP-public", "DP contrastive against public captions, per-sample clipping",
              tokens=True, clipping="per_sample", zero_shot="embedding"),
)}


def objective(name: str) -> Objective:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown objective {name!r} (allowed: {', '.join(OBJECTIVES)})") from None


def recipe_name(name: str | None) -> str:
    """e.g. "ViP"; an unknown objective's own name."""
    return OBJECTIVES[name].recipe if name in OBJECTIVES else str(name)


def recipe_title(name: str | None) -> str:
    """e.g. "ViP (DP masked autoencoder)"."""
    return f"{OBJECTIVES[name].recipe} ({OBJECTIVES[name].description})" if name in OBJECTIVES else str(name)
