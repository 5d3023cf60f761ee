"""Few-shot evaluation: K examples per class, several seeded random subsets, mean ± std.

* `fewshot_logreg` — logistic regression on frozen features (cheap; the default);
* `fewshot_finetune` — the whole encoder plus a linear head fine-tuned with AdamW on the K-shot
  subset (ViP's few-shot protocol; off by default because it trains a copy of the encoder per
  subset).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from joblib import Parallel, delayed

from pipeline.data.transforms import to_tensor
from pipeline.eval.probe import POOL_WIDTHS, fit_workers, logreg_probe, pool_tokens
from pipeline.train import lr_at


def kshot_subsets(labels: np.ndarray, k: int, repeats: int, seed: int) -> list[np.ndarray]:
    """`repeats` index sets with exactly k examples of every class, drawn without replacement.

    Subset r depends only on (seed, k, r), so adding repeats or shots keeps the earlier subsets.
    """
    labels = np.asarray(labels)
    classes, counts = np.unique(labels, return_counts=True)
    if counts.min() < k:
        short = classes[counts < k].tolist()
        raise ValueError(f"{k}-shot needs {k} examples of every class; classes {short} have only "
                         f"{counts.min()} in the probe-train split")
    by_class = [np.flatnonzero(labels == c) for c in classes]
    subsets = []
    for r in range(repeats):
        rng = np.random.default_rng([seed, k, r])
        subsets.append(np.sort(np.concatenate([rng.choice(idx, size=k, replace=False) for idx in by_class])))
    return subsets


def summarise(accs: list[float]) -> dict:
    """Mean and sample standard deviation over the subsets (None for one: a spread of one run is no
    spread, where "± 0.0" said there was none)."""
    std = float(np.std(accs, ddof=1)) if len(accs) > 1 else None
    return {"mean": float(np.mean(accs)), "std": std, "runs": [float(a) for a in accs]}


def fewshot_logreg(train_x, train_y, test_x, test_y, shots, repeats: int, c: float | str, seed: int) -> dict:
    """{k: {"mean", "std", "runs"}} of K-shot logistic-regression test accuracy. Under c="auto" each fit
    cross-validates its C (8 strengths × 3 folds: about half a second on the default run's features), so the
    fits go one per core: the evaluate stage of `make run` spent about 43 of its 78 s on them in turn."""
    tasks = [(k, s) for k in shots for s in kshot_subsets(train_y, k, repeats, seed)]
    jobs = fit_workers(len(tasks)) if c == "auto" else 1
    accs = Parallel(n_jobs=jobs)(delayed(_kshot_accuracy)(train_x[s], train_y[s], test_x, test_y, c, seed)
                                 for _, s in tasks)
    return {str(k): summarise([a for (shot, _), a in zip(tasks, accs) if shot == k]) for k in shots}


def _kshot_accuracy(train_x, train_y, test_x, test_y, c, seed: int) -> float:
    return logreg_probe(train_x, train_y, c, seed).score(test_x, test_y)


def finetune_accuracy(encoder, train_images, train_y, test_images, test_y, num_classes: int, *, pool: str,
                      epochs: int, batch_size: int, lr: float, weight_decay: float, seed: int = 0,
                      device: str = "cpu") -> float:
    """Fine-tune a copy of `encoder` + a linear head on the training images; test accuracy.

    Images are (N, H, W, 3) uint8 arrays or lazy `Images`: the (K-shot, small) training images are
    decoded once and held, as every epoch reads them; the test images are decoded batch by batch.
    """
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = copy.deepcopy(encoder).to(device).train()
    head = nn.Linear(POOL_WIDTHS[pool] * model.width, num_classes).to(device)
    with torch.no_grad():  # small, not zero: a zero head would give the encoder no gradient at first
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.01)
        head.bias.zero_()
    params = list(model.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    x, y = to_tensor(train_images[:]), torch.as_tensor(train_y, dtype=torch.long)  # [:] decodes lazy `Images`
    batch_size = min(batch_size, len(x))
    per_epoch = -(-len(x) // batch_size)
    total, step = epochs * per_epoch, 0
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g)
        for b in range(per_epoch):
            idx = order[b * batch_size:(b + 1) * batch_size]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, lr, max(1, total // 10), total)
            tokens, _, _ = model.forward_features(x[idx].to(device))
            loss = F.cross_entropy(head(pool_tokens(tokens, pool)), y[idx].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(test_images), 256):
            tokens, _, _ = model.forward_features(to_tensor(test_images[i:i + 256]).to(device))
            pred = head(pool_tokens(tokens, pool)).argmax(1).cpu().numpy()
            correct += int((pred == np.asarray(test_y[i:i + 256])).sum())
    return correct / len(test_images)


def fewshot_finetune(encoder, train_images, train_y, test_images, test_y, num_classes: int, shots, repeats: int,
                     cfg: dict, pool: str, seed: int, device: str = "cpu") -> dict:
    """{k: {"mean", "std", "runs"}} of K-shot full fine-tuning test accuracy; `train_images[s]` decodes
    just the K-shot subset s (a few images per class), `test_images` stays lazy."""
    out = {}
    for k in shots:
        accs = [finetune_accuracy(encoder, train_images[s], train_y[s], test_images, test_y, num_classes, pool=pool,
                                  epochs=cfg["epochs"], batch_size=cfg["batch_size"], lr=cfg["lr"],
                                  weight_decay=cfg["weight_decay"], seed=seed, device=device)
                for s in kshot_subsets(train_y, k, repeats, seed)]
        out[str(k)] = summarise(accs)
    return out
