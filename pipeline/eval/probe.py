"""Linear probes on frozen encoder features (ViP/MAE protocol).

Features: the cls token, the mean of the patch tokens, or both, after the encoder's final norm,
optionally concatenated over the last k blocks. Probes:
* `logreg` — standardised features (the BatchNorm-without-affine of the protocol, in closed
  form) and L2 logistic regression: exact and fast on small sets, the default. Its strength C is
  given, or `auto`: chosen by cross-validation on the probe's training part alone (never the test
  part), so every encoder gets its best probe and none is favoured by one fixed C. On a GPU the
  same problem is solved there (device_logreg), in seconds where the CPU's fits take minutes;
* `lars` / `adamw` — BatchNorm1d(affine=False) + Linear trained by minibatch SGD with LARS (as
  ViP/MAE) or AdamW, with warmup and a cosine schedule: for large sets.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from joblib import Parallel, delayed
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.linear_model import LogisticRegression, LogisticRegressionCV
from sklearn.model_selection import StratifiedKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from pipeline.data.transforms import to_tensor
from pipeline.errors import check_finite
from pipeline.eval import device_logreg
from pipeline.eval.images import Images
from pipeline.train import lr_at

SOLVERS = ("logreg", "lars", "adamw")


# Features per token width: "cls+mean" takes both, as the objectives pool differently (CLIP's
# embedding is the cls token, MAE's loss reads every patch token, a captioner attends over them).
POOL_WIDTHS = {"cls": 1, "mean": 1, "cls+mean": 2}


def pool_tokens(tokens: torch.Tensor, pool: str) -> torch.Tensor:
    """(B, 1 + L, D) tokens, cls first -> (B, POOL_WIDTHS[pool] * D) pooled features."""
    if pool == "cls":
        return tokens[:, 0]
    if pool == "mean":
        return tokens[:, 1:].mean(dim=1)
    if pool == "cls+mean":
        return torch.cat([tokens[:, 0], tokens[:, 1:].mean(dim=1)], dim=1)
    raise ValueError(f"unknown pool {pool!r}; use one of {', '.join(POOL_WIDTHS)}")


def blocks_read(depth: int, last_k: int | str) -> int:
    """How many of an encoder's last blocks the features read (evaluate.last_k_blocks; "all": every one)."""
    last_k = depth if last_k == "all" else last_k
    if not 1 <= last_k <= depth:
        raise ValueError(f"last_k_blocks={last_k}: the encoder has {depth} blocks")
    return last_k


@torch.no_grad()
def extract_features(encoder, images: np.ndarray | Images, pool: str = "cls", last_k: int | str = 1,
                     device: str = "cpu", batch_size: int = 256) -> np.ndarray:
    """(N, H, W, 3) uint8 images -> (N, last_k * width) float32 features of the frozen encoder.

    `images` is an array or lazy `Images`: only one batch of it is decoded at a time. last_k="all"
    takes every block."""
    last_k = blocks_read(len(encoder.blocks), last_k)
    encoder.eval().to(device)
    captured: list[torch.Tensor] = []
    hooks = [blk.register_forward_hook(lambda _m, _i, out: captured.append(out))
             for blk in encoder.blocks[len(encoder.blocks) - last_k:]]
    # Filled in place: no per-batch pieces left between each batch's big temporaries (they fragment the
    # heap: RSS crept up with the set's size) nor concatenated at the end (twice the features' memory).
    out = np.empty((len(images), last_k * POOL_WIDTHS[pool] * encoder.width), np.float32)
    try:
        for i in range(0, len(images), batch_size):
            captured.clear()
            encoder.forward_features(to_tensor(images[i:i + batch_size]).to(device))
            # Every block's tokens go through the encoder's final norm, so k = 1 is `encode`.
            pooled = torch.cat([pool_tokens(encoder.norm(t), pool) for t in captured], dim=1)
            out[i:i + batch_size] = pooled.float().cpu().numpy()
    finally:
        for h in hooks:
            h.remove()
    return out


