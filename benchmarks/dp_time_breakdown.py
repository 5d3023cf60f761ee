"""Where a book-keeping DP step's time goes, against the non-private step of the same model.

    python -m benchmarks.dp_time_breakdown [--models mae-tiny,captioner-tiny,...] [--rounds 5] [--threads 2]

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
route for those layers (the other route, instantiating, costs its memory passes instead). Ends with
one JSON line of the phases in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

from benchmarks.dp_overhead import MODELS, _setup, _step, in_subprocess

PHASES = {"ghost_sq_norm": "Gram products", "per_sample": "per-example gradients", "clipped_sum": "clipped sums"}


class PhaseClock:
    """Seconds spent inside each layer rule's method, summed over calls, while `on`. A method called
    from another (a rule's clipped_sum built from its per_sample) counts for the outer one only."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
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
                self.seconds[method] += time.perf_counter() - t0
                self.depth -= 1
        return timed

    @contextlib.contextmanager
    def measuring(self):
        self.seconds, self.on = dict.fromkeys(PHASES, 0.0), True
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


def breakdown(model_name: str, rounds: int, threads: int, keep_heap: bool) -> dict:
    """Runs inside a subprocess: median seconds of each phase of both steps."""
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
    m = {k: statistics.median(v) for k, v in samples.items()}
    return {
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
    args = ap.parse_args()
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown} (known: {', '.join(MODELS)})")
    out = {}
    for name in models:
        res = {heap: in_subprocess(f"breakdown({name!r}, {args.rounds}, {args.threads}, {heap == 'kept'})",
                                  "benchmarks.dp_time_breakdown")
               for heap in ("default", "kept")}
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
    print(json.dumps({"benchmark": "dp_time_breakdown", "threads": args.threads, "rounds": args.rounds,
                      "seconds": out}))


if __name__ == "__main__":
    main()
