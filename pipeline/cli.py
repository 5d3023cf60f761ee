"""The `dpfm` command: one subcommand per pipeline stage, plus tools (validate, plan, epsilon, calibrate, audit,
export-dvc, stages, scan-shards, owner-composition, budget-sync)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import ParamsError, load_params, read_resolved, sections_of
from pipeline.errors import (BudgetCorrupt, BudgetNotHere, Diverged, InputError, PrivateDataError, RanksDisagree,
                             StageBusy, Stopped, VerificationFailed)
from pipeline.stages import STAGES, Stage, stage


@dataclass
class StageContext:
    """What every stage's `run(params, ctx)` gets besides its params sections."""

    stage: Stage
    tracker: object          # pipeline.tracking.StageRun
    threads: int
    device: str


def resolve_device(requested: str) -> str:
    import torch

    from pipeline.launch import JOB_GPUS_ENV

    given = int(os.environ.get(JOB_GPUS_ENV) or 0)  # by pipeline.launch, from the job's resources
    if requested != "cpu" and given and not torch.cuda.is_available():
        raise ParamsError([f"run.device: {requested}: this job was given {given} GPU(s) but torch "
                           f"{torch.__version__} sees no CUDA device (a driver older than its CUDA "
                           f"{torch.version.cuda or '(none: a CPU-only build)'}, or CUDA_VISIBLE_DEVICES empty); "
                           "it would hold them and train on the CPU. Set run.device: cpu to mean that"])
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ParamsError(["run.device: 'cuda' was requested but no CUDA device is visible"])
    return requested


def runner(name: str):
    """The `run(params, ctx)` of stage `name`, imported on demand: the table itself stays light (the
    Snakefile imports it), and a stage loads only its own dependencies."""
    match name:
        case "shards":
            from pipeline.stages.shards import run
        case "synthetic":
            from pipeline.stages.synthetic import run
        case "tokenizer":
            from pipeline.stages.tokenizer import run
        case "pretrain":
            from pipeline.stages.pretrain import run
        case "dp-train":
            from pipeline.stages.dp_train import run
        case "verify":
            from pipeline.stages.verify import run
        case "curve":
            from pipeline.stages.curve import run
        case "evaluate":
            from pipeline.stages.evaluate import run
        case "report":
            from pipeline.stages.report import run
        case _:
            stage(name)  # raises, naming the stages
    return run


def job_params(params_path: str, overrides=(), resolved: str | None = None) -> dict:
    """Under Snakemake, the params it validated (`--resolved`); by hand, params.yaml with `--set`s."""
    if resolved is not None:  # also "": an unset variable in a job's shell is an error, not params.yaml
        if overrides or params_path != "params.yaml":
            raise ParamsError(["--resolved is the whole config: it takes no --set or --params"])
        return read_resolved(resolved)
    return load_params(params_path, overrides)


def job_threads(threads: int, params: dict) -> int:
    """--threads, run.threads or every core; inside a SLURM job, what SLURM gave it (pipeline/slurm.py)."""
    from pipeline import slurm

    return slurm.threads_per_process(threads or params["run"]["threads"] or os.cpu_count() or 1)


def run_stage(name: str, params_path: str = "params.yaml", overrides=(), resolved: str | None = None,
              threads: int = 0) -> None:
    st = stage(name)
    params = sections_of(job_params(params_path, overrides, resolved), st.sections)
    threads = job_threads(threads, params)
    import torch

    torch.set_num_threads(threads)
    run = runner(name)
    from pipeline.distributed import process_rank
    from pipeline.locking import stage_lock
    from pipeline.tracking import NullRun, stage_run

    device = resolve_device(params["run"]["device"])
    if process_rank() > 0:  # torchrun: rank 0 alone tracks the stage
        run(params, StageContext(st, NullRun(), threads, device))
        return
    with stage_lock(st.name), stage_run(st, params, params["run"]["experiment"]) as tracker:
        run(params, StageContext(st, tracker, threads, device))
    from pipeline.dvc_commit import record_done

    record_done(st.name, params)  # for the Snakemake run this job is one of: it versions what its jobs made


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (every core) or more, got {value}")
    return value


