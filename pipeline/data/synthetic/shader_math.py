"""GLSL-style pixel maths on torch tensors: fract, smoothstep, length, atan2, pow,
a lattice hash and 2-D rotation, plus `_const` for uploading per-frame uniforms.

Only element-wise ops whose CPU result does not depend on where an element sits
in a tensor are used (see the package docstring): atan2 and pow are rebuilt
from atan and exp/log because torch's own versions fail that.
"""

from __future__ import annotations

import math

import torch

TAU = 2.0 * math.pi


def _fract(x):
    return x - torch.floor(x)


def _smoothstep(e0: float, e1: float, x):
    s = ((x - e0) * (1.0 / (e1 - e0))).clamp(0.0, 1.0)
    return s * s * (3.0 - 2.0 * s)


def _length(x, y):
    return torch.sqrt(x * x + y * y)


def _atan2(y, x, r=None):
    """atan2 via the half-angle identity 2*atan(y / (r + x)).

    torch.atan2 is avoided because its CPU rounding depends on tensor layout.
    The single undefined point (negative x-axis with y == 0) becomes 0.
    """
    if r is None:
        r = _length(x, y)
    return torch.nan_to_num(2.0 * torch.atan(y / (r + x)), nan=0.0)


def _powf(x, e: float):
    """x**e for x >= 0 via exp/log (torch.pow is layout-dependent on CPU)."""
    return torch.exp(torch.log(x.clamp_min(1e-6)) * e)


def _hash21(ix, iy, salt: float):
    """Pseudo-random [0,1) per integer lattice point, using exact float ops only
    ("hash without sine" style), so CPU, GPU and any batching agree."""
    a = _fract(ix * 0.1031 + salt)
    b = _fract(iy * 0.1137 + salt * 0.71)
    c = _fract((ix + iy) * 0.0973)
    d = a * (b + 33.33) + b * (c + 33.33) + c * (a + 33.33)
    a, b, c = a + d, b + d, c + d
    return torch.frac((a + b) * c)


def _rot(x, y, c, s):
    return x * c - y * s, x * s + y * c


def _const(values, device, dtype=torch.float32) -> torch.Tensor:
    """Small host-side list -> device tensor.  On CUDA the copy goes through pinned
    memory without blocking, so uploading uniforms never stalls the GPU queue."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
