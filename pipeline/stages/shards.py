"""The `shards` stage: the private-train and held-out eval splits as webdataset shards + indexes.

Sources (`shards.source`): a labelled set (pipeline/data/labelled_sets.py: `digits`, scikit-learn's
bundled handwritten digits, or `fashion-mnist`, unpacked by `make fashion-mnist`), subsampled to
`shards.limit` examples, captioned from its templates and written here; `urls`, webdataset shards
by URL or path (brace patterns; file, http(s), s3); `img2dataset`, an img2dataset output folder used
where it is; `download`, a (url, caption) table downloaded into shards under `shards.cache_dir`
(resumable). Shards from the last three are scanned once into `{private,eval}/index.parquet`, which
point at them where they live. For `urls` and `img2dataset`, Snakemake first runs `scan_group` in
shards.scan_groups jobs (`dpfm scan-shards`, rules/scan.smk), so this stage finds every shard's
scan in the cache and only merges them.

stats.json records per split the usable examples (the n that accounting uses, public); the rows
read and every excluded row by reason are statistics of the private data, kept owner-only
(`.dpfm/owner/shards.json`, privacy/owner.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline import processes
from pipeline.config import ParamsError
from pipeline.data import labelled_sets, sources
from pipeline.data.index import INDEX_NAME, build_index, scan_group, write_index
from pipeline.data.shards import encode_png, write_shard
from pipeline.io import atomic_dir, atomic_path, write_json
from pipeline.privacy import owner
from pipeline.progress import untimed_bar
from pipeline.stages import SCAN_GROUP_SOURCES, params_digest
from pipeline.tracking import input_tag

SPLITS = ("private", "eval")

def split_indices(labels: np.ndarray, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split: each class contributes eval_fraction of its examples to the eval set."""
    rng = np.random.default_rng(seed)
    train, held = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(len(idx) * eval_fraction))
        held.extend(idx[:k])
        train.extend(idx[k:])
    return np.sort(np.array(train, dtype=np.int64)), np.sort(np.array(held, dtype=np.int64))


# A writer process starts in about a second, the time some 2,500 samples take to write: each worker
# gets at least this many samples, so a small set (digits) is written in this process.
WORKER_SAMPLES = 4096


