"""The clipped sum's rounding when one example leaves, against the batch size B: micro-batches cut by
index range (`sampling.split_by_index`, what dp-train runs) beside the cut by place in the batch that
it replaced (2026-11-29).

    python -m benchmarks.sum_rounding [--batches 512 2048 8192] [--physical 8] [--objectives mae caption clip-public]
                                      [--device cuda] [--precision bf16]

The real step on the tests' micro models and public random inputs, every example clipped, σ = 0,
sums in fp64 (`step_audit.rounding_moves`): the others' part of the move, R(B) − R(B∖x) − R({x}), in
units of C. Cut by place, x leaving shifts every later micro-batch and that part grows as √B; cut by
index range it regroups x's bucket only, so it stays what one bucket shows whatever B, and outside the
bucket it is 0. On a GPU in bf16 (`--device cuda --precision bf16`) the same figures take in what its
kernels' batch dependence moves. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from pipeline.config import load_params
from pipeline.objectives import OBJECTIVES
from pipeline.privacy import engine
from pipeline.privacy.sampling import PoissonSampler
from pipeline.privacy.tools.step_audit import SENSITIVITY_TOL, rounding_moves

ROOT = Path(__file__).resolve().parent.parent
MICRO = ["model.size=micro", "model.img_size=16", "model.decoder_width=32", "model.decoder_depth=1",
         "model.decoder_heads=2", "model.text_width=32", "model.text_depth=1", "model.text_heads=2",
         "model.max_caption_len=12", "tokenizer.vocab_size=128"]


def by_place(indices, sampler, mode, physical, world):
    """The split before 2026-11-29: each rank's share by place in the batch, cut in order."""
    return PoissonSampler.split(np.arange(len(indices)), physical, world.rank, world.size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--physical", type=int, default=8, help="examples per micro-batch")
    per_example = [n for n, o in OBJECTIVES.items() if o.clipping == "per_sample"]
    ap.add_argument("--objectives", nargs="+", default=per_example, choices=per_example)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="the forward's (dp.precision)")
    args = ap.parse_args()
    by_index, rows = engine.rank_share, []
    print(f"the others' part of the move when one example leaves, in units of C (the audit allows {SENSITIVITY_TOL:g})")
    print(f"{'objective':<12} {'B':>6}  {'by index':>9} {'by place':>9} {'place/index':>11}  "
          f"{'outside bucket':>14}  seconds")
    for name in args.objectives:
        params = load_params(ROOT / "params.yaml", [*MICRO, f"dp.objective={name}", f"dp.precision={args.precision}"])
        for batch in args.batches:
            t0, got = time.perf_counter(), {}
            for label, split in (("index", by_index), ("place", by_place)):
                engine.rank_share = split
                try:
                    got[label] = rounding_moves(params, batch, args.physical, device=args.device)
                finally:
                    engine.rank_share = by_index
            index, place = got["index"]["others"], got["place"]["others"]
            print(f"{name:<12} {batch:>6}  {index:>9.2e} {place:>9.2e} {place / index:>11.1f}  "
                  f"{got['index']['beyond_bucket']:>14.1e}  {time.perf_counter() - t0:7.0f}", flush=True)
            rows.append({"objective": name, "batch": batch, "physical": args.physical, "device": args.device,
                         "precision": args.precision, "by_index": index,
                         "by_place": place, "beyond_bucket": got["index"]["beyond_bucket"],
                         "bucket_size": got["index"]["bucket_size"]})
    print(json.dumps({"benchmark": "sum_rounding", "rows": rows}))


if __name__ == "__main__":
    main()
