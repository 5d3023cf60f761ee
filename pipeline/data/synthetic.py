"""Shaders21k-style procedural images, rendered with torch on CPU or GPU.

ViP warm-starts its MAE on Shaders21k: frames of ~21k OpenGL fragment shaders.
We cannot ship those, so this module generates a family that behaves alike: each
*program* is a seeded random composition of the building blocks real fragment
shaders are made of (cosine palettes, fract tiling, polar maps, rotations,
kaleidoscopic folds, noise/fBm, domain warping, signed-distance shapes, orbit-trap
fractals, a small raymarcher), evaluated per pixel on
``uv = (fragCoord - 0.5 * res) / res.y`` at a frame time ``t``.

Determinism contract: an image depends only on (base_seed, program_id,
frame_index, resolution) and the device kind.  Program structure comes from a
private splitmix64 stream keyed by (base_seed, program_id), frame time from a hash
of (base_seed, program_id, frame_index), and every per-frame uniform is computed
in Python doubles per frame.  Pixel maths uses only element-wise torch ops whose
CPU results do not depend on where an element sits in a tensor (+-*/, floor,
abs, min/max, clamp, sqrt, sin, cos, exp, log, atan, grid_sample; the tests check
this).  ``torch.atan2`` and ``torch.pow`` are avoided: their SIMD body and scalar
tail round differently, so a pixel's bytes would depend on the batch it was
rendered in.  Per-frame decisions use only min/max reductions, which are exact in
any order.  Hence output is byte-identical however frames are batched or split
across processes.  CPU and GPU agree only approximately.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "num_programs_available",
    "frame_time",
    "render",
    "render_float",
    "render_items",
    "mix_components",
    "describe_program",
    "program_signature",
    "near_constant_fraction",
    "diversity",
    "contact_sheet",
]

TAU = 2.0 * math.pi
T_MIN, T_MAX = 0.1, 10.0
# Program ids are any integer in [0, 2**31); Shaders21k itself has ~21k programs,
# which is also the default pool that mixing partners are drawn from.
NUM_PROGRAMS = 2**31
SHADERS21K_SIZE = 21_000

# Pixels rendered per torch call: small on CPU so tensors stay in cache, large on
# GPU so kernels have enough work.  Results do not depend on this split.
_CHUNK_PIXELS = {"cpu": 1 << 17, "cuda": 1 << 23}

_MASK64 = (1 << 64) - 1
_TAG_PROGRAM, _TAG_TIME, _TAG_MIX = 0x5EED_0001, 0x5EED_0002, 0x5EED_0003


# --------------------------------------------------------------------------- #
# Seeded randomness (pure Python, so it is stable across numpy/torch versions)  #
# --------------------------------------------------------------------------- #
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """splitmix64 finaliser: a bijective 64-bit mixer."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _hash_ints(*values: int) -> int:
    """Order-sensitive 64-bit hash of a tuple of (possibly negative) ints."""
    h = 0x6A09E667F3BCC909
    for v in values:
        h = _mix64(((h ^ (int(v) & _MASK64)) + _GOLDEN) & _MASK64)
    return h


class _Rng:
    """Tiny splitmix64 generator keyed by a tuple of ints (no global state)."""

    def __init__(self, *key: int):
        self.state = _hash_ints(*key)

    def random(self) -> float:
        self.state = (self.state + _GOLDEN) & _MASK64
        return (_mix64(self.state) >> 11) * (1.0 / (1 << 53))

    def uniform(self, lo: float, hi: float) -> float:
        return lo + (hi - lo) * self.random()

    def loguniform(self, lo: float, hi: float) -> float:
        return math.exp(self.uniform(math.log(lo), math.log(hi)))

    def integers(self, lo: int, hi: int) -> int:
        """Uniform integer in [lo, hi] (inclusive)."""
        return lo + min(int(self.random() * (hi - lo + 1)), hi - lo)

    def chance(self, p: float) -> bool:
        return self.random() < p

    def sign(self) -> float:
        return 1.0 if self.random() < 0.5 else -1.0

    def choice(self, options, weights=None):
        if weights is None:
            return options[self.integers(0, len(options) - 1)]
        u = self.random() * sum(weights)
        for option, w in zip(options, weights):
            u -= w
            if u < 0:
                return option
        return options[-1]

    def normal(self) -> float:
        u1 = max(self.random(), 1e-300)
        return math.sqrt(-2.0 * math.log(u1)) * math.cos(TAU * self.random())

    def gamma(self, alpha: float) -> float:
        """Marsaglia-Tsang; the alpha < 1 case uses the boost U**(1/alpha)."""
        if alpha < 1.0:
            return self.gamma(alpha + 1.0) * max(self.random(), 1e-300) ** (1.0 / alpha)
        d = alpha - 1.0 / 3.0
        c = 1.0 / math.sqrt(9.0 * d)
        while True:
            x = self.normal()
            v = (1.0 + c * x) ** 3
            if v <= 0:
                continue
            u = max(self.random(), 1e-300)
            if math.log(u) < 0.5 * x * x + d - d * v + d * math.log(v):
                return d * v

    def dirichlet(self, k: int, alpha: float) -> list[float]:
        g = [self.gamma(alpha) for _ in range(k)]
        s = sum(g)
        return [x / s for x in g]


# --------------------------------------------------------------------------- #
# Pixel-maths helpers (layout-invariant ops only; see module docstring)        #
# --------------------------------------------------------------------------- #
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


# --------------------------------------------------------------------------- #
# Noise textures: shaders sample noise from textures (iChannel0); we do too.   #
# A periodic fBm bank is built once per device and read with one bilinear      #
# grid_sample per lookup, which is far cheaper than per-pixel hashed octaves.  #
# --------------------------------------------------------------------------- #
_TEX_SIZE = 512


def _np_uniform(n: int, seed: int) -> np.ndarray:
    """splitmix64 over a counter in numpy uint64 (wrapping maths, exact)."""
    z = (np.arange(n, dtype=np.uint64) + np.uint64(seed)) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


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


# --------------------------------------------------------------------------- #
# Per-batch frame context                                                      #
# --------------------------------------------------------------------------- #
class _Frames:
    """Frames of one program rendered together: times, resolution, device."""

    def __init__(self, times: list[float], resolution: int, device, unit: float):
        self.times = times
        self.n = len(times)
        self.res = resolution
        self.device = torch.device(device)
        # Size of one pixel in domain units, for resolution-aware edge softness.
        self.px = unit / resolution

    def uniform(self, fn) -> torch.Tensor:
        """A per-frame uniform: fn(t) in Python doubles -> (N,1,1) float32."""
        vals = [float(fn(t)) for t in self.times]
        return _const(vals, self.device).view(-1, 1, 1)

    def vec3(self, fn) -> torch.Tensor:
        """Per-frame RGB uniform: fn(t) -> 3 floats, as (N,3,1,1)."""
        vals = [[float(v) for v in fn(t)] for t in self.times]
        return _const(vals, self.device).view(-1, 3, 1, 1)

    def aa(self, k: float = 1.5) -> float:
        return k * self.px

    def uv(self):
        """uv = (fragCoord - 0.5*res)/res.y with GLSL's bottom-left origin, as
        contiguous (N,H,W) tensors: mixing (1,H,W) with per-frame (N,1,1) uniforms
        would hit torch's slow double-broadcast path in every later op."""
        r = self.res
        c = (torch.arange(r, dtype=torch.float32, device=self.device) + 0.5 - 0.5 * r) / r
        x = c.view(1, 1, r).expand(self.n, r, r).contiguous()
        y = c.flip(0).view(1, r, 1).expand(self.n, r, r).contiguous()
        return x, y


# --------------------------------------------------------------------------- #
# Blocks.  Each samples its constants from the program's Rng at construction,  #
# records discrete choices in `opts` (structure) and continuous ones in `k`.   #
# --------------------------------------------------------------------------- #
class _Block:
    kind = "block"

    def __init__(self):
        self.opts: dict = {}
        self.k: dict = {}

    def structure(self) -> tuple:
        return (self.kind,) + tuple(f"{a}={b}" for a, b in self.opts.items())

    def constants(self) -> tuple:
        flat = []
        for v in self.k.values():
            flat.extend(v if isinstance(v, (list, tuple)) else [v])
        return tuple(round(float(v), 6) for v in flat)

    def describe(self) -> str:
        inner = ",".join(str(v) for v in self.opts.values())
        return f"{self.kind}({inner})" if inner else self.kind


