"""Webdataset shards: a deterministic tar writer that records where every member lands, and an
index-backed reader with O(1) random access by byte range.

A sample is a group of tar members sharing a key: `<key>.png` (image), `<key>.txt` (caption),
`<key>.json` (metadata such as the class label). `index.parquet` has one row per sample.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from pipeline.io import atomic_path

MEMBER_EXTS = ("png", "txt", "json")
INDEX_NAME = "index.parquet"


class ShardWriter:
    """Writes samples into `<prefix>-NNNNNN.tar` files of `samples_per_shard` samples each.

    Tars are byte-reproducible (fixed mtime, owner and mode), so the same samples give the same bytes.
    """

    def __init__(self, out_dir: str | Path, prefix: str = "shard", samples_per_shard: int = 1000):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.samples_per_shard = samples_per_shard
        self.rows: list[dict] = []
        self._tar = None
        self._tmp_ctx = None
        self._count_in_shard = 0
        self._shard_id = -1

    def _open_next(self):
        self._close_current()
        self._shard_id += 1
        name = f"{self.prefix}-{self._shard_id:06d}.tar"
        self._tmp_ctx = atomic_path(self.out_dir / name)
        tmp = self._tmp_ctx.__enter__()
        self._shard_name = name
        self._tar = tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT)
        self._count_in_shard = 0

    def _close_current(self):
        if self._tar is not None:
            self._tar.close()
            self._tmp_ctx.__exit__(None, None, None)
            self._tar = None

    def write(self, key: str, image_png: bytes, caption: str, meta: dict) -> None:
        if self._tar is None or self._count_in_shard >= self.samples_per_shard:
            self._open_next()
        payloads = {"png": image_png, "txt": caption.encode("utf-8"),
                    "json": json.dumps(meta, sort_keys=True).encode("utf-8")}
        row = {"key": key, "shard": self._shard_name, "caption_len": len(caption), "status": "ok"}
        for ext in MEMBER_EXTS:
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(payloads[ext])
            info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
            self._tar.addfile(info, io.BytesIO(payloads[ext]))
            # The member's data ends the archive so far, padded to whole 512-byte blocks.
            padded = -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            row[f"{ext}_offset"], row[f"{ext}_size"] = self._tar.offset - padded, info.size
        self.rows.append(row)
        self._count_in_shard += 1

    def close(self) -> Path:
        self._close_current()
        index_path = self.out_dir / INDEX_NAME
        with atomic_path(index_path) as tmp:
            pq.write_table(pa.Table.from_pylist(self.rows), tmp)
        return index_path

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        elif self._tar is not None:
            self._tar.close()
            self._tmp_ctx.__exit__(exc_type, exc, tb)


def encode_png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    # compress_level fixed so the bytes do not depend on pillow defaults changing.
    Image.fromarray(image).save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


class ShardDataset:
    """Random access to the samples of one shard directory through its index."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index_path = self.directory / INDEX_NAME
        if not index_path.exists():
            raise FileNotFoundError(f"{index_path} is missing: run the stage that writes these shards")
        table = pq.read_table(index_path).to_pydict()
        keep = [i for i, s in enumerate(table["status"]) if s == "ok"]
        self.index = {k: [v[i] for i in keep] for k, v in table.items()}
        self._files: dict[str, object] = {}

    def __len__(self) -> int:
        return len(self.index["key"])

    def read_member(self, i: int, ext: str) -> bytes:
        shard = self.index["shard"][i]
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = open(self.directory / shard, "rb")
        f.seek(self.index[f"{ext}_offset"][i])
        return f.read(self.index[f"{ext}_size"][i])

    def image(self, i: int) -> np.ndarray:
        """(H, W, 3) uint8."""
        return np.asarray(Image.open(io.BytesIO(self.read_member(i, "png"))).convert("RGB"))

    def caption(self, i: int) -> str:
        return self.read_member(i, "txt").decode("utf-8")

    def meta(self, i: int) -> dict:
        return json.loads(self.read_member(i, "json"))

    def load_images(self) -> np.ndarray:
        """All images as one (N, H, W, 3) uint8 array: for the small sets this stage handles in memory."""
        return np.stack([self.image(i) for i in range(len(self))])

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()
