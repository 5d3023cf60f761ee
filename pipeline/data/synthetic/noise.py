"""Noise textures: shaders sample noise from textures (iChannel0); we do too.

A bank of four periodic 512x512 channels (two fBm, blobs, ridged) is built once
in numpy from the splitmix64 stream, uploaded once per device and read with one
bilinear grid_sample per lookup, which is far cheaper than per-pixel hashed
octaves.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.data.synthetic.rng import _np_uniform
from pipeline.data.synthetic.shader_math import _fract

if TYPE_CHECKING:
    from pipeline.data.synthetic.blocks import _Frames

_TEX_SIZE = 512


def _periodic_value_noise(size: int, cells: int, seed: int) -> np.ndarray:
    lattice = _np_uniform(cells * cells, seed).reshape(cells, cells)
    coord = (np.arange(size) + 0.5) * cells / size
    i0 = np.floor(coord).astype(np.int64)
    f = coord - i0
    f = f * f * (3.0 - 2.0 * f)
    i1, i0 = (i0 + 1) % cells, i0 % cells
    rows = lattice[i0] * (1 - f)[:, None] + lattice[i1] * f[:, None]
    return rows[:, i0] * (1 - f)[None, :] + rows[:, i1] * f[None, :]


def _periodic_fbm(size: int, base_cells: int, octaves: int, seed: int) -> np.ndarray:
    out = np.zeros((size, size))
    for o in range(octaves):
        out += 0.5**o * _periodic_value_noise(size, base_cells << o, seed * 131 + o * 7919)
    return out


def _stretch01(a: np.ndarray) -> np.ndarray:
    lo, hi = np.percentile(a, [0.5, 99.5])
    return np.clip((a - lo) / (hi - lo), 0.0, 1.0)


@functools.lru_cache(maxsize=None)
def _noise_bank_np() -> np.ndarray:
    s = _TEX_SIZE
    fbm_a = _stretch01(_periodic_fbm(s, 4, 7, 1))
    fbm_b = _stretch01(_periodic_fbm(s, 4, 7, 2))
    blobs = _stretch01(_periodic_value_noise(s, 8, 3))
    ridged = _stretch01((1.0 - np.abs(2.0 * _stretch01(_periodic_fbm(s, 4, 6, 4)) - 1.0)) ** 2)
    return np.stack([fbm_a, fbm_b, blobs, ridged]).astype(np.float32)


_NOISE_CHANNEL = {"fbm": 0, "fbm2": 1, "blobs": 2, "ridged": 3}


@functools.lru_cache(maxsize=None)
def _noise_texture(device: str, first: int, count: int) -> torch.Tensor:
    bank = _noise_bank_np()[first : first + count]
    return torch.from_numpy(np.ascontiguousarray(bank)).unsqueeze(0).to(device)


def _sample_noise(fr: "_Frames", x, y, channel: str, count: int = 1):
    """Bilinear lookup of noise channel(s) at texture coordinates (x, y), where
    one unit is one (periodic) texture width.  Returns `count` tensors (N,H,W)."""
    gx, gy = _fract(x), _fract(y)
    gx, gy = torch.broadcast_tensors(gx, gy)
    if gx.shape[0] != fr.n:
        gx, gy = gx.expand(fr.n, -1, -1), gy.expand(fr.n, -1, -1)
    n, h, w = gx.shape
    grid = torch.empty((n, h, w, 2), dtype=torch.float32, device=gx.device)
    torch.sub(gx * 2.0, 1.0, out=grid[..., 0])
    torch.sub(gy * 2.0, 1.0, out=grid[..., 1])
    # Frames are stacked along the grid's height so the texture is not copied.
    tex = _noise_texture(str(gx.device), _NOISE_CHANNEL[channel], count)
    out = F.grid_sample(tex, grid.view(1, n * h, w, 2), mode="bilinear",
                        padding_mode="border", align_corners=False)
    out = out.view(count, n, h, w)
    return [out[i] for i in range(count)]
