"""The `pretrain` stage: non-private MAE on the synthetic images (ViP's warm start; no privacy cost).

Images stream from the shards by byte range (nothing is held in memory whole). What step s computes
is a function of (seed, s): its batch is positions [s·B, (s+1)·B) of a sequence of seeded per-epoch
shuffles (every image once per epoch), its masks come from the shared step-seed scheme
(train.step_generator). With the model, optimizer and RNG state in the checkpoint, an interrupted
run resumes exactly.
"""

from __future__ import annotations

import functools
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from pipeline import checkpoints
from pipeline.data.loader import BatchLoader
from pipeline.data.shards import ShardDataset
from pipeline.distributed import barrier, init_world
from pipeline.errors import Diverged
from pipeline.io import atomic_dir, write_json
from pipeline.models import ModelConfig, build_model, model_params_read
from pipeline.stages import HOW_IT_RUNS
from pipeline.train import (MASKS, Checkpointer, Schedule, TrainState, autocast, log_earlier, loss_scale,
                            make_optimizer, run_loop, state_dir, step_generator, uses_bf16)



@functools.lru_cache(maxsize=2)
def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(seed: int, step: int, batch_size: int, n: int) -> np.ndarray:
    """Image indices of step `step`: positions [step·B, (step+1)·B) of the concatenated epoch orders."""
    positions = np.arange(step * batch_size, (step + 1) * batch_size)
    out = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(positions // n):
        here = positions // n == epoch
        out[here] = epoch_order(seed, int(epoch), n)[positions[here] % n]
    return out


def step_batches(loader, seed: int, start: int, steps: int, batch: int, n: int, mine: slice):
    """The decoded images of steps [start, steps), this rank's share of each, prefetched by `loader`."""
    return loader(batch_indices(seed, s, batch, n)[mine] for s in range(start, steps))


def mae_step(model, optimizer, images: torch.Tensor, noise: torch.Tensor, device: str, precision: str,
             grad_clip: float) -> dict:
    """One optimiser step on the mean MAE loss (the masks are `noise`'s argsort, as in the models)."""
    with autocast(device, precision):
        loss = model(images.to(device, non_blocking=True), noise=noise.to(device)).float().mean()
    optimizer.zero_grad(set_to_none=True)
    (loss * loss_scale(precision)).backward()
    for p in model.parameters():  # fp16's fixed loss scale, taken back out before clipping
        if p.grad is not None and loss_scale(precision) != 1.0:
            p.grad.div_(loss_scale(precision))
    # The norm of the gradients (all-reduced: every rank stops alike), clipped to grad_clip where one is set.
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip) if grad_clip > 0 else
                      torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
    if not math.isfinite(grad_norm):  # one such step makes every weight NaN, and dp-train would start from it
        raise Diverged(f"pretrain diverged: a non-finite gradient (loss {loss.item()}) before the optimiser step; "
                       "lower pretrain.lr, set pretrain.grad_clip, or train in bf16 or fp32 (pretrain.precision)")
    optimizer.step()
    return {"loss": loss.item()} | ({"grad_norm": grad_norm} if grad_clip > 0 else {})


def resumable_state(params: dict, images) -> Path:
    """The run's state directory, keyed without how it runs (decoding workers, checkpoint cadence: a resume
    is bit-exact under any), so a run restarted with fewer workers after one ran out of memory resumes, and
    without the model keys the MAE never reads (the text tower's). A run keyed with them, before they left
    the key, resumes under its old values."""
    how = HOW_IT_RUNS["pretrain"]
    path = state_dir("pretrain", {**params, "model": model_params_read(params["model"], "mae"),
                                  "pretrain": {k: v for k, v in params["pretrain"].items() if k not in how}},
                     inputs=[images])
    before = state_dir("pretrain", params, inputs=[images])
    return before if before.is_dir() and not path.is_dir() else path


