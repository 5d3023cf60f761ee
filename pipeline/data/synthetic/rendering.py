"""The public rendering API: program ids and frame times, descriptions and
signatures, and rendering frames of one program (`render`, `render_float`) or
lists of (program, frame) items with optional mixing (`render_items`).

Frames of one program are rendered together in cache-sized chunks; chunking
and batching never change a frame's bytes.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from pipeline.data.synthetic.program import _program
from pipeline.data.synthetic.rng import _TAG_MIX, _TAG_TIME, _hash_ints, _Rng
from pipeline.data.synthetic.shader_math import _const

T_MIN, T_MAX = 0.1, 10.0
# Program ids are any integer in [0, 2**31); Shaders21k itself has ~21k programs,
# which is also the default pool that mixing partners are drawn from.
NUM_PROGRAMS = 2**31
SHADERS21K_SIZE = 21_000

# Pixels rendered per torch call: small on CPU so tensors stay in cache, large on
# GPU so kernels have enough work.  Results do not depend on this split.
_CHUNK_PIXELS = {"cpu": 1 << 17, "cuda": 1 << 23}


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
