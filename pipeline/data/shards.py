"""Webdataset shards: a deterministic tar writer that records where every member lands, and an
index-backed reader with O(1) random access by byte range (local file, http(s), s3, any fsspec URL).

A sample is a group of tar members sharing a key: `<key>.<image ext>` (png, jpg, ...), `<key>.txt`
(caption) and `<key>.json` (metadata such as the class label). `index.parquet` (see index.py) has
one row per sample.
"""

from __future__ import annotations

import io
import json
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import numpy as np
from PIL import Image

from pipeline.data.index import INDEX_NAME, IndexMismatch, content_hash, read_index, read_usable_table, write_index
from pipeline.data.index_mmap import USABLE_NAME, map_usable
from pipeline.data.remote import (MAX_CONCURRENCY, VERSION_TAGS, RangeReader, ShardReadError, fingerprint, is_local,
                                  local_path, retry)
from pipeline.data.transforms import decode_image
from pipeline.io import atomic_path
from pipeline.privacy import owner

__all__ = ["INDEX_NAME", "IndexMismatch", "ShardDataset", "ShardReadError", "ShardWriter", "TarShard", "encode_png",
           "write_shard"]

HEADER = tarfile.BLOCKSIZE


class TarShard:
    """One tar, written atomically at `path` (a reader never sees half of it) and byte-reproducibly
    (fixed mtime, owner and mode). `add` returns where the member's data starts."""

    def __init__(self, path: str | Path):
        self._ctx = atomic_path(path)
        self._tmp = self._ctx.__enter__()
        self._tar = tarfile.open(self._tmp, "w", format=tarfile.USTAR_FORMAT)

    def add(self, name: str, payload: bytes) -> int:
        info = tarfile.TarInfo(name)
        info.size = len(payload)
        info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
        self._tar.addfile(info, io.BytesIO(payload))
        # The member's data ends the archive so far, padded to whole 512-byte blocks.
        return self._tar.offset - -(-info.size // HEADER) * HEADER

    def close(self) -> int:
        """Finish the archive and move it into place; returns its size in bytes."""
        self._tar.close()
        size = self._tmp.stat().st_size
        self._ctx.__exit__(None, None, None)
        return size

    def abort(self, exc_type=None, exc=None, tb=None) -> None:
        self._tar.close()
        self._ctx.__exit__(exc_type or RuntimeError, exc, tb)


class ShardWriter:
    """Writes samples into `<prefix>-NNNNNN.tar` files of `samples_per_shard` samples each, and on
    close the index of all of them. The same samples give the same bytes."""

    def __init__(self, out_dir: str | Path, prefix: str = "shard", samples_per_shard: int = 1000):
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix, self.samples_per_shard = prefix, samples_per_shard
        self.rows: list[dict] = []
        self.shards: list[dict] = []
        self._keys: set[str] = set()
        self._shard: TarShard | None = None
        self._count_in_shard = 0

    def _open_next(self) -> None:
        self._close_current()
        name = f"{self.prefix}-{len(self.shards):06d}.tar"
        self._shard = TarShard(self.out_dir / name)
        self.shards.append({"url": name, "size": None})
        self._count_in_shard = 0

    def _close_current(self) -> None:
        if self._shard is not None:
            self.shards[-1]["size"] = self._shard.close()
            self._shard = None

    def write(self, key: str, image_png: bytes, caption: str, meta: dict, image_ext: str = "png") -> None:
        """Add one sample; `image_png` holds the encoded image (PNG unless `image_ext` says otherwise)."""
        if self._shard is None or self._count_in_shard >= self.samples_per_shard:
            self._open_next()
        self.rows.append({"shard": self.shards[-1]["url"], "shard_id": len(self.shards) - 1,
                          **add_sample(self._shard, self._keys, key, image_png, caption, meta, image_ext)})
        self._count_in_shard += 1

    def close(self) -> Path:
        self._close_current()
        return write_index(self.out_dir / INDEX_NAME, self.rows, self.shards)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        elif self._shard is not None:
            self._shard.abort(exc_type, exc, tb)
            self._shard = None


def add_sample(shard: TarShard, keys: set[str], key: str, image: bytes, caption: str, meta: dict,
               image_ext: str = "png") -> dict:
    """Write one sample's members into `shard`; its index row (less which shard it is in). `keys` holds
    the keys written so far, and gains this one."""
    if key in keys:
        raise ValueError(f"duplicate sample key {key!r}: each example must be written once")
    if "." in key.rsplit("/", 1)[-1]:
        raise ValueError(f"sample key {key!r} contains a dot, which webdataset reads as an extension")
    keys.add(key)
    row = {"key": key, "image_ext": image_ext, "caption_len": len(caption), "status": "ok",
           "content_hash": content_hash(image, caption.encode("utf-8"))}
    payloads = (("image", image_ext, image), ("txt", "txt", caption.encode("utf-8")),
                ("json", "json", json.dumps(meta, sort_keys=True).encode("utf-8")))
    for member, ext, payload in payloads:
        row[f"{member}_offset"] = shard.add(f"{key}.{ext}", payload)
        row[f"{member}_size"] = len(payload)
    return row


def write_shard(path: Path, shard_id: int, samples: Iterable[tuple[str, bytes, str, dict]]) -> tuple[list[dict], int]:
    """Shard `shard_id` of a set written on its own (by a worker, in any order): the (key, png, caption,
    meta) `samples` into the tar at `path`, atomically; its index rows and its size in bytes."""
    shard, keys, rows = TarShard(path), set(), []
    try:
        for key, image, caption, meta in samples:
            rows.append({"shard": path.name, "shard_id": shard_id, **add_sample(shard, keys, key, image, caption, meta)})
    except BaseException as e:
        shard.abort(type(e), e, e.__traceback__)
        raise
    return rows, shard.close()


def encode_png(image: np.ndarray, compress_level: int = 6) -> bytes:
    """Lossless, so the level moves only the bytes and the time. Fixed, so the bytes do not depend on
    pillow's default; a labelled set's level is part of its examples' content hashes (the budget's)."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=compress_level)
    return buf.getvalue()


def _check_header(block: bytes, name: str, size: int, where: str) -> None:
    """The tar header before a member's data must name that member: else the index is stale."""
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        # Long or non-ASCII names live in an extended header further back; the size still must match.
        name_ok = info.name == name or len(name.encode("utf-8")) > 100 or not name.isascii()
    except tarfile.HeaderError:
        info, name_ok = None, False
    if not name_ok or info.size != size:
        found = f"{info.name!r} of {info.size} bytes" if info else "no valid tar header"
        raise IndexMismatch(f"{where}: the index expects member {name!r} of {size} bytes there, the shard has "
                            f"{found}: the shards changed after the index was written; re-run the shards stage")


class ShardDataset:
    """Random access to the usable samples of one shard directory through its index.

    `ds[i]` is {"key", "image" (H, W, 3) uint8, "caption", "meta"}; each read fetches the sample's
    bytes by range (one read when its members are adjacent, as in every webdataset writer's output)
    and checks the tar headers around them against the index.
    """

    def __init__(self, directory: str | Path, check_versions: bool = False):
        self.directory = Path(directory)
        self._rows, self.shards, self.status_counts = read_index(self.directory)
        self._check_local_sizes()
        if check_versions:
            self.check_remote_versions()
        self._reader = RangeReader([s["url"] for s in self.shards])
        self._index_dict = None

    def _check_local_sizes(self) -> None:
        """Cheap and before any read: a local shard of another size is not the one indexed."""
        for s in self.shards:
            if not is_local(s["url"]) or s["size"] is None:
                continue  # remote shards are checked on every read, by their tar headers
            path = Path(local_path(s["url"]))
            if not path.exists():
                raise ShardReadError(f"{self.directory / INDEX_NAME} refers to {path}, which is missing: "
                                     "re-run the shards stage (or restore the shards)")
            if path.stat().st_size != s["size"]:  # a shard's size is a statistic of its examples: the owner's
                log = owner.note("shards", f"{path} is {path.stat().st_size} bytes but {self.directory / INDEX_NAME} "
                                           f"was built from {s['size']} bytes")
                raise IndexMismatch(f"{path} is not the shard {self.directory / INDEX_NAME} was built from (its size "
                                    f"differs: {log}): re-run the shards stage")

    def check_remote_versions(self) -> None:
        """Once before training: every remote shard whose store gave a version tag at the scan (an ETag,
        a generation) is asked for it again, concurrently. A shard rewritten in place with members of
        the same names and sizes passes every read's header check, and its examples would be neither
        the ones the scan decoded nor the ones the budget counts."""
        tagged = [s for s in self.shards if not is_local(s["url"]) and any(k in s for k in VERSION_TAGS)]
        if not tagged:
            return
        with ThreadPoolExecutor(min(MAX_CONCURRENCY, len(tagged))) as pool:
            now = list(pool.map(lambda s: retry(lambda: fingerprint(s["url"])), tagged))
        for s, current in zip(tagged, now):
            if current.get("size") != s["size"] or any(current.get(k) != s[k] for k in VERSION_TAGS if k in s):
                raise IndexMismatch(f"{s['url']} is not the shard {self.directory / INDEX_NAME} was built from (the "
                                    "store's version tag has changed since the scan): re-run the shards stage")

    @property
    def index(self) -> dict:
        """The usable rows as columns of Python lists (small sets; large ones use the arrays).

        Besides image_offset/image_size, each image format present gets `<ext>_offset`/`<ext>_size`
        (-1 on rows of another format), as indexes had when every image was a png.
        """
        if self._index_dict is None:
            d = read_usable_table(self.directory).to_pydict()
            for code, ext in enumerate(self._rows.exts):
                mine = self._rows.image_ext == code
                for field, values in (("offset", self._rows.offsets["image"]), ("size", self._rows.sizes["image"])):
                    d[f"{ext}_{field}"] = np.where(mine, values, -1).tolist()
            self._index_dict = d
        return self._index_dict

    def __len__(self) -> int:
        return len(self._rows.shard_id)

    def key(self, i: int) -> str:
        return self._rows.keys[i]

    def _member_name(self, i: int, member: str) -> str:
        ext = self._rows.exts[self._rows.image_ext[i]] if member == "image" else member
        return f"{self.key(i)}.{ext}"

    def read_member(self, i: int, ext: str) -> bytes:
        """Raw bytes of one member; `ext` is txt, json, or the image (any image extension, or "image")."""
        member = ext if ext in ("txt", "json") else "image"
        return self.read_sample(i, (member,))[member]

    def read_sample(self, i: int, members=("image", "txt", "json")) -> dict[str, bytes]:
        """Raw bytes of the sample's members present among `members`, in as few reads as possible."""
        return self.read_samples([i], members)[0]

    def read_samples(self, indices, members=("image", "txt", "json")) -> list[dict[str, bytes]]:
        """read_sample of each index, all read together: ranges close in a shard as one request, and
        the requests to remote shards concurrently (RangeReader.read_many)."""
        plans = [(int(i), self._reads(int(i), members)) for i in indices]
        requests = [(int(self._rows.shard_id[i]), start, end) for i, reads in plans for start, end, _ in reads]
        blobs = iter(self._reader.read_many(requests))
        return [self._members(i, [(next(blobs), start, spans) for start, _, spans in reads]) for i, reads in plans]

    def _reads(self, i: int, members) -> list[tuple[int, int, list]]:
        """The byte ranges (start, end, [(member, offset, size)]) that hold sample i's `members`, headers
        included: one when the members are adjacent, as in every webdataset writer's output."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} usable samples")
        offsets, sizes = self._rows.offsets, self._rows.sizes
        spans = [(m, int(offsets[m][i]), int(sizes[m][i])) for m in members if offsets[m][i] >= 0]
        if not spans:
            raise KeyError(f"sample {self.key(i)!r} has none of the members {members}")
        start = min(o for _, o, _ in spans) - HEADER
        end = max(o + s for _, o, s in spans)
        needed = sum(s + HEADER for _, _, s in spans)
        if end - start <= 2 * needed + 8 * HEADER:  # adjacent: one read serves all members
            return [(start, end, spans)]
        return [(o - HEADER, o + s, [(m, o, s)]) for m, o, s in spans]

    def _members(self, i: int, blobs: list[tuple[bytes, int, list]]) -> dict[str, bytes]:
        """Each member's data out of the (bytes, start, spans) read for it, after its tar header is checked."""
        url = self.shards[int(self._rows.shard_id[i])]["url"]
        out = {}
        for blob, start, spans in blobs:
            for m, o, s in spans:
                view = blob[o - HEADER - start:o + s - start]
                _check_header(view[:HEADER], self._member_name(i, m), s, f"{url} at byte {o - HEADER}")
                out[m] = view[HEADER:]
        return out

    def image(self, i: int, size: int | None = None) -> np.ndarray:
        """(H, W, 3) uint8; with `size`, centre-cropped and resized to (size, size)."""
        return decode_image(self.read_member(i, "image"), size)

    def caption(self, i: int) -> str:
        return self.read_member(i, "txt").decode("utf-8")

    def meta(self, i: int) -> dict:
        return json.loads(self.read_member(i, "json")) if self._rows.offsets["json"][i] >= 0 else {}

    def __getitem__(self, i: int) -> dict:
        raw = self.read_sample(i)
        return {"key": self.key(i), "image": decode_image(raw["image"]),
                "caption": raw["txt"].decode("utf-8") if "txt" in raw else "",
                "meta": json.loads(raw["json"]) if "json" in raw else {}}

    def load_images(self, size: int | None = None) -> np.ndarray:
        """All images as one (N, H, W, 3) uint8 array: for the small sets this stage handles in memory."""
        return np.stack([self.image(i, size) for i in range(len(self))])

    def close(self) -> None:
        self._reader.close()

    def __getstate__(self):  # worker processes reopen their own handles and map the index themselves
        state = self.__dict__.copy()
        state["_index_dict"] = state["_rows"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._rows = map_usable(self.directory / USABLE_NAME)[0]  # the same pages as every other process
