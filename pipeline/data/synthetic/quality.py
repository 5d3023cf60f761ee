"""Quality figures for a set of rendered images (near-constant fraction,
diversity) and a PNG contact sheet for looking at them."""

from __future__ import annotations

import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.io import atomic_path


def _as_float01(images, chunk: int = 64):
    """uint8 (N,H,W,3) tensor/array -> float64 (n,3,H,W) in [0,1] on CPU, `chunk` images at a time:
    the whole sample at once is 8 bytes a pixel, 2.7 GB for 1,024 images at 224 px."""
    t = torch.as_tensor(np.asarray(images.cpu() if torch.is_tensor(images) else images))
    for i in range(0, len(t), chunk):
        yield t[i:i + chunk].to(torch.float64).permute(0, 3, 1, 2) / 255.0


def near_constant_fraction(images_uint8, threshold: float = 0.02) -> float:
    """Fraction of images whose largest per-channel spatial std (in [0,1] units) is
    below `threshold` (default 0.02, about 5 grey levels): flat, useless frames."""
    std = [x.flatten(2).std(dim=2).amax(dim=1) for x in _as_float01(images_uint8)]
    return float((torch.cat(std) < threshold).double().mean()) if std else 0.0


def diversity(images_uint8) -> float:
    """Mean pairwise L2 distance between images area-downsampled to 16x16x3 in [0,1]. Summed exactly
    (fsum): torch's mean splits the sum by thread, and stats.json must not change with the core count."""
    small = [F.adaptive_avg_pool2d(x, 16).flatten(1) for x in _as_float01(images_uint8)]
    small = torch.cat(small) if small else torch.zeros(0)
    return math.fsum(torch.pdist(small).tolist()) / math.comb(len(small), 2) if len(small) >= 2 else 0.0


def contact_sheet(images_uint8, path, ncols: int = 8, pad: int = 2) -> str:
    """Write images (N,H,W,3 uint8) as a PNG grid, atomically (pipeline.io.atomic_path)."""
    from PIL import Image

    arr = np.asarray(images_uint8.cpu() if torch.is_tensor(images_uint8) else images_uint8, dtype=np.uint8)
    n, h, w, _ = arr.shape
    ncols = max(1, min(ncols, n))
    nrows = max(1, -(-n // ncols))
    sheet = np.full((nrows * (h + pad) + pad, ncols * (w + pad) + pad, 3), 24, dtype=np.uint8)
    for i in range(n):
        r, c = divmod(i, ncols)
        y0, x0 = pad + r * (h + pad), pad + c * (w + pad)
        sheet[y0 : y0 + h, x0 : x0 + w] = arr[i]
    path = os.fspath(path)
    with atomic_path(path) as tmp:
        # the temp name ends in .tmp, so say the format rather than let PIL guess it
        Image.fromarray(sheet).save(tmp, format="PNG")
    return path