class _Palette(_Block):
    """Inigo Quilez cosine palette a + b*cos(2*pi*(c*v + d)), optionally cycling in t."""

    kind = "palette"

    def __init__(self, rng: _Rng):
        super().__init__()
        style = rng.choice(["rainbow", "duo", "warm", "mono", "free"], [3, 2, 1.5, 0.7, 2])
        self.opts["style"] = style
        if style == "mono":
            a = [rng.uniform(0.4, 0.6)] * 3
            b = [rng.uniform(0.35, 0.5)] * 3
            c = [1.0] * 3
            d = [rng.random()] * 3
            tint = [rng.uniform(0.8, 1.0) for _ in range(3)]
            a = [x * t for x, t in zip(a, tint)]
        else:
            a = [rng.uniform(0.4, 0.6) for _ in range(3)]
            b = [rng.uniform(0.3, 0.55) for _ in range(3)]
            if style == "rainbow":
                c, d0 = [1.0] * 3, rng.random()
                d = [d0, d0 + 0.33, d0 + 0.67]
            elif style == "duo":
                c = [rng.choice([0.5, 1.0])] * 3
                d = [rng.random() for _ in range(3)]
            elif style == "warm":
                c = [1.0, 1.0, rng.uniform(0.5, 1.0)]
                d = [0.0, rng.uniform(0.1, 0.2), rng.uniform(0.2, 0.3)]
            else:
                c = [rng.choice([0.5, 1.0, 1.0, 2.0]) for _ in range(3)]
                d = [rng.random() for _ in range(3)]
        self.k.update(a=a, b=b, c=c, d=d)
        self.k["cycle"] = rng.uniform(-0.1, 0.1) if rng.chance(0.5) else 0.0

    def __call__(self, fr: _Frames, v):
        a, b, c, d = (self.k[n] for n in "abcd")
        cyc = self.k["cycle"]
        # Constants are made (N,3,1,1) rather than (1,3,1,1): torch's CPU kernels
        # are several times slower when both operands broadcast along different dims.
        cc = fr.vec3(lambda t: [TAU * x for x in c])
        phase = fr.vec3(lambda t: [TAU * (di + cyc * t) for di in d])
        v = v.expand(fr.n, -1, -1).unsqueeze(1)
        return fr.vec3(lambda t: a) + fr.vec3(lambda t: b) * torch.cos(v * cc + phase)

    def const(self, v: float, t: float):
        a, b, c, d = (self.k[n] for n in "abcd")
        cyc = self.k["cycle"]
        return [a[i] + b[i] * math.cos(TAU * (c[i] * v + d[i] + cyc * t)) for i in range(3)]


# ---- domain operations: (x, y) -> (x, y) ----------------------------------- #
class _Space:
    """What the sampler knows about the domain a block will see: its visible
    half-extent `span`, how many repetitions `reps` fit across the screen, and
    `unit`, domain units per uv unit (for pixel-sized edges).  Fields divide their
    frequencies by reps**0.6 (`calm`) so repeated domains do not turn into noise."""

    def __init__(self, zoom: float):
        self.span, self.reps, self.unit = 0.5 * zoom, 1.0, zoom

    @property
    def calm(self) -> float:
        return self.reps ** -0.6


class _Domain(_Block):
    def update(self, sp: _Space) -> None:
        """Adjust the sampler's view of the domain after this op."""


class _Rotate(_Domain):
    kind = "rotate"

    def __init__(self, rng, sp):
        super().__init__()
        self.k.update(a0=rng.uniform(0, TAU), w=rng.uniform(-0.4, 0.4) if rng.chance(0.7) else 0.0)

    def __call__(self, fr, x, y):
        a0, w = self.k["a0"], self.k["w"]
        return _rot(x, y, fr.uniform(lambda t: math.cos(a0 + w * t)),
                    fr.uniform(lambda t: math.sin(a0 + w * t)))


class _Scroll(_Domain):
    kind = "scroll"

    def __init__(self, rng, sp):
        super().__init__()
        span = sp.span
        a, s = rng.uniform(0, TAU), rng.uniform(0.02, 0.15) * span
        self.k.update(vx=s * math.cos(a), vy=s * math.sin(a))

    def __call__(self, fr, x, y):
        vx, vy = self.k["vx"], self.k["vy"]
        return x + fr.uniform(lambda t: vx * t), y + fr.uniform(lambda t: vy * t)


class _Mirror(_Domain):
    kind = "mirror"

    def __init__(self, rng, sp):
        super().__init__()
        span = sp.span
        self.opts["axes"] = rng.choice(["x", "y", "xy"])
        self.k.update(ox=rng.uniform(-0.3, 0.3) * span, oy=rng.uniform(-0.3, 0.3) * span)

    def update(self, sp):
        sp.reps *= 1.3

    def __call__(self, fr, x, y):
        axes = self.opts["axes"]
        if "x" in axes:
            x = x.abs() - self.k["ox"]
        if "y" in axes:
            y = y.abs() - self.k["oy"]
        return x, y


class _Kaleido(_Domain):
    """Fold the angle into one mirrored sector: the kaleidoscope trick."""

    kind = "kaleido"

    def __init__(self, rng, sp):
        super().__init__()
        self.opts["n"] = rng.integers(3, 12)
        self.k.update(a0=rng.uniform(0, TAU), w=rng.uniform(-0.3, 0.3))

    def update(self, sp):
        sp.reps *= max(1.0, self.opts["n"] / 4.0)

    def __call__(self, fr, x, y):
        r = _length(x, y)
        sector = TAU / self.opts["n"]
        a0, w = self.k["a0"], self.k["w"]
        a = _atan2(y, x, r) + fr.uniform(lambda t: a0 + w * t)
        a = a - sector * torch.floor(a * (1.0 / sector))
        a = (a - 0.5 * sector).abs()
        return r * torch.cos(a), r * torch.sin(a)


class _Tile(_Domain):
    """fract/mod repetition of the plane (optionally mirrored so it stays continuous)."""

    kind = "tile"

    def __init__(self, rng, sp):
        super().__init__()
        span = sp.span
        self.opts["mirrored"] = rng.chance(0.4)
        self.k["period"] = span * 2.0 / rng.uniform(1.5, 7.0)

    def update(self, sp):
        sp.reps *= 2.0 * sp.span / self.k["period"]
        sp.span = self.k["period"] * 0.5

    def __call__(self, fr, x, y):
        p = self.k["period"]
        if self.opts["mirrored"]:
            # triangle wave: a mirrored repetition with no seams
            tri = lambda v: ((_fract(v * (0.5 / p) + 0.25) * 2.0 - 1.0).abs() - 0.5) * p
            return tri(x), tri(y)
        return (_fract(x * (1.0 / p) + 0.5) - 0.5) * p, (_fract(y * (1.0 / p) + 0.5) - 0.5) * p


class _Polar(_Domain):
    """Polar, log-polar or tunnel (1/r) coordinates: (angle, radius) as (x, y)."""

    kind = "polar"

    def __init__(self, rng, sp):
        super().__init__()
        self.opts["map"] = rng.choice(["polar", "logpolar", "tunnel"], [1, 1, 1.2])
        self.opts["arms"] = rng.integers(1, 6)
        self.k.update(speed=rng.uniform(-0.5, 0.5), scale=rng.uniform(0.6, 1.6))

    def update(self, sp):
        sp.span, sp.unit = 1.0, 1.0
        sp.reps *= max(1.0, self.opts["arms"] / 2.0)

    def __call__(self, fr, x, y):
        r = _length(x, y).clamp_min(1e-4)
        a = _atan2(y, x, r)
        k, s = self.k["scale"], self.k["speed"]
        ax = a * (self.opts["arms"] / math.pi)
        m = self.opts["map"]
        if m == "polar":
            ry = r * k
        elif m == "logpolar":
            ry = torch.log(r) * k
        else:
            ry = 0.35 * k / r.clamp_min(0.02)
        return ax, ry + fr.uniform(lambda t: s * t)


class _Swirl(_Domain):
    kind = "swirl"

    def __init__(self, rng, sp):
        super().__init__()
        span = sp.span
        self.k.update(amount=rng.uniform(1.0, 5.0) * rng.sign(), fall=1.0 / (span * span * rng.uniform(0.3, 1.5)),
                      w=rng.uniform(0.2, 1.0))

    def __call__(self, fr, x, y):
        amt, w = self.k["amount"], self.k["w"]
        ang = torch.exp(-(x * x + y * y) * self.k["fall"]) * fr.uniform(lambda t: amt * math.sin(w * t))
        return _rot(x, y, torch.cos(ang), torch.sin(ang))


class _SineWarp(_Domain):
    kind = "sinewarp"

    def __init__(self, rng, sp):
        super().__init__()
        span = sp.span
        self.k.update(amp=rng.uniform(0.05, 0.25) * span, fx=TAU * rng.uniform(0.5, 2.5) * sp.calm / span,
                      fy=TAU * rng.uniform(0.5, 2.5) * sp.calm / span, wx=rng.uniform(-2, 2), wy=rng.uniform(-2, 2),
                      px=rng.uniform(0, TAU), py=rng.uniform(0, TAU))

    def __call__(self, fr, x, y):
        k = self.k
        x = x + k["amp"] * torch.sin(y * k["fx"] + fr.uniform(lambda t: k["wx"] * t + k["px"]))
        y = y + k["amp"] * torch.sin(x * k["fy"] + fr.uniform(lambda t: k["wy"] * t + k["py"]))
        return x, y


