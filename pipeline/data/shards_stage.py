"""The `shards` stage: the private-train and held-out eval splits as webdataset shards.

The default source is scikit-learn's bundled handwritten digits (no download), captioned.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from pipeline.data.shards import ShardDataset, ShardWriter, encode_png
from pipeline.io import atomic_dir, write_json

OUT_DIR = "data/shards"
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
CAPTION_TEMPLATES = (
    "a handwritten digit {w}",
    "the number {w} written by hand",
    "a small scan of a handwritten {w}",
    "a blurry picture of the digit {w}",
    "the digit {w} in white ink on a black background",
)


def caption_for(label: int, rng: np.random.Generator) -> str:
    return CAPTION_TEMPLATES[rng.integers(len(CAPTION_TEMPLATES))].format(w=NUMBER_WORDS[label])


def load_digits_rgb(image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Digits as (N, S, S, 3) uint8 images and (N,) labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    small = (digits.images / 16.0 * 255.0).round().astype(np.uint8)
    images = np.stack([np.asarray(Image.fromarray(im).resize((image_size, image_size), Image.BILINEAR))
                       for im in small])
    return np.repeat(images[..., None], 3, axis=-1), digits.target.astype(int)


def split_indices(labels: np.ndarray, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split: each class contributes eval_fraction of its examples to the eval set."""
    rng = np.random.default_rng(seed)
    train, held = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(len(idx) * eval_fraction))
        held.extend(idx[:k])
        train.extend(idx[k:])
    return np.sort(np.array(train)), np.sort(np.array(held))


def run(params: dict, ctx) -> None:
    cfg, seed = params["shards"], params["run"]["seed"]
    images, labels = load_digits_rgb(cfg["image_size"])
    train_idx, eval_idx = split_indices(labels, cfg["eval_fraction"], seed)
    rng = np.random.default_rng(seed + 1)
    stats = {"source": cfg["source"]}
    with atomic_dir(OUT_DIR) as out:
        for split, idx in (("private", train_idx), ("eval", eval_idx)):
            with ShardWriter(out / split, prefix=split, samples_per_shard=cfg["samples_per_shard"]) as w:
                for i in idx:
                    label = int(labels[i])
                    w.write(f"{split}-{i:06d}", encode_png(images[i]), caption_for(label, rng),
                            {"label": label, "source_index": int(i)})
            ds = ShardDataset(out / split)
            # n for accounting = usable examples, counted from the index that training reads.
            stats[split] = {"usable": len(ds), "written": len(idx), "skipped": len(idx) - len(ds),
                            "shards": len(set(ds.index["shard"])), "classes": int(len(np.unique(labels[idx])))}
        write_json(out / "stats.json", stats)
    ctx.tracker.log_metrics({f"{s}_usable": stats[s]["usable"] for s in ("private", "eval")})
    print(f"shards: {stats['private']['usable']} private-train and {stats['eval']['usable']} eval samples in {OUT_DIR}/")
