"""Fields, (x, y) -> value for the palette (+ optional alpha / light / colour):
gradients, texture noise, plasma waves, polar patterns, Truchet tiles, Voronoi
cells, grids, neon lines and starfields, and the table of every 2-D field that
layers draw from (SDF shapes and fractals live in shapes.py and fractals.py, the
raymarcher in raymarch.py).
"""

from __future__ import annotations

import math

import torch

from pipeline.data.synthetic.blocks import _Field, _Out
from pipeline.data.synthetic.fractals import _Julia, _Kali
from pipeline.data.synthetic.noise import _sample_noise
from pipeline.data.synthetic.shader_math import TAU, _atan2, _fract, _hash21, _length, _powf, _smoothstep
from pipeline.data.synthetic.shapes import _Metaballs, _Shape


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


# 2-D fields a layer draws from (the raymarcher is chosen per program instead).
# As with domains.py's table, order and weights decide every program's draws.
_FIELDS = [_Gradient, _Noise, _Waves, _PolarPattern, _Shape, _Metaballs, _Truchet, _Voronoi, _Grid, _Kali, _Julia,
           _NeonLines, _Stars]
_FIELD_WEIGHTS = [0.5, 3.0, 2.0, 1.6, 2.6, 0.9, 1.0, 1.0, 1.0, 0.9, 0.9, 0.8, 0.5]