class _NoiseWarp(_Domain):
    """Domain warping by a noise vector field (iq's p + k*fbm(p))."""

    kind = "noisewarp"

    def __init__(self, rng, sp):
        super().__init__()
        span = sp.span
        a = rng.uniform(0, TAU)
        self.k.update(amp=rng.uniform(0.2, 0.8) * span, scale=rng.uniform(0.2, 0.7) / span,
                      ox=rng.random(), oy=rng.random(), vx=0.02 * math.cos(a), vy=0.02 * math.sin(a))

    def __call__(self, fr, x, y):
        k = self.k
        dx, dy = _sample_noise(fr, x * k["scale"] + fr.uniform(lambda t: k["ox"] + k["vx"] * t),
                               y * k["scale"] + fr.uniform(lambda t: k["oy"] + k["vy"] * t), "fbm", 2)
        return x + (dx - 0.5) * (2.0 * k["amp"]), y + (dy - 0.5) * (2.0 * k["amp"])


class _KIFS(_Domain):
    """Kaleidoscopic IFS: repeated abs-fold, rotate, scale, offset."""

    kind = "kifs"

    def __init__(self, rng, sp):
        super().__init__()
        span = sp.span
        self.opts["iters"] = rng.integers(2, 5)
        self.k.update(scale=rng.uniform(1.3, 1.9), a0=rng.uniform(0, TAU), w=rng.uniform(-0.15, 0.15),
                      ox=rng.uniform(0.2, 0.8) * span, oy=rng.uniform(0.0, 0.6) * span)

    def update(self, sp):
        sp.reps *= 1.4 ** self.opts["iters"]

    def __call__(self, fr, x, y):
        k = self.k
        c = fr.uniform(lambda t: math.cos(k["a0"] + k["w"] * t))
        s = fr.uniform(lambda t: math.sin(k["a0"] + k["w"] * t))
        for _ in range(self.opts["iters"]):
            x, y = _rot(x.abs(), y.abs(), c, s)
            x, y = x * k["scale"] - k["ox"], y * k["scale"] - k["oy"]
        norm = 1.0 / k["scale"] ** self.opts["iters"]
        return x * norm, y * norm


class _Inversion(_Domain):
    kind = "inversion"

    def __init__(self, rng, sp):
        super().__init__()
        span = sp.span
        self.k.update(radius2=(rng.uniform(0.3, 0.8) * span) ** 2, span=span)

    def update(self, sp):
        sp.span = max(sp.span, 0.5)
        sp.reps *= 1.5

    def __call__(self, fr, x, y):
        d = (x * x + y * y).clamp_min(1e-3 * self.k["radius2"])
        f = self.k["radius2"] / d
        return x * f, y * f


class _Pixelate(_Domain):
    kind = "pixelate"

    def __init__(self, rng, sp):
        super().__init__()
        span = sp.span
        self.k["cells"] = rng.uniform(10, 40) / (2 * span)

    def __call__(self, fr, x, y):
        c = self.k["cells"]
        return (torch.floor(x * c) + 0.5) * (1.0 / c), (torch.floor(y * c) + 0.5) * (1.0 / c)


_DOMAINS = [_Rotate, _Scroll, _Mirror, _Kaleido, _Tile, _Polar, _Swirl, _SineWarp, _NoiseWarp, _KIFS,
            _Inversion, _Pixelate]
_DOMAIN_WEIGHTS = [3.0, 1.2, 1.0, 1.6, 2.2, 1.2, 0.8, 1.4, 1.4, 1.0, 0.4, 0.25]


# ---- fields: (x, y) -> value for the palette (+ optional alpha / light / colour) #
class _Out:
    """A field's result: value v feeds the palette; alpha is coverage (None = full);
    light multiplies the colour; spec is added on top (highlights); color
    (N,3,H,W) bypasses the palette.  alpha/light/spec are (N,1,H,W)."""

    def __init__(self, v=None, alpha=None, light=None, color=None, spec=None):
        self.v, self.alpha, self.light, self.color, self.spec = v, alpha, light, color, spec


class _Field(_Block):
    phase_valued = False  # True if v is a phase (unbounded); palettes are periodic anyway
    heavy = False  # at most one expensive field per program
    uses_palette = False  # called as field(fr, x, y, palette) to colour its own parts

    def __init__(self, rng, sp):
        super().__init__()


class _Gradient(_Field):
    kind = "gradient"

    def __init__(self, rng, sp):
        super().__init__(rng, sp)
        span = sp.span
        a = rng.uniform(0, TAU)
        g = rng.uniform(0.4, 1.0) / span
        self.k.update(gx=g * math.cos(a), gy=g * math.sin(a), w=rng.uniform(-0.1, 0.1))

    def __call__(self, fr, x, y):
        k = self.k
        return _Out(x * k["gx"] + y * k["gy"] + fr.uniform(lambda t: k["w"] * t))


class _Noise(_Field):
    kind = "noise"

    def __init__(self, rng, sp):
        super().__init__(rng, sp)
        span, calm = sp.span, sp.calm
        self.opts["style"] = rng.choice(["fbm", "ridged", "blobs", "warp", "marble", "contour"], [2, 1.2, 0.8, 2, 1, 1])
        a = rng.uniform(0, TAU)
        drift = rng.uniform(0.005, 0.04)
        self.k.update(scale=rng.uniform(0.15, 0.6) * calm / span, ox=rng.random(), oy=rng.random(),
                      vx=drift * math.cos(a), vy=drift * math.sin(a), warp=rng.uniform(0.08, 0.3),
                      bands=rng.uniform(3.0, 10.0), freq=rng.uniform(1.0, 4.0) * calm * TAU / span,
                      w=rng.uniform(-0.5, 0.5))
        self.phase_valued = self.opts["style"] in ("contour", "marble")

    def __call__(self, fr, x, y):
        k, style = self.k, self.opts["style"]
        u = x * k["scale"] + fr.uniform(lambda t: k["ox"] + k["vx"] * t)
        v = y * k["scale"] + fr.uniform(lambda t: k["oy"] + k["vy"] * t)
        if style in ("fbm", "ridged", "blobs"):
            return _Out(_sample_noise(fr, u, v, style)[0])
        if style == "warp":
            qx, qy = _sample_noise(fr, u, v, "fbm", 2)
            amp = 2.0 * k["warp"]
            n = _sample_noise(fr, u + (qx - 0.5) * amp, v + (qy - 0.5) * amp, "fbm")[0]
            return _Out(n + 0.3 * qx)
        n = _sample_noise(fr, u, v, "fbm")[0]
        if style == "marble":
            return _Out(0.5 + 0.5 * torch.sin(x * k["freq"] + n * k["bands"] + fr.uniform(lambda t: k["w"] * t)))
        return _Out(n * k["bands"] + fr.uniform(lambda t: k["w"] * t))  # contour bands


class _Waves(_Field):
    """Plasma: sums of travelling planar / radial sine waves."""

    kind = "waves"

    def __init__(self, rng, sp):
        super().__init__(rng, sp)
        span, calm = sp.span, sp.calm
        self.opts["style"] = rng.choice(["planar", "radial", "mixed"])
        self.opts["nested"] = rng.chance(0.4)
        n = rng.integers(2, 5)
        self.waves = []
        for _ in range(n):
            a = rng.uniform(0, TAU)
            f = TAU * rng.uniform(0.5, 3.0) * calm / span
            self.waves.append([f * math.cos(a), f * math.sin(a), rng.uniform(-2, 2), rng.uniform(0, TAU),
                               rng.uniform(-0.7, 0.7) * span, rng.uniform(-0.7, 0.7) * span])
        self.k.update(waves=[v for w in self.waves for v in w], gain=rng.uniform(0.7, 2.0))

    def __call__(self, fr, x, y):
        style = self.opts["style"]
        acc = None
        for i, (fx, fy, w, ph, cx, cy) in enumerate(self.waves):
            radial = style == "radial" or (style == "mixed" and i % 2 == 1)
            if radial:
                arg = _length(x - cx, y - cy) * math.hypot(fx, fy)
            else:
                arg = x * fx + y * fy
            s = torch.sin(arg + fr.uniform(lambda t: w * t + ph))
            acc = s if acc is None else acc + s
        acc = acc * (1.0 / len(self.waves))
        if self.opts["nested"]:
            return _Out(0.5 + 0.5 * torch.sin(acc * (math.pi * self.k["gain"])))
        return _Out(0.5 + 0.5 * acc)


