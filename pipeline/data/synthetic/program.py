"""The program grammar: a sampled shader is a zoom and centre, a chain of domain
ops, one to three layers (or a raymarched scene over a background) and a post
step.  `_Program.render` composites the layers and applies auto-exposure;
`_program` caches programs by (program_id, base_seed)."""

from __future__ import annotations

import functools

import torch

from pipeline.data.synthetic.blocks import _Frames
from pipeline.data.synthetic.domains import (_DOMAIN_WEIGHTS, _DOMAINS, _Domain, _Mirror, _Pixelate, _Rotate,
                                             _SineWarp, _Space, _Tile)
from pipeline.data.synthetic.fields import (_FIELD_WEIGHTS, _FIELDS, _Gradient, _Grid, _Noise, _PolarPattern,
                                            _Stars, _Truchet, _Waves)
from pipeline.data.synthetic.layers import _Layer, _Post
from pipeline.data.synthetic.raymarch import _Raymarch
from pipeline.data.synthetic.rng import _TAG_PROGRAM, _Rng
from pipeline.data.synthetic.shader_math import _length
from pipeline.data.synthetic.shapes import _Metaballs, _Shape


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
