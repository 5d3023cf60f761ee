"""The noise the step adds has std σ·K·C; a test of the sample variance catches even 3% too little."""

import math

import pytest
import torch
import torch.nn as nn
from scipy import stats

from pipeline.privacy.clipping import BookKeepingClipper
from pipeline.privacy.engine import add_noise


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
