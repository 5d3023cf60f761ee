"""Is the data loader ever the bottleneck of DP training? (pipeline/data/loader.py)

    python benchmarks/loader.py [--quick] [--workers N] [--size tiny] [--precision auto]

Writes a temporary shard set of photo-like JPEGs (320x256, like web images after img2dataset's
resize), then measures decoded, centre-cropped, normalised images/s of BatchLoader at 64 and 224 px
(Poisson-style random index batches, so every read is a random access by byte range), with
`--workers` decoding processes and with one process. Beside each, the images/s one DP-SGD step
consumes on the same machine: the MAE objective on a ViT of `--size` (patch 16) at that
resolution, per-sample clipping with BookKeepingClipper, noise, AdamW step (on CUDA when there is
one; under `--precision`'s autocast, bf16 there by default as in training), on one batch held on the
device, and the same steps fed by the loader from the shards ("fed by the loader": its share of the
step alone is the share of the time the step does not wait for data). Target: loader >= 3x the
consumption. Prints a table, then ONE JSON line of the figures.

Both sides use every core of this machine, one after the other; on a training node the DP step
runs on the accelerator while the loader has the CPU cores, so the ratio here is conservative
wherever an accelerator does the step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline.data.loader import BatchLoader  # noqa: E402
from pipeline.data.shards import ShardDataset, ShardWriter  # noqa: E402
from pipeline.data.transforms import encode_jpeg  # noqa: E402
from pipeline.models import build_model  # noqa: E402
from pipeline.privacy.engine import dp_step, make_clipper  # noqa: E402
from pipeline.privacy.plan import Plan  # noqa: E402
from pipeline.privacy.sampling import FixedBatch  # noqa: E402
from pipeline.train import autocast  # noqa: E402

TARGET_RATIO = 3.0


def photo_like(rng, h=256, w=320) -> np.ndarray:
    """Smooth colour fields plus texture: JPEG sizes (~20-40 kB) like web photos, unlike pure noise."""
    y, x = np.mgrid[0:h, 0:w] / np.array([h, w])[:, None, None]
    base = np.stack([np.sin(2 * np.pi * (rng.random() * 3 * x + rng.random() * 2 * y + rng.random()))
                     for _ in range(3)], -1)
    image = 127 + 80 * base + rng.normal(0, 18, (h, w, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def make_shards(directory: str, count: int) -> ShardDataset:
    rng = np.random.default_rng(0)
    palette = [encode_jpeg(photo_like(rng), quality=90) for _ in range(min(count, 64))]
    with ShardWriter(directory, prefix="bench", samples_per_shard=1000) as w:
        for i in range(count):
            w.write(f"img{i:07d}", palette[i % len(palette)], f"a photo of thing {i}", {}, image_ext="jpg")
    return ShardDataset(directory)


def loader_rate(ds: ShardDataset, res: int, workers: int, images: int, batch: int, device: str = "cpu") -> float:
    """Images/s through BatchLoader over random index batches (first batch excluded: worker start-up),
    onto `device` as in training: on a GPU the uint8 images are normalised there, not on the host."""
    rng = np.random.default_rng(res)
    batches = [np.sort(rng.choice(len(ds), batch, replace=False)) for _ in range(images // batch + 1)]
    it = BatchLoader(ds, res, workers=workers, prefetch=4, device=device)(batches)
    next(it)
    t0 = time.perf_counter()
    n = sum(len(idx) for idx, _ in it)
    if device == "cuda":
        torch.cuda.synchronize()  # the last copies and normalisations are asynchronous
    return n / (time.perf_counter() - t0)


def dp_stepper(res: int, size: str, device: str, precision: str):
    """One full DP-SGD step (clip, noise, AdamW) of the MAE at `res`, under training's autocast, as a
    function of a batch of images already on the device."""
    torch.manual_seed(0)
    model = build_model("mae", {"size": size, "img_size": res, "patch_size": 16}).to(device)
    clipper = make_clipper("per_sample", model, 1.0, "bookkeeping", autocast=lambda: autocast(device, precision))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plan = Plan.unaccounted("mae", "per_sample", sigma=1.0, clip_norm=1.0, n=1 << 20, steps=1 << 30)

    def step(x: torch.Tensor) -> None:
        rows = np.arange(len(x))
        noise = torch.rand(len(x), (res // 16) ** 2, device=device)  # the masks' noise, drawn where training draws it
        dp_step(0, sampler=FixedBatch(rows),
                fetch=lambda s, idx, pos: (x[pos], noise[pos]), clipper=clipper, plan=plan, key=0,
                physical_batch_size=len(x))
        opt.step()

    return step


def dp_step_rate(step, res: int, batch: int, steps: int, device: str) -> float:
    """Images/s consumed by DP-SGD steps on one batch held on the device: the step alone."""
    x = torch.randn(batch, 3, res, res, device=device)
    step(x)  # warm-up
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x)
    synchronize(device)
    return batch * steps / (time.perf_counter() - t0)


def streamed_rate(step, ds: ShardDataset, res: int, batch: int, steps: int, workers: int, device: str) -> float:
    """Images/s of the same steps fed by BatchLoader from the shards, decoding in `workers` processes
    while the device steps, as dp-train streams: against dp_step_rate, the share of the time the step
    is not waiting for data."""
    rng = np.random.default_rng(res + 1)
    batches = [np.sort(rng.choice(len(ds), batch, replace=False)) for _ in range(steps + 1)]
    it = BatchLoader(ds, res, workers=workers, prefetch=4, device=device)(batches)
    step(next(it)[1][0])  # warm-up: worker start-up and the first step
    synchronize(device)
    t0 = time.perf_counter()
    for _, (images,) in it:
        step(images)
    synchronize(device)
    return batch * steps / (time.perf_counter() - t0)


def keeps_up(rows: list[dict]) -> bool:
    """The target: at every resolution the loader decodes TARGET_RATIO times what the DP step consumes."""
    return all(r["ratio"] >= TARGET_RATIO for r in rows)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer images and steps (noisier)")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="decoding processes")
    ap.add_argument("--size", default="tiny", help="ViT size of the DP step (pipeline.models.VIT_SIZES)")
    ap.add_argument("--precision", default="auto", help="the DP step's, as dp.precision (auto: bf16 on a GPU)")
    args = ap.parse_args(argv)
    images = 600 if args.quick else 3000
    steps = 1 if args.quick else 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(os.cpu_count())

    rows, fig = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        ds = make_shards(tmp, 2000)
        for res in (64, 224):
            parallel = loader_rate(ds, res, args.workers, images, 128, device)
            single = loader_rate(ds, res, 0, images // 3, 128, device)
            dp_batch = (32 if res == 64 else 8) * (32 if device == "cuda" else 1)
            step = dp_stepper(res, args.size, device, args.precision)
            consumed = dp_step_rate(step, res, dp_batch, steps, device)
            streamed = streamed_rate(step, ds, res, dp_batch, 2 * steps, args.workers, device)
            ratio = parallel / consumed
            rows.append({"res": res, "parallel": parallel, "single": single, "consumed": consumed,
                         "streamed": streamed, "ratio": ratio})
            fig[f"loader_{res}"] = round(parallel, 1)
            fig[f"loader_{res}_one_process"] = round(single, 1)
            fig[f"dp_step_{res}"] = round(consumed, 2)
            fig[f"dp_step_streamed_{res}"] = round(streamed, 2)
            fig[f"ratio_{res}"] = round(ratio, 2)

    print(f"{'res':>5}{f'loader ({args.workers} proc) img/s':>26}{'loader (1 proc)':>17}"
          f"{f'DP step ({args.size}, {device}, {args.precision}) img/s':>36}{'fed by the loader':>19}{'ratio':>8}")
    for r in rows:
        fed = f"{r['streamed']:.2f} ({r['streamed'] / r['consumed']:.0%})"
        print(f"{r['res']:>5}{r['parallel']:>26.1f}{r['single']:>17.1f}{r['consumed']:>36.2f}"
              f"{fed:>19}{r['ratio']:>8.1f}")
    ok = keeps_up(rows)
    print(f"target: loader >= {TARGET_RATIO:.0f}x the DP step's consumption: {'met' if ok else 'MISSED'} "
          f"(timings on a shared machine are noisy)")
    result = {**fig, "target_ratio": TARGET_RATIO, "targets_met": ok, "workers": args.workers,
              "cpu_count": os.cpu_count(), "model_size": args.size, "device": device, "precision": args.precision,
              "quick": args.quick,
              "torch": torch.__version__}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
