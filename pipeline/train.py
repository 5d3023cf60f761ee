"""What `pretrain` and `dp-train` share: the optimiser and its schedule, the precision policy, the
step-seed scheme, the resumable state (atomic checkpoints, exact resume), the finished-model writer
and the loop itself. What one step computes is the caller's `step_fn`."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from pipeline.config import earlier_forms
from pipeline.data.index_mmap import USABLE_NAME
from pipeline.distributed import World, barrier, same_on_every_rank
from pipeline.errors import RanksDisagree
from pipeline.io import atomic_path, remove_stale_temps
from pipeline.preemption import StopRequests, stop
from pipeline.progress import untimed_bar

STATE_ROOT = Path(".dpfm/state")


def make_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float,
                   encoder_lr_scale: float = 1.0) -> torch.optim.Optimizer:
    """AdamW or SGD; the encoder's parameters take `encoder_lr_scale` times the scheduled rate
    (`lr_scale` of their groups: run_loop applies it), the rest of the model the rate itself."""
    encoder = {id(p) for p in model.encoder.parameters()} if encoder_lr_scale != 1.0 else set()
    groups = []
    for scale, part in ((1.0, False), (encoder_lr_scale, True)):
        mine = [p for p in model.parameters() if p.requires_grad and (id(p) in encoder) == part]
        # No weight decay on 1-D parameters (norms, biases), as in MAE's pretraining; the (1, dim)
        # class and mask tokens and the text embeddings are decayed with the weights.
        groups += [{"params": [p for p in mine if p.ndim >= 2], "weight_decay": weight_decay, "lr_scale": scale},
                   {"params": [p for p in mine if p.ndim < 2], "weight_decay": 0.0, "lr_scale": scale}]
    groups = [g for g in groups if g["params"]]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r} (allowed: adamw, sgd)")


def freeze(model: torch.nn.Module, names: list[str]) -> None:
    """Keeps the named modules (everything under each) at the weights they start from: out of the
    optimizer, the clipping and the noise. Those are the warm start's public weights (or a seeded
    random init), released as they were: a function of no private example, so they cost no ε. Where a
    block's step is nearly all noise (benchmarks/gradient_norms.py reads it per block), training it
    walks its weights from the warm start for little signal."""
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in modules or not n]
    if unknown:
        tops = ", ".join(n for n, _ in model.named_children())
        raise ValueError(f"dp.frozen names {unknown}, which are not modules of the {type(model).__name__} "
                         f"(module names as in named_modules(), e.g. encoder.blocks.0; its top level: {tops})")
    for name in names:
        modules[name].requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"dp.frozen {names} freezes every parameter of the {type(model).__name__}: nothing would train")


def lr_at(step: int, base_lr: float, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to zero (`step` counts from 0)."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def state_dir(stage: str, params: dict, inputs=(), name=None) -> Path:
    """Resumable state lives outside the stage outputs (a failed Snakemake job's outputs are deleted)
    and is keyed by the params and the inputs, so a changed config or changed data never resumes a
    stale run (for dp-train that would mix another dataset's checkpoint and ledger into this one).
    `name(digest)` names the run from its key's digest where the plain digest must not be published
    (inputs that are private data); a run named plainly before keeps its state."""
    from pipeline.stages import UNTRACKED  # naming and scheduling keys are not part of the key

    kept = {s: {k: v for k, v in value.items() if k not in UNTRACKED[s]} if s in UNTRACKED else value
            for s, value in params.items()}
    digests = [input_digest(p) for p in inputs]
    # A model input was known by its files' bytes and times until 2026-12-04: a run keyed so keeps its state.
    file_digests = [input_digest(p, by_weights=False) if is_model(p) else d for p, d in zip(inputs, digests)]

    def keyed(form: dict, named=True, inputs=digests) -> Path:
        key = json.dumps({"params": form, "inputs": inputs}, sort_keys=True)
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return STATE_ROOT / f"{stage}-{name(digest) if name and named else digest}"

    # The current key first; then a run made before a knob was added (the same run while the knob sits
    # at its neutral value), and one named plainly before runs on private data were named by `name`.
    namings = (True, False) if name else (True,)
    candidates = [keyed(form, named, list(keys)) for keys in dict.fromkeys(map(tuple, (digests, file_digests)))
                  for named in namings
                  for form in [kept, *earlier_forms(kept)]]
    return next((path for path in candidates if path.is_dir()), candidates[0])


SMALL_FILE = 1 << 20


def is_model(path: str | Path) -> bool:
    """A finished model's directory (the warm start): known by its weights (`input_digest`)."""
    return Path(path).is_dir() and (Path(path) / "checkpoint.pt").is_file()


def input_digest(path: str | Path, by_weights: bool = True) -> str:
    """Identifies an input file or directory cheaply at any scale: the bytes of its small files
    (indexes, manifests, stats) and the size and modification time of large ones (shards). A rewrite
    of a large file changes its mtime, so this can only make a resume less likely, never wrong.
    usable.idx is left out: it is derived from the index.parquet beside it, and an index written
    before it existed gets one on its first open, which must not change the key.

    A finished model (a directory with a checkpoint.pt, the warm start) is known by its weights
    (`checkpoints.weights_digest`): pretrain run again to the same weights (another log_every, a
    resume, `--forcerun`) writes another file time, summary and history, and a DP run keyed by those
    would not resume but train, and be charged, again."""
    path = Path(path)
    if by_weights and is_model(path):
        from pipeline import checkpoints

        return checkpoints.weights_digest(path / "checkpoint.pt")
    h = hashlib.sha256()
    files = [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file() and p.name != USABLE_NAME)
    for f in sorted(files):
        size = f.stat().st_size
        h.update(f"{f.relative_to(path.parent)} {size}\n".encode())
        h.update(f.read_bytes() if size <= SMALL_FILE else str(f.stat().st_mtime_ns).encode())
    return h.hexdigest()[:16]


PRECISIONS = ("auto", "fp32", "bf16", "fp16")
FP16_LOSS_SCALE = 2.0 ** 12  # fixed: under DP, a scale that backs off on overflow would depend on private data


def uses_bf16(device: str, precision: str) -> bool:
    """bf16 when asked for, or with `auto` on a GPU that supports it."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (allowed: {', '.join(PRECISIONS)})")
    # Not emulated bf16 (a V100's or T4's): slower than fp32 there.
    return precision == "bf16" or (precision == "auto" and device == "cuda"
                                   and torch.cuda.is_bf16_supported(including_emulation=False))


def precision_used(device: str, precision: str) -> str:
    """What `precision` computes in on `device`: fp32, bf16 or fp16."""
    return "fp16" if precision == "fp16" else "bf16" if uses_bf16(device, precision) else "fp32"


def autocast(device: str, precision: str):
    """The forward pass's autocast: bf16 where `uses_bf16`, fp16 for fp16, else none (weights,
    gradients and optimizer always stay fp32)."""
    if precision == "fp16":
        return torch.autocast(device_type=device, dtype=torch.float16)
    return torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=uses_bf16(device, precision))


def loss_scale(precision: str) -> float:
    """The loss multiplier that keeps fp16 gradients from underflowing (1 otherwise)."""
    return FP16_LOSS_SCALE if precision == "fp16" else 1.0


def step_generator(key: int, step: int, stream: int, device: str | torch.device = "cpu") -> torch.Generator:
    """The one step-seed scheme: an independent generator per (key, step, stream), the same on every
    rank and on every re-run, so a step's randomness does not depend on how the run got there. On a
    GPU it is the device's own counter-based generator (Philox), so the draws never leave the device.
    On the CPU torch keeps 32 bits of the seed: fine for masks, not for the DP noise (noise.step_noise)."""
    seed = int(np.random.SeedSequence([key, step, stream]).generate_state(1, np.uint64)[0] >> np.uint64(1))
    return torch.Generator(device=device).manual_seed(seed)


MASKS, NOISE = 1, 2  # streams of step_generator: MAE masks, DP noise


class WeightAverage:
    """An exponential moving average of a model's weights over its updates, `w ← w + (1 − decay)(θ − w)`,
    starting at the weights it is given. Under DP it averages the noisy iterates, which the accountant
    already counts as released: post-processing, the same ε. The noise a step adds to the weights is a
    random walk; an average over the last ~1/(1 − decay) updates cancels part of it."""

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"an average's decay must lie in (0, 1), not {decay}")
        self.model, self.decay = model, decay
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self) -> None:
        for name, value in self.model.state_dict().items():
            if value.is_floating_point():
                self.weights[name].lerp_(value, 1.0 - self.decay)
            else:  # counters and other integer buffers are not averaged
                self.weights[name].copy_(value)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "weights": self.weights}

    def load_state_dict(self, saved: dict) -> None:
        if saved["decay"] != self.decay:
            raise ValueError(f"the checkpoint's average has decay {saved['decay']}, this run {self.decay}")
        self.weights = {k: v.to(self.weights[k].device) for k, v in saved["weights"].items()}

    def copy_to(self, model: torch.nn.Module) -> None:
        model.load_state_dict(self.weights)


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


@dataclass
class TrainState:
    """What a run carries from step to step and across a resume: saved in every checkpoint."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    counters: dict = field(default_factory=dict)  # the caller's running figures (kept across a resume)
    step: int = 0                                  # the next step to run
    resumed_at: int = 0                            # the step this process started at
    history: dict = field(default_factory=lambda: {"step": [], "metrics": []})
    average: WeightAverage | None = None           # the weights' moving average, where the run keeps one

    def save(self, checkpointer: "Checkpointer") -> None:
        # This process's device's generator only: the run may resume on fewer GPUs (the curve's one GPU
        # resumes the point dp-train trained on eight), where a state per device of this job has no device.
        cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        checkpointer.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                           "step": self.step, "rng": torch.get_rng_state(), "cuda_rng": cuda_rng,
                           "history": self.history, "extra": self.counters,
                           "average": self.average.state_dict() if self.average else None})

    def restore(self, saved: dict) -> None:
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])
        if saved.get("cuda_rng") is not None and torch.cuda.is_available():
            state = saved["cuda_rng"]  # a list, one per device of the job, in checkpoints before 2026-12-05
            torch.cuda.set_rng_state(state[0] if isinstance(state, (list, tuple)) else state)
        self.step = self.resumed_at = saved["step"]
        self.history = saved["history"]
        self.counters.update(saved.get("extra", {}))
        if self.average is not None:
            if saved.get("average") is None:
                raise ValueError("the checkpoint keeps no weight average, and this run averages its weights")
            self.average.load_state_dict(saved["average"])