# `auto`'s grid of inverse L2 strengths. It reaches 0.001: raw pixels of Fashion-MNIST (3,072 features, 5,000
# probe-train images) cross-validate best at 0.003 (84.3%, against 84.1% at 0.01, the old grid's edge, and
# 79.7% at 1); trained encoders' features best at 0.3-1.
AUTO_CS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
AUTO_FOLDS = 3
# Independent logistic fits go one per core from this many training floats, where the fits outweigh
# starting the workers (about 2 s, once per process: joblib keeps them for the next call): the 20
# refits from 100k (269 digits × 768 features, `make run`'s probe: 2.2 s in turn, 1.4 s in two started
# workers; 5,000 images: minutes), auto's 3 folds, which share a worker's start among fewer fits, from
# 2M (898 digits × 768 features: 5.3 s in workers against 4.1 s in turn; 5,000 × 768: 73 s against
# 243 s; benchmarks/probe_speed.py; all timed before fits with fewer images than features moved to
# TrainingRowSpace).
PARALLEL_FIT_FLOATS = 100_000
PARALLEL_FOLD_FLOATS = 2_000_000


def fit_workers(fits: int) -> int:
    """Processes for `fits` independent single-threaded logistic fits: one per thread the job was given
    (torch's count, which the CLI sets from --threads, run.threads or SLURM's allocation), at most `fits`."""
    return max(1, min(fits, torch.get_num_threads()))


class TrainingRowSpace(TransformerMixin, BaseEstimator):
    """Coordinates in the span of the training rows (an orthonormal basis from their SVD).

    An L2 logistic regression's weights lie in that span (its gradient is a sum of training rows, and
    any part outside it only adds penalty), and a row's logits depend only on its projection onto the
    span: on these coordinates the fit is the same problem, with r ≤ n instead of d weights per class.
    With fewer images than features (few-shot; `make run`'s 269 probe-train digits against 768 or 3,072
    features) L-BFGS then takes cheaper steps and stops nearer the optimum (benchmarks/probe_speed.py)."""

    def fit(self, x, y=None):
        x = np.asarray(x, np.float64)
        _, s, vt = np.linalg.svd(x, full_matrices=False)
        rank = int((s > s[:1].max(initial=0) * max(x.shape) * np.finfo(np.float64).eps).sum())  # duplicates: lower
        # At least one column: constant features (all zero once standardised) still fit their intercept.
        self.basis_ = vt[:max(rank, 1)].T
        return self

    def transform(self, x):
        return np.asarray(x, np.float64) @ self.basis_


def on_gpu(device: str) -> bool:
    """Whether the logreg probe is solved on `device` (device_logreg) instead of by scikit-learn's CPU fits."""
    return torch.device(device).type == "cuda"


def auto_folds(train_y, seed: int) -> StratifiedKFold | None:
    """auto's cross-validation folds on the probe's training part; None with fewer than 2 examples of
    some class (1-shot), where there is nothing to validate on."""
    counts = np.unique(train_y, return_counts=True)[1]
    folds = min(AUTO_FOLDS, int(counts.min()) if len(counts) else 0)
    return StratifiedKFold(folds, shuffle=True, random_state=seed) if folds >= 2 else None


