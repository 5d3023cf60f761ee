"""The `synthetic` stage: Shaders21k-style procedural images into shards, a contact sheet and stats.

Shard i holds items [i·S, (i+1)·S) of the list (program, frame) in program-major order; its bytes are
a pure function of (seed, synthetic params, i). Workers render and write whole shards into a staging
directory under .dpfm/state/, each followed by a record of its size and sha256 (the manifest). A crashed
or killed run keeps its finished shards there and a re-run renders only the missing ones. The output
is then assembled in one atomic step, so it is byte-identical whatever the worker count and whether or
not the run was interrupted.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import PIL
import pyarrow as pa
import torch
from tqdm import tqdm

from pipeline import processes
from pipeline.data import shards as shard_format, splitmix, synthetic
from pipeline.data.index import INDEX_NAME, SCHEMA, index_writer
from pipeline.data.shards import ShardDataset, encode_png, write_shard
from pipeline.io import atomic_dir, file_digest, read_json, remove_stale_temps, write_json
from pipeline.train import state_dir

PREFIX = "synthetic"
MANIFEST = "manifest.json"   # every shard's size and sha256
STATS_SAMPLE = 1024          # images the quality figures are computed on (a seeded random sample)
SHEET_IMAGES = 64            # images on the contact sheet (the first of that sample)
NEAR_CONSTANT_TARGET = 0.01  # at most this fraction of flat, useless frames


def total_images(cfg: dict) -> int:
    return cfg["num_programs"] * cfg["frames_per_program"]


# zlib's fastest level: at 224 px, level 6 took longer than rendering (12.8 ms an image against 5.1);
# level 1 takes 4.5, 1.86x the images per core for 9% larger files (benchmarks/synthetic.py).
PNG_LEVEL = 1


def num_shards(cfg: dict) -> int:
    return math.ceil(total_images(cfg) / cfg["samples_per_shard"])


def shard_name(shard: int) -> str:
    return f"{PREFIX}-{shard:06d}.tar"


def shard_items(cfg: dict, shard: int) -> list[tuple[int, int]]:
    """The (program, frame) items of one shard."""
    start = shard * cfg["samples_per_shard"]
    stop = min(start + cfg["samples_per_shard"], total_images(cfg))
    return [divmod(g, cfg["frames_per_program"]) for g in range(start, stop)]


def generator_sources() -> list[Path]:
    """The code that decides a shard's bytes: every module of the synthetic package (sorted by name),
    the splitmix64 it draws from, the shard writer and this file."""
    package = sorted(Path(synthetic.__file__).parent.glob("*.py"))
    return package + [Path(splitmix.__file__), Path(shard_format.__file__), Path(__file__)]


def renderer_build() -> dict:
    """What else moves a pixel: torch's version and the CPU kernels it picked (AVX2 and plain kernels
    differ by a grey level on about one image in sixty), and the PNG encoder. A run resumed on another
    kind of node starts over rather than mix two machines' shards."""
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(), "pillow": PIL.__version__}


def staging_dir(cfg: dict, seed: int) -> Path:
    """Keyed by everything that decides the bytes (seed, params but the worker count, generator code,
    the renderer's build), so shards left by another config, generator or machine are never reused."""
    code = hashlib.sha256()
    for path in generator_sources():
        code.update(path.name.encode() + b"\0" + path.read_bytes())
    return state_dir("synthetic", {"seed": seed, "code": code.hexdigest(), "build": renderer_build(),
                                   "synthetic": {k: v for k, v in cfg.items() if k != "workers"}})


def build_shard(staging: Path, shard: int, cfg: dict, seed: int) -> dict:
    """Render one shard, write it (atomically), then record its size and sha256. The record is
    written last, so a shard counts as done only once its tar is whole."""
    items = shard_items(cfg, shard)
    images = synthetic.render_items(items, cfg["resolution"], base_seed=seed, mix_k=cfg["mix_k"],
                                    mix_alpha=cfg["mix_alpha"], mix_pool=cfg["num_programs"]).numpy()
    name = shard_name(shard)
    rows, size = write_shard(staging / name, shard, (
        (f"p{program:06d}-f{frame:03d}", encode_png(image, PNG_LEVEL), synthetic.describe_program(program, seed),
         {"program": program, "frame": frame}) for (program, frame), image in zip(items, images)))
    record = {"index": shard, "shard": name, "images": len(items), "size": size, "sha256": file_digest(staging / name)}
    write_json(staging / f"{name}.json", {**record, "rows": rows})
    return record  # the index rows stay on disk: at 1M images they would not fit comfortably in memory


def completed_shards(staging: Path, cfg: dict) -> dict[int, dict]:
    """Shards a previous run finished whose tar still matches its recorded size and sha256."""
    done = {}
    for shard in range(num_shards(cfg)):
        name = shard_name(shard)
        tar, rec = staging / name, staging / f"{name}.json"
        if not rec.exists():
            continue
        record = read_json(rec)
        if tar.exists() and tar.stat().st_size == record["size"] and file_digest(tar) == record["sha256"]:
            done[shard] = {k: v for k, v in record.items() if k != "rows"}
        else:
            print(f"synthetic: staged {name} does not match its record; rendering it again")
    return done


