"""The logreg probe's problem solved with torch, many at once, for a GPU.

The same problem as probe.logreg_estimator's: features standardised on the fit's rows, then
multinomial logistic regression (one weight vector for two classes) with an unpenalised intercept,
minimising mean cross-entropy + ‖W‖² / (2·C·n) as scikit-learn does, stopped by scikit-learn's rule
(the largest gradient entry ≤ 1e-4, or no relative progress). The problem is strictly convex, so
both find one optimum up to that rule (tests/test_device_logreg.py).

Why: scikit-learn fits one problem per CPU core, and at 224 px (9,216 ViT-S features, 5,000
probe-train images) choosing C and the refits took minutes of a GPU lease per row. Here every
problem of a step is one of a batch on the same features: the 3 folds × 8 candidate C of `auto`,
or the 20 bootstrap refits, which differ only in how much each row weighs (0/1 for a fold, counts
for a resample), in C and in their standardisation. Their logits are one product of the features
with every problem's weights, so a GPU takes them in few, wide kernels, and one L-BFGS (a step per
problem, backtracking to Armijo's condition on each) moves them all.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_ITER = 3000  # scikit-learn's probe allows as many
TOL = 1e-4  # on the largest gradient entry, as scikit-learn's L-BFGS-B (gtol)
PREDICT_ROWS = 4096  # test rows scored at once
STANDARDISE_ELEMENTS = 1 << 24  # deviations `standardisers` holds at once (128 MiB): flat in rows and problems
FTOL = 64 * np.finfo(np.float64).eps  # relative decrease below which a problem has stopped moving (its ftol)
HISTORY = 10  # curvature pairs kept, as scikit-learn's (maxcor)
MAX_HALVINGS = 40


class DeviceLogreg:
    """Fitted probes, a batch of them: standardisation, weights, the class labels they score and each
    one's C; with C chosen, `scores_`: the held-out accuracy of each fold (rows) and candidate C
    (columns), as scikit-learn's LogisticRegressionCV keeps them."""

    def __init__(self, mean, scale, weights, classes: np.ndarray, cs, scores: np.ndarray | None = None):
        self.mean, self.scale, self.weights, self.classes = mean, scale, weights, classes
        self.cs, self.C_, self.scores_ = list(cs), float(cs[0]), scores

    def logits(self, x) -> torch.Tensor:
        """(problems, rows, classes) logits of every probe on the rows of x."""
        x = torch.as_tensor(np.asarray(x), dtype=torch.float64, device=self.weights.device)
        return class_logits(self.weights, x, self.mean, self.scale)

    def predict_all(self, x, chunk: int = PREDICT_ROWS) -> np.ndarray:
        """(problems, rows): each probe's class for each row of x, `chunk` rows at a time: the rows in
        float64 and every refit's logits for them stay bounded, however large the test part."""
        x = np.asarray(x)
        return np.concatenate([self.classes[self.logits(x[i:i + chunk]).argmax(2).cpu().numpy()]
                               for i in range(0, max(len(x), 1), chunk)], axis=1)

    def predict(self, x) -> np.ndarray:
        return self.predict_all(x)[0]


