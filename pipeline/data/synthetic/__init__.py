"""Shaders21k-style procedural images, rendered with torch on CPU or GPU.

ViP warm-starts its MAE on Shaders21k: frames of ~21k OpenGL fragment shaders.
We cannot ship those, so this package generates a family that behaves alike: each
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

Modules, from the bottom up:

- ``rng``: the splitmix64-based Rng for program structure, times and mixing
- ``shader_math``: GLSL-style pixel helpers (fract, smoothstep, atan2, pow, hash)
- ``noise``: the periodic noise texture bank and its bilinear lookup
- ``blocks``: the per-batch frame context and the block / field base classes
- ``domains``: domain operations (x, y) -> (x, y)
- ``fields``, ``shapes``, ``fractals``, ``raymarch``: fields (x, y) -> value
- ``layers``: palette, transfer curve, layer blending, post-processing
- ``program``: the program grammar, compositing and auto-exposure
- ``rendering``: the public rendering API
- ``quality``: quality figures and the contact sheet

Every .py file here is generator code: the `synthetic` stage keys its staged
shards by a hash of all of them (pipeline/stages/synthetic.py).
"""

from __future__ import annotations

from pipeline.data.synthetic.quality import contact_sheet, diversity, near_constant_fraction
from pipeline.data.synthetic.rendering import (NUM_PROGRAMS, SHADERS21K_SIZE, T_MAX, T_MIN, describe_program,
                                               frame_time, mix_components, num_programs_available,
                                               program_signature, render, render_float, render_items)

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
    "NUM_PROGRAMS",
    "SHADERS21K_SIZE",
    "T_MIN",
    "T_MAX",
]
