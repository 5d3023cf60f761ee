"""What every block shares: the per-batch frame context (`_Frames`), the block
base class (`_Block`), and the field interface (`_Field`, returning an `_Out`).

A block samples its constants from the program's Rng at construction, records
discrete choices in `opts` (its structure) and continuous ones in `k`, and is
then called on pixel tensors of shape (N,H,W), one row per frame.
"""

from __future__ import annotations

import torch

from pipeline.data.synthetic.shader_math import _const


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


class _Block:
    """Base of every block: `opts` (discrete choices) give its structure and
    description, `k` (continuous constants) its rounded constants."""

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


class _Out:
    """A field's result: value v feeds the palette; alpha is coverage (None = full);
    light multiplies the colour; spec is added on top (highlights); color
    (N,3,H,W) bypasses the palette.  alpha/light/spec are (N,1,H,W)."""

    def __init__(self, v=None, alpha=None, light=None, color=None, spec=None):
        self.v, self.alpha, self.light, self.color, self.spec = v, alpha, light, color, spec


class _Field(_Block):
    """A field maps domain coordinates (x, y) to an _Out for its layer's palette."""

    phase_valued = False  # True if v is a phase (unbounded); palettes are periodic anyway
    heavy = False  # at most one expensive field per program
    uses_palette = False  # called as field(fr, x, y, palette) to colour its own parts

    def __init__(self, rng, sp):
        super().__init__()
