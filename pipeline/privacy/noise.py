"""The DP noise's draw: standard normals in fp64 whose tail reaches 12.1 std.

Every normal sampler on floats has an edge: torch's draws by Box-Muller, |z| = sqrt(-2 ln u)·|cos θ|, so
|z| never passes sqrt(-2 ln u_min) for the smallest uniform u_min it can give: 5.77 std in fp32 on the
CPU (24-bit uniforms), 6.76 on CUDA, 8.57 in fp64. A released coordinate past the edge is possible only
when the example that moved it was in the batch, so an adversary who knows the rest learns that for
certain (docs/privacy.md, "Floating-point noise"). Here u is built from two fp64 uniforms, the second
filling in below the first's 2^-53 resolution, so u reaches 2^-106 and |z| reaches 12.1 std
(noise_edge.NOISE_EDGE): past it a Gaussian goes once in 1e33 draws.

The uniforms are k·2^-53 for a uniform integer k < 2^53 on every device (`uniforms`), so the edge is
the same on a GPU: torch's own fp64 `rand` gives these on the CPU, but on CUDA it rounds cuRAND's
(k + 1/2)·2^-53 and turns 1 into 0, so 1 - u never falls below 2^-52 there (an edge of 12.06, not
the 12.12 the ledger records) and draws near 0 come 1.5 times too often.

Drawn from the step's noise generator (`step_noise`) in a fixed order: the same on every rank and on
every re-run.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pipeline.privacy.noise_edge import UNRECORDED_EDGE, box_muller_edge
from pipeline.train import NOISE, step_generator

FINE = 2.0 ** -53  # an fp64 uniform's resolution
# Where torch's own normals stop (Box-Muller on its smallest uniform), for comparison.
TORCH_EDGES = {"torch fp32, CPU": UNRECORDED_EDGE, "torch fp32, CUDA": box_muller_edge(2.0 ** -33),
               "torch fp64": box_muller_edge(2.0 ** -53)}


def box_muller(coarse: torch.Tensor, fine: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Two normals per triple of uniforms in [0, 1): u = coarse + (1 - fine)·2^-53 lies in (0, 1] down to
    2^-106, radius sqrt(-2 ln u), angle 2π·angle. Works in place on its inputs."""
    u = coarse.add_(fine.neg_().add_(1.0).mul_(FINE))
    radius = u.log_().mul_(-2.0).sqrt_()
    turn = angle.mul_(2 * math.pi)
    out = torch.empty(2 * len(turn), dtype=turn.dtype, device=turn.device)
    torch.cos(turn, out=out[:len(turn)]).mul_(radius)
    torch.sin(turn, out=out[len(turn):]).mul_(radius)
    return out


NoiseGenerator = torch.Generator | np.random.Generator


def step_noise(key: int, step: int, device: str | torch.device) -> NoiseGenerator:
    """The generator of step `step`'s noise under the run's secret `key`. On a GPU, the device's Philox
    seeded with 63 bits of (key, step) (train.step_generator). Not so on the CPU: torch's Mersenne
    Twister keeps only the low 32 bits of any seed, so each step's whole noise would be one of 2^32
    vectors, which a search over them recovers from a single released update (and among 10^5 steps
    two would draw the same noise, odds 2 in 3). There numpy's PCG64 draws it, seeded with the whole
    (key, step) SeedSequence: 128 bits of state."""
    if torch.device(device).type == "cpu":
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([key, step, NOISE])))
    return step_generator(key, step, NOISE, device)


def uniforms(count: int, generator: NoiseGenerator, device: torch.device) -> torch.Tensor:
    """`count` fp64 uniforms k·2^-53, k uniform in [0, 2^53), from 53 bits of the generator on any device."""
    if isinstance(generator, np.random.Generator):
        k = torch.from_numpy(generator.integers(0, 2 ** 53, size=count, dtype=np.int64)).to(device)
    else:
        k = torch.randint(0, 2 ** 53, (count,), generator=generator, device=device, dtype=torch.int64)
    return k.to(torch.float64).mul_(FINE)


def gaussian(shape: torch.Size, generator: NoiseGenerator, device: torch.device) -> torch.Tensor:
    """fp64 standard normals of `shape` from `generator` (which lives on `device`)."""
    count = math.prod(shape)
    half = (count + 1) // 2
    return box_muller(*(uniforms(half, generator, device) for _ in range(3)))[:count].view(shape)
