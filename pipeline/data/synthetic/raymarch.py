"""The raymarched field: a small sphere-tracer for the 3-D scenes about one
program in seven draws over a 2-D background.  The camera is computed per frame
in Python doubles; marching, normals and shading are element-wise torch ops."""

from __future__ import annotations

import math

import torch

from pipeline.data.synthetic.blocks import _Field, _Out
from pipeline.data.synthetic.shader_math import TAU, _powf, _smoothstep


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