def add_params_arguments(p: argparse.ArgumentParser, threads: str | None = None) -> None:
    """--params and --set, for a command that reads params.yaml; with `threads` (its help), also what
    Snakemake passes the jobs it runs: --resolved and --threads."""
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one parameter (repeatable); the value is parsed as YAML")
    if threads is not None:
        p.add_argument("--resolved", help=argparse.SUPPRESS)  # the params Snakemake validated (rules/common.smk)
        p.add_argument("--threads", type=non_negative, default=0, help=threads)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpfm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for st in STAGES:
        p = sub.add_parser(st.name, help=st.summary, description=st.summary)
        add_params_arguments(p, threads="CPU threads (default: run.threads or all)")
        p.set_defaults(func=lambda a, name=st.name: run_stage(name, a.params, a.set, a.resolved, a.threads))

    p = sub.add_parser("scan-shards", help="scan one group of a web source's shards into the scan cache",
                       description="One job of Snakemake's scatter of the shards stage (rules/scan.smk): scan "
                                   "group GROUP of GROUPS of the shard list into shards.cache_dir, where "
                                   "`dpfm shards` then finds every scan.")
    add_params_arguments(p, threads="scan processes when shards.workers is 0 (default: run.threads or all cores)")
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--groups", type=int, required=True)
    p.add_argument("--summary", help="write the group's summary here (JSON)")
    p.set_defaults(func=_scan_shards)

    p = sub.add_parser("export-dvc", help="write dvc.yaml from the stage table")
    p.add_argument("--check", action="store_true", help="exit 1 if the committed dvc.yaml differs")
    p.add_argument("--output", default="dvc.yaml")
    p.set_defaults(func=_export_dvc)

    p = sub.add_parser("owner-composition", help="the data owner's composed ε: the runs on sets sharing examples",
                       description="Compose only the DP runs charged to examples the run of LEDGER trained on, "
                                   "into .dpfm/owner/composition.json (the data owner's: which sets share "
                                   "examples is a fact about the private data, and so is how long this takes, "
                                   "so no stage computes it). Examples are matched by their bytes: the same "
                                   "images re-encoded (another shards.image_size, a new download) are not "
                                   "matched, and runs on them are left out; the published composition, which "
                                   "takes every run, is not.")
    p.add_argument("--ledger", default="models/dp/ledger.json", help="a run's published ledger")
    p.set_defaults(func=_owner_composition)

    p = sub.add_parser("budget-sync", help="add to data/budget the runs of the version data/budget.dvc records",
                       description="After `git pull` brings another checkout's data/budget.dvc (and `dvc fetch` its "
                                   "files), add the DP runs it charged to this checkout's data/budget: every stage "
                                   "that composes does so too; `make push` runs it before recording the budget.")
    p.set_defaults(func=_budget_sync)

    p = sub.add_parser("stages", help="print the stage table")
    p.set_defaults(func=_print_stages)

    p = sub.add_parser("validate", help="validate params.yaml (with --set overrides) and exit")
    add_params_arguments(p)
    p.set_defaults(func=_validate)

    try:
        from pipeline.privacy.tools.accounting_cli import add_accounting_commands
    except ImportError:  # accounting not installed in this build
        pass
    else:
        add_accounting_commands(sub)

    from pipeline.privacy.tools.audit_cli import add_audit_command

    add_audit_command(sub)
    return parser


def _validate(args) -> None:
    """The schema, the model's shapes and what DP training refuses from its params alone; once the
    shards are built, dp-train's privacy plan at their n too (an ε no σ reaches, δ ≥ 1/n, a batch larger
    than n), which needs n."""
    from pipeline.artifacts import artifact
    from pipeline.io import read_json
    from pipeline.privacy import release
    from pipeline.privacy.params_check import check_dp_params, schedule_warnings
    from pipeline.stages import params_digest

    params = load_params(args.params, args.set)
    release.check_asked_for(params)
    check_dp_params(params)
    for warning in schedule_warnings(params):
        print(f"{args.params}: warning: {warning}")
    stats = artifact("shards") / "stats.json"
    if not stats.exists():
        print(f"{args.params}: ok (the schema, model shapes and DP settings; dp-train's privacy plan needs n: "
              f"validate again once `dpfm shards` has run)")
        return
    built = read_json(stats)
    if built.get("params_digest", params_digest(params, "shards")) != params_digest(params, "shards"):
        print(f"{args.params}: ok (the schema, model shapes and DP settings; dp-train's privacy plan needs the n of "
              f"shards built with these params, and {stats.parent} was built with others: validate again once "
              f"`dpfm shards` has run)")
        return
    from pipeline.privacy.plan import checked_plan
    from pipeline.privacy.training import check_point_plans

    checked_plan(params["dp"], built["private"]["usable"], params["privacy"]["adjacency"])
    if params["curve"]["inits"]:
        check_point_plans(params, built["private"]["usable"])
    print(f"{args.params}: ok (the schema, model shapes, DP settings and the privacy plans of dp-train and the "
          "curve's points at the shards' n)")


