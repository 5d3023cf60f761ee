"""The `evaluate` stage: linear probes on frozen encoder features, the DP encoder beside its
baselines (random init, synthetic-only), on the held-out eval split."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from pipeline.data.shards import ShardDataset
from pipeline.data.transforms import to_tensor
from pipeline.io import write_json
from pipeline.modelcfg import model_config
from pipeline.models import build_encoder

SHARDS, PRETRAIN, DP_DIR, OUT = "data/shards", "models/pretrain", "models/dp", "results/eval/metrics.json"


@torch.no_grad()
def features(encoder, images: torch.Tensor, pool: str, device: str, batch_size: int = 256) -> np.ndarray:
    encoder.eval().to(device)
    return torch.cat([encoder.encode(images[i:i + batch_size].to(device), pool=pool).float().cpu()
                      for i in range(0, len(images), batch_size)]).numpy()


def linear_probe(train_x, train_y, test_x, test_y, c: float, seed: int) -> float:
    """Logistic regression on standardised features (the BatchNorm-without-affine of ViP's probe)."""
    probe = make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000, random_state=seed))
    probe.fit(train_x, train_y)
    return float(probe.score(test_x, test_y))


def load_encoder(path: str, mcfg: dict):
    encoder = build_encoder(mcfg)
    encoder.load_state_dict(torch.load(path, map_location="cpu", weights_only=False)["encoder"])
    return encoder


def run(params: dict, ctx) -> None:
    cfg, seed = params["evaluate"], params["run"]["seed"]
    ds = ShardDataset(f"{SHARDS}/eval")
    images = to_tensor(ds.load_images())
    labels = np.array([ds.meta(i)["label"] for i in range(len(ds))])
    tr, te = train_test_split(np.arange(len(ds)), train_size=cfg["probe_fraction"], stratify=labels,
                              random_state=seed)
    dp_ckpt = torch.load(f"{DP_DIR}/checkpoint.pt", map_location="cpu", weights_only=False)
    mcfg = dp_ckpt["model_cfg"]
    encoders = {"dp": load_encoder(f"{DP_DIR}/checkpoint.pt", mcfg)}
    if "synthetic" in cfg["baselines"]:
        encoders["synthetic"] = load_encoder(f"{PRETRAIN}/checkpoint.pt", mcfg)
    if "random" in cfg["baselines"]:
        torch.manual_seed(seed)
        encoders["random"] = build_encoder(mcfg)
    results = {}
    for name, encoder in encoders.items():
        x = features(encoder, images, cfg["pool"], ctx.device)
        results[name] = {"linear_probe_acc": linear_probe(x[tr], labels[tr], x[te], labels[te], cfg["probe_c"], seed)}
        print(f"evaluate: {name:<10} linear probe accuracy {results[name]['linear_probe_acc']:.3f}")
    metrics = {"eval_set": "digits-eval", "probe_train": int(len(tr)), "probe_test": int(len(te)),
               "classes": int(len(np.unique(labels))), "pool": cfg["pool"], "encoders": results}
    write_json(OUT, metrics)
    ctx.tracker.log_metrics({f"{k}_linear_probe_acc": v["linear_probe_acc"] for k, v in results.items()})
    ctx.tracker.log_artifact(OUT)
