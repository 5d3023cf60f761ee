"""How a field becomes colour: the cosine palette, the transfer curve applied
before it, the layer (field + palette + blend mode) and the post-processing
(grade, vignette) applied to the composite."""

from __future__ import annotations

import math

import torch

from pipeline.data.synthetic.blocks import _Block, _Frames
from pipeline.data.synthetic.rng import _Rng
from pipeline.data.synthetic.shader_math import TAU, _const, _fract, _powf, _smoothstep


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