def write_labelled(cfg: dict, seed: int, out: Path, workers: int = 1) -> dict:
    """A labelled set as shards: `limit` examples (seeded, stratified), split by class, each captioned
    from the set's public templates; keys and `source_index` are positions in the whole set. The shards
    are written by up to `workers` processes, the same bytes whatever their number."""
    lset = labelled_sets.get(cfg["source"])
    grey, labels = lset.load(cfg["path"])
    keep = labelled_sets.subsample(labels, cfg["limit"], seed + 2)
    train_idx, eval_idx = (keep[part] for part in split_indices(labels[keep], cfg["eval_fraction"], seed))
    # A smaller private set with the same held-out split: how utility grows with n, on one eval set.
    train_idx = train_idx[labelled_sets.subsample(labels[train_idx], cfg.get("private_limit"), seed + 3)]
    if not len(eval_idx):
        raise ParamsError([f"shards.limit={cfg['limit']} leaves the {lset.name} eval split empty (eval_fraction "
                           f"{cfg['eval_fraction']} of each class rounds to 0): raise shards.limit"])
    per, jobs = cfg["samples_per_shard"], []
    # Each split's captions from a generator of its own (the eval split's drew after the private one's, so
    # they changed with shards.private_limit), drawn here in one order: none depends on which process
    # writes its shard.
    rngs = (np.random.default_rng(seed + 1), np.random.default_rng([seed + 1, 1]))
    for split, idx, rng in zip(SPLITS, (train_idx, eval_idx), rngs):
        (out / split).mkdir(parents=True, exist_ok=True)
        captions = [lset.caption_for(int(labels[i]), rng) for i in idx]
        for number, start in enumerate(range(0, len(idx), per)):
            part = idx[start:start + per]
            jobs.append((out / split, number, part, np.asarray(grey[part]), labels[part],
                         captions[start:start + per], cfg["image_size"]))
    total = len(train_idx) + len(eval_idx)
    workers = max(1, min(workers, len(jobs), total // WORKER_SAMPLES))
    written = {}
    # Counted in shards, not images: the counts drawn do not depend on which shard finished first.
    with untimed_bar(len(jobs), "shards", unit="shards") as bar:
        for directory, number, rows, shard in processes.unordered(write_labelled_shard, jobs, workers):
            written[directory.name, number] = rows, shard
            bar.update()
    stats = {}
    for split, idx in zip(SPLITS, (train_idx, eval_idx)):
        parts = [written[split, number] for number in range(-(-len(idx) // per))]
        write_index(out / split / INDEX_NAME, [row for rows, _ in parts for row in rows], [shard for _, shard in parts])
        stats[split] = {"usable": len(idx), "rows": len(idx), "excluded": {}, "shards": len(parts),
                        "classes": int(len(np.unique(labels[idx])))}
    return stats


def write_labelled_shard(directory: Path, number: int, indices: np.ndarray, grey: np.ndarray, labels: np.ndarray,
                         captions: list[str], image_size: int) -> tuple[Path, int, list[dict], dict]:
    """Shard `number` of a labelled split (the split is the directory's name): its index rows and its {url, size}."""
    split, name = directory.name, f"{directory.name}-{number:06d}.tar"
    samples = ((f"{split}-{i:06d}", encode_png(image), caption, {"label": int(label), "source_index": int(i)})
               for i, image, label, caption in zip(indices, labelled_sets.rgb(grey, image_size), labels, captions))
    rows, size = write_shard(directory / name, number, samples)
    return directory, number, rows, {"url": name, "size": size}


def resolve_source(cfg: dict, stats: bool = True) -> tuple[list[str], dict]:
    """The shard list of a web source, and (with `stats`) what the source itself reports."""
    source = cfg["source"]
    if source == "urls":
        return sources.expand_urls(cfg["urls"]), {}
    if not cfg["path"]:
        raise ParamsError([f"shards.source={source} needs shards.path "
                           f"({'the img2dataset output folder' if source == 'img2dataset' else 'a (url, caption) table'})"])
    if source == "img2dataset":
        return sources.img2dataset_shards(cfg["path"], stats)
    dl = cfg["download"]
    return sources.download(cfg["path"], Path(cfg["cache_dir"]) / "download", image_size=cfg["image_size"],
                            samples_per_shard=cfg["samples_per_shard"], url_column=dl["url_column"],
                            caption_column=dl["caption_column"], threads=dl["threads"],
                            timeout_s=dl["timeout_s"], retries=dl["retries"])


def eval_fraction(cfg: dict) -> float:
    """The held-out share: a labelled set (public data standing in for private) keeps a public held-out
    part; a web source trains on (and protects) everything unless a private-derived eval split is
    asked for explicitly."""
    fraction, source = cfg["eval_fraction"], cfg["source"]
    if source in labelled_sets.SETS:
        if fraction == 0:
            raise ParamsError([f"shards.eval_fraction=0 with source {source} leaves the {source} eval set empty: "
                               "use null (0.3) or a value in (0, 1)"])
        return 0.3 if fraction is None else fraction
    if fraction:
        print(f"shards: WARNING shards.eval_fraction={fraction} holds out private examples for evaluation: "
              "they are not trained on and NOT protected by the ε of this run")
    return fraction or 0.0


def scan_cache(cfg: dict) -> Path:
    return Path(cfg["cache_dir"]) / "scan"


def scan(params: dict, group: int, groups: int, threads: int) -> dict:
    """One scan job: resolve the shard list (the same in every job) and scan group `group` of it into the cache."""
    cfg = params["shards"]
    if cfg["source"] not in SCAN_GROUP_SOURCES:
        raise ParamsError([f"shards.source={cfg['source']} is not scanned in groups (only "
                           f"{', '.join(SCAN_GROUP_SOURCES)})"], source="scan-shards")
    urls, _ = resolve_source(cfg, stats=False)
    return scan_group(urls, group, groups, scan_cache(cfg), workers=cfg["workers"] or threads,
                      check_size=cfg["image_size"])


def check_row_counts(out: Path, stats: dict) -> None:
    """Each index holds the rows the stage counted: from the parquet footers, without reading a row."""
    for split in SPLITS:
        rows = pq.ParquetFile(out / split / INDEX_NAME).metadata.num_rows
        if rows != stats[split]["rows"]:  # the counts are the owner's; the message names no number
            owner.note("shards", f"{split} index holds {rows} rows, the stage counted {stats[split]['rows']}")
            raise RuntimeError(f"the {split} index does not hold the rows the stage counted ({owner.OWNER_DIR}/shards.log)")


def run(params: dict, ctx) -> None:
    cfg, seed = params["shards"], params["run"]["seed"]
    labelled = cfg["source"] in labelled_sets.SETS
    if cfg.get("private_limit") is not None and not labelled:
        raise ParamsError([f"shards.private_limit subsamples a labelled set's private split ({', '.join(labelled_sets.SETS)}); "
                           f"source {cfg['source']} trains on every usable example"])
    if cfg["limit"] is not None and not labelled:
        raise ParamsError([f"shards.limit subsamples a labelled set ({', '.join(labelled_sets.SETS)}); "
                           f"source {cfg['source']} uses every usable sample: set it to null"])
    fraction = eval_fraction(cfg)
    # A web source's eval split is private data: whatever is computed on it is released unprotected.
    stats = {"source": cfg["source"], "eval_fraction": fraction,
             "eval_from_private": not labelled and fraction > 0, "params_digest": params_digest(params, "shards")}
    out_dir = ctx.stage.output("shards")
    # The digest vouches for the shards beside it: gone before they are replaced, so a stage stopped
    # after the swap (run by hand; Snakemake and DVC delete outputs first) leaves none for the new ones.
    ctx.stage.output("shards_digest").unlink(missing_ok=True)
    with atomic_dir(out_dir) as out:
        if labelled:
            stats.update(write_labelled({**cfg, "eval_fraction": fraction}, seed, out, cfg["workers"] or ctx.threads))
        else:
            urls, source_stats = resolve_source(cfg)
            stats.update(source_stats)
            stats.update(build_index(urls, out, eval_fraction=fraction, seed=seed,
                                     cache_dir=scan_cache(cfg), workers=cfg["workers"] or ctx.threads,
                                     check_size=cfg["image_size"]))
        # n for accounting = the usable examples build_index (or write_labelled) counted as it
        # wrote the index; re-reading 233M rows to count them again would take ~24 GB.
        check_row_counts(out, stats)
        if stats["private"]["usable"] == 0:
            raise ValueError("no usable private examples: every sample was excluded (the reasons, for the data "
                             f"owner only, are in {owner.write('shards', stats)})")
        public, private = split_stats(stats)
        write_json(out / "stats.json", public)
    where = owner.write("shards", private)  # per-reason exclusions, download and scan details: owner-only
    # What DVC tracks of the shards (their keyed hash), written last: a stage stopped before it has no
    # digest, so neither Snakemake nor DVC takes the shards for done. The md5s it reads are recorded
    # for the stages that start on the shards next (tracking.input_tag).
    with atomic_path(ctx.stage.output("shards_digest")) as tmp:
        tmp.write_text(input_tag(str(out_dir)) + "\n")
    ctx.tracker.log_metrics({f"{s}_usable": stats[s]["usable"] for s in SPLITS})
    print(f"shards: {stats['private']['usable']} private-train and {stats['eval']['usable']} eval samples in {out_dir}/ "
          f"(what was excluded, and why, is kept for the data owner only: {where})")


PUBLIC_SPLIT_KEYS = ("usable", "shards", "classes")  # n is public (privacy.adjacency); the rest is of labelled sets


def split_stats(stats: dict) -> tuple[dict, dict]:
    """(published, owner-only) parts of the stage's statistics. Published: the source, the split,
    each split's usable count n and a digest of the (public) params the shards were built with. Everything else (rows read, exclusions by reason, what the download
    and the shard scan reported) is a statistic of the private data: owner-only (privacy/owner.py)."""
    public = {k: stats[k] for k in ("source", "eval_fraction", "eval_from_private", "params_digest")}
    for split in SPLITS:
        public[split] = {k: v for k, v in stats[split].items() if k in PUBLIC_SPLIT_KEYS}
    return public, stats
