"""Downstream evaluation: eval sets, linear probes, few-shot, zero-shot (used by pipeline.evaluate)."""

# The papers' names for the three DP objectives, and what each trains.
RECIPES = {"mae": "ViP", "caption": "DP-Cap", "clip": "Dp-CLIP"}
RECIPE_DESCRIPTIONS = {"mae": "DP masked autoencoder", "caption": "DP image captioner",
                       "clip": "DP contrastive, per-batch clipping"}


def recipe_title(objective: str | None) -> str:
    """e.g. "ViP (DP masked autoencoder)"."""
    if objective not in RECIPES:
        return str(objective)
    return f"{RECIPES[objective]} ({RECIPE_DESCRIPTIONS[objective]})"
