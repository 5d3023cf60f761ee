"""Image tensors for the models. Normalisation uses fixed public constants (ImageNet's), never
statistics of the private data: those would leave the DP boundary unaccounted."""

from __future__ import annotations

import numpy as np
import torch

MEAN = torch.tensor([0.485, 0.456, 0.406])
STD = torch.tensor([0.229, 0.224, 0.225])


def to_tensor(images_uint8: np.ndarray | torch.Tensor) -> torch.Tensor:
    """(N, H, W, 3) uint8 -> (N, 3, H, W) float32, normalised."""
    x = torch.as_tensor(images_uint8).float().div_(255.0)
    x = (x - MEAN) / STD
    return x.permute(0, 3, 1, 2).contiguous()