class _PolarPattern(_Field):
    kind = "polarpat"
    phase_valued = True

    def __init__(self, rng, sp):
        super().__init__(rng, sp)
        span, calm = sp.span, sp.calm
        self.opts["style"] = rng.choice(["rings", "rays", "spiral", "flower"])
        self.opts["n"] = rng.integers(2, 12)
        self.k.update(cx=rng.uniform(-0.3, 0.3) * span, cy=rng.uniform(-0.3, 0.3) * span,
                      freq=rng.uniform(1.5, 6.0) * calm / span, w=rng.uniform(-1.0, 1.0),
                      dark=rng.uniform(0.0, 1.2) if rng.chance(0.5) else 0.0, span=span)

    def __call__(self, fr, x, y):
        k, style, n = self.k, self.opts["style"], self.opts["n"]
        x, y = x - k["cx"], y - k["cy"]
        r = _length(x, y)
        move = fr.uniform(lambda t: k["w"] * t)
        if style == "rings":
            v = r * k["freq"] - move
        else:
            a = _atan2(y, x, r) * (n / TAU)
            if style == "rays":
                v = a + move
            elif style == "spiral":
                v = a + torch.log(r.clamp_min(1e-4)) * (k["freq"] * k["span"] * 0.5) - move
            else:
                v = r * k["freq"] + 0.25 * torch.cos(a * TAU + move * 3.0) - move
        light = None
        if k["dark"] > 0:
            light = _powf((r * (1.0 / k["span"])).clamp(0.0, 1.0), k["dark"]).unsqueeze(1)
        return _Out(v, light=light)


def _sd_box(ax, ay, hx: float, hy: float):
    """Signed distance to an axis-aligned box with half sizes (hx, hy); ax, ay = |p|."""
    qx, qy = ax - hx, ay - hy
    return _length(qx.clamp_min(0), qy.clamp_min(0)) + torch.maximum(qx, qy).clamp_max(0.0)


def _sd_shape(shape: str, x, y, size: float, aux: float, n: int):
    """2-D signed distances (negative inside) of a few classic shapes."""
    if shape == "circle":
        return _length(x, y) - size
    if shape == "ring":
        return (_length(x, y) - size).abs() - size * aux * 0.3
    if shape == "box":
        return _sd_box(x.abs(), y.abs(), size, size * aux)
    if shape == "cross":
        ax, ay, w = x.abs(), y.abs(), size * 0.3
        return torch.minimum(_sd_box(ax, ay, size, w), _sd_box(ax, ay, w, size))
    if shape == "rhombus":
        return (x.abs() * (1.0 / size) + y.abs() * (1.0 / (size * aux)) - 1.0) * (size * 0.6)
    r = _length(x, y)
    a = _atan2(y, x, r)
    if shape == "polygon":
        # regular n-gon: distance to the nearest edge line in its sector
        sector = TAU / n
        local = a - sector * torch.floor(a * (1.0 / sector) + 0.5)
        return r * torch.cos(local) - size
    # star / flower: radius modulated by angle (not exact, but shader-typical)
    return r - size * (1.0 + aux * 0.45 * torch.cos(a * n))


class _Shape(_Field):
    """Signed-distance shapes rendered with smoothstep edges, outlines, glow or iso-bands."""

    kind = "shape"

    def __init__(self, rng, sp):
        super().__init__(rng, sp)
        span, calm = sp.span, sp.calm
        self.opts["shape"] = rng.choice(["circle", "ring", "box", "cross", "rhombus", "polygon", "star"],
                                        [1.2, 1, 1.2, 0.6, 0.6, 1, 1])
        self.opts["style"] = rng.choice(["fill", "outline", "glow", "bands"], [1.5, 1, 1.3, 1.2])
        self.opts["n"] = rng.integers(3, 8)
        self.phase_valued = self.opts["style"] == "bands"
        self.k.update(size=rng.uniform(0.3, 0.75) * span, aux=rng.uniform(0.5, 1.0),
                      pulse=rng.uniform(0.0, 0.25), pw=rng.uniform(0.5, 2.0),
                      width=rng.uniform(0.02, 0.08) * span, glow=rng.uniform(0.02, 0.12) * span,
                      bands=rng.uniform(2.0, 8.0) * calm / span, w=rng.uniform(-1.5, 1.5), span=span)

    def __call__(self, fr, x, y):
        k, style = self.k, self.opts["style"]
        size = k["size"]
        d = _sd_shape(self.opts["shape"], x, y, size, k["aux"], self.opts["n"])
        pulse = fr.uniform(lambda t: -k["pulse"] * size * math.sin(k["pw"] * t))
        d = d + pulse
        aa = fr.aa()
        if style == "fill":
            alpha = _smoothstep(aa, -aa, d)
            return _Out(-d * (1.0 / k["span"]), alpha=alpha.unsqueeze(1))
        if style == "outline":
            alpha = _smoothstep(k["width"] + aa, k["width"] - aa, d.abs())
            return _Out(d * (1.0 / k["span"]) + fr.uniform(lambda t: 0.05 * t), alpha=alpha.unsqueeze(1))
        if style == "glow":
            g = k["glow"] / (d.abs() + k["glow"])
            return _Out(d * (-0.5 / k["span"]), light=(g * g * 1.6).unsqueeze(1))
        return _Out(d * k["bands"] + fr.uniform(lambda t: k["w"] * t * 0.3))


class _Metaballs(_Field):
    kind = "metaballs"

    def __init__(self, rng, sp):
        super().__init__(rng, sp)
        span = sp.span
        self.opts["n"] = rng.integers(3, 7)
        self.opts["style"] = rng.choice(["solid", "glow"])
        self.balls = [[rng.uniform(0.3, 0.8) * span, rng.uniform(0.3, 0.8) * span, rng.uniform(0.3, 1.2),
                       rng.uniform(0.3, 1.2), rng.uniform(0, TAU), rng.uniform(0, TAU),
                       (rng.uniform(0.12, 0.3) * span) ** 2] for _ in range(self.opts["n"])]
        self.k.update(balls=[v for b in self.balls for v in b])

    def __call__(self, fr, x, y):
        acc = None
        for ax, ay, wx, wy, px, py, r2 in self.balls:
            cx = fr.uniform(lambda t: ax * math.sin(wx * t + px))
            cy = fr.uniform(lambda t: ay * math.cos(wy * t + py))
            dx, dy = x - cx, y - cy
            term = r2 / (dx * dx + dy * dy + 1e-3 * r2)
            acc = term if acc is None else acc + term
        if self.opts["style"] == "glow":
            return _Out(acc * 0.3, light=(acc * 0.5).clamp(0.0, 1.5).unsqueeze(1))
        alpha = _smoothstep(0.85, 1.15, acc)
        return _Out(acc * 0.25, alpha=alpha.unsqueeze(1))


class _Truchet(_Field):
    """Truchet tiles: quarter-circle arcs or 10PRINT diagonals with a random flip per cell."""

    kind = "truchet"

    def __init__(self, rng, sp):
        super().__init__(rng, sp)
        span, calm = sp.span, sp.calm
        self.opts["style"] = rng.choice(["arcs", "diagonal"], [2, 1])
        self.k.update(cells=rng.uniform(2.0, 7.0) * calm / span, width=rng.uniform(0.06, 0.2),
                      salt=rng.uniform(0, 100))

    def __call__(self, fr, x, y):
        k = self.k
        x, y = x * k["cells"], y * k["cells"]
        ix, iy = torch.floor(x), torch.floor(y)
        fx, fy = x - ix - 0.5, y - iy - 0.5
        flip = torch.sign(_hash21(ix, iy, k["salt"]) - 0.5)
        fx = fx * flip
        if self.opts["style"] == "arcs":
            d1 = (_length(fx - 0.5, fy - 0.5) - 0.5).abs()
            d2 = (_length(fx + 0.5, fy + 0.5) - 0.5).abs()
            d = torch.minimum(d1, d2)
        else:
            d = (fx - fy).abs() * 0.7071
        aa = fr.aa() * k["cells"]
        alpha = _smoothstep(k["width"] + aa, k["width"] - aa, d)
        return _Out(d * 2.0 + _hash21(ix, iy, k["salt"] + 7.0) * 0.5, alpha=alpha.unsqueeze(1))


class _Voronoi(_Field):
    """Cellular (Worley) noise: nearest and second-nearest feature distances, 3x3 cells."""

    kind = "voronoi"
    heavy = True

    def __init__(self, rng, sp):
        super().__init__(rng, sp)
        span, calm = sp.span, sp.calm
        self.opts["style"] = rng.choice(["f1", "edges", "f2", "cracks"])
        self.k.update(cells=rng.uniform(2.0, 6.0) * calm / span, jitter=rng.uniform(0.6, 1.0),
                      salt=rng.uniform(0, 100))

    def __call__(self, fr, x, y):
        k = self.k
        x, y = x * k["cells"], y * k["cells"]
        ix, iy = torch.floor(x), torch.floor(y)
        fx, fy = x - ix, y - iy
        f1 = f2 = None
        for oy in (-1.0, 0.0, 1.0):
            for ox in (-1.0, 0.0, 1.0):
                h = _hash21(ix + ox, iy + oy, k["salt"])
                h2 = torch.frac(h * 47.31 + 0.37)
                dx = ox + 0.5 + (h - 0.5) * k["jitter"] - fx
                dy = oy + 0.5 + (h2 - 0.5) * k["jitter"] - fy
                d = dx * dx + dy * dy
                if f1 is None:
                    f1, f2 = d, torch.full_like(d, 8.0)
                else:
                    f2 = torch.minimum(f2, torch.maximum(f1, d))
                    f1 = torch.minimum(f1, d)
        f1, f2 = torch.sqrt(f1), torch.sqrt(f2)
        style = self.opts["style"]
        if style == "f1":
            return _Out(f1)
        if style == "f2":
            return _Out(f2 * 0.7)
        edge = f2 - f1
        if style == "edges":
            return _Out(edge * 1.5 + f1 * 0.3)
        alpha = _smoothstep(0.12, 0.04, edge)
        return _Out(f1 * 0.8, alpha=alpha.unsqueeze(1))


