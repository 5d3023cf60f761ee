"""Zero-shot classification with the text tower the model was trained with.

* captioner (DP-Cap): the class whose prompt captions have the lowest loss given the image
  (mean token loss, averaged over the prompt templates of the class);
* CLIP (Dp-CLIP): the class whose prompt embedding (templates averaged, re-normalised, as CLIP)
  has the highest cosine similarity with the image embedding.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.data.transforms import to_tensor
from pipeline.errors import check_finite
from pipeline.eval.images import Images
from pipeline.objectives import OBJECTIVES

ZERO_SHOT_OBJECTIVES = tuple(name for name, o in OBJECTIVES.items() if o.zero_shot)


@torch.no_grad()
def class_scores(model, objective: str, images: np.ndarray | Images, prompts: list[list[str]],
                 tokenize: Callable[[list[str]], torch.Tensor], device: str = "cpu",
                 batch_size: int = 128) -> np.ndarray:
    """(N, C) scores, higher = more likely class; `prompts[c]` are the prompts of class c.

    `images` is an (N, H, W, 3) uint8 array or lazy `Images`, read batch by batch."""
    if objective not in ZERO_SHOT_OBJECTIVES:
        raise ValueError(f"zero-shot needs a text tower: objective {objective!r} has none "
                         f"(use one of {ZERO_SHOT_OBJECTIVES})")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every class needs at least one prompt")
    model.eval().to(device)
    owner = torch.tensor([c for c, ps in enumerate(prompts) for _ in ps], device=device)
    tokens = tokenize([p for ps in prompts for p in ps]).to(device)
    per_class = torch.zeros(len(prompts), len(owner), device=device)
    per_class[owner, torch.arange(len(owner), device=device)] = 1.0
    per_class /= per_class.sum(dim=1, keepdim=True)  # rows average a class's prompts
    method = OBJECTIVES[objective].zero_shot
    if method == "embedding":
        text = F.normalize(per_class @ model.encode_text(tokens), dim=-1)
    out = np.empty((len(images), len(prompts)), np.float32)  # filled in place, as extract_features
    for i in range(0, len(images), batch_size):
        imgs = to_tensor(images[i:i + batch_size]).to(device)
        if method == "caption_loss":
            scores = -(model.score_captions(imgs, tokens) @ per_class.t())
        else:
            scores = model.encode_image(imgs) @ text.t()
        out[i:i + batch_size] = scores.float().cpu().numpy()
    check_finite(out, f"the zero-shot scores of the {objective} model")  # an argmax over NaN picks class 0
    return out


def zero_shot_accuracy(model, objective: str, images: np.ndarray | Images, labels: np.ndarray,
                       prompts: list[list[str]], tokenize, device: str = "cpu") -> float:
    pred = class_scores(model, objective, images, prompts, tokenize, device).argmax(axis=1)
    return float((pred == np.asarray(labels)).mean())
