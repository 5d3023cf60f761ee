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

from pipeline.distributed import World
from pipeline.io import atomic_path, remove_stale_temps
from pipeline.preemption import StopRequests, stop

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


def state_dir(stage: str, params: dict, inputs=()) -> Path:
    """Resumable state lives outside the stage outputs (a failed Snakemake job's outputs are deleted)
    and is keyed by the params and the inputs, so a changed config or changed data never resumes a
    stale run (for dp-train that would mix another dataset's checkpoint and ledger into this one)."""
    key = json.dumps({"params": params, "inputs": [input_digest(p) for p in inputs]}, sort_keys=True)
    return STATE_ROOT / f"{stage}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


SMALL_FILE = 1 << 20


def input_digest(path: str | Path) -> str:
    """Identifies an input file or directory cheaply at any scale: the bytes of its small files
    (indexes, manifests, stats) and the size and modification time of large ones (shards,
    checkpoints). A rewrite of a large file changes its mtime, so this can only make a resume less
    likely, never wrong."""
    path = Path(path)
    h = hashlib.sha256()
    for f in sorted([path] if path.is_file() else (p for p in path.rglob("*") if p.is_file())):
        size = f.stat().st_size
        h.update(f"{f.relative_to(path.parent)} {size}\n".encode())
        h.update(f.read_bytes() if size <= SMALL_FILE else str(f.stat().st_mtime_ns).encode())
    return h.hexdigest()[:16]


PRECISIONS = ("auto", "fp32", "bf16")


def uses_bf16(device: str, precision: str) -> bool:
    """bf16 when asked for, or with `auto` on a GPU that supports it; fp32 otherwise."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (allowed: {', '.join(PRECISIONS)})")
    return precision == "bf16" or (precision == "auto" and device == "cuda" and torch.cuda.is_bf16_supported())


def autocast(device: str, precision: str):
    """bf16 autocast where `uses_bf16` says so (weights, gradients and optimizer stay fp32)."""
    return torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=uses_bf16(device, precision))


class Checkpointer:
    def __init__(self, directory: Path, write: bool = True):
        """`write=False` for non-main torchrun ranks: they resume from the shared checkpoint, rank 0 saves it."""
        self.path, self.write = Path(directory) / "checkpoint.pt", write

    def save(self, state: dict) -> None:
        if not self.write:
            return
        # Through a Python file: torch.save(path) reports a full disk as an obscure "unexpected pos"
        # RuntimeError, a file object raises OSError(ENOSPC), which atomic_path names clearly.
        with atomic_path(self.path) as tmp, open(tmp, "wb") as f:
            torch.save(state, f)

    def load(self) -> dict | None:
        if self.write:  # a kill -9 mid-save leaves a temp file nobody will finish: reclaim its space
            remove_stale_temps(self.path.parent, self.path.name)
        return torch.load(self.path, map_location="cpu", weights_only=False) if self.path.exists() else None


def run_loop(*, model, optimizer, total_steps: int, base_lr: float, warmup: int, step_fn: Callable[[int], dict],
             checkpointer: Checkpointer, checkpoint_every: int, desc: str, extra_state: Callable[[], dict] = dict,
             restore_extra: Callable[[dict], None] = lambda s: None, on_log: Callable[[int, dict], None] = None,
             log_every: int = 10, on_start: Callable[[int], None] | None = None, world: World = World()) -> dict:
    """Run steps [start, total) where start comes from the last checkpoint; return the history.

    A checkpoint holds the model, optimizer, step, torch RNG states, history and `extra_state()`;
    the learning rate is a function of the step, so restoring these resumes the run exactly when
    `step_fn(step)` draws its data and randomness as a function of the step. `on_start(start)` is
    called once, before the first step, with the step the run starts (or resumes) at. A SIGTERM or
    Ctrl-C ends the run after the step in flight, with a checkpoint (`Stopped`).
    """
    start, history = 0, {"step": [], "metrics": []}
    saved = checkpointer.load()
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])
        if saved.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda_rng"])
        start, history = saved["step"], saved["history"]
        restore_extra(saved.get("extra", {}))
        print(f"{desc}: resuming at step {start} from {checkpointer.path}")
    if on_start:
        on_start(start)

    def save(step: int) -> None:
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        checkpointer.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                           "rng": torch.get_rng_state(), "cuda_rng": cuda_rng, "history": history,
                           "extra": extra_state()})

    t0, done = time.time(), 0
    with StopRequests() as requests:
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
            last = step + 1 == total_steps
            signum = None if last else requests.agreed(world)
            if (step + 1) % checkpoint_every == 0 or last or signum:
                save(step + 1)
            if signum:
                raise stop(signum, desc, step + 1, total_steps, checkpointer.path)
    return history