class _Grid(_Field):
    kind = "grid"

    def __init__(self, rng, sp):
        super().__init__(rng, sp)
        span, calm = sp.span, sp.calm
        self.opts["style"] = rng.choice(["checker", "lines", "dots", "stripes"])
        self.k.update(cells=rng.uniform(2.0, 8.0) * calm / span, width=rng.uniform(0.04, 0.2),
                      a=rng.uniform(0, TAU), w=rng.uniform(-0.5, 0.5))

    def __call__(self, fr, x, y):
        k, style = self.k, self.opts["style"]
        x, y = x * k["cells"], y * k["cells"]
        aa = fr.aa() * k["cells"]
        if style == "checker":
            s = torch.floor(x) + torch.floor(y)
            return _Out((s - 2.0 * torch.floor(s * 0.5)) * 0.5 + 0.1 * _fract(x + y))
        if style == "stripes":
            u = x * math.cos(k["a"]) + y * math.sin(k["a"]) + fr.uniform(lambda t: k["w"] * t)
            tri = (_fract(u) - 0.5).abs()
            return _Out(_smoothstep(0.25 - aa, 0.25 + aa, tri) * 0.5 + u * 0.05)
        gx, gy = _fract(x) - 0.5, _fract(y) - 0.5
        if style == "lines":
            d = 0.5 - torch.maximum(gx.abs(), gy.abs())
        else:
            d = _length(gx, gy) - (0.25 + k["width"])
        alpha = _smoothstep(k["width"] + aa, k["width"] - aa, d) if style == "lines" else _smoothstep(aa, -aa, d)
        return _Out(d + 0.05 * (torch.floor(x) + torch.floor(y)), alpha=alpha.unsqueeze(1))


class _Kali(_Field):
    """Kali's fractal p = |p|/dot(p,p) - c, coloured by orbit statistics."""

    kind = "kali"
    heavy = True

    def __init__(self, rng, sp):
        super().__init__(rng, sp)
        span = sp.span
        self.opts["iters"] = rng.integers(5, 10)
        self.opts["stat"] = rng.choice(["mean", "trap"])
        self.k.update(cx=rng.uniform(0.4, 1.0), cy=rng.uniform(0.3, 1.0), wob=rng.uniform(0.0, 0.05),
                      w=rng.uniform(0.2, 1.0), zoom=rng.uniform(0.6, 1.6) / span)

    def __call__(self, fr, x, y):
        k = self.k
        x, y = x * k["zoom"], y * k["zoom"]
        cx = fr.uniform(lambda t: k["cx"] + k["wob"] * math.sin(k["w"] * t))
        cy = fr.uniform(lambda t: k["cy"] + k["wob"] * math.cos(k["w"] * t))
        acc = trap = None
        for _ in range(self.opts["iters"]):
            inv = 1.0 / (x * x + y * y).clamp_min(1e-3)
            x, y = x.abs() * inv - cx, y.abs() * inv - cy
            m = (x * x + y * y).clamp_max(100.0)
            acc = m if acc is None else acc + m
            trap = m if trap is None else torch.minimum(trap, m)
        if self.opts["stat"] == "mean":
            v = torch.sqrt(acc * (1.0 / self.opts["iters"])) * 0.5
        else:
            v = torch.sqrt(trap) * 1.5
        return _Out(v, light=(0.5 + torch.exp(-trap * 2.0)).unsqueeze(1))


class _Julia(_Field):
    """Julia set z -> z^2 + c with orbit-trap colouring (c animated on a circle)."""

    kind = "julia"
    heavy = True

    def __init__(self, rng, sp):
        super().__init__(rng, sp)
        span = sp.span
        self.opts["iters"] = rng.integers(8, 14)
        self.opts["trap"] = rng.choice(["point", "cross", "circle"])
        self.k.update(rad=rng.uniform(0.7, 0.8), a0=rng.uniform(0, TAU), w=rng.uniform(0.05, 0.3),
                      zoom=rng.uniform(1.2, 2.8) / (2 * span), tx=rng.uniform(-0.5, 0.5), ty=rng.uniform(-0.5, 0.5))

    def __call__(self, fr, x, y):
        k = self.k
        zx, zy = x * k["zoom"], y * k["zoom"]
        cx = fr.uniform(lambda t: k["rad"] * math.cos(k["a0"] + k["w"] * t))
        cy = fr.uniform(lambda t: k["rad"] * math.sin(k["a0"] + k["w"] * t))
        trap = smooth = None
        for _ in range(self.opts["iters"]):
            zx, zy = (zx * zx - zy * zy + cx).clamp(-50, 50), (2.0 * zx * zy + cy).clamp(-50, 50)
            m2 = zx * zx + zy * zy
            if self.opts["trap"] == "point":
                d = (zx - k["tx"]) * (zx - k["tx"]) + (zy - k["ty"]) * (zy - k["ty"])
            elif self.opts["trap"] == "cross":
                d = torch.minimum(zx.abs(), zy.abs())
            else:
                d = (torch.sqrt(m2) - 0.5).abs()
            trap = d if trap is None else torch.minimum(trap, d)
            e = torch.exp(-m2.clamp_max(50.0))
            smooth = e if smooth is None else smooth + e
        v = smooth * (1.0 / self.opts["iters"]) * 2.0 + torch.sqrt(trap) * 0.5
        return _Out(v, light=(0.35 + 0.9 * torch.exp(-trap * 6.0)).unsqueeze(1))


class _NeonLines(_Field):
    """Glowing sine curves, each with its own palette colour."""

    kind = "neon"
    uses_palette = True

    def __init__(self, rng, sp):
        super().__init__(rng, sp)
        span, calm = sp.span, sp.calm
        self.opts["n"] = rng.integers(2, 6)
        self.lines = [[rng.uniform(0.1, 0.5) * span, TAU * rng.uniform(0.3, 1.5) * calm / span, rng.uniform(-2.0, 2.0),
                       rng.uniform(0, TAU), rng.uniform(-0.5, 0.5) * span] for _ in range(self.opts["n"])]
        self.k.update(lines=[v for ln in self.lines for v in ln], glow=rng.uniform(0.01, 0.04) * span)

    def __call__(self, fr, x, y, palette):
        col = None
        g0 = self.k["glow"]
        for i, (amp, f, w, ph, off) in enumerate(self.lines):
            d = (y - off - amp * torch.sin(x * f + fr.uniform(lambda t: w * t + ph))).abs()
            glow = (g0 / (d + g0)).unsqueeze(1)
            tint = fr.vec3(lambda t: palette.const(i / len(self.lines), t))
            term = glow * tint
            col = term if col is None else col + term
        return _Out(color=col * 1.2)


class _Stars(_Field):
    """Parallax starfield: one jittered gaussian dot per lattice cell, a few layers."""

    kind = "stars"

    def __init__(self, rng, sp):
        super().__init__(rng, sp)
        span, calm = sp.span, sp.calm
        self.opts["layers"] = rng.integers(1, 3)
        a = rng.uniform(0, TAU)
        self.k.update(cells=rng.uniform(5.0, 14.0) * calm / span, vx=math.cos(a) * 0.3, vy=math.sin(a) * 0.3,
                      size=rng.uniform(0.08, 0.18), salt=rng.uniform(0, 100))

    def __call__(self, fr, x, y):
        k = self.k
        acc = None
        for layer in range(self.opts["layers"]):
            c = k["cells"] * (1.0 + 0.7 * layer)
            sx = fr.uniform(lambda t: k["vx"] * t * (1 + layer))
            sy = fr.uniform(lambda t: k["vy"] * t * (1 + layer))
            u, v = x * c + sx, y * c + sy
            iu, iv = torch.floor(u), torch.floor(v)
            h = _hash21(iu, iv, k["salt"] + layer)
            h2 = torch.frac(h * 31.7 + 0.2)
            dx = u - iu - 0.2 - 0.6 * h
            dy = v - iv - 0.2 - 0.6 * h2
            s = k["size"] * (0.4 + h2)
            star = torch.exp(-(dx * dx + dy * dy) * (1.0 / (s * s))) * (h * h)
            acc = star if acc is None else acc + star
        return _Out(acc * 3.0, light=acc.clamp(0.0, 1.5).unsqueeze(1) * 2.0 + 0.15)


