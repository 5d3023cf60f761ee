"""Fields built on 2-D signed distances: classic SDF shapes (filled, outlined,
glowing or banded) and metaballs."""

from __future__ import annotations

import math

import torch

from pipeline.data.synthetic.blocks import _Field, _Out
from pipeline.data.synthetic.shader_math import TAU, _atan2, _length, _smoothstep


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
