"""benchmarks/gpu_throughput.py: the kernels a step dispatches (--launches, counted without a GPU), and a
measurement that leaves nothing behind for the next one's peak."""

import gc

import pytest

from benchmarks import gpu_throughput
from pipeline.privacy import layer_rules

MICRO = {"size": "micro", "img_size": 16, "patch_size": 4, **gpu_throughput.TEXT}


@pytest.mark.parametrize("objective", ["mae", "caption"])
def test_launches_counts_the_clippers_kernels_and_leaves_the_products_as_they_were(objective):
    before = layer_rules.low_gemm_applies, layer_rules.low_gemm
    plain = gpu_throughput.launches(objective, MICRO, "plain", "bf16")
    clipped = gpu_throughput.launches(objective, MICRO, "bookkeeping", "bf16")
    assert (layer_rules.low_gemm_applies, layer_rules.low_gemm) == before  # the emulation is undone
    assert plain["bf16 gemm"] == 0 < clipped["bf16 gemm"]  # the clipper's products, one launch each
    assert sum(clipped.values()) > sum(plain.values()) > 0
    # The per-layer norms are gathered once per clip group: no in-place add and write-back per layer
    # (which took a copy_ a layer, twice) beyond what the plain step does.
    assert clipped["copy_"] <= plain["copy_"], (clipped["copy_"], plain["copy_"])


def test_a_measured_step_leaves_no_model_behind():
    """The clipper's hooks tie model and clipper in a reference cycle: left to the collector, one
    measurement's memory (an OOM'd try's activations too) counted in the next one's peak."""
    gc.collect()
    gc.disable()  # only what measure() frees itself counts
    try:
        gpu_throughput.measure("mae", MICRO, "bookkeeping", 2, "cpu", "bf16", steps=1)
        alive = [o for o in gc.get_objects() if type(o).__name__ == "MaskedAutoencoder"]
    finally:
        gc.enable()
    assert not alive