class _Raymarch(_Field):
    """A small sphere-tracer: one SDF primitive (optionally repeated, twisted or
    on a floor) under an orbiting camera, with diffuse/specular/fog shading."""

    kind = "raymarch"
    heavy = True

    def __init__(self, rng, sp):
        super().__init__(rng, sp)
        span = sp.span
        self.opts["prim"] = rng.choice(["sphere", "box", "torus", "octahedron", "blob"])
        self.opts["repeat"] = rng.choice(["none", "xz", "xyz"], [2, 1, 1])
        self.opts["floor"] = self.opts["repeat"] != "xyz" and rng.chance(0.4)
        self.opts["style"] = rng.choice(["lit", "glow"], [3, 1])
        self.opts["steps"] = rng.integers(14, 22)
        la, le = rng.uniform(0, TAU), rng.uniform(0.3, 1.2)
        self.k.update(size=rng.uniform(0.6, 1.0), aux=rng.uniform(0.25, 0.45), period=rng.uniform(2.5, 4.0),
                      dist=rng.uniform(3.0, 4.5), height=rng.uniform(-0.3, 1.5), orbit=rng.uniform(-0.4, 0.4),
                      a0=rng.uniform(0, TAU), spin=rng.uniform(-0.8, 0.8), focal=rng.uniform(1.2, 2.0),
                      disp=rng.uniform(0.0, 0.12) if rng.chance(0.5) else 0.0, dfreq=rng.uniform(3.0, 7.0),
                      lx=math.cos(la) * math.cos(le), ly=math.sin(le), lz=math.sin(la) * math.cos(le),
                      fog=rng.uniform(0.01, 0.06), shin=rng.uniform(8.0, 40.0), uvscale=1.0 / max(span, 1e-3))

    def _sdf(self, px, py, pz, c, s, fr_disp):
        k, prim = self.k, self.opts["prim"]
        rep = self.opts["repeat"]
        if rep != "none":
            per = k["period"]
            px = px - per * torch.round(px * (1.0 / per))
            pz = pz - per * torch.round(pz * (1.0 / per))
            if rep == "xyz":
                py = py - per * torch.round(py * (1.0 / per))
        qx, qz = px * c - pz * s, px * s + pz * c  # spin the object about y
        size = k["size"]
        if prim == "sphere" or prim == "blob":
            d = torch.sqrt(qx * qx + py * py + qz * qz) - size
        elif prim == "box":
            ax, ay, az = qx.abs() - size * 0.8, py.abs() - size * 0.8, qz.abs() - size * 0.8
            bx, by, bz = ax.clamp_min(0), ay.clamp_min(0), az.clamp_min(0)
            out = torch.sqrt(bx * bx + by * by + bz * bz)
            d = out + torch.maximum(torch.maximum(ax, ay), az).clamp_max(0.0) - 0.05
        elif prim == "torus":
            ring = torch.sqrt(qx * qx + qz * qz) - size
            d = torch.sqrt(ring * ring + py * py) - size * k["aux"]
        else:
            d = (qx.abs() + py.abs() + qz.abs() - size * 1.3) * 0.577
        if prim == "blob" or k["disp"] > 0:
            amp = k["disp"] if k["disp"] > 0 else 0.1
            d = d + amp * torch.sin((qx + py * 0.7 - qz * 0.4) * k["dfreq"] + fr_disp)
        if self.opts["floor"]:
            d = torch.minimum(d, py + 1.1)
        return d

    def __call__(self, fr, x, y):
        k = self.k
        x, y = x * k["uvscale"] * 0.5, y * k["uvscale"] * 0.5

        def cam(t):
            a = k["a0"] + k["orbit"] * t
            if self.opts["repeat"] == "none":  # orbit the object, looking at it
                ox, oy, oz = k["dist"] * math.sin(a), k["height"], -k["dist"] * math.cos(a)
                fwd = [-ox, -oy, -oz]
            else:  # sit at a lattice-cell corner (never inside an object) and look around
                half = 0.5 * k["period"]
                oy = half if self.opts["repeat"] == "xyz" else k["height"]
                ox, oz = half + 0.3 * math.sin(a), half + 0.3 * math.cos(a)
                fwd = [math.sin(2.0 * a), -0.3, math.cos(2.0 * a)]
            n = math.sqrt(sum(v * v for v in fwd))
            fwd = [v / n for v in fwd]
            right = [fwd[2], 0.0, -fwd[0]]  # cross((0,1,0), fwd)
            n = math.sqrt(sum(v * v for v in right))
            right = [v / n for v in right]
            up = [fwd[1] * right[2] - fwd[2] * right[1], fwd[2] * right[0] - fwd[0] * right[2],
                  fwd[0] * right[1] - fwd[1] * right[0]]
            return [ox, oy, oz], fwd, right, up

        U = lambda i, j: fr.uniform(lambda t: cam(t)[i][j])
        ox, oy, oz = U(0, 0), U(0, 1), U(0, 2)
        f = k["focal"]
        dx = x * U(2, 0) + y * U(3, 0) + U(1, 0) * f
        dy = x * U(2, 1) + y * U(3, 1) + U(1, 1) * f
        dz = x * U(2, 2) + y * U(3, 2) + U(1, 2) * f
        inv = 1.0 / torch.sqrt(dx * dx + dy * dy + dz * dz)
        dx, dy, dz = dx * inv, dy * inv, dz * inv
        c = fr.uniform(lambda t: math.cos(k["spin"] * t))
        s = fr.uniform(lambda t: math.sin(k["spin"] * t))
        ph = fr.uniform(lambda t: 1.5 * t)
        tmax = 20.0
        dist = torch.full_like(dx, 0.1)
        glow = None
        d = None
        for _ in range(self.opts["steps"]):
            d = self._sdf(ox + dx * dist, oy + dy * dist, oz + dz * dist, c, s, ph)
            if self.opts["style"] == "glow":
                g = torch.exp(d.abs() * -8.0)
                glow = g if glow is None else glow + g
            dist = (dist + d * 0.9).clamp_max(tmax)
        px, py, pz = ox + dx * dist, oy + dy * dist, oz + dz * dist
        hit = _smoothstep(0.05, 0.01, d.abs()) * (dist < tmax * 0.98)
        fog = torch.exp(-(dist * dist) * k["fog"])
        if self.opts["style"] == "glow":
            v = dist * 0.15 + glow * 0.05
            light = 1.0 - torch.exp(glow * (-2.0 / self.opts["steps"]))
            return _Out(v, light=(light * 1.3).unsqueeze(1))
        # tetrahedral normal: four SDF taps
        e = 0.01
        taps = [(1, -1, -1), (-1, -1, 1), (-1, 1, -1), (1, 1, 1)]
        nx = ny = nz = None
        for sx_, sy_, sz_ in taps:
            v = self._sdf(px + sx_ * e, py + sy_ * e, pz + sz_ * e, c, s, ph)
            nx = v * sx_ if nx is None else nx + v * sx_
            ny = v * sy_ if ny is None else ny + v * sy_
            nz = v * sz_ if nz is None else nz + v * sz_
        inv = 1.0 / torch.sqrt(nx * nx + ny * ny + nz * nz + 1e-12)
        nx, ny, nz = nx * inv, ny * inv, nz * inv
        diff = (nx * k["lx"] + ny * k["ly"] + nz * k["lz"]).clamp(0.0, 1.0)
        # Blinn-Phong with half vector between light and view
        hx, hy, hz = k["lx"] - dx, k["ly"] - dy, k["lz"] - dz
        hinv = 1.0 / torch.sqrt(hx * hx + hy * hy + hz * hz + 1e-12)
        spec = _powf(((nx * hx + ny * hy + nz * hz) * hinv).clamp(0.0, 1.0), k["shin"])
        amb = 0.5 + 0.5 * ny
        light = (0.2 + 0.3 * amb + 0.9 * diff) * fog
        if self.opts["floor"]:
            # the classic shadertoy checkerboard floor
            on_floor = _smoothstep(0.08, 0.02, py + 1.1)
            cells = torch.floor(px) + torch.floor(pz)
            checker = cells - 2.0 * torch.floor(cells * 0.5)
            light = light * (1.0 - on_floor * 0.55 * checker)
        v = (nx * 0.3 + ny * 0.2 + nz * 0.1) + py * 0.15 + dist * 0.05
        alpha = (hit * (0.3 + 0.7 * fog)).unsqueeze(1)
        return _Out(v, alpha=alpha, light=light.unsqueeze(1), spec=(spec * fog * 0.8).unsqueeze(1))


# 2-D fields a layer draws from (the raymarcher is chosen per program instead).
_FIELDS = [_Gradient, _Noise, _Waves, _PolarPattern, _Shape, _Metaballs, _Truchet, _Voronoi, _Grid, _Kali, _Julia,
           _NeonLines, _Stars]
_FIELD_WEIGHTS = [0.5, 3.0, 2.0, 1.6, 2.6, 0.9, 1.0, 1.0, 1.0, 0.9, 0.9, 0.8, 0.5]


class _Transfer(_Block):
    """Reshapes a bounded field value before the palette: bands, thresholds, gamma."""

    kind = "transfer"

    def __init__(self, rng):
        super().__init__()
        self.opts["fn"] = rng.choice(["none", "bands", "cosbands", "step", "gamma"], [3, 0.8, 0.8, 0.5, 0.6])
        self.k.update(n=rng.uniform(2.0, 6.0), edge=rng.uniform(0.35, 0.65), g=rng.uniform(0.5, 2.0))

    def __call__(self, v):
        fn, k = self.opts["fn"], self.k
        if fn == "bands":
            return _fract(v * k["n"])
        if fn == "cosbands":
            return 0.5 + 0.5 * torch.cos(v * (TAU * k["n"]))
        if fn == "step":
            return _smoothstep(k["edge"] - 0.05, k["edge"] + 0.05, v) * 0.6 + v * 0.4
        if fn == "gamma":
            return _powf(v.clamp(0.0, 1.0), k["g"])
        return v


