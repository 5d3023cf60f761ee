"""Escape-time fractal fields coloured by orbit statistics: Kali's set and Julia sets.
Both are `heavy`: a program uses at most one expensive field."""

from __future__ import annotations

import math

import torch

from pipeline.data.synthetic.blocks import _Field, _Out
from pipeline.data.synthetic.shader_math import TAU


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
