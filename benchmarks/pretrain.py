"""Training throughput of the `pretrain` stage's MAE step (pipeline.stages.pretrain.mae_step).

    python benchmarks/pretrain.py [--quick] [--threads N]

Cases on CPU (one thread unless --threads: the per-core figure, steadier on a shared machine) and,
where torch.cuda.is_available(), on the GPU (batch 256 at 32 px, 64 at 224 px, bf16 autocast):
  default-32   the params.yaml model (size cpu, 32 px, patch 4), batch 64, fp32 (and bf16 autocast)
  default-32 + shards   the same, with batches decoded from synthetic shards by the stage's loader
  vit-tiny-32  model.size tiny (ViT-S's shape: width 384, 6 heads) MAE at 32 px, patch 4, batch 64
  vit-b-224    ViT-B/16 MAE at 224 px (ViP's encoder), one step of a small batch on CPU
Ratios side by side: the stage's data path against preloaded tensors (1.0 = free loading) and
bf16 autocast against fp32. Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline.config import load_params  # noqa: E402
from pipeline.data import synthetic  # noqa: E402
from pipeline.data.loader import BatchLoader  # noqa: E402
from pipeline.data.shards import ShardDataset, ShardWriter, encode_png  # noqa: E402
from pipeline.models import ModelConfig  # noqa: E402
from pipeline.models import build_model  # noqa: E402
from pipeline.stages.pretrain import mae_step  # noqa: E402
from pipeline.train import make_optimizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_model_cfg() -> dict:
    return ModelConfig.from_params(load_params(os.path.join(ROOT, "params.yaml"),
                                               schema_path=os.path.join(ROOT, "schemas/params.schema.yaml"))["model"],
                                   "mae").to_dict()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(cfg: dict, batch: int, steps: int, device: str, precision: str, batches=None) -> float:
    """Seconds per training step after one warm-up step; `batches` yields image tensors (else random)."""
    torch.manual_seed(0)
    model = build_model("mae", cfg).to(device)
    optimizer = make_optimizer(model, "adamw", 1e-4, 0.05)
    patches = (cfg["img_size"] // cfg["patch_size"]) ** 2
    fixed = torch.randn(batch, 3, cfg["img_size"], cfg["img_size"])
    next_images = (lambda: next(batches)) if batches is not None else (lambda: fixed)
    mae_step(model, optimizer, next_images(), torch.rand(batch, patches), device, precision, 1.0)  # warm-up
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        mae_step(model, optimizer, next_images(), torch.rand(batch, patches), device, precision, 1.0)
    sync(device)
    return (time.perf_counter() - start) / steps


def synthetic_shards(directory: str, images: int, resolution: int) -> ShardDataset:
    items = [(p, f) for p in range(images // 4) for f in range(4)]
    pixels = synthetic.render_items(items, resolution, base_seed=0).numpy()
    with ShardWriter(directory, prefix="synthetic", samples_per_shard=256) as writer:
        for (p, f), image in zip(items, pixels):
            writer.write(f"p{p:06d}-f{f:03d}", encode_png(image), "", {})
    return ShardDataset(directory)


def loader_batches(ds: ShardDataset, size: int, batch: int, workers: int):
    rng = np.random.default_rng(0)
    order = (rng.integers(0, len(ds), batch) for _ in itertools.count())
    return (images for _, (images,) in BatchLoader(ds, size, workers=workers)(order))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (noisier figures)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default: 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = 3 if args.quick else 8
    default = default_model_cfg()
    tiny = {**default, "size": "tiny"}
    vit_b = {"size": "base", "img_size": 224, "patch_size": 16}  # paper defaults for the decoder
    rows, fig = [], {}

    def case(name, device, cfg, batch, n_steps, precision="fp32", batches=None):
        secs = time_steps(cfg, batch, n_steps, device, precision, batches)
        fig[f"{device}_{name}_img_s"] = round(batch / secs, 1)
        rows.append((device, name, precision, batch, secs, batch / secs))
        return batch / secs

    with tempfile.TemporaryDirectory() as tmp:
        ds = synthetic_shards(tmp, 512, default["img_size"])
        plain = case("default_32", "cpu", default, 64, steps)
        shards = case("default_32_shards", "cpu", default, 64, steps,
                      batches=loader_batches(ds, default["img_size"], 64, workers=0))
        bf16 = case("default_32_bf16", "cpu", default, 64, steps, precision="bf16")
        case("vit_tiny_32", "cpu", tiny, 64, 2 if args.quick else 4)
        case("vit_b_224", "cpu", vit_b, 8, 1)
        fig["cpu_vit_b_224_step_s"] = round(rows[-1][4], 2)
        if torch.cuda.is_available():
            gpu = case("default_32", "cuda", default, 256, steps * 3)
            case("default_32_bf16", "cuda", default, 256, steps * 3, precision="bf16")
            case("default_32_shards", "cuda", default, 256, steps * 3,
                 batches=loader_batches(ds, default["img_size"], 256, workers=min(8, os.cpu_count() or 1)))
            case("vit_tiny_32", "cuda", tiny, 256, steps * 3, precision="bf16")
            case("vit_b_224", "cuda", vit_b, 64, steps, precision="bf16")
            fig["cuda_shards_ratio"] = round(fig["cuda_default_32_shards_img_s"] / gpu, 2)
        ds.close()

    print(f"{'device':<7}{'case':<20}{'precision':>10}{'batch':>7}{'s/step':>9}{'images/s':>10}")
    for device, name, precision, batch, secs, ips in rows:
        print(f"{device:<7}{name:<20}{precision:>10}{batch:>7}{secs:>9.3f}{ips:>10.1f}")
    print("(shared machines give noisy figures: repeat the run and compare)")
    result = {**fig, "cpu_shards_ratio": round(shards / plain, 2), "cpu_bf16_ratio": round(bf16 / plain, 2),
              "threads": torch.get_num_threads(), "steps": steps, "quick": args.quick,
              "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "torch": torch.__version__}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
