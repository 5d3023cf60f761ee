"""`dpfm audit`: the white-box audit of the configured run's DP step (step_audit.py; default), or,
with --one-run, the one-run canary audit of the engine (canary_audit.py). Exit 1 when the audit flags.

Under torchrun the step audit runs at the training's world size:
    torchrun --nproc_per_node=8 -m pipeline.cli audit
"""

from __future__ import annotations

from pipeline.privacy.tools.canary_settings import AuditConfig


def add_audit_command(subparsers) -> None:
    d = AuditConfig()
    p = subparsers.add_parser("audit", help="audit the DP step: the configured run's (default) or the engine's "
                                            "in one canary run (--one-run)", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a parameter")
    p.add_argument("--sigma", type=float, help="σ to audit (default: dp.sigma, or calibrated from dp.epsilon "
                                               "with n from data/shards/stats.json)")
    p.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    one = p.add_argument_group("one-run canary audit (--one-run)")
    one.add_argument("--one-run", action="store_true", help="run the one-run canary audit of the engine instead")
    one.add_argument("--canaries", type=int, default=d.canaries, help=f"m (default {d.canaries})")
    one.add_argument("--steps", type=int, default=d.steps, help=f"DP-SGD steps (default {d.steps})")
    one.add_argument("--batch-size", type=int, default=d.expected_batch_size, dest="expected_batch_size",
                     help=f"expected (Poisson) batch size (default {d.expected_batch_size})")
    one.add_argument("--epsilon", type=float, default=d.epsilon, help=f"ε the run is calibrated to (default {d.epsilon})")
    one.add_argument("--delta", type=float, default=d.delta, help=f"δ (default {d.delta})")
    one.add_argument("--clipping", default=d.clipping,
                     help=f"per-sample clipping method to audit, as dp.clipping (default {d.clipping})")
    one.add_argument("--confidence", type=float, default=d.confidence, help="of the lower bound (default 0.95)")
    one.add_argument("--seed", type=int, default=d.seed)
    one.add_argument("--no-clipping", action="store_false", dest="clipping_enabled",
                     help="FAULT: disable per-sample clipping (the audit should flag the run)")
    one.add_argument("--noise-scale", type=float, default=d.noise_scale,
                     help="FAULT when < 1: multiply the accounted noise, e.g. 0.1 (the audit should flag the run)")
    p.set_defaults(func=_run, _parser=p)


def _run(args) -> int:
    import torch

    torch.set_num_threads(max(1, args.threads))
    return _one_run(args) if args.one_run else _step(args)


def _step(args) -> int:
    from pipeline.config import ParamsError, load_params
    from pipeline.distributed import init_world
    from pipeline.io import read_json, write_json
    from pipeline.privacy.tools.step_audit import audit_step

    params = load_params(args.params, args.set)
    sigma = args.sigma or params["dp"]["sigma"]
    if sigma is None:
        from pipeline.artifacts import artifact

        stats = artifact("shards") / "stats.json"
        if not stats.exists():
            raise ParamsError([f"dpfm audit: σ is calibrated from n, and {stats} is missing: "
                               "run `dpfm shards` first or pass --sigma"])
        from pipeline.privacy.plan import checked_plan

        sigma = checked_plan(params["dp"], read_json(stats)["private"]["usable"], params["privacy"]["adjacency"]).sigma
    from pipeline.cli import resolve_device
    from pipeline.train import precision_used

    device = resolve_device(params["run"]["device"])  # as dp-train resolves it: `auto` is the GPU where there is one
    world = init_world(device)
    result = audit_step(params, sigma, world, device)
    from pipeline.objectives import objective
    from pipeline.privacy.tools.step_audit import worst_case_sensitivity

    worst = worst_case_sensitivity(objective(params["dp"]["objective"]).clipping, params["dp"]["clipping"],
                                   params["dp"]["precision"], params["dp"]["clip_norm"], sigma, device)
    result = {**result, "worst_case": worst, "problems": result["problems"] + worst["problems"]}
    if world.is_main:
        dp = params["dp"]
        print(f"audit of the dp-train step: objective={dp['objective']}, clipping={dp['clipping']}, "
              f"precision={dp['precision']} ({precision_used(device, dp['precision'])} on {device}), "
              f"world size {world.size}, σ={sigma:.4g}, C={dp['clip_norm']:g}")
        print(f"  noise std    {result['noise_std']:.6g}  = {result['noise_ratio']:.4f} × accounted "
              f"{result['noise_std_accounted']:.6g}  ({result['parameters']} coordinates)")
        print(f"  sensitivity  {result['sensitivity']:.6g}  = {result['sensitivity_ratio']:.4f} × accounted "
              f"{result['sensitivity_accounted']:.6g}")
        if result["batch_norm"] is not None:
            print(f"  batch mean   {result['batch_norm']:.6g}  = {result['batch_norm_ratio']:.4f} × K·C/2  "
                  f"(the clipped mean; a neighbour can turn it around)")
        print(f"  σ effective  {result['sigma_effective']:.4g} (accounted {sigma:.4g})")
        print(f"  worst case   {worst['move']:.6g}  = {worst['ratio']:.4f} × accounted {worst['bound']:.6g}  "
              f"(neighbours built to move the release the most)")
        for problem in result["problems"]:
            print(f"  FLAGGED: {problem}")
        if not result["problems"]:
            print("  verdict: consistent: the step adds the accounted noise for the accounted sensitivity")
        if args.json:
            write_json(args.json, result)
    return 1 if result["problems"] else 0


def _one_run(args) -> int:
    from pipeline.io import write_json
    from pipeline.privacy.accounting import bound_text
    from pipeline.privacy.tools.canary_audit import run_audit

    fields = {k: getattr(args, k) for k in ("canaries", "steps", "expected_batch_size", "epsilon", "delta", "clipping",
                                            "confidence", "seed", "clipping_enabled", "noise_scale")}
    try:
        result = run_audit(AuditConfig(**fields))
    except ValueError as e:
        args._parser.error(str(e))
    faults = [f for f, on in (("clipping disabled", not args.clipping_enabled),
                              (f"noise ×{args.noise_scale:g}", args.noise_scale != 1)) if on]
    print(f"audit: {args.canaries} canaries ({result['included']} included), {args.steps} steps, "
          f"q={result['sample_rate']:.4g}, σ={result['sigma']:.4g}, δ={args.delta:g}"
          + (f"; faults injected: {', '.join(faults)}" if faults else ""))
    print(f"  {'ε claimed (PLD)':<20} = {bound_text(result['epsilon_claimed'], 3)}")
    how = (f"{result['correct']}/{result['guesses']} correct: top {result['k_in']} guessed in, "
           f"bottom {result['k_out']} out" if result["guesses"] else "no guess count beats chance")
    print(f"  {f'ε lower ({args.confidence:.0%} conf.)':<20} = {result['epsilon_lower']:.3f}   ({how})")
    if result["verdict"] == "flagged":
        print("  verdict: FLAGGED: the run leaks more than the ε claimed for it; the engine is broken")
    else:
        print("  verdict: consistent: the audit found no leak beyond the ε claimed")
    print(f"  ({result['seconds']:.1f} s)")
    if args.json:
        write_json(args.json, result)
    return 1 if result["verdict"] == "flagged" else 0