def logreg_estimator(train_x, train_y, c: float | str = 1.0, seed: int = 0, fold_jobs: int | None = None,
                     row_space: bool | None = None):
    """logreg_probe's probe, not yet fitted: standardised features + L2 logistic regression (L-BFGS),
    on TrainingRowSpace's coordinates when `row_space` (default: fewer images than features).
    c="auto" picks C from AUTO_CS by stratified cross-validated accuracy on (train_x, train_y), its
    folds in `fold_jobs` processes (default: one per core for a large enough problem); with fewer than
    2 examples of some class (1-shot) there is nothing to validate on, and C falls back to 1. Each
    fold's rows span part of the whole set's span, so one basis serves every fold."""
    cv = auto_folds(train_y, seed) if c == "auto" else None
    if cv is not None:
        if fold_jobs is None:
            fold_jobs = fit_workers(cv.n_splits) if np.size(train_x) >= PARALLEL_FOLD_FLOATS else 1
        model = LogisticRegressionCV(Cs=list(AUTO_CS), cv=cv, scoring="accuracy", max_iter=3000, random_state=seed,
                                     n_jobs=fold_jobs)
    else:
        model = LogisticRegression(C=1.0 if c == "auto" else c, max_iter=3000, random_state=seed)
    if row_space is None:
        row_space = len(train_x) < math.prod(np.shape(train_x)[1:])
    return make_pipeline(StandardScaler(), *([TrainingRowSpace()] if row_space else []), model)


def logreg_probe(train_x, train_y, c: float | str = 1.0, seed: int = 0, device: str = "cpu"):
    """logreg_estimator's probe, fitted on (train_x, train_y); on a GPU, device_logreg's fit of the
    same problem (C chosen on the same folds)."""
    if on_gpu(device):
        cv = auto_folds(train_y, seed) if c == "auto" else None
        if cv is None:
            return device_logreg.fit(train_x, train_y, 1.0 if c == "auto" else c, device)
        return device_logreg.fit(train_x, train_y, None, device, list(cv.split(train_x, train_y)), AUTO_CS)
    probe = logreg_estimator(train_x, train_y, c, seed)
    # One BLAS thread per fit, the cores spread over independent fits instead: L-BFGS's products have
    # one column per class, too thin for a thread pool to pay its synchronisation (2 cores, 5,000
    # probe-train images, 768 encoder features: C chosen and fit in 81 s against 260 s with the pool
    # and the folds in turn; benchmarks/probe_speed.py).
    with threadpool_limits(1), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # LogisticRegressionCV's announced attribute changes
        return probe.fit(train_x, train_y)


def chosen_c(train_x, train_y, seed: int = 0, device: str = "cpu") -> float:
    """The C that `logreg_probe(..., c="auto")` picks on (train_x, train_y)."""
    if on_gpu(device):  # the choice alone: the probe at it is fit where it is used
        cv = auto_folds(train_y, seed)
        return device_logreg.choose_c(train_x, train_y, device, list(cv.split(train_x, train_y)), AUTO_CS)[0] \
            if cv is not None else 1.0
    model = logreg_probe(train_x, train_y, "auto", seed)[-1]
    return float(model.C_[0]) if hasattr(model, "C_") else float(model.C)


class LARS(torch.optim.Optimizer):
    """Layer-wise adaptive rate scaling (You et al. 2017) as used for MAE/ViP linear probes:
    SGD with momentum whose step for each weight matrix is scaled by trust·‖w‖/‖g + wd·w‖.
    Biases and 1-d parameters take plain momentum SGD."""

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, trust: float = 0.001):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust=trust))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad
                if p.ndim > 1:
                    d = d.add(p, alpha=group["weight_decay"])
                    w_norm, d_norm = p.norm(), d.norm()
                    if w_norm > 0 and d_norm > 0:
                        d = d * (group["trust"] * w_norm / d_norm)
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(d)
                p.add_(buf, alpha=-group["lr"])


