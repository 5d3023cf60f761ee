"""The `synthetic` stage: Shaders21k-style procedural images into shards, a contact sheet and stats.

Each shard's images are a pure function of (seed, program, frame), rendered in worker processes and
written in order by this process, so the bytes do not depend on the worker count.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

import numpy as np
from tqdm import tqdm

from pipeline.data import synthetic
from pipeline.data.shards import ShardWriter, encode_png
from pipeline.io import atomic_dir, write_json

OUT_DIR = "data/synthetic"


def _render_chunk(args) -> np.ndarray:
    items, resolution, seed, mix_k, mix_alpha, mix_pool = args
    import torch

    torch.set_num_threads(1)  # one core per worker process
    return synthetic.render_items(items, resolution, base_seed=seed, mix_k=mix_k, mix_alpha=mix_alpha,
                                  mix_pool=mix_pool).numpy()


def run(params: dict, ctx) -> None:
    cfg, seed = params["synthetic"], params["run"]["seed"]
    items = [(p, f) for p in range(cfg["num_programs"]) for f in range(cfg["frames_per_program"])]
    chunk = cfg["samples_per_shard"]
    jobs = [(items[i:i + chunk], cfg["resolution"], seed, cfg["mix_k"], cfg["mix_alpha"], cfg["num_programs"])
            for i in range(0, len(items), chunk)]
    workers = cfg["workers"] or ctx.threads
    sample = []  # a small fixed-size sample of images for the quality figures and the contact sheet
    with atomic_dir(OUT_DIR) as out, ShardWriter(out, prefix="synthetic", samples_per_shard=chunk) as writer, \
            ProcessPoolExecutor(max_workers=workers) as pool, \
            tqdm(total=len(items), desc="synthetic", unit="img") as bar:
        for job, images in zip(jobs, pool.map(_render_chunk, jobs)):
            for (program, frame), image in zip(job[0], images):
                caption = synthetic.describe_program(program, seed)
                writer.write(f"p{program:06d}-f{frame:03d}", encode_png(image), caption,
                             {"program": program, "frame": frame})
            sample.extend(images[: max(1, 256 // len(jobs))])
            bar.update(len(job[0]))
        sample = np.stack(sample[:256])
        stats = {"images": len(items), "programs": cfg["num_programs"], "resolution": cfg["resolution"],
                 "near_constant_fraction": float(synthetic.near_constant_fraction(sample)),
                 "diversity": float(synthetic.diversity(sample))}
        rng = np.random.default_rng(seed)
        synthetic.contact_sheet(sample[rng.permutation(len(sample))[:64]], out / "contact_sheet.png")
        write_json(out / "stats.json", stats)
    ctx.tracker.log_metrics({k: stats[k] for k in ("images", "near_constant_fraction", "diversity")})
    ctx.tracker.log_artifact(f"{OUT_DIR}/contact_sheet.png")
    print(f"synthetic: {len(items)} images, near-constant {stats['near_constant_fraction']:.3f}, "
          f"diversity {stats['diversity']:.3f}")
