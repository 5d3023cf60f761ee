"""The noise the step adds has std σ·K·C; a test of the sample variance catches even 3% too little."""

import math

import pytest
import torch
import torch.nn as nn
from scipy import stats

from pipeline.privacy.clipping import BookKeepingClipper
from pipeline.privacy.engine import add_noise
from pipeline.privacy.noise import gaussian, step_noise


def noise_std_of(noise_std, scale=1.0):
    model = nn.Linear(300, 300)
    clipper = BookKeepingClipper(model, 1.0)
    clipper.reset()
    add_noise(clipper, noise_std * scale, 1.0, torch.Generator().manual_seed(1))
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def noise_matches(sample, std, alpha=1e-3):
    """Two-sided chi-square test of the sample variance against std²."""
    n = sample.numel()
    chi2 = (sample.double().pow(2).sum() / std ** 2).item()
    cdf = stats.chi2.cdf(chi2, df=n)
    return 2 * min(cdf, 1 - cdf) > alpha and abs(sample.mean().item()) < 5 * std / math.sqrt(n)


@pytest.mark.parametrize("sigma, sensitivity, clip_norm", [(0.7, 1.0, 1.0), (0.7, 2.0, 0.5), (2.0, 1.0, 3.0)])
def test_noise_std_is_sigma_times_sensitivity_times_c(sigma, sensitivity, clip_norm):
    std = sigma * sensitivity * clip_norm
    assert noise_matches(noise_std_of(std), std)
    assert not noise_matches(noise_std_of(std, scale=0.1), std)  # noise scaled down 10x is caught
    assert not noise_matches(noise_std_of(std, scale=0.97), std)  # even 3% too little is caught


@pytest.mark.parametrize("device_kind", ["cpu", "gpu"])
def test_each_noise_value_is_its_own_draw_from_a_stream_no_other_randomness_shares(monkeypatch, device_kind):
    """Each coordinate's normal N(0, 1) alone (the variance and normality tests above) is not enough: two
    released coordinates sharing one draw, or noise drawn from the bits that chose the batch or the masks,
    cancel or follow what they should hide. Measured on both branches of step_noise (the GPU's torch
    Philox taken here on the CPU): the halves of a Box-Muller draw are uncorrelated and every value is
    distinct; the noise follows the key and the step; and its stream is neither the step's Poisson
    sampler's (numpy's generator of (key, step)) nor the MAE masks' (step_generator's MASKS stream)."""
    import numpy as np

    from pipeline.privacy import noise
    from pipeline.train import MASKS, step_generator

    if device_kind == "gpu":  # the branch a CUDA device takes, its generator built on the CPU
        monkeypatch.setattr(noise, "step_generator", lambda key, step, stream, device: step_generator(
            key, step, stream, "cpu"))
    device = "cpu" if device_kind == "cpu" else "cuda"
    cpu = torch.device("cpu")

    def draw(key, step, count=20_000):
        return noise.gaussian((count,), noise.step_noise(key, step, device), cpu)

    z, half = draw(11, 3), 10_000
    assert abs(np.corrcoef(z[:half].numpy(), z[half:].numpy())[0, 1]) < 5 / math.sqrt(half)
    assert z.unique().numel() == z.numel()
    assert not torch.equal(draw(11, 4), z) and not torch.equal(draw(12, 3), z)
    ks = noise.uniforms(64, noise.step_noise(11, 3, device), cpu).mul_(2 ** 53).to(torch.int64)
    sampler_bits = torch.from_numpy(np.random.default_rng([11, 3]).integers(0, 2 ** 53, size=64, dtype=np.int64))
    mask_bits = torch.randint(0, 2 ** 53, (64,), generator=step_generator(11, 3, MASKS), dtype=torch.int64)
    assert len(set(ks.tolist()) & (set(sampler_bits.tolist()) | set(mask_bits.tolist()))) == 0


@pytest.mark.parametrize("shape", [(300_001,), (7, 13, 3)])
def test_the_cpu_noise_streams_draws_are_standard_normal_in_any_shape(shape):
    """dp-train's CPU noise comes from numpy's PCG64 (step_noise), not the torch generator the other tests
    use: its normals must be N(0, 1) too, and an odd count must still fill the shape."""
    z = gaussian(torch.Size(shape), step_noise(11, 3, "cpu"), torch.device("cpu"))
    assert z.shape == shape and z.dtype == torch.float64
    if z.numel() > 1000:
        assert stats.kstest(z.numpy(), "norm").pvalue > 1e-3 and noise_matches(z, 1.0)
