"""The two exact routes to a Linear layer's clipped sum, timed side by side per layer shape, and the
route the clipper's cost rule picks (pipeline/privacy/layer_rules.py, WRITE_COST).

  ghost        Gram products for the norms, then the clipped sum (one weight gradient)
  instantiate  the per-example gradients (B, p, d), their norms, then their weighted sum

Beside them, the Gram products alone as the clipper forms them (from 2·GRAM_BLOCK tokens blocks of
GRAM_BLOCK, only those on and above the diagonal; below, columns rounded down to a multiple of
GRAM_ALIGN and the corner past them) against one T×T product each: "formed/one".

    python -m benchmarks.clipping_routes [--threads 2] [--rounds 5]
    python -m benchmarks.clipping_routes --device cuda --batch 256   # on a GPU (refits WRITE_COST there)

On a GPU both sides come in bf16, as the clipper holds them under autocast (its products are then bf16
GEMMs with fp32 output), every shape takes --batch examples (a GPU's micro-batch, not a CPU's), and the
crossover of "inst/ghost" against T²(d+p)/(d·p) is the WRITE_COST that device wants.

Shapes: the layers of the models dpfm trains (the CPU recipe's captioner at B = 256, the
dp_overhead sizes at 32 px and ViT-S/16 at 224 px). Ends with one JSON line: per shape the times,
T²(d+p)/(d·p), the picked route and whether it was the faster one.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn as nn

from pipeline.privacy.clipping import clip_factors
from pipeline.privacy.layer_rules import WRITE_COST, LinearRule, gram_inner, mm32
from pipeline.train import keep_freed_memory

SHAPES = [  # (B, T, d_in, d_out, where)
    (256, 65, 96, 288, "cpu captioner encoder qkv"),
    (256, 65, 96, 96, "cpu captioner encoder proj"),
    (256, 65, 96, 384, "cpu captioner encoder fc1"),
    (256, 65, 384, 96, "cpu captioner encoder fc2"),
    (256, 33, 96, 288, "cpu captioner encoder qkv, half the patches"),
    (256, 33, 96, 96, "cpu captioner encoder proj, half the patches"),
    (256, 33, 96, 384, "cpu captioner encoder fc1, half the patches"),
    (256, 33, 384, 96, "cpu captioner encoder fc2, half the patches"),
    (256, 33, 96, 192, "cpu captioner cross-attention kv, half the patches"),
    (256, 13, 96, 288, "cpu captioner text qkv"),
    (256, 13, 96, 384, "cpu captioner text fc1"),
    (256, 17, 96, 288, "cpu MAE encoder qkv"),
    (32, 17, 384, 1536, "tiny MAE encoder fc1, 32 px"),
    (32, 65, 384, 1152, "tiny captioner qkv, 32 px"),
    (32, 65, 512, 2048, "MAE decoder fc1, 32 px"),
    (8, 50, 384, 1536, "ViT-S MAE encoder fc1, 224 px"),
    (8, 197, 384, 1152, "ViT-S captioner qkv, 224 px"),
    (8, 197, 384, 1536, "ViT-S captioner fc1, 224 px"),
    (8, 197, 768, 2304, "ViT-B captioner qkv, 224 px"),
    (2, 577, 768, 2304, "ViT-B captioner qkv, 384 px"),
]


def best_ms(fn, rounds: int, device: str = "cpu") -> float:
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    fn()
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def routes(B: int, T: int, d: int, p: int, device: str = "cpu"):
    """(ghost, instantiate) closures computing the same clipped sum with the rule's own code."""
    rule, layer = LinearRule(), nn.Linear(d, p, bias=False, device=device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # what the clipper holds there
    a, g = torch.randn(B, T, d, device=device, dtype=dtype), torch.randn(B, T, p, device=device, dtype=dtype)

    def ghost():
        factors, _ = clip_factors(rule.ghost_sq_norm(layer, a, g).sqrt(), 1.0)
        return rule.clipped_sum(layer, a, g, factors)["weight"]

    def instantiate():
        per = rule.per_sample(layer, a, g)["weight"]
        factors, _ = clip_factors(torch.linalg.vector_norm(per.flatten(1), dim=1), 1.0)
        return torch.einsum("b,b...->...", factors, per)

    def gram_one_product():  # the plain form: one T×T product per example and side
        return (mm32(a, a.transpose(1, 2)) * mm32(g, g.transpose(1, 2))).sum((1, 2))

    return ghost, instantiate, lambda: gram_inner(a, g), gram_one_product


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, help="every shape at this many examples (default: each shape's own)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # Freed memory stays in the heap as training keeps it: otherwise every per-example-gradient buffer
    # above glibc's mmap threshold is mapped, faulted in and returned on each call, which training never pays.
    keep_freed_memory()
    print(f"{'layer':<32}{'B':>5}{'T':>5}{'d→p':>11}{'T²(d+p)/dp':>12}{'ghost ms':>10}{'inst ms':>9}"
          f"{'inst/ghost':>12}{'Gram formed/one':>17}  picked")
    out, right = [], 0
    # the ghost route's clipped sum rounds its scaled side to bf16 on a GPU (layer_rules.scaled_to_bf16)
    gap = 1e-2 if args.device == "cuda" else 1e-4
    for B, T, d, p, where in SHAPES:
        B = args.batch or B
        ghost, instantiate, gram_formed, gram_one = routes(B, T, d, p, args.device)
        want = instantiate()
        assert (ghost() - want).norm() <= gap * want.norm(), where  # the same result
        assert torch.allclose(gram_formed(), gram_one(), rtol=1e-4), where
        t_ghost, t_inst = best_ms(ghost, args.rounds, args.device), best_ms(instantiate, args.rounds, args.device)
        t_formed = best_ms(gram_formed, args.rounds, args.device)
        t_one = best_ms(gram_one, args.rounds, args.device)
        ratio = T * T * (d + p) / (d * p)
        layer, g = nn.Linear(d, p, device="meta"), torch.empty(B, T, p, device="meta")
        picked = "ghost" if LinearRule().ghost_is_faster(layer, None, g) else "instantiate"  # the clipper's own rule
        faster = "ghost" if t_ghost <= t_inst else "instantiate"
        right += picked == faster
        print(f"{where:<32}{B:>5}{T:>5}{f'{d}→{p}':>11}{ratio:>12.0f}{t_ghost:>10.1f}{t_inst:>9.1f}"
              f"{t_inst / t_ghost:>11.2f}×{t_formed / t_one:>16.2f}×  {picked}"
              f"{'' if picked == faster else '  (the other is faster)'}")
        out.append({"layer": where, "B": B, "T": T, "d": d, "p": p, "gram_ratio": round(ratio, 1),
                    "ghost_ms": round(t_ghost, 2), "instantiate_ms": round(t_inst, 2),
                    "gram_formed_ms": round(t_formed, 2), "gram_one_product_ms": round(t_one, 2), "picked": picked,
                    "picked_faster": picked == faster})
    print(f"clipping_routes: WRITE_COST = {WRITE_COST:g}; the rule picked the faster route for {right} of {len(out)}")
    print(json.dumps({"benchmark": "clipping_routes", "device": args.device, "threads": args.threads, "write_cost": WRITE_COST,
                      "picked_faster": right, "shapes": out}))


if __name__ == "__main__":
    main()
