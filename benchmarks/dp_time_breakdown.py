"""Where a book-keeping DP step's time goes, against the non-private step of the same model.

    python -m benchmarks.dp_time_breakdown [--models mae-tiny,captioner-tiny,...] [--rounds 5] [--threads 2]
                                           [--per-layer]

dp_overhead.py says how much slower the clipped step is; this says why. Both steps of a model run in
one process on identical copies, in interleaved rounds (median of --rounds), split into phases, once
with glibc's default heap and once with the heap kept as training keeps it (a fresh process each:
`pipeline.train.keep_freed_memory`), side by side:

  non-private   forward + backward to the layers' inputs (weights frozen), and the weight gradients
                (the rest of the step)
  book-keeping  forward + backward (the hooks keep each layer's input and output gradient; no weight
                gradients), Gram products (ghost norms), per-example gradients (instantiated layers,
                LayerNorms' inside the backward, counted here),
                clipped sums (ghost layers: one weight gradient's worth each), and the rest (norms of
                instantiated gradients, clip factors, their weighted sums)

The Gram products are work a non-private step never does: B·T²·(d+p) multiply-adds per ghost layer.
Their share of the non-private step is a floor under any exact one-pass clipper that takes the ghost
route for those layers (the other route, instantiating, costs its memory passes instead).

--per-layer splits the phases by group of like layers (every block's fc1 together) and gives the
multiply-add rate of each: the Gram products' against the clipped sums', which are one weight
gradient's GEMM. Ends with one JSON line of the phases in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import statistics
import time

from benchmarks.dp_overhead import MODELS, _setup, _step, in_subprocess

PHASES = {"ghost_sq_norm": "Gram products", "per_sample": "per-example gradients", "clipped_sum": "clipped sums"}


class PhaseClock:
    """Seconds spent inside each layer rule's method, summed over calls, while `on`, in all and per
    module (`layers`: {(id(module), method): seconds}, `shapes`: {id(module): (input, output gradient)
    shapes}). A method called from another (a rule's clipped_sum built from its per_sample) counts for
    the outer one only."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.layers, self.shapes = {}, {}
        self.on, self.depth = False, 0

    def wrap(self, rules) -> None:
        for rule in rules:
            for method in PHASES:
                setattr(rule, method, self._timed(method, getattr(rule, method)))

    def _timed(self, method, fn):
        def timed(*args, **kwargs):
            if not self.on or self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t0
                self.seconds[method] += spent
                if args:  # (module, input, output gradient, ...)
                    key = (id(args[0]), method)
                    self.layers[key] = self.layers.get(key, 0.0) + spent
                    self.shapes[id(args[0])] = tuple(getattr(x, "shape", None) for x in args[1:3])
                self.depth -= 1
        return timed

    @contextlib.contextmanager
    def measuring(self):
        self.seconds, self.layers, self.shapes, self.on = dict.fromkeys(PHASES, 0.0), {}, {}, True
        try:
            yield self.seconds
        finally:
            self.on = False


def frozen_backward(clipper, batch) -> None:
    """The non-private step without its weight gradients: backward reaches the layers' inputs only."""
    params = list(clipper.params.values())
    for p in params:
        p.requires_grad_(False)
    try:
        first = batch[0].clone().requires_grad_(True)  # something must need a gradient for backward to run
        clipper.model(first, *batch[1:]).float().sum().backward()
    finally:
        for p in params:
            p.requires_grad_(True)


def layer_rows(model, per_round: list[dict], shapes: dict) -> list[dict]:
    """One row per group of like layers (block numbers as *), the slowest first: how many, the route
    (ghost: Gram products; per-example: instantiated), T tokens and d -> p for a Linear layer, the
    median seconds per step of each phase summed over the group, and the multiply-adds behind the
    Gram products (B·T²·(d+p), without gram_inner's blocks) and behind the clipped sum or the
    per-example gradients (B·T·d·p, one weight gradient's worth)."""
    import torch.nn as nn

    groups: dict[str, dict] = {}
    for name, module in model.named_modules():
        methods = {meth: statistics.median(r.get((id(module), meth), 0.0) for r in per_round)
                   for meth in PHASES if any((id(module), meth) in r for r in per_round)}
        if not methods:
            continue
        key = re.sub(r"\.\d+(?=\.|$)", ".*", name) or type(module).__name__
        row = groups.setdefault(key, {"layer": key, "kind": type(module).__name__, "count": 0,
                                      "route": "ghost" if "ghost_sq_norm" in methods else "per-example",
                                      "seconds": dict.fromkeys(PHASES, 0.0), "gram_macs": 0, "gemm_macs": 0})
        row["count"] += 1
        for meth, sec in methods.items():
            row["seconds"][meth] += sec
        a, g = shapes.get(id(module), (None, None))
        if isinstance(module, nn.Linear) and a is not None and g is not None:
            batch, tokens = a[0], math.prod(a[1:-1])
            row.update(tokens=tokens, d=a[-1], p=g[-1])
            row["gram_macs"] += batch * tokens * tokens * (a[-1] + g[-1]) if "ghost_sq_norm" in methods else 0
            row["gemm_macs"] += batch * tokens * a[-1] * g[-1]
    return sorted(groups.values(), key=lambda r: -sum(r["seconds"].values()))


def gflops(macs: float, seconds: float) -> float:
    return 2 * macs / seconds / 1e9 if seconds > 0 else float("nan")


def print_layers(rows: list[dict], np_step: float) -> None:
    """The per-layer table, as shares of the non-private step, and the rate of the Gram products against
    the clipped sums' (a weight gradient's GEMM) over the ghost layers."""
    print(f"  {'layers':<40}{'route':<13}{'T':>5}{'d -> p':>13}   Gram products   clipped sums   per-example")
    for r in rows:
        shape = f"{r['d']} -> {r['p']}" if "d" in r else ""
        cells = []
        for meth, macs in (("ghost_sq_norm", r["gram_macs"]), ("clipped_sum", r["gemm_macs"]),
                          ("per_sample", r["gemm_macs"] if r["route"] == "per-example" else 0)):
            sec = r["seconds"][meth]
            rate = f" {gflops(macs, sec):>4.0f}G" if macs and sec else "      "
            cells.append(f"{sec / np_step:>7.2%}{rate}" if sec else f"{'':>7}      ")
        label = f"{r['layer']} x{r['count']}"
        print(f"  {label:<40}{r['route']:<13}{r.get('tokens', ''):>5}{shape:>13}   " + "  ".join(cells))
    ghost = [r for r in rows if r["route"] == "ghost" and r["gram_macs"]]
    gram_s, sum_s = (sum(r["seconds"][m] for r in ghost) for m in ("ghost_sq_norm", "clipped_sum"))
    print(f"  ghost layers: Gram products {gflops(sum(r['gram_macs'] for r in ghost), gram_s):.0f} GFLOP/s, "
          f"clipped sums {gflops(sum(r['gemm_macs'] for r in ghost), sum_s):.0f} GFLOP/s "
          f"({gram_s / np_step:.1%} and {sum_s / np_step:.1%} of the non-private step)")


def breakdown(model_name: str, rounds: int, threads: int, keep_heap: bool, per_layer: bool = False) -> dict:
    """Runs inside a subprocess: median seconds of each phase of both steps (and with `per_layer`, of
    each group of like layers: `layer_rows`)."""
    from pipeline.privacy.layer_rules import RULES
    from pipeline.train import keep_freed_memory

    if keep_heap:
        keep_freed_memory()
    clippers, batch = _setup(model_name, ["nonprivate", "bookkeeping"], threads)
    plain, bk = clippers["nonprivate"], clippers["bookkeeping"]
    if bk.mode != "per_sample":
        raise SystemExit(f"{model_name}: per-batch clipping has no per-layer phases (dp_overhead.py times it)")
    clock = PhaseClock()
    clock.wrap(RULES.values())
    backward_of = bk._backward
    bk_backward = []

    def timed_backward(b):  # without the rules' work done inside it (layers reduced as their gradient arrives)
        t0, in_rules = time.perf_counter(), sum(clock.seconds.values())
        try:
            return backward_of(b)
        finally:
            bk_backward[-1] = time.perf_counter() - t0 - (sum(clock.seconds.values()) - in_rules)

    bk._backward = timed_backward
    samples = {k: [] for k in ("np_step", "np_frozen", "bk_step", "bk_backward", *PHASES)}
    per_round = []
    for r in range(rounds + 1):  # round 0 warms up
        t0 = time.perf_counter()
        _step(plain, batch)
        np_step = time.perf_counter() - t0
        t0 = time.perf_counter()
        frozen_backward(plain, batch)
        np_frozen = time.perf_counter() - t0
        bk_backward.append(0.0)
        with clock.measuring() as phases:
            t0 = time.perf_counter()
            _step(bk, batch)
            bk_step = time.perf_counter() - t0
        if r:
            for k, v in (("np_step", np_step), ("np_frozen", np_frozen), ("bk_step", bk_step),
                         ("bk_backward", bk_backward[-1]), *phases.items()):
                samples[k].append(v)
            per_round.append(dict(clock.layers))
    m = {k: statistics.median(v) for k, v in samples.items()}
    layers = {"layers": layer_rows(bk.model, per_round, clock.shapes)} if per_layer else {}
    return {
        **layers,
        "nonprivate": {"step": m["np_step"], "forward + backward to inputs": m["np_frozen"],
                       "weight gradients": m["np_step"] - m["np_frozen"]},
        "bookkeeping": {"step": m["bk_step"], "forward + backward (hooks)": m["bk_backward"],
                        **{PHASES[k]: m[k] for k in PHASES},
                        "rest": m["bk_step"] - m["bk_backward"] - sum(m[k] for k in PHASES)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mae-tiny,captioner-tiny,mae-s16-224,captioner-s16-224",
                    help=f"comma-separated per-example models of {', '.join(MODELS)}")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-layer", action="store_true",
                    help="also each group of like layers' phases and multiply-add rates (heap kept)")
    args = ap.parse_args()
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown} (known: {', '.join(MODELS)})")
    out = {}
    for name in models:
        res = {heap: in_subprocess(f"breakdown({name!r}, {args.rounds}, {args.threads}, {heap == 'kept'}, "
                                   f"{args.per_layer and heap == 'kept'})", "benchmarks.dp_time_breakdown")
               for heap in ("default", "kept")}
        layers = res["kept"].pop("layers", None)
        print(f"\n{name}: seconds per step (share of the non-private step), glibc's default heap | heap kept")
        for engine, phases in res["default"].items():
            for phase in phases:
                cells = [f"{r[engine][phase]:>7.3f} ({r[engine][phase] / r['nonprivate']['step']:>6.1%})"
                         for r in res.values()]
                print(f"  {engine:<13}{phase:<30}{cells[0]}  | {cells[1]}")
        for heap, r in res.items():
            base = r["nonprivate"]["step"]
            print(f"  heap {heap:<8} overhead {r['bookkeeping']['step'] / base - 1:+.1%}; Gram products alone "
                  f"{r['bookkeeping']['Gram products'] / base:.1%} (work the non-private step never does)")
        out[name] = {heap: {e: {k: round(v, 4) for k, v in p.items()} for e, p in r.items()} for heap, r in res.items()}
        if layers is not None:
            print(f"\n{name}, heap kept: each group of like layers, its phases as shares of the non-private step, "
                  f"and their multiply-add rates")
            print_layers(layers, res["kept"]["nonprivate"]["step"])
            out[name]["layers"] = layers
    print(json.dumps({"benchmark": "dp_time_breakdown", "threads": args.threads, "rounds": args.rounds,
                      "seconds": out}))


if __name__ == "__main__":
    main()
