"""Small shard sets for the data tests: written by ShardWriter (`write_set`), or raw tars holding any
members at all (`raw_tar`, `good`), indexed the way the shards stage indexes them (`index`), and
img2dataset's output folders (`img2dataset_folder`)."""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.index import build_index
from pipeline.data.shards import ShardDataset, ShardWriter, encode_png
from pipeline.data.transforms import encode_jpeg

SIZE = 8


def picture(rng, size=SIZE) -> np.ndarray:
    return rng.integers(0, 256, (size, size, 3), dtype=np.uint8)


def write_set(directory, n=23, per_shard=5, prefix="s", seed=0) -> list[tuple]:
    rng = np.random.default_rng(seed)
    samples = [(f"{prefix}{i:04d}", encode_png(picture(rng)), f"caption number {i}", {"label": i % 3})
               for i in range(n)]
    with ShardWriter(directory, prefix=prefix, samples_per_shard=per_shard) as w:
        for s in samples:
            w.write(*s)
    return samples


def raw_tar(path, members) -> None:
    """A tar holding exactly `members` [(name, bytes)], whatever they are."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


def good(key, rng=None, caption="a photo", image: bytes | None = None):
    """One sample's members: `image` (encoded) or a random picture drawn from `rng`."""
    return [(f"{key}.jpg", encode_jpeg(picture(rng, 16)) if image is None else image), (f"{key}.txt", caption.encode()),
            (f"{key}.json", b"{}")]


def index(urls, tmp_path, name="out", workers=1, cache=None):
    """`cache`: the name of another build whose scan cache this one reads (default: its own)."""
    with contextlib.chdir(tmp_path):  # the owner's log of skipped and damaged shards: in the test's project
        stats = build_index([str(u) for u in urls], tmp_path / name, eval_fraction=1e-9, seed=0,
                            cache_dir=tmp_path / f"{cache or name}-cache", workers=workers, check_size=SIZE)
    ds = ShardDataset(tmp_path / name / "private")
    assert len(ds) == stats["private"]["usable"]  # the n accounting reads is what training reads
    return stats, ds


def excluded(stats) -> dict:
    out = {}
    for split in ("private", "eval"):
        for k, v in stats[split]["excluded"].items():
            out[k] = out.get(k, 0) + v
    return out


def img2dataset_folder(root: Path, rng, counts=(3, 2, 4), shape=(20, 30)) -> None:
    """What img2dataset writes with output_format=webdataset: tar, parquet and _stats.json per shard
    (`counts` samples each; the last shard is unfinished: no _stats.json)."""
    root.mkdir()
    for shard, n in enumerate(counts):
        name = f"{shard:05d}"
        with tarfile.open(root / f"{name}.tar", "w") as t:
            for i in range(n):
                key = f"{name}{i:04d}"
                for ext, data in (("jpg", encode_jpeg(rng.integers(0, 256, (*shape, 3), dtype=np.uint8))),
                                  ("txt", f"a photo {key}".encode()), ("json", json.dumps({"key": key}).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))
        pq.write_table(pa.table({"key": [f"{name}{i:04d}" for i in range(n)], "status": ["success"] * n}),
                       root / f"{name}.parquet")
        if shard != len(counts) - 1:  # the last was interrupted: img2dataset writes the stats last
            (root / f"{name}_stats.json").write_text(json.dumps(
                {"count": n + 1, "successes": n, "failed_to_download": 1, "failed_to_resize": 0}))
