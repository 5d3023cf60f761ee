"""The training loop shared by `pretrain` and `dp-train`: optimiser, schedule, atomic checkpoints,
exact resume, progress and metrics. What one step computes is the caller's `step_fn`."""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from pipeline.io import atomic_path

STATE_ROOT = Path(".dpfm/state")


def make_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    # No weight decay on norms, biases and tokens (1-D parameters), as in MAE.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r} (allowed: adamw, sgd)")


def lr_at(step: int, base_lr: float, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to zero (`step` counts from 0)."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def state_dir(stage: str, params: dict) -> Path:
    """Resumable state lives outside the stage outputs (a failed Snakemake job's outputs are deleted)
    and is keyed by the params, so a changed config never resumes from a stale run."""
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    return STATE_ROOT / f"{stage}-{digest}"


def autocast(device: str, precision: str):
    """bf16 autocast where the device supports it; fp32 otherwise."""
    use_bf16 = precision == "bf16" or (precision == "auto" and device == "cuda" and torch.cuda.is_bf16_supported())
    return torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=use_bf16)


class Checkpointer:
    def __init__(self, directory: Path):
        self.path = Path(directory) / "checkpoint.pt"

    def save(self, state: dict) -> None:
        with atomic_path(self.path) as tmp:
            torch.save(state, tmp)

    def load(self) -> dict | None:
        return torch.load(self.path, map_location="cpu", weights_only=False) if self.path.exists() else None


def run_loop(*, model, optimizer, total_steps: int, base_lr: float, warmup: int, step_fn: Callable[[int], dict],
             checkpointer: Checkpointer, checkpoint_every: int, desc: str, extra_state: Callable[[], dict] = dict,
             restore_extra: Callable[[dict], None] = lambda s: None, on_log: Callable[[int, dict], None] = None,
             log_every: int = 10) -> dict:
    """Run steps [start, total) where start comes from the last checkpoint; return the history."""
    start, history = 0, {"step": [], "metrics": []}
    saved = checkpointer.load()
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])
        start, history = saved["step"], saved["history"]
        restore_extra(saved.get("extra", {}))
        print(f"{desc}: resuming at step {start} from {checkpointer.path}")

    def save(step: int) -> None:
        checkpointer.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                           "rng": torch.get_rng_state(), "history": history, "extra": extra_state()})

    t0, done = time.time(), 0
    for step in tqdm(range(start, total_steps), desc=desc, initial=start, total=total_steps, unit="step"):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, base_lr, warmup, total_steps)
        metrics = step_fn(step)
        done += 1
        metrics["lr"] = optimizer.param_groups[0]["lr"]
        if step % log_every == 0 or step == total_steps - 1:
            metrics["steps_per_s"] = done / max(1e-9, time.time() - t0)
            history["step"].append(step)
            history["metrics"].append(metrics)
            if on_log:
                on_log(step, metrics)
        if (step + 1) % checkpoint_every == 0 or step + 1 == total_steps:
            save(step + 1)
    return history
