"""The DP noise's edge, and what drawing past it costs (pipeline/privacy/noise.py, engine.add_noise).

    python -m benchmarks.noise_draw [--tail-draws 1000000000] [--device cpu] [--models captioner-cpu mae-s16-224]

1. The edge. A Box-Muller normal never passes sqrt(-2 ln u_min) std for its smallest uniform u_min:
   torch's fp32 draws stop at 5.77 std on the CPU, where a Gaussian passes once in 1.2e8 draws. Draws
   `--tail-draws` normals each from torch in fp32, torch in fp64 and dp-train's (noise.gaussian, edge
   12.1) and counts those past 5.77, beside a Gaussian's expected count.
2. What an edge gives away (noise_edge.noise_edge_floor): an informed adversary sees a released
   coordinate past it only if example x was in; with x's clipped gradient along one coordinate, about
   epochs·Q(edge - 1/σ) over a run. A floor under the run's true δ, set beside the δ printed.
3. The cost: one logical step's noise through the real add_noise against the same with torch's fp32
   draws (the baseline, dp-train's noise before 2026-11-29), for each model's parameters.

Prints the tables, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from benchmarks.dp_overhead import MODELS
from pipeline.models import build_model
from pipeline.privacy import engine
from pipeline.privacy.noise_edge import NOISE_EDGE, largest_move, noise_edge_floor
from pipeline.privacy.noise import TORCH_EDGES, gaussian, step_noise
from pipeline.train import NOISE, step_generator

KEY = 0x5EC12E7  # a benchmark key; real runs keep theirs secret
FP32_EDGE = TORCH_EDGES["torch fp32, CPU"]
SAMPLERS = {"torch fp32": lambda n, g, d: torch.randn(n, generator=g, device=d),
            "torch fp64": lambda n, g, d: torch.randn(n, generator=g, device=d, dtype=torch.float64),
            "dp-train": lambda n, g, d: gaussian(torch.Size([n]), g, torch.device(d))}
EDGES = {**TORCH_EDGES, "dp-train": NOISE_EDGE}

# Runs the edges are set against: (label, σ, q, steps, printed δ).
RUNS = [("make run (digits, n = 1,258)", 0.75, 128 / 1258, 40, 1 / (2 * 1258)),
        ("scale table MAE, ε = 8 (n = 60k)", 1.198, 2048 / 60_000, 800, 1 / (2 * 60_000)),
        ("scale table captioner, ε = 8 (n = 60k)", 0.828, 1024 / 60_000, 1200, 1 / (2 * 60_000)),
        ("ViP's schedule (n = 233M, B = 98,304)", 0.48, 98_304 / 233e6, 6027, 1 / (2 * 233e6)),
        ("ε = 8, n = 233M, B = 98,304, 10 epochs", 0.489, 98_304 / 233e6, 23_702, 1 / (2 * 233e6))]


def torch_generator(key: int, step: int, device: str) -> torch.Generator:
    """The baselines' generator: torch's own, seeded the way the step's masks are."""
    return step_generator(key, step, NOISE, device)


GENERATORS = {"torch fp32": torch_generator, "torch fp64": torch_generator, "dp-train": step_noise}


def count_past(sample, draws: int, device: str, make_generator=step_noise, chunk: int = 1 << 26) -> tuple[int, float]:
    """(draws past FP32_EDGE, largest |z|) over `draws` normals from one step's generator."""
    generator, past, largest = make_generator(KEY, 0, device), 0, 0.0
    for start in range(0, draws, chunk):
        z = sample(min(chunk, draws - start), generator, device).abs_()
        past += int((z > FP32_EDGE).sum())
        largest = max(largest, float(z.max()))
    return past, largest


class Sums:
    """What add_noise reads of a clipper: the summed gradients and the parameters they belong to."""

    def __init__(self, model: torch.nn.Module):
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.sum = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in self.params.items()}


def noise_fp32_draws(clipper, noise_std, denominator, generator):
    """The baseline: torch's fp32 normals, scaled and added in fp64."""
    for name, total in clipper.sum.items():
        total.add_(torch.randn(total.shape, generator=generator, device=total.device, dtype=torch.float32),
                   alpha=noise_std)
        clipper.params[name].grad = total.div_(denominator).to(clipper.params[name].dtype)


def seconds_per_step(add_noise, model: torch.nn.Module, device: str, rounds: int, make_generator=step_noise) -> float:
    times = []
    for step in range(rounds + 1):
        sums = Sums(model)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        add_noise(sums, 0.8, 1024.0, make_generator(KEY, step, device))
        if device == "cuda":
            torch.cuda.synchronize()
        if step:  # the first call warms up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tail-draws", type=int, default=1_000_000_000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", nargs="+", default=["captioner-cpu", "mae-cpu", "captioner-s16-224"],
                    choices=sorted(MODELS), help="models of benchmarks/dp_overhead.py whose parameters get one step's noise")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    expected = args.tail_draws * math.erfc(FP32_EDGE / math.sqrt(2))
    print(f"1. Past {FP32_EDGE:.4f} std (torch fp32's edge on the CPU), {args.tail_draws:,} draws each on {args.device}; "
          f"a Gaussian: {expected:.1f} expected")
    tails = {}
    for name, sample in SAMPLERS.items():
        past, largest = count_past(sample, args.tail_draws, args.device, GENERATORS[name])
        edge = EDGES.get(name, EDGES.get(f"{name}, {'CUDA' if args.device == 'cuda' else 'CPU'}"))
        tails[name] = {"past": past, "largest": largest, "edge": edge}
        print(f"   {name:<12} {past:>4} past it, largest |z| {largest:.4f} (its edge {edge:.2f})")

    print("2. Each edge as a floor under δ (epochs · Q(edge − 1/σ)), in units of the δ printed")
    print(f"   {'run':<42} {'σ':>6} {'δ':>8}" + "".join(f" {name[:18]:>19}" for name in EDGES))
    floors = []
    for label, sigma, q, steps, delta in RUNS:
        move = largest_move(1.0, "replace_one", q)  # per example; 1 at q < 1
        row = {name: noise_edge_floor(sigma, q, steps, edge, move=move) for name, edge in EDGES.items()}
        floors.append({"run": label, "sigma": sigma, "sample_rate": q, "steps": steps, "delta": delta, "floor": row})
        print(f"   {label:<42} {sigma:>6} {delta:>8.2g}" + "".join(f" {v / delta:>18.2g}δ" for v in row.values()))

    print(f"3. One step's noise on {args.device}, median of {args.rounds}")
    costs = []
    for spec in args.models:
        objective, cfg, _ = MODELS[spec]
        model = build_model(objective, cfg).to(args.device)
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        new = seconds_per_step(engine.add_noise, model, args.device, args.rounds)
        old = seconds_per_step(noise_fp32_draws, model, args.device, args.rounds, torch_generator)
        costs.append({"model": spec, "params_m": params / 1e6, "ms": new * 1e3, "fp32_ms": old * 1e3,
                      "ratio": new / old})
        print(f"   {spec:<18} {params / 1e6:6.1f}M parameters: add_noise {new * 1e3:7.1f} ms, with torch's fp32 "
              f"draws {old * 1e3:7.1f} ms, {new / old:.2f}x")
        del model
    result = {"benchmark": "noise_draw", "device": args.device, "tail_draws": args.tail_draws, "tails": tails,
              "floors": floors, "cost": costs}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