def _owner_composition(args) -> int:
    from pipeline.io import read_json
    from pipeline.privacy import budget

    try:
        ledger = read_json(args.ledger)
        delta = ledger["delta"]
    except (ValueError, KeyError, TypeError) as e:  # not JSON, or not a ledger
        raise InputError(f"--ledger {args.ledger}: not a dp-train ledger ({type(e).__name__}: {e})") from None
    print(f"owner-composition: written to {budget.keep_overlap_composition(ledger, delta)}")
    return 0


def _budget_sync(args) -> int:
    from pipeline.privacy import budget

    budget.sync()
    return 0


def _export_dvc(args) -> int:
    from pipeline.dvc_export import check_dvc_yaml, write_dvc_yaml

    if args.check:
        diff = check_dvc_yaml(args.output)
        if diff:
            print(f"{args.output} is out of date with the stage table; run `dpfm export-dvc`:\n{diff}",
                  file=sys.stderr)
            return 1
        print(f"{args.output} matches the stage table")
        return 0
    write_dvc_yaml(args.output)
    print(f"wrote {args.output}")
    return 0


def _scan_shards(args) -> int:
    """Neither a stage lock nor an MLflow run: the groups run side by side (each shard's scan is
    written atomically, and no two groups share a shard), and `shards` records the totals."""
    from pipeline.io import write_json
    from pipeline.stages.shards import scan

    params = job_params(args.params, args.set, args.resolved)
    summary = scan(params, args.group, args.groups, job_threads(args.threads, params))
    if args.summary:
        write_json(args.summary, summary)
    # No count (listed, read, skipped, found cached): beside the published n, a downloaded or img2dataset
    # list's length says how many rows failed; the summary, in the cache, is the owner's
    print(f"scan-shards: group {args.group} of {args.groups} done")
    return 0


def _print_stages(args) -> int:
    for st in STAGES:
        print(f"{st.name:<10} {st.command:<16} in={list(st.inputs)} out={list(st.all_outputs)} "
              f"params={list(st.sections)}")
    return 0


def missing_text(e: FileNotFoundError) -> str:
    """A missing file, and the stage that makes it where it is a stage's output."""
    missing = str(Path(e.filename)) if e.filename else ""
    for st in STAGES:
        if any(missing == out.rstrip("/") or missing.startswith(out) for out in st.all_outputs):
            return f"{missing} is missing: `dpfm {st.name}` makes it (snakemake runs every stage it needs)"
    return str(e)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except ParamsError as e:
        print(f"dpfm: {e}", file=sys.stderr)
        return 2
    except VerificationFailed as e:
        print(f"dpfm: {e}", file=sys.stderr)
        return 3
    except Stopped as e:
        print(f"dpfm: {e}", file=sys.stderr)
        return 128 + e.signum
    # No traceback: PrivateDataError's would name what it keeps owner-only.
    except (StageBusy, RanksDisagree, PrivateDataError, BudgetNotHere, BudgetCorrupt, InputError, Diverged) as e:
        print(f"dpfm: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"dpfm: {missing_text(e)}", file=sys.stderr)
        return 1
    except OSError as e:
        from pipeline.io import DISK_FULL

        if e.errno not in DISK_FULL:
            raise
        # atomic_path's message names the file; another write's (a copy, a link) keeps it in e.filename
        where = f": {e.filename}" if e.filename and str(e.filename) not in str(e.strerror) else ""
        print(f"dpfm: {e.strerror}{where}", file=sys.stderr)
        return 1
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
