"""layer_rules' GPU route (bf16 GEMMs with fp32 results) switched on where there is no GPU, for tests and
benchmarks/bf16_rounding.py: CUDA's kernel emulated by what it computes, exact products of bf16 values
summed in fp32."""

from __future__ import annotations

import torch

from pipeline.privacy import layer_rules


def emulated_low_gemm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    assert x.dtype == y.dtype == torch.bfloat16
    return torch.matmul(x.float(), y.float())  # each product of two bf16 values is exact in fp32


def enable(setattr=setattr, calls: list | None = None) -> None:
    """Route every bf16 Linear product through the emulated kernel (`setattr`: pytest's monkeypatch.setattr
    to undo it after a test; plain setattr in a spawned rank). `calls` collects the products' shapes."""

    def applies(x, y):
        return layer_rules.LOW_PRECISION_PRODUCTS and x.dtype == y.dtype == torch.bfloat16

    def gemm(x, y):
        if calls is not None:
            calls.append(tuple(x.shape))
        return emulated_low_gemm(x, y)

    setattr(layer_rules, "low_gemm_applies", applies)
    setattr(layer_rules, "low_gemm", gemm)
