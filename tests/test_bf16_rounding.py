"""benchmarks/bf16_rounding.py: a clipped example's contribution against C, upcast and on the GPU's route."""

import pytest

from benchmarks.bf16_rounding import BOUND, contribution, gpu_route
from micro_batches import micro_model_and_batch
from pipeline.privacy import layer_rules
from pipeline.privacy.engine import make_clipper
from pipeline.train import autocast


@pytest.mark.parametrize("name", ["mae", "caption"])
def test_the_gpu_route_adds_a_little_less_than_c_and_is_undone_after(name):
    model, rows = micro_model_and_batch(name, 1)
    clipper = make_clipper("per_sample", model, BOUND, "bookkeeping", autocast=lambda: autocast("cpu", "bf16"))
    exact = contribution(clipper, rows)
    real = layer_rules.low_gemm
    with gpu_route():
        rounded = contribution(clipper, rows)
    assert layer_rules.low_gemm is real  # the emulation does not outlive the measurement
    assert exact == pytest.approx(1.0, abs=1e-4)  # the Gram products' rounding bound (κ·S²) alone
    assert 0.9 < rounded < 1 - 1e-4  # the slack the clip factor pays, and no more than a little
    with pytest.raises(ValueError, match="not far above the bound"):
        contribution(make_clipper("per_sample", model, 1e6, "bookkeeping"), rows)