def class_logits(theta: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(b, n, k) logits of b problems' (b, d + 1, k') weights, intercept last, on raw rows x (n, d),
    each problem standardising with its own (b, d) mean and scale. Standardisation is folded into the
    weights, so all b products are one (n, d) × (d, b·k') product. k' = 1 is the binary model (class 0
    at 0)."""
    b, _, k = theta.shape
    v = theta[:, :-1] / scale[:, :, None]
    z = (x @ v.permute(1, 0, 2).reshape(x.shape[1], b * k)).reshape(len(x), b, k).transpose(0, 1)
    z = z + (theta[:, -1] - torch.einsum("bd,bdk->bk", mean, v))[:, None]
    return torch.cat([torch.zeros_like(z), z], 2) if k == 1 else z


def standardisers(x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """StandardScaler's mean and scale of each problem's rows (weights `rows`, (b, n)): population
    variance, and scale 1 where a feature is as good as constant (within the two-pass variance's
    rounding bound, as scikit-learn tests it)."""
    n = rows.sum(1, keepdim=True)
    mean = rows @ x / n
    # Two passes, each problem's deviations from its own mean (a block of problems at a time): a one-pass
    # variance leaves rounding of the order of eps·(x - shift)², which scaled a feature constant on a
    # resample's rows (a pixel blank on them, set on a row left out) by 1e-11 where scikit-learn keeps 1.
    var = torch.zeros_like(mean)
    chunk = max(1, STANDARDISE_ELEMENTS // x.shape[1])  # rows at a time
    block = max(1, STANDARDISE_ELEMENTS // (min(chunk, len(x)) * x.shape[1]))  # problems at a time
    for lo in range(0, len(x), chunk):
        for p in range(0, len(rows), block):
            deviations = (x[lo:lo + chunk] - mean[p:p + block, None]).square()
            var[p:p + block] += torch.einsum("bn,bnd->bd", rows[p:p + block, lo:lo + chunk], deviations)
    var /= n
    eps = torch.finfo(torch.float64).eps
    constant = var <= n * eps * var + (n * mean * eps) ** 2
    return mean, torch.where(constant, torch.ones_like(var), var.sqrt())


def solve(x: torch.Tensor, y: torch.Tensor, classes: int, rows: torch.Tensor, cs: torch.Tensor, mean, scale,
          tol: float = TOL, max_iter: int = MAX_ITER) -> torch.Tensor:
    """(b, d + 1, k') weights: problem j minimises, over the rows weighted by rows[j], the weighted
    mean cross-entropy + ‖W‖² / (2·cs[j]·n_j), n_j = rows[j].sum(), on features standardised by
    (mean[j], scale[j]). Batched L-BFGS: each problem has its own curvature pairs and step, found by
    halving from 1 until Armijo's condition holds; a problem stops when its largest gradient entry is
    ≤ tol, it stops moving, or its step finds no decrease."""
    b, k = len(rows), 1 if classes == 2 else classes
    n = rows.sum(1)
    onehot = torch.nn.functional.one_hot(y, classes).to(torch.float64)

    def value_and_grad(theta):
        theta = theta.detach().requires_grad_(True)
        z = class_logits(theta, x, mean, scale)
        nll = torch.logsumexp(z, 2) - (z * onehot).sum(2)  # (b, n)
        f = (rows * nll).sum(1) / n + theta[:, :-1].square().sum((1, 2)) / (2 * cs * n)
        (g,) = torch.autograd.grad(f.sum(), theta)  # the problems are separate: each gets its own gradient
        return f.detach(), g.reshape(b, -1)

    theta = torch.zeros(b, x.shape[1] + 1, k, dtype=torch.float64, device=x.device)
    f, g = value_and_grad(theta)
    active = g.abs().amax(1) > tol
    pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    gamma = 1 / g.norm(dim=1).clamp_min(1.0)  # the first step: along -g, at most unit length
    for _ in range(max_iter):
        if not active.any():
            break
        q = g.clone()
        alphas = []
        for s, yv, rho in reversed(pairs):
            a = rho * (s * q).sum(1)
            q -= a[:, None] * yv
            alphas.append(a)
        d = gamma[:, None] * q
        for (s, yv, rho), a in zip(pairs, reversed(alphas)):
            d += (a - rho * (yv * d).sum(1))[:, None] * s
        d = -d
        slope = (g * d).sum(1)
        lost = slope >= 0  # rounding turned the direction uphill: that problem starts its history again
        if lost.any():
            d = torch.where(lost[:, None], -gamma[:, None] * g, d)
            slope = (g * d).sum(1)
            pairs = [(s.where(~lost[:, None], 0), yv.where(~lost[:, None], 0), rho.where(~lost, 0))
                     for s, yv, rho in pairs]
        t = torch.ones(b, dtype=torch.float64, device=x.device)
        todo = active.clone()
        flat = theta.reshape(b, -1)
        for _ in range(MAX_HALVINGS):
            f_new, g_new = value_and_grad((flat + t[:, None] * d).reshape(theta.shape))
            todo = todo & ~(f_new <= f + 1e-4 * t * slope)
            if not todo.any():
                break
            t = torch.where(todo, t / 2, t)
        moved = active & ~todo  # a problem whose halvings ran out keeps its last point and stops
        s, yv = t[:, None] * d, g_new - g
        sy = (s * yv).sum(1)
        keep = moved & (sy > 1e-10 * yv.square().sum(1).sqrt() * s.square().sum(1).sqrt())
        pairs.append((torch.where(keep[:, None], s, 0), torch.where(keep[:, None], yv, 0),
                      torch.where(keep, 1 / sy.where(keep, 1.0), 0)))
        pairs = pairs[-HISTORY:]
        gamma = torch.where(keep, sy / yv.square().sum(1).where(keep, 1.0), gamma)
        still = (f - f_new) > FTOL * torch.maximum(torch.maximum(f.abs(), f_new.abs()), torch.ones_like(f))
        theta = torch.where(moved[:, None], flat + s, flat).reshape(theta.shape)
        f, g = torch.where(moved, f_new, f), torch.where(moved[:, None], g_new, g)
        active = moved & still & (g.abs().amax(1) > tol)
    return theta


def choose_c(train_x, train_y, device: str, folds, cs, tol: float = TOL) -> tuple[float, np.ndarray]:
    """auto's C: the candidate in `cs` whose summed held-out accuracy over `folds` ((fit, held-out)
    index pairs) is highest (the first of ties), as LogisticRegressionCV chooses; and the accuracies
    (folds, candidates). Every fold and candidate is one problem of a batch on the features
    standardised once, on all the rows, as scikit-learn's pipeline does."""
    classes, x, y = problem(train_x, train_y, device)
    mean, scale = (s.expand(len(folds) * len(cs), -1) for s in standardisers(x, every_row(x)))
    fold_rows = torch.zeros(len(folds), len(cs), len(x), dtype=torch.float64, device=device)
    for f, (tr, _) in enumerate(folds):
        fold_rows[f, :, torch.as_tensor(tr, device=device)] = 1
    cand = torch.tensor(cs, dtype=torch.float64, device=device).repeat(len(folds))
    theta = solve(x, y, len(classes), fold_rows.reshape(-1, len(x)), cand, mean, scale, tol)
    z = class_logits(theta, x, mean, scale).reshape(len(folds), len(cs), len(x), -1)
    scores = np.array([[(z[f, i, held].argmax(1) == y[held]).double().mean().item() for i in range(len(cs))]
                       for f, held in enumerate(torch.as_tensor(h, device=device) for _, h in folds)])
    return float(cs[int(np.argmax(scores.sum(0)))]), scores


def fit(train_x, train_y, c: float | None, device: str, folds=(), cs=(), rows=None,
        tol: float = TOL) -> DeviceLogreg:
    """The probe at inverse strength `c` on (train_x, train_y), or at choose_c's choice among `cs`
    with `folds`. With `rows` ((b, n) weights: a resample's counts), b probes at `c`, each
    standardised on its own rows."""
    scores = None
    if folds:
        c, scores = choose_c(train_x, train_y, device, folds, cs, tol)
    classes, x, y = problem(train_x, train_y, device)
    rows = every_row(x) if rows is None else torch.as_tensor(np.asarray(rows), dtype=torch.float64, device=device)
    mean, scale = standardisers(x, rows)
    cand = torch.full((len(rows),), float(c), dtype=torch.float64, device=device)
    theta = solve(x, y, len(classes), rows, cand, mean, scale, tol)
    return DeviceLogreg(mean, scale, theta, classes, cand.tolist(), scores)


def problem(train_x, train_y, device: str) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """The class labels, and the rows (float64) and their class indices on `device`."""
    classes, y = np.unique(np.asarray(train_y), return_inverse=True)
    x = torch.as_tensor(np.asarray(train_x), dtype=torch.float64, device=device)
    return classes, x, torch.as_tensor(y, device=device)


def every_row(x: torch.Tensor) -> torch.Tensor:
    return torch.ones(1, len(x), dtype=torch.float64, device=x.device)
