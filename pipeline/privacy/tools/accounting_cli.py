"""Command-line front end for :mod:`pipeline.privacy.accounting`.

``add_accounting_commands(subparsers)`` registers ``epsilon``,
``calibrate`` and ``plan`` on an existing argparse subparsers object (so the pipeline's
main CLI can host them); ``main()`` builds a standalone parser.

Examples::

    epsilon   --sigma 0.48 --steps 6027 --batch-size 98304 --n 233000000 --delta 1/2n --accountant all
    calibrate --epsilon 8 --steps 10000 --batch-size 98304 --n 233000000 --delta 1/2n --json
    plan      --n 60000 --epsilon 8 --epochs 3 10 --batch-sizes 256 1024 4096
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Dict, List, Optional, Sequence

from pipeline.objectives import SENSITIVITY
from pipeline.privacy import accounting
from pipeline.privacy.accountant_backends import supports
from pipeline.privacy.noise_edge import SHARE_OF_DELTA, largest_move, noise_edge_floor

_ACCOUNTANT_CHOICES = list(accounting.ACCOUNTANTS) + ["all"]


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, required=True, help="number of DP-SGD steps T")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--sample-rate", type=float, help="Poisson sampling rate q")
    rate.add_argument(
        "--batch-size", type=int, help="expected batch size B (q = B/n; needs --n)"
    )
    parser.add_argument("--n", type=int, help="dataset size (for --batch-size, 1/n, 1/2n)")
    parser.add_argument(
        "--delta", required=True,
        help="delta: a number, '1/n' or '1/2n' (needs --n). Here delta >= 1/n is accepted with a "
             "warning, to reproduce published figures; dp-train requires delta < 1/n",
    )
    parser.add_argument(
        "--sensitivity",
        type=float,
        default=1.0,
        help="L2 sensitivity K in units of the clip norm (2 for per-batch clipping). sigma is relative to it, "
             "as in dp-train and the ledger: the noise std is sigma*K*C, and epsilon does not depend on K",
    )
    parser.add_argument(
        "--accountant",
        choices=_ACCOUNTANT_CHOICES,
        default="pld",
        help="pld (tight, default), rdp (Opacus RDP), prv (Opacus PRV) or all",
    )
    parser.add_argument(
        "--adjacency", choices=["replace_one", "add_remove"], default="replace_one",
        help="neighbours: replace_one (dp-train's default, privacy.adjacency: covers releasing n) or add_remove "
             "(the literature's; rdp and prv account only this one)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_accounting_commands(subparsers) -> None:
    """Register the ``epsilon`` and ``calibrate`` subcommands."""
    eps = subparsers.add_parser(
        "epsilon", help="privacy spent (epsilon) by DP-SGD with given noise"
    )
    eps.add_argument("--sigma", type=float, required=True, help="noise multiplier")
    _add_common_arguments(eps)
    eps.set_defaults(func=_run_epsilon, _parser=eps)

    cal = subparsers.add_parser(
        "calibrate", help="smallest noise multiplier sigma reaching a target epsilon"
    )
    cal.add_argument("--epsilon", type=float, required=True, help="target epsilon")
    _add_common_arguments(cal)
    cal.set_defaults(func=_run_calibrate, _parser=cal)

    plan = subparsers.add_parser(
        "plan", help="DP schedules for n examples and a compute budget: B, steps, sigma and sigma/B side by side",
        description="For each expected batch B and number of epochs (passes over the data), the steps T = "
                    "epochs*n/B and the sigma that reaches --epsilon, with the noise on one coordinate of the "
                    "averaged gradient, sigma/B (in units of C; per-batch clipping: 2*sigma, whatever B). At a "
                    "fixed compute budget (epochs), a larger B means fewer but far less noisy steps; the papers train with B of "
                    "1-10% of n over a few thousand steps. Pick the largest B that still leaves the "
                    "optimizer enough steps (a few hundred).",
    )
    plan.add_argument("--n", type=int, required=True, help="usable private examples")
    plan.add_argument("--epsilon", type=float, required=True, help="target epsilon")
    plan.add_argument("--delta", default="1/2n", help="a number, '1/n' or '1/2n' (default 1/2n)")
    plan.add_argument("--epochs", type=float, nargs="+", default=[1, 3, 10, 30],
                      help="passes over the data the compute budget allows")
    plan.add_argument("--batch-sizes", type=int, nargs="+",
                      help="expected batch sizes (default: n/1000 .. n/8 by powers of 2)")
    plan.add_argument("--clipping", choices=list(SENSITIVITY), default="per_sample",
                      help="per_sample (ViP, DP-Cap: noise sigma*C/B) or per_batch (Dp-CLIP: sensitivity 2C on the "
                           "batch's clipped mean, noise 2*sigma*C whatever B)")
    plan.add_argument("--examples-per-s", type=float, help="training throughput, to print hours per schedule")
    plan.add_argument("--accountant", choices=list(accounting.ACCOUNTANTS), default="pld")
    plan.add_argument("--adjacency", choices=["replace_one", "add_remove"], default="replace_one",
                      help="replace_one (dp-train's default) or add_remove (the literature's)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=_run_plan, _parser=plan)


def _resolve(args) -> Dict[str, object]:
    """Turn the parsed arguments into (q, delta, ...); errors exit via argparse."""
    parser: argparse.ArgumentParser = args._parser
    if args.n is not None and args.n < 1:
        parser.error(f"--n must be a positive integer (got {args.n})")
    if args.batch_size is not None:
        if args.n is None:
            parser.error("--batch-size needs --n (the dataset size) to form q = B/n")
        if args.batch_size < 1:
            parser.error(f"--batch-size must be >= 1 (got {args.batch_size})")
        if args.batch_size > args.n:
            parser.error(f"--batch-size {args.batch_size} exceeds --n {args.n}")
        sample_rate = args.batch_size / args.n
    elif args.sample_rate is not None:
        sample_rate = args.sample_rate
    else:
        parser.error("give either --sample-rate or --batch-size with --n")
    text = args.delta.strip().lower()
    if text.startswith("1/") and "n" in text and args.n is None:
        parser.error(f"--delta {args.delta} needs --n (the dataset size)")
    try:
        delta = accounting.parse_delta(args.delta, args.n)
    except ValueError as exc:
        parser.error(f"--delta: {exc}")
    if args.n is not None and delta >= 1.0 / args.n:
        # As the literature uses it (DP-Cap: delta = 1/n); dp-train itself refuses it.
        print(f"warning: delta={delta:g} >= 1/n = {1.0 / args.n:g}: a mechanism that publishes one random "
              "example in full meets such a guarantee; dp-train requires delta < 1/n", file=sys.stderr)
    names: List[str] = (
        [a for a in accounting.ACCOUNTANTS if supports(a, args.adjacency)]
        if args.accountant == "all" else [args.accountant]
    )
    if args.adjacency == "replace_one" and names != ["pld"]:
        args._parser.error(f"--accountant {args.accountant} accounts add/remove neighbours only: pass "
                           "--adjacency add_remove (the literature's), or use pld")
    return {"sample_rate": sample_rate, "delta": delta, "accountants": names}


def _emit(args, payload: Dict[str, object], lines: List[str]) -> None:
    if args.json:
        print(json.dumps(payload, sort_keys=True))
    else:
        print("\n".join(lines))


def _settings_line(steps: int, q: float, delta: float, k: float, adjacency: str) -> str:
    return (f"steps={steps}  q={q:.6g}  delta={delta:.6g}  sensitivity={k:g} (noise std = sigma*{k:g}*C)  "
            f"adjacency={adjacency}")


def _run_epsilon(args) -> int:
    cfg = _resolve(args)
    q, delta = cfg["sample_rate"], cfg["delta"]
    results: Dict[str, float] = {}
    try:
        for name in cfg["accountants"]:
            results[name] = accounting.epsilon(
                args.sigma, q, args.steps, delta,
                accountant=name, adjacency=args.adjacency,
            )
    except ValueError as exc:
        args._parser.error(str(exc))
    lines = [f"sigma={args.sigma:g}  " + _settings_line(args.steps, q, delta, args.sensitivity, args.adjacency)]
    lines += [f"epsilon[{name}] = {accounting.bound_text(value, 4)}" for name, value in results.items()]
    payload = {
        "command": "epsilon",
        "sigma": args.sigma,
        "steps": args.steps,
        "sample_rate": q,
        "delta": delta,
        "sensitivity": args.sensitivity,
        "adjacency": args.adjacency,
        "epsilon": results,
    }
    _emit(args, payload, lines)
    return 0


def _run_calibrate(args) -> int:
    cfg = _resolve(args)
    q, delta = cfg["sample_rate"], cfg["delta"]
    sigmas: Dict[str, float] = {}
    achieved: Dict[str, float] = {}
    try:
        for name in cfg["accountants"]:
            sigma = accounting.calibrate_sigma(
                args.epsilon, q, args.steps, delta,
                accountant=name, adjacency=args.adjacency,
            )
            sigmas[name] = sigma
            achieved[name] = accounting.epsilon(
                sigma, q, args.steps, delta,
                accountant=name, adjacency=args.adjacency,
            )
    except ValueError as exc:
        args._parser.error(str(exc))
    lines = [
        f"target epsilon={args.epsilon:g}  "
        + _settings_line(args.steps, q, delta, args.sensitivity, args.adjacency)
    ]
    # Printed sigma is rounded *up*: more noise never breaks the target.
    lines += [
        f"sigma[{name}] = {accounting.round_up(sigmas[name], 6):.6f}  "
        f"(epsilon = {accounting.bound_text(achieved[name], 4)})"
        for name in sigmas
    ]
    payload = {
        "command": "calibrate",
        "target_epsilon": args.epsilon,
        "steps": args.steps,
        "sample_rate": q,
        "delta": delta,
        "sensitivity": args.sensitivity,
        "adjacency": args.adjacency,
        "sigma": sigmas,
        "epsilon": achieved,
    }
    _emit(args, payload, lines)
    return 0


def plan_schedules(n: int, epsilon: float, delta: float, epochs: Sequence[float], batch_sizes: Sequence[int],
                   clipping: str = "per_sample", accountant: str = "pld",
                   adjacency: str = "replace_one") -> List[Dict[str, float]]:
    """Every (B, epochs) schedule: T = ceil(epochs * n / B) steps, its calibrated sigma, sigma/B (the noise on
    one step's averaged gradient) and sigma/(B*sqrt(T)) (the noise left on the mean of all T steps' gradients:
    what a signal that holds its direction for the run is weighed against). Once sigma is past ~1.5 the
    last barely moves with B or T: it tends to a constant over n*epsilon, so at a fixed n only epsilon
    and the signal itself raise what the run can learn; compute buys the optimizer's steps, not less noise.
    Per batch (Dp-CLIP) the release is already a mean: its noise, 2*sigma, is divided by no B."""
    sensitivity = SENSITIVITY[clipping]
    rows = []
    for batch in batch_sizes:
        for e in epochs:
            steps = max(1, math.ceil(round(e * n / batch, 9)))  # 1.1 epochs of 100 at B = 1: 110, not 111
            q = batch / n
            sigma = accounting.calibrate_sigma(epsilon, q, steps, delta, accountant=accountant, adjacency=adjacency)
            per = sigma * sensitivity / (1 if clipping == "per_batch" else batch)
            rows.append({"batch": batch, "sample_rate": q, "epochs": e, "steps": steps, "sigma": sigma,
                         "noise_per_coordinate": per, "noise_over_run": per / math.sqrt(steps),
                         "noise_edge_floor": noise_edge_floor(sigma, q, steps, move=largest_move(sensitivity, adjacency, q))})
    return rows


def _run_plan(args) -> int:
    parser = args._parser
    if args.n < 2:
        parser.error(f"--n must be at least 2 (got {args.n})")
    try:
        delta = accounting.parse_delta(args.delta, args.n)
        accounting.check_delta(delta, args.n)
    except ValueError as exc:
        parser.error(f"--delta: {exc}")
    batches = args.batch_sizes or sorted({2 ** k for k in range(int(math.log2(max(args.n // 1000, 1))),
                                                                 int(math.log2(max(args.n // 8, 1))) + 1)})
    if any(b < 1 or b > args.n for b in batches):
        parser.error(f"--batch-sizes must lie in 1..n={args.n}")
    if any(not (math.isfinite(e) and e > 0) for e in args.epochs):
        parser.error(f"--epochs must be positive and finite (got {' '.join(f'{e:g}' for e in args.epochs)})")
    if not (math.isfinite(args.epsilon) and args.epsilon > 0):
        parser.error(f"--epsilon must be positive and finite (got {args.epsilon:g})")
    if args.examples_per_s is not None and not (math.isfinite(args.examples_per_s) and args.examples_per_s > 0):
        parser.error(f"--examples-per-s must be positive and finite (got {args.examples_per_s:g})")
    try:
        rows = plan_schedules(args.n, args.epsilon, delta, args.epochs, batches, args.clipping, args.accountant,
                              args.adjacency)
    except ValueError as exc:
        parser.error(str(exc))
    for r in rows:
        if args.examples_per_s is not None:
            r["hours"] = r["epochs"] * args.n / args.examples_per_s / 3600
    per = ("2*sigma on the batch's clipped mean, whatever B (Dp-CLIP: a larger B does not lower it)"
           if args.clipping == "per_batch" else "sigma/B")
    lines = [f"n={args.n}  epsilon={args.epsilon:g}  delta={delta:.3g}  {args.clipping} clipping  "
             f"({args.accountant}, {args.adjacency}); noise per averaged coordinate = {per}, in units of C;",
             "over the run = that over sqrt(steps), the noise on the mean of every step's gradient: "
             "the figure to compare schedules by",
             f"{'B':>9} {'q':>9} {'epochs':>7} {'steps':>7} {'sigma':>8} "
             f"{'2*sigma' if args.clipping == 'per_batch' else 'sigma/B':>10} {'over run':>10}"
             + (f" {'hours':>8}" if args.examples_per_s is not None else "")]
    for r in rows:
        sigma = accounting.round_up(r["sigma"], 3)  # up: more noise, so copied into dp.sigma it still reaches ε
        lines.append(f"{r['batch']:>9} {r['sample_rate']:>9.2e} {r['epochs']:>7g} {r['steps']:>7} {sigma:>8.3f} "
                     f"{r['noise_per_coordinate']:>10.2e} {r['noise_over_run']:>10.2e}"
                     + (f" {r['hours']:>8.2f}" if "hours" in r else "")
                     + ("  refused by dp-train: sigma too small for the noise's edge (docs/privacy.md)"
                        if r["noise_edge_floor"] > SHARE_OF_DELTA * delta else ""))
    _emit(args, {"command": "plan", "n": args.n, "epsilon": args.epsilon, "delta": delta,
                 "clipping": args.clipping, "sensitivity": SENSITIVITY[args.clipping], "schedules": rows}, lines)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dpfm-accounting", description="DP-SGD privacy accounting"
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_accounting_commands(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