def build_shards(staging: Path, todo: list[int], cfg: dict, seed: int, workers: int):
    """Yield each shard's record as it completes (in any order)."""
    return processes.unordered(build_shard, [(staging, shard, cfg, seed) for shard in todo], workers)


def quality_sample(out: Path, n: int, seed: int) -> np.ndarray:
    """A seeded random sample of the written images: the same whatever the worker count."""
    picks = np.random.default_rng(seed).choice(n, size=min(n, STATS_SAMPLE), replace=False)
    ds = ShardDataset(out)
    try:
        return np.stack([ds.image(int(i)) for i in picks])
    finally:
        ds.close()


def assemble(out: Path, staging: Path, records: list[dict]) -> None:
    """Shards (hard links to the staged tars where the filesystem allows), index and manifest."""
    for record in records:
        src, dst = staging / record["shard"], out / record["shard"]
        try:
            os.link(src, dst)
        except OSError:  # another filesystem: copy
            shutil.copyfile(src, dst)
    with index_writer(out / INDEX_NAME, [{"url": r["shard"], "size": r["size"]} for r in records]) as write:
        for record in records:
            write(pa.Table.from_pylist(read_json(staging / f"{record['shard']}.json")["rows"], schema=SCHEMA))
    fields = ("shard", "images", "size", "sha256")
    write_json(out / MANIFEST, {"shards": [{k: r[k] for k in fields} for r in records]})


def remove_other_renders(kept: Path) -> None:
    """The shards a killed run left for another configuration (other params, seed, generator or machine):
    nothing resumes them once this one is done, and at ViP's scale each is ~70 GB. The stage's lock
    (one synthetic job per project) means no other render is in flight here."""
    for old in sorted(kept.parent.glob("synthetic-*")):
        if old != kept and old.is_dir():
            tars = len(list(old.glob("*.tar")))
            shutil.rmtree(old, ignore_errors=True)
            print(f"synthetic: removed {old}: {tars} shards another configuration's unfinished run left")


def run(params: dict, ctx) -> None:
    cfg, seed = params["synthetic"], params["run"]["seed"]
    n, shards = total_images(cfg), num_shards(cfg)
    staging = staging_dir(cfg, seed)
    staging.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(staging)  # shards a killed run was rendering
    done = completed_shards(staging, cfg)
    todo = [s for s in range(shards) if s not in done]
    workers = max(1, min(cfg["workers"] or ctx.threads, len(todo)))
    if done:
        print(f"synthetic: resuming, {len(done)} of {shards} shards already rendered in {staging}")
    start, rendered = time.time(), 0
    with tqdm(total=n, initial=sum(r["images"] for r in done.values()), desc="synthetic", unit="img") as bar:
        for record in build_shards(staging, todo, cfg, seed, workers):
            done[record["index"]] = record
            rendered += record["images"]
            bar.update(record["images"])
    images_per_s = rendered / max(time.time() - start, 1e-9)

    with atomic_dir(ctx.stage.output("synthetic")) as out:
        assemble(out, staging, [done[s] for s in range(shards)])
        sample = quality_sample(out, n, seed)
        synthetic.contact_sheet(sample[:SHEET_IMAGES], out / "contact_sheet.png")
        stats = {"images": n, "programs": cfg["num_programs"], "frames_per_program": cfg["frames_per_program"],
                 "resolution": cfg["resolution"], "shards": shards, "quality_sample": len(sample),
                 "near_constant_fraction": synthetic.near_constant_fraction(sample),
                 "near_constant_target": NEAR_CONSTANT_TARGET, "diversity": synthetic.diversity(sample)}
        write_json(out / "stats.json", stats)
    ctx.tracker.log_metrics({"images": n, "shards_resumed": shards - len(todo),
                             "near_constant_fraction": stats["near_constant_fraction"],
                             "diversity": stats["diversity"],
                             **({"images_per_s": images_per_s} if rendered else {})})
    ctx.tracker.log_artifact(str(ctx.stage.output("synthetic") / "contact_sheet.png"))
    ctx.tracker.log_artifact(str(ctx.stage.output("synthetic") / "stats.json"))
    if stats["near_constant_fraction"] > NEAR_CONSTANT_TARGET:
        print(f"synthetic: WARNING {stats['near_constant_fraction']:.3f} of sampled images are near-constant "
              f"(target ≤ {NEAR_CONSTANT_TARGET})")
    print(f"synthetic: {n} images in {shards} shards ({rendered} rendered now), near-constant "
          f"{stats['near_constant_fraction']:.3f}, diversity {stats['diversity']:.3f}")
    # Last (the output holds every shard): a failure before here fails the job, Snakemake deletes its
    # output, and the staged shards let the next run assemble it again without rendering any.
    shutil.rmtree(staging, ignore_errors=True)
    remove_other_renders(staging)