def run(params: dict, ctx) -> None:
    cfg, seed, device = params["pretrain"], params["run"]["seed"], ctx.device
    batch = cfg["batch_size"]
    mcfg = ModelConfig.from_params(params["model"], "mae")
    images = ctx.stage.input("synthetic")
    dataset = ShardDataset(images)
    n = len(dataset)
    if n == 0:
        raise ValueError(f"{images} has no usable images: run the synthetic stage")
    # Images are centre-cropped/resized to the model's size, should the synthetic resolution differ.
    loader = BatchLoader(dataset, mcfg.img_size, workers=cfg["data_workers"], device=device)
    world = init_world(device)
    if batch % world.size:
        raise ValueError(f"pretrain.batch_size={batch} must divide evenly over the {world.size} torchrun ranks")
    torch.manual_seed(seed)
    model = build_model("mae", mcfg).to(device)
    optimizer = make_optimizer(model, "adamw", cfg["lr"], cfg["weight_decay"])
    # Each rank takes every world.size-th example of the global batch; DDP averages the gradients.
    trained = model if world.size == 1 else DistributedDataParallel(model)
    mine = slice(world.rank, None, world.size)
    num_patches = (mcfg.img_size // mcfg.patch_size) ** 2
    work = resumable_state(params, images)
    state, batches = TrainState(model, optimizer), None

    def step_fn(step: int) -> dict:
        nonlocal batches
        if batches is None:  # the first step run here: after a resume, the one the checkpoint holds
            batches = step_batches(loader, seed, step, cfg["steps"], batch, n, mine)
        _, (images,) = next(batches)
        noise = torch.rand(batch, num_patches, generator=step_generator(seed, step, MASKS))[mine]
        return mae_step(trained, optimizer, images, noise, device, cfg["precision"], cfg["grad_clip"])

    def log(step: int, metrics: dict) -> None:
        ctx.tracker.log_metrics({**metrics, "images_per_s": metrics["steps_per_s"] * batch}, step=step)

    started = time.time()
    try:
        run_loop(state, Schedule(cfg["steps"], cfg["lr"], cfg["warmup_steps"], cfg["checkpoint_every"], cfg["log_every"]),
                 step_fn, Checkpointer(work, write=world.is_main), desc="pretrain", log=log, world=world)
    finally:
        if batches is not None:
            batches.close()  # stops the decoding workers
        dataset.close()
    if not world.is_main:
        barrier(world)
        return
    history, start = state.history, state.resumed_at
    elapsed, steps_now = time.time() - started, cfg["steps"] - start
    log_earlier(state, ctx.tracker, ("loss", "lr", "grad_norm"))

    summary = {"images": n, "steps": cfg["steps"], "resumed_at": start,
               "final_loss": history["metrics"][-1]["loss"] if history["step"] else None,
               "images_per_s": steps_now * batch / max(elapsed, 1e-9) if steps_now else None,
               "bf16": uses_bf16(device, cfg["precision"])}
    with atomic_dir(ctx.stage.output("pretrain")) as out:
        checkpoints.save(out / "checkpoint.pt", model, objective="mae", model_cfg=mcfg.to_dict(), steps=cfg["steps"],
                         private=False, config=params)
        write_json(out / "history.json", history)
        write_json(out / "summary.json", summary)
    barrier(world)
    # "images_per_s" is the per-step curve; the run's mean gets its own name.
    ctx.tracker.log_metrics({("mean_" + k if k == "images_per_s" else k): v for k, v in summary.items()
                             if isinstance(v, (int, float))})
    rate = f"{summary['images_per_s']:.0f} img/s" if summary["images_per_s"] else "no steps run now"
    print(f"pretrain: {cfg['steps']} steps on {n} synthetic images, final loss {summary['final_loss']}, {rate}")
    # Last: a failure before here (MLflow, a SIGTERM) fails the job, and Snakemake deletes its output; the
    # state then resumes the run at its end, where without it every step would be trained again.
    shutil.rmtree(work, ignore_errors=True)