class _Layer(_Block):
    kind = "layer"

    def __init__(self, rng, sp, field_cls, first: bool):
        super().__init__()
        self.field = field_cls(rng, sp)
        self.palette = _Palette(rng)
        self.transfer = _Transfer(rng) if not self.field.phase_valued else None
        self.opts["blend"] = "base" if first else rng.choice(["over", "add", "multiply", "screen", "difference"],
                                                              [4, 2, 1.2, 1, 0.8])
        self.k["opacity"] = 1.0 if first else rng.uniform(0.5, 1.0)

    def structure(self):
        s = self.field.structure() + self.palette.structure() + (self.opts["blend"],)
        return s + (self.transfer.structure() if self.transfer else ())

    def constants(self):
        c = self.field.constants() + self.palette.constants() + super().constants()
        return c + (self.transfer.constants() if self.transfer else ())

    def describe(self):
        t = f"|{self.transfer.opts['fn']}" if self.transfer and self.transfer.opts["fn"] != "none" else ""
        return f"{self.opts['blend']}:{self.field.describe()}{t}~{self.palette.opts['style']}"

    def __call__(self, fr, x, y):
        f = self.field
        out = f(fr, x, y, self.palette) if f.uses_palette else f(fr, x, y)
        if out.color is not None:
            col = out.color
        else:
            v = self.transfer(out.v) if self.transfer is not None else out.v
            col = self.palette(fr, v)
        if out.light is not None:
            col = col * out.light
        if out.spec is not None:
            col = col + out.spec
        return col, out.alpha


class _Post(_Block):
    kind = "post"

    def __init__(self, rng):
        super().__init__()
        self.opts["vignette"] = rng.chance(0.4)
        self.opts["grade"] = rng.choice(["none", "gamma", "contrast", "tint"], [3, 1, 1, 1])
        self.k.update(vig=rng.uniform(0.5, 1.5), g=rng.uniform(0.6, 1.5), c=rng.uniform(1.1, 1.6),
                      tint=[rng.uniform(0.7, 1.2) for _ in range(3)])

    def describe(self):
        bits = [self.opts["grade"]] if self.opts["grade"] != "none" else []
        return ",".join(bits + (["vignette"] if self.opts["vignette"] else [])) or "none"

    def __call__(self, fr, col, x0, y0):
        k, grade = self.k, self.opts["grade"]
        if grade == "gamma":
            col = _powf(col.clamp(0.0, 1.0), k["g"])
        elif grade == "contrast":
            col = (col - 0.5) * k["c"] + 0.5
        elif grade == "tint":
            col = col * _const(k["tint"], col.device).view(1, 3, 1, 1)
        if self.opts["vignette"]:
            col = col * (1.0 - (x0 * x0 + y0 * y0) * (k["vig"] * 0.8)).unsqueeze(1)
        return col


# --------------------------------------------------------------------------- #
# Programs                                                                     #
# --------------------------------------------------------------------------- #
class _Program:
    """A sampled shader: zoom/centre, a chain of domain ops, 1-3 layers, post."""

    def __init__(self, program_id: int, base_seed: int):
        self.program_id, self.base_seed = int(program_id), int(base_seed)
        rng = _Rng(base_seed, program_id, _TAG_PROGRAM)
        self.zoom = rng.loguniform(1.0, 5.0)
        self.cx, self.cy = rng.uniform(-0.5, 0.5) * self.zoom, rng.uniform(-0.5, 0.5) * self.zoom
        if rng.chance(0.5):
            self.cx = self.cy = 0.0  # centred compositions are common in shaders
        sp = _Space(self.zoom)
        # About one program in seven is a raymarched 3-D scene over a 2-D background.
        scene = rng.chance(0.15)
        n_ops = rng.choice([0, 1], [1, 1]) if scene else rng.choice([0, 1, 2, 3], [1.2, 2.5, 2, 1])
        self.domain: list[_Domain] = []
        for _ in range(n_ops):
            if scene:  # keep the camera image intact: only rigid or tiling ops
                op = rng.choice([_Rotate, _Mirror, _Tile, _Pixelate], [2, 1, 1, 0.3])(rng, sp)
            else:
                cls = rng.choice(_DOMAINS, _DOMAIN_WEIGHTS)
                if self.domain and isinstance(self.domain[-1], cls):  # e.g. tile > tile adds nothing
                    cls = _Rotate if cls is not _Rotate else _SineWarp
                op = cls(rng, sp)
            op.update(sp)
            self.domain.append(op)
        self.unit = sp.unit
        self.layers: list[_Layer] = []
        if scene:
            bg = rng.choice([_Gradient, _Noise, _Waves, _PolarPattern, _Stars], [2, 1.5, 1, 1, 0.7])
            self.layers.append(_Layer(rng, sp, bg, True))
            ray = _Layer(rng, sp, _Raymarch, False)
            # solid objects cover the background; glowing ones light it up
            ray.opts["blend"] = "over" if ray.field.opts["style"] == "lit" else "add"
            ray.k["opacity"] = 1.0
            self.layers.append(ray)
        else:
            heavy = False
            n_layers = rng.choice([1, 2, 3], [2, 3, 1])
            for i in range(n_layers):
                if len(self.layers) >= n_layers:
                    break
                cls = rng.choice(_FIELDS, _FIELD_WEIGHTS)
                if cls.heavy and heavy:  # at most one expensive field per program
                    cls = rng.choice([_Noise, _Waves, _Shape, _Grid])
                heavy = heavy or cls.heavy
                if i == 0 and cls in (_Shape, _Truchet, _Grid, _Metaballs) and rng.chance(0.75):
                    # objects and masks need something behind them: a background layer first
                    bg = rng.choice([_Gradient, _Noise, _Waves, _PolarPattern])
                    self.layers.append(_Layer(rng, sp, bg, True))
                self.layers.append(_Layer(rng, sp, cls, not self.layers))
        self.post = _Post(rng)

    def structure(self) -> tuple:
        s = tuple(op.structure() for op in self.domain) + tuple(layer.structure() for layer in self.layers)
        return s + (self.post.structure(),)

    def constants(self) -> tuple:
        c = (round(self.zoom, 6), round(self.cx, 6), round(self.cy, 6))
        for b in self.domain + self.layers + [self.post]:
            c += b.constants()
        return c

    def describe(self) -> str:
        dom = " > ".join(op.describe() for op in self.domain) or "identity"
        lay = " + ".join(layer.describe() for layer in self.layers)
        return (f"program {self.program_id}: zoom {self.zoom:.2f}; domain {dom}; layers {lay}; "
                f"post {self.post.describe()}")

    def render(self, times: list[float], resolution: int, device) -> torch.Tensor:
        """Float colour (N,3,H,W) before clamping."""
        fr = _Frames(times, resolution, device, self.unit)
        x0, y0 = fr.uv()
        x, y = x0 * self.zoom + self.cx, y0 * self.zoom + self.cy
        for op in self.domain:
            x, y = op(fr, x, y)
        col = None
        for layer in self.layers:
            c, alpha = layer(fr, x, y)
            if col is None:
                # a masked base sits on a dim copy of itself rather than on black
                col = c if alpha is None else c * (0.2 + 0.8 * alpha)
                col = col.expand(fr.n, 3, resolution, resolution)
                continue
            a = layer.k["opacity"] if alpha is None else alpha * layer.k["opacity"]
            mode = layer.opts["blend"]
            if mode == "over":
                col = col + (c - col) * a
            elif mode == "add":
                col = col + c * a
            elif mode == "multiply":
                col = col * (1.0 + (c - 1.0) * a)
            elif mode == "screen":
                col = col + (1.0 - (1.0 - col) * (1.0 - c) - col) * a
            else:
                col = col + ((col - c).abs() - col) * a
        col = self.post(fr, col, x0, y0).expand(fr.n, 3, resolution, resolution)
        return self._auto_exposure(fr, col, x0, y0)

    def _auto_exposure(self, fr, col, x0, y0):
        """Stretch frames whose colours span a tiny range (dark scenes, a faint
        pattern), the way a camera's auto-exposure would; a frame with no range at
        all gets its first palette's radial gradient instead.  Decisions use only
        per-frame min/max, which are exact in any reduction order, so a frame's
        result never depends on the other frames in the batch."""
        c = col.clamp(0.0, 1.0)
        lo = c.amin(dim=(1, 2, 3), keepdim=True)
        span = c.amax(dim=(1, 2, 3), keepdim=True) - lo
        dim, flat = span < 0.3, span < 0.004
        # On CPU skip work no frame needs; on GPU that test would stall the queue, and
        # torch.where gives identical results either way.
        on_cpu = col.device.type == "cpu"
        if on_cpu and not bool(dim.any()):
            return col
        gain = (0.3 / (span + 1e-4)).clamp(1.0, 12.0)
        fixed = lo + (c - lo) * gain
        if not on_cpu or bool(flat.any()):
            grad = self.layers[0].palette(fr, _length(x0, y0) * 2.0 + x0 * 0.5)
            fixed = torch.where(flat, grad, fixed)
        return torch.where(dim, fixed, col)


