"""Domain operations, (x, y) -> (x, y): rotations, scrolling, mirrors,
kaleidoscopes, tiling, polar maps, swirls, sine and noise warps, KIFS folds,
inversion and pixelation, and the table programs draw them from.

`_Space` is the sampler's view of the domain that later blocks will see, so
their frequencies suit it.
"""

from __future__ import annotations

import math

import torch

from pipeline.data.synthetic.blocks import _Block
from pipeline.data.synthetic.noise import _sample_noise
from pipeline.data.synthetic.shader_math import TAU, _atan2, _fract, _length, _rot


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


# The ops a 2-D program chains, with their weights.  Order and weights decide every
# program's draws: changing either changes the images.
_DOMAINS = [_Rotate, _Scroll, _Mirror, _Kaleido, _Tile, _Polar, _Swirl, _SineWarp, _NoiseWarp, _KIFS,
            _Inversion, _Pixelate]
_DOMAIN_WEIGHTS = [3.0, 1.2, 1.0, 1.6, 2.2, 1.2, 0.8, 1.4, 1.4, 1.0, 0.4, 0.25]
