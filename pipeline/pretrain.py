"""The `pretrain` stage: non-private MAE on the synthetic images (ViP's warm start; no privacy cost)."""

from __future__ import annotations

import time

import torch

from pipeline.data.shards import ShardDataset
from pipeline.data.transforms import to_tensor
from pipeline.io import atomic_dir, write_json
from pipeline.modelcfg import model_config
from pipeline.models import build_model
from pipeline.train import Checkpointer, autocast, make_optimizer, run_loop, state_dir

IN_DIR, OUT_DIR = "data/synthetic", "models/pretrain"


def step_generator(seed: int, step: int) -> torch.Generator:
    """Batches and masks are a function of (seed, step): a resumed run sees exactly the same data."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def run(params: dict, ctx) -> None:
    cfg, seed, device = params["pretrain"], params["run"]["seed"], ctx.device
    images = to_tensor(ShardDataset(IN_DIR).load_images())
    n = len(images)
    torch.manual_seed(seed)
    mcfg = model_config(params["model"], "mae")
    model = build_model("mae", mcfg).to(device)
    optimizer = make_optimizer(model, "adamw", cfg["lr"], cfg["weight_decay"])
    num_patches = (mcfg["img_size"] // mcfg["patch_size"]) ** 2

    def step_fn(step: int) -> dict:
        g = step_generator(seed, step)
        idx = torch.randint(n, (cfg["batch_size"],), generator=g)
        noise = torch.rand(cfg["batch_size"], num_patches, generator=g)
        with autocast(device, cfg["precision"]):
            loss = model(images[idx].to(device), noise=noise.to(device)).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        optimizer.step()
        return {"loss": loss.item()}

    start = time.time()
    history = run_loop(model=model, optimizer=optimizer, total_steps=cfg["steps"], base_lr=cfg["lr"],
                       warmup=cfg["warmup_steps"], step_fn=step_fn,
                       checkpointer=Checkpointer(state_dir("pretrain", params)),
                       checkpoint_every=cfg["checkpoint_every"], desc="pretrain", log_every=cfg["log_every"],
                       on_log=lambda s, m: ctx.tracker.log_metrics(m, step=s))
    elapsed = time.time() - start
    summary = {"images": n, "steps": cfg["steps"], "final_loss": history["metrics"][-1]["loss"] if history["step"] else None,
               "images_per_s": cfg["steps"] * cfg["batch_size"] / max(elapsed, 1e-9)}
    with atomic_dir(OUT_DIR) as out:
        torch.save({"objective": "mae", "model_cfg": mcfg, "model": model.state_dict(),
                    "encoder": model.encoder.state_dict(), "step": cfg["steps"]}, out / "checkpoint.pt")
        write_json(out / "history.json", history)
        write_json(out / "summary.json", summary)
    ctx.tracker.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float))})
    print(f"pretrain: {cfg['steps']} steps, final loss {summary['final_loss']}, {summary['images_per_s']:.0f} img/s")