def train_linear_head(train_x, train_y, num_classes: int, solver: str, epochs: int, batch_size: int, lr: float,
                      weight_decay: float, seed: int = 0, device: str = "cpu") -> nn.Module:
    """BatchNorm1d(affine=False) + Linear on fixed features. `lr` is the base rate per 256 examples."""
    g = torch.Generator().manual_seed(seed)
    x = torch.as_tensor(train_x, dtype=torch.float32, device=device)
    y = torch.as_tensor(train_y, dtype=torch.long, device=device)
    head = nn.Sequential(nn.BatchNorm1d(x.shape[1], affine=False), nn.Linear(x.shape[1], num_classes))
    with torch.no_grad():
        head[1].weight.copy_(torch.randn(head[1].weight.shape, generator=g) * 0.01)
        head[1].bias.zero_()
    head.to(device)
    batch_size = min(batch_size, len(x))
    rate = lr * batch_size / 256
    if solver == "lars":
        opt = LARS(head.parameters(), lr=rate, weight_decay=weight_decay)
    elif solver == "adamw":
        opt = torch.optim.AdamW(head.parameters(), lr=rate, weight_decay=weight_decay)
    else:
        raise ValueError(f"unknown solver {solver!r}; choose from {SOLVERS}")
    per_epoch = max(1, len(x) // batch_size)  # drop the ragged last batch (BatchNorm needs > 1 row)
    total, step = epochs * per_epoch, 0
    head.train()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g).to(device)
        for b in range(per_epoch):
            idx = order[b * batch_size:(b + 1) * batch_size]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, rate, max(1, total // 10), total)
            loss = F.cross_entropy(head(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
    return head.eval()


def probe_correct(train_x, train_y, test_x, test_y, *, solver: str = "logreg", c: float | str = 1.0,
                  train_cfg: dict | None = None, seed: int = 0, device: str = "cpu") -> np.ndarray:
    """Per test example, whether a linear probe fit on (train_x, train_y) classifies it right: what
    the accuracy and its bootstrap interval (eval/stats.py) are computed from."""
    if solver == "logreg":
        pred = logreg_probe(train_x, train_y, c, seed, device).predict(test_x)
    else:
        num_classes = int(max(np.max(train_y), np.max(test_y))) + 1
        head = train_linear_head(train_x, train_y, num_classes, solver, seed=seed, device=device, **(train_cfg or {}))
        with torch.no_grad():
            pred = head(torch.as_tensor(test_x, dtype=torch.float32, device=device)).argmax(1).cpu().numpy()
    return np.asarray(pred) == np.asarray(test_y)


def features(encoder, images: np.ndarray | Images, cfg: dict, device: str = "cpu", what: str = "encoder") -> np.ndarray:
    """What a probe of the `evaluate` protocol `cfg` sees: the frozen encoder's pooled features, or
    the raw pixels when `encoder` is None (the simplest baseline). Refused where not finite."""
    if encoder is None:
        return pixel_features(images)
    x = extract_features(encoder, images, cfg["pool"], cfg["last_k_blocks"], device)
    check_finite(x, f"the features of {what}")
    return x


def linear_probe(x: np.ndarray, labels: np.ndarray, split, cfg: dict, seed: int, device: str = "cpu") -> np.ndarray:
    """Per probe-test example, whether the probe of protocol `cfg` fit on the probe-train part is right."""
    tr, te = split
    return probe_correct(x[tr], labels[tr], x[te], labels[te], solver=cfg["probe_solver"], c=cfg["probe_c"],
                         train_cfg=cfg["probe_train"], seed=seed, device=device)


def with_chosen_c(x: np.ndarray, labels: np.ndarray, tr: np.ndarray, cfg: dict, seed: int = 0,
                  device: str = "cpu") -> dict:
    """The protocol `cfg` with `auto`'s C chosen on the probe-train part `tr`, so that a probe and its
    refits (refit_correct) share one choice: it costs about ten fits (on 3,072 pixel features, two minutes)."""
    if cfg["probe_solver"] == "logreg" and cfg["probe_c"] == "auto":
        return {**cfg, "probe_c": chosen_c(x[tr], labels[tr], seed, device)}
    return cfg


def probe_outcomes(x: np.ndarray, labels: np.ndarray, split, cfg: dict, seed: int = 0,
                   device: str = "cpu") -> tuple[np.ndarray, np.ndarray | None]:
    """linear_probe's outcomes and, with cfg["probe_refits"], refit_correct's, with `auto`'s C chosen
    once on the probe-train part for both (choosing it inside each again gave the same C at the cost
    of another cross-validation)."""
    cfg = with_chosen_c(x, labels, split[0], cfg, seed, device)
    correct = linear_probe(x, labels, split, cfg, seed, device)
    fits = cfg["probe_refits"]
    return correct, (refit_correct(x, labels, split, cfg, fits, seed, device) if fits else None)


def refit_correct(x: np.ndarray, labels: np.ndarray, split, cfg: dict, fits: int, seed: int = 0,
                  device: str = "cpu") -> np.ndarray:
    """(fits, len(test part)): linear_probe's outcomes with the probe refit on `fits` bootstrap
    resamples of the probe-train part, what an interval needs to cover which images the probe was
    fit on (eval/stats.py). Resample r is drawn from r alone, so every encoder is refit on the same
    images and two encoders' refits pair."""
    tr, te = split
    # C is chosen once, on the probe-train part itself: cross-validating on a resample would put its
    # duplicated images on both sides of a fold and choose too weak a penalty.
    cfg = with_chosen_c(x, labels, tr, cfg, seed, device)
    if cfg["probe_solver"] == "logreg" and on_gpu(device) and fits:
        # On a GPU the refits are one batch of problems on probe-train's rows, each weighing them by
        # how often its resample drew them. A class a resample missed keeps its column there, pushed
        # down by the data and held by the penalty, where scikit-learn drops it: at 10 classes in
        # hundreds of images a resample misses one with odds below 1e-10.
        counts = np.stack([np.bincount(resample(tr, r), minlength=len(x))[tr] for r in range(fits)])
        probes = device_logreg.fit(x[tr], labels[tr], cfg["probe_c"], device, rows=counts)
        return probes.predict_all(x[te]) == labels[te]
    # scikit-learn's logistic fits are independent, single-threaded and on the CPU: one per core. The
    # torch solvers share one device, so they run in turn.
    parallel = cfg["probe_solver"] == "logreg" and len(tr) * math.prod(x.shape[1:]) >= PARALLEL_FIT_FLOATS
    jobs = fit_workers(fits) if parallel else 1
    out = Parallel(n_jobs=jobs)(delayed(_refit)(x, labels, tr, te, cfg, r, seed, device) for r in range(fits))
    return np.stack(out) if out else np.empty((0, len(te)), bool)


def resample(tr: np.ndarray, r: int) -> np.ndarray:
    """Bootstrap resample r of the probe-train part, drawn from r alone."""
    return np.random.default_rng([len(tr), r]).choice(tr, size=len(tr), replace=True)


def _refit(x, labels, tr, te, cfg, r: int, seed: int, device: str) -> np.ndarray:
    return linear_probe(x, labels, (resample(tr, r), te), cfg, seed, device)


def probe_accuracy(train_x, train_y, test_x, test_y, **kw) -> float:
    """Test accuracy of a linear probe fit on (train_x, train_y) (keywords: probe_correct's)."""
    return float(probe_correct(train_x, train_y, test_x, test_y, **kw).mean())


PIXEL_SIDE = 32  # the raw-pixel baseline's resolution: 3,072 features keep its probe a small fit


def pixel_features(images: np.ndarray | Images, side: int = PIXEL_SIDE, batch_size: int = 512) -> np.ndarray:
    """The simplest baseline's features: the raw pixels, area-downsampled to at most `side` px,
    normalised as the encoders' inputs are, flattened."""
    size = images.shape[1]
    out = np.empty((len(images), 3 * min(size, side) ** 2), np.float32)
    for i in range(0, len(images), batch_size):
        x = to_tensor(images[i:i + batch_size])
        if size > side:
            x = F.adaptive_avg_pool2d(x, side)
        out[i:i + batch_size] = x.flatten(1).numpy()
    return out