@functools.lru_cache(maxsize=8192)
def _program(program_id: int, base_seed: int) -> _Program:
    return _Program(program_id, base_seed)


# --------------------------------------------------------------------------- #
# Public API                                                                   #
# --------------------------------------------------------------------------- #
def num_programs_available() -> int:
    """Number of distinct program ids (0 .. n-1).  Every id is a valid program;
    the first 21,000 are checked distinct by the tests."""
    return NUM_PROGRAMS


def _check_id(program_id: int) -> int:
    if not 0 <= int(program_id) < NUM_PROGRAMS:
        raise ValueError(f"program_id must be in [0, {NUM_PROGRAMS}), got {program_id}")
    return int(program_id)


def frame_time(base_seed: int, program_id: int, frame_index: int) -> float:
    """Shader time t in [0.1, 10], a pure hash of (base_seed, program_id, frame_index)."""
    u = (_hash_ints(base_seed, program_id, frame_index, _TAG_TIME) >> 11) * (1.0 / (1 << 53))
    return T_MIN + (T_MAX - T_MIN) * u


def describe_program(program_id: int, base_seed: int) -> str:
    """Short human-readable list of the blocks a program uses."""
    return _program(_check_id(program_id), int(base_seed)).describe()


def program_signature(program_id: int, base_seed: int) -> tuple[tuple, tuple]:
    """(structure, constants): discrete block choices and rounded constants."""
    p = _program(_check_id(program_id), int(base_seed))
    return p.structure(), p.constants()


def _device_kind(device) -> str:
    return torch.device(device).type


def _frames_per_chunk(resolution: int, device) -> int:
    return max(1, _CHUNK_PIXELS.get(_device_kind(device), 1 << 20) // (resolution * resolution))


def _program_chunks(program_id, frame_indices, resolution, base_seed, device):
    """Yield (offset, float colour (n,3,H,W), unclamped) over cache-sized chunks
    of one program's frames.  Chunking never changes a frame's bytes."""
    prog = _program(_check_id(program_id), int(base_seed))
    times = [frame_time(base_seed, program_id, int(f)) for f in frame_indices]
    per = _frames_per_chunk(resolution, device)
    for i in range(0, len(times), per):
        yield i, prog.render(times[i : i + per], resolution, device)


def _to_uint8(col: torch.Tensor) -> torch.Tensor:
    """(N,3,H,W) float -> (N,H,W,3) uint8 (clamp to [0,1], round to nearest)."""
    col = torch.nan_to_num(col, nan=0.0).clamp(0.0, 1.0)
    return torch.floor(col * 255.0 + 0.5).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def _put(out: torch.Tensor, rows: list[int], src: torch.Tensor) -> None:
    """out[rows] = src, as a plain slice copy when rows are consecutive."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        out[rows[0] : rows[0] + len(rows)] = src
    else:
        out[_const(rows, out.device, torch.long)] = src


def _by_program(pairs) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for i, (pid, _) in enumerate(pairs):
        groups[pid].append(i)
    return groups


def render_float(program_id: int, frame_indices, resolution: int, *, base_seed: int, device="cpu") -> torch.Tensor:
    """The float stage: (N,H,W,3) float32 colour before clamping/quantisation."""
    frame_indices, resolution = list(frame_indices), int(resolution)
    out = torch.empty((len(frame_indices), resolution, resolution, 3), dtype=torch.float32, device=device)
    for i, col in _program_chunks(program_id, frame_indices, resolution, base_seed, device):
        out[i : i + col.shape[0]] = col.permute(0, 2, 3, 1)
    return out


def render(program_id: int, frame_indices, resolution: int, *, base_seed: int, device="cpu") -> torch.Tensor:
    """Frames of one program as uint8 (N, H, W, 3), H = W = resolution."""
    frame_indices, resolution = list(frame_indices), int(resolution)
    out = torch.empty((len(frame_indices), resolution, resolution, 3), dtype=torch.uint8, device=device)
    for i, col in _program_chunks(program_id, frame_indices, resolution, base_seed, device):
        out[i : i + col.shape[0]] = _to_uint8(col)
    return out


def mix_components(item, *, base_seed: int, mix_k: int = 1, mix_alpha: float = 1.0,
                   mix_pool: int = SHADERS21K_SIZE) -> list[tuple[int, int, float]]:
    """The (program_id, frame_index, weight) images that one output item blends.

    Component 0 is the item itself; partners are drawn from program ids
    [0, mix_pool) and Dirichlet(mix_alpha) weights are seeded by the item only.
    """
    pid, fidx = int(item[0]), int(item[1])
    if mix_k <= 1:
        return [(pid, fidx, 1.0)]
    rng = _Rng(base_seed, pid, fidx, mix_k, _TAG_MIX)
    weights = rng.dirichlet(mix_k, float(mix_alpha))
    comps = [(pid, fidx, weights[0])]
    for j in range(1, mix_k):
        comps.append((rng.integers(0, mix_pool - 1), rng.integers(0, 2**31 - 1), weights[j]))
    return comps


def render_items(items, resolution: int, *, base_seed: int, mix_k: int = 1, mix_alpha: float = 1.0,
                 device="cpu", mix_pool: int = SHADERS21K_SIZE) -> torch.Tensor:
    """Render a list of (program_id, frame_index) items as uint8 (N, H, W, 3).

    Frames of the same program are rendered together.  With mix_k > 1 each output
    blends mix_k clamped images (see mix_components), accumulated in component
    order so the bytes never depend on the batch.
    """
    items = [(int(p), int(f)) for p, f in items]
    resolution = int(resolution)
    out = torch.empty((len(items), resolution, resolution, 3), dtype=torch.uint8, device=device)
    if mix_k <= 1:
        for pid, rows in _by_program(items).items():
            frames = [items[r][1] for r in rows]
            for i, col in _program_chunks(pid, frames, resolution, base_seed, device):
                _put(out, rows[i : i + col.shape[0]], _to_uint8(col))
        return out
    # Mixed items: partners are random programs, so work through cache-sized
    # blocks of items, one component at a time.
    per = _frames_per_chunk(resolution, device)
    for b in range(0, len(items), per):
        comps = [mix_components(it, base_seed=base_seed, mix_k=mix_k, mix_alpha=mix_alpha, mix_pool=mix_pool)
                 for it in items[b : b + per]]
        acc = None
        for j in range(mix_k):
            pairs = [(c[j][0], c[j][1]) for c in comps]
            layer = torch.empty((len(pairs), 3, resolution, resolution), dtype=torch.float32, device=device)
            for pid, rows in _by_program(pairs).items():
                frames = [pairs[r][1] for r in rows]
                for i, col in _program_chunks(pid, frames, resolution, base_seed, device):
                    _put(layer, rows[i : i + col.shape[0]], col)
            w = _const([c[j][2] for c in comps], device).view(-1, 1, 1, 1)
            term = layer.clamp(0.0, 1.0) * w
            acc = term if acc is None else acc + term
        out[b : b + len(comps)] = _to_uint8(acc)
    return out


# --------------------------------------------------------------------------- #
# Quality metrics and previews                                                 #
# --------------------------------------------------------------------------- #
def _as_float01(images) -> torch.Tensor:
    """uint8 (N,H,W,3) tensor/array -> float64 (N,3,H,W) in [0,1] on CPU."""
    t = torch.as_tensor(np.asarray(images.cpu() if torch.is_tensor(images) else images))
    return t.to(torch.float64).permute(0, 3, 1, 2) / 255.0


def near_constant_fraction(images_uint8, threshold: float = 0.02) -> float:
    """Fraction of images whose largest per-channel spatial std (in [0,1] units) is
    below `threshold` (default 0.02, about 5 grey levels): flat, useless frames."""
    x = _as_float01(images_uint8)
    if x.shape[0] == 0:
        return 0.0
    std = x.flatten(2).std(dim=2).amax(dim=1)
    return float((std < threshold).double().mean())


def diversity(images_uint8) -> float:
    """Mean pairwise L2 distance between images area-downsampled to 16x16x3 in [0,1]."""
    x = _as_float01(images_uint8)
    if x.shape[0] < 2:
        return 0.0
    small = F.adaptive_avg_pool2d(x, 16).flatten(1)
    return float(torch.pdist(small).mean())


def contact_sheet(images_uint8, path, ncols: int = 8, pad: int = 2) -> str:
    """Write images (N,H,W,3 uint8) as a PNG grid, atomically (temp file + os.replace)."""
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
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".contact_", suffix=".png", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            Image.fromarray(sheet).save(fh, format="PNG")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