@dataclass(frozen=True)
class Schedule:
    steps: int
    lr: float
    warmup: int
    checkpoint_every: int
    log_every: int = 10


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
HEAP_LIMIT = 1 << 30  # blocks up to this size are reused from the heap, and this much may stay free on top


def heap_policy(mmap_threshold: int, trim_threshold: int) -> bool:
    """glibc's heap: blocks above `mmap_threshold` bytes get mappings of their own (returned on free),
    and free memory above `trim_threshold` at the heap's top goes back to the OS. Returns whether glibc
    took both (elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...)
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))


def keep_freed_memory() -> bool:
    """Keep the memory a step frees in this process's heap for the next step (glibc; elsewhere a no-op).

    By default glibc serves blocks above a threshold (at most 32 MB) from fresh mappings and hands the
    top of its heap back to the OS once twice that lies free, so every step faults its pages in again.
    A book-keeping step holds each layer's output gradient until the norms are known and swings the
    heap more, so it lost 2-6% of its time to those page faults (`python -m benchmarks.dp_time_breakdown`
    shows the step with the default heap and kept). Between steps the process stays near its peak;
    the peak grew 2.5% (1,293 → 1,325 MB, four clipped steps of the CPU recipe's captioner at batch
    256). Returns whether it applied. Older glibc refuses thresholds above 32 MB: then 32 MB."""
    return heap_policy(HEAP_LIMIT, HEAP_LIMIT) or heap_policy(32 << 20, HEAP_LIMIT)


def log_earlier(state: TrainState, tracker, keys: tuple[str, ...], prefix: str = "") -> None:
    """The points logged before this process resumed went to the interrupted stage's MLflow run: give
    this run the whole curve (one batch per metric)."""
    earlier = [(s, m) for s, m in zip(state.history["step"], state.history["metrics"]) if s < state.resumed_at]
    for key in keys:
        points = [(s, m[key]) for s, m in earlier if key in m]
        if points:
            tracker.log_series(prefix + key, [v for _, v in points], [s for s, _ in points])


def run_loop(state: TrainState, schedule: Schedule, step_fn: Callable[[int], dict], checkpointer: Checkpointer,
             desc: str, log: Callable[[int, dict], None] | None = None, world: World = World(),
             timed: bool = True) -> TrainState:
    """Run steps [state.step, schedule.steps), starting from the last checkpoint if there is one.

    The learning rate is a function of the step, so restoring the state resumes the run exactly when
    `step_fn(step)` draws its data and randomness as a function of the step (step_generator). Metrics
    every `log_every` steps go to the history, and to `log` once a checkpoint holds their step: a step
    redone after a crash (another device's noise, nondeterministic kernels) is then published once. A
    SIGTERM or Ctrl-C ends the run after the step in flight, with a checkpoint (`Stopped`).
    """
    keep_freed_memory()
    saved = checkpointer.load()
    if saved is not None:
        state.restore(saved)
        print(f"{desc}: resuming at step {state.step} from {checkpointer.path}")
    # Ranks starting from different states would train different weights, and at different steps put two
    # batches into one sum, where an example sampled in both would count twice against one charge.
    if world.size > 1:
        weights = sum(float(p.detach().double().sum()) for p in state.model.parameters())
        if not same_on_every_rank([state.step, weights], world):
            raise RanksDisagree(f"{desc}: the ranks would start from different states (rank {world.rank}: step "
                                f"{state.step}, from {checkpointer.path.parent}): every node must see the same "
                                f"`.dpfm/` and `data/budget/`, on the file system the ranks share")
    t0, done, total, unsaved = time.time(), 0, schedule.steps, []
    steps = range(state.step, total)
    # Untimed (private data), the bar moves only when a checkpoint holds the steps: the number of a step
    # that failed says when a private example (one that did not read, say) was sampled, and a bar moved
    # step by step would print it as its last count; the last checkpoint's step is public anyway.
    bar = (tqdm(steps, desc=desc, initial=state.step, total=total, unit="step") if timed
           else untimed_bar(total, desc, initial=state.step, unit="steps"))
    with StopRequests() as requests, contextlib.nullcontext() if timed else bar:
        for step in bar if timed else steps:
            for group in state.optimizer.param_groups:
                group["lr"] = lr_at(step, schedule.lr, schedule.warmup, total) * group.get("lr_scale", 1.0)
            metrics = step_fn(step)
            state.step, done = step + 1, done + 1
            metrics["lr"] = state.optimizer.param_groups[0]["lr"]
            if step % schedule.log_every == 0 or step == total - 1:
                if timed:
                    metrics["steps_per_s"] = done / max(1e-9, time.time() - t0)
                state.history["step"].append(step)
                state.history["metrics"].append(metrics)
                unsaved.append((step, metrics))
            last = step + 1 == total
            # Asked on the last step too: a stop told then would end with this loop, and the stage's next
            # training (the twin, the curve's next point) would run on as if nothing had been asked.
            signum = requests.agreed(world)
            if (step + 1) % schedule.checkpoint_every == 0 or last or signum:
                state.save(checkpointer)
                if not timed:
                    bar.update(state.step - bar.n)
                for logged in unsaved if log else ():
                    log(*logged)
                unsaved.clear()
            if signum:  # every rank waits for rank 0's checkpoint: on several nodes the first rank to exit
                barrier(world)  # has srun end the step, rank 0's save with it (after SLURM's KillWait, 30 s)
                raise stop(signum, desc, step + 1, total, checkpointer.path)
        # Told while the last checkpoint was written or its steps logged: the run is saved whole, and the
        # stage must still stop before its next training.
        signum = requests.agreed(world)
        if signum:
            raise stop(signum, desc, state.step, total, checkpointer.path)
    return state
