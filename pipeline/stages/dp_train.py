"""The `dp-train` stage: DP-SGD on the private shards (ViP's MAE, DP-Cap's captioner or Dp-CLIP).

The training itself is privacy/training.py (the curve and the extra seeds train through it too);
this stage trains the configured run (and, when asked for, its non-private twin) and writes the
model, the published ledger (the mechanism and the steps charged) and the held-out loss history.
"""

from __future__ import annotations

from pipeline import checkpoints
from pipeline.artifacts import artifact
from pipeline.distributed import barrier
from pipeline.io import atomic_dir, read_json, write_json
from pipeline.privacy import release
from pipeline.privacy.accounting import bound_text
from pipeline.privacy.params_check import nonprivate_params
from pipeline.privacy.training import setup, train_nonprivate, train_private



def run(params: dict, ctx) -> None:
    dp = params["dp"]
    trainer = setup(params, ctx.device)
    world = trainer.world
    model, counters, record = train_private(params, trainer, ctx)
    plan = trainer.plan  # the mechanism the run began with (its ledger's, on a resume)
    baseline = train_nonprivate(params, trainer, ctx) if dp["nonprivate_baseline"] else None
    if not world.is_main:
        barrier(world)
        return
    history = record.pop("history")
    with atomic_dir(ctx.stage.output("dp")) as out:
        # A test run's noise key is known: its model is not private, and is never registered as such.
        checkpoints.save(out / "checkpoint.pt", model, objective=dp["objective"], model_cfg=trainer.mcfg.to_dict(),
                         steps=counters["applied_updates"], private=not params["privacy"]["testing"], config=params)
        if baseline is not None:  # NOT private: for the evaluation table only; .dvcignore keeps it from the remote
            twin = nonprivate_params(params)
            checkpoints.save(out / "nonprivate.pt", baseline, objective=dp["objective"], model_cfg=trainer.mcfg.to_dict(),
                             steps=twin["dp"]["steps"], private=False, config=twin)
        write_json(out / "ledger.json", record)
        write_json(out / "history.json", history)
    barrier(world)
    ctx.tracker.log_metrics({"epsilon": record["epsilon"], "sigma": plan.sigma, "steps": trainer.ledger.steps,
                             "sample_rate": plan.sample_rate})
    ctx.tracker.set_tags({"dpfm.epsilon": bound_text(record["epsilon"], 4), "dpfm.accountant": plan.accountant})
    print(f"dp-train: {trainer.ledger.steps} steps on n={plan.n}, q={plan.sample_rate:.4f}, σ={plan.sigma:.4f}, "
          f"ε={bound_text(record['epsilon'], 3)} (δ={bound_text(plan.delta, 2, exponent=True)}, {plan.accountant}, "
          f"{plan.adjacency.replace('_', '-')})")
    # What this stage itself released outside that ε (its held-out loss reads an eval split carved out
    # of the private source: the shards' public stats say so).
    reasons = release.not_private_reasons(params, read_json(artifact("shards") / "stats.json"))
    for reason in reasons:
        print(f"dp-train: NOT PRIVATE as a whole: {reason}")
    ctx.tracker.set_tags(release.not_private_tags(reasons))
    if dp["log_private_stats"]:  # opted in: released without noise, not covered by the ε above
        nonfinite = counters["nonfinite"]
        ctx.tracker.log_metrics({"private_nonfinite_examples": nonfinite})
        print(f"dp-train: {nonfinite} non-finite examples dropped "
              "(a statistic of the private data, released without noise: dp.log_private_stats)")
