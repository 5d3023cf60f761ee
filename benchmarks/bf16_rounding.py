"""What the GPU's one-GEMM clipped sum costs in signal: each clipped example's contribution against C.

    python -m benchmarks.bf16_rounding [--dir DIR] [--objectives mae caption] [--examples 256] [--scale-schedule]

On a GPU under bf16 autocast the clipped sum rounds c_i·g to bf16 for one GEMM, and the clip factor
pays for the rounding: it is taken against ‖G_l‖ + u·Σ_t ‖a_t‖·‖g_t‖ for each Linear layer l
(layer_rules.LinearRule.reach_sq), not against ‖G_l‖. A clipped example then adds less than C to the
sum, at the same noise σC. This reads how much less, for the model as dp-train starts it
(gradient_norms.warm_model) on public eval examples, one example at a time under a bound far below
every norm (every example clipped): ‖its contribution‖ / C with CUDA's kernel emulated
(pipeline.privacy.tools.emulated_bf16_gemm), beside the upcast route, which gives 1 less its own bound
on the Gram products' fp32 rounding (about 1e-5). Run it in a scale_utility --dir's n-full directory,
or a project that has run dp-train's inputs. Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import numpy as np
import torch

from benchmarks.gradient_norms import QUANTILES, params_for, warm_model
from pipeline.data.tokenizer import Tokenizer
from pipeline.objectives import objective
from pipeline.privacy import layer_rules
from pipeline.privacy.clipping import view_rows
from pipeline.privacy.engine import make_clipper
from pipeline.privacy.tools import emulated_bf16_gemm
from pipeline.privacy.training import split_loader
from pipeline.train import autocast

BOUND = 1e-6  # far below every gradient norm: every example is clipped


@contextlib.contextmanager
def gpu_route():
    """layer_rules' CUDA route, emulated, for the duration."""
    saved = {k: getattr(layer_rules, k) for k in ("low_gemm_applies", "low_gemm")}
    emulated_bf16_gemm.enable()
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(layer_rules, k, v)


def contributions(obj: str, params: dict, examples: int) -> torch.Tensor:
    """(examples,) ‖clip(g_i)‖ / C under the bf16 GPU route, one public eval example at a time."""
    tokenizer = Tokenizer("models/tokenizer") if objective(obj).tokens else None
    model, mcfg = warm_model(obj, params, tokenizer)
    loader = split_loader("eval", mcfg, tokenizer)
    ids = np.sort(np.random.default_rng(0).choice(len(loader.dataset), min(examples, len(loader.dataset)),
                                                  replace=False))
    clipper = make_clipper("per_sample", model, BOUND, "bookkeeping", autocast=lambda: autocast("cpu", "bf16"))
    ratios = []
    for i in ids:
        batch, masks = tuple(loader.load(np.array([i]))), None
        if mcfg.reads_masks(obj):  # a mask as dp-train draws one: uniform noise per patch
            masks = torch.rand(1, 1, (mcfg.img_size // mcfg.patch_size) ** 2, generator=torch.Generator().manual_seed(int(i)))
        ratios.append(contribution(clipper, view_rows(batch, masks, 1)))
    return torch.tensor(ratios)


def contribution(clipper, rows: tuple[torch.Tensor, ...]) -> float:
    """‖clip(g)‖ / C for the one example `rows` hold, under a bound far below its gradient's norm."""
    clipper.reset()
    norm = clipper.accumulate(*rows).norms[0]
    if norm < 100 * clipper.clip_norm:
        raise ValueError(f"the example's gradient norm {norm:.3g} is not far above the bound {clipper.clip_norm:g}")
    return torch.sqrt(sum(v.double().pow(2).sum() for v in clipper.sum.values())).item() / clipper.clip_norm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".", help="where dp-train's inputs are (data/shards, models/): default here")
    ap.add_argument("--objectives", nargs="+", default=["mae", "caption"], choices=["mae", "caption"])
    ap.add_argument("--examples", type=int, default=256)
    ap.add_argument("--scale-schedule", action="store_true",
                    help="each objective on benchmarks/scale_utility's recipe (before any --set)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="as `dpfm --set`")
    args = ap.parse_args()
    params = {obj: params_for(obj, args.scale_schedule, args.set) for obj in args.objectives}
    os.chdir(args.dir)
    q = torch.tensor(QUANTILES, dtype=torch.float64)
    rows = []
    print(f"{'objective':<10}{'route':<22}{'contribution / C at quantiles ' + str(QUANTILES):<52}{'mean':>8}")
    for obj in args.objectives:
        for route, context in (("upcast (exact)", contextlib.nullcontext), ("bf16 GEMM (GPU)", gpu_route)):
            with context():
                r = contributions(obj, params[obj], args.examples).double()
            quantiles = [round(v, 4) for v in r.quantile(q).tolist()]
            print(f"{obj:<10}{route:<22}{str(quantiles):<52}{r.mean().item():>8.4f}")
            rows.append({"objective": obj, "route": route, "examples": len(r), "quantiles": quantiles,
                         "mean": round(r.mean().item(), 5), "max": round(r.max().item(), 6)})
    print(json.dumps({"benchmark": "bf16_rounding", "quantiles": QUANTILES, "rows": rows}))


if __name__ == "__main__":
    main()
