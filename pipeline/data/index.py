"""The random-access sample index (`index.parquet`) and the scan that builds it from tar shards.

One row per sample: its key, shard, the byte offset and size of each member's data (image, txt,
json; -1 when absent), the caption length and a status. Only `ok` rows are usable; every other
status is a reason the sample was excluded, counted in stats.json, so the n that accounting uses
is exactly the number of examples training can read.

The parquet metadata lists the shards with their sizes, so a reader can tell that the index no
longer matches its shards before it reads a wrong byte. Beside it, `usable.idx` holds the usable
rows in the memory-mapped form training reads (index_mmap.py); every index written here gets one.
"""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
import tempfile
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.config import ParamsError
from pipeline.data import remote
from pipeline.data.dedup import duplicate_rows
from pipeline.data.index_mmap import (MEMBERS, USABLE_NAME, UsableRows, build_lock, derived_from, map_usable,
                                      source_id, usable_writer)
from pipeline.data.splitmix import GOLDEN, MASK64, mix64_np
from pipeline.data.transforms import decode_image
from pipeline.errors import InputError
from pipeline.io import atomic_path
from pipeline.privacy import owner
from pipeline.progress import ShareBar

INDEX_NAME = "index.parquet"
META_KEY = b"dpfm.index"
VERSION = 2
SCAN_VERSION = 3  # bump when the scan's verdicts or columns change, so cached scans are redone
IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "ppm", "tif", "tiff", "gif"})
STATUSES = ("ok", "truncated", "missing_image", "corrupt_image", "missing_caption", "bad_caption",
            "duplicate_key", "duplicate_content")

SCHEMA = pa.schema([
    ("key", pa.string()), ("shard", pa.string()), ("shard_id", pa.int32()), ("image_ext", pa.string()),
    ("image_offset", pa.int64()), ("image_size", pa.int64()), ("txt_offset", pa.int64()), ("txt_size", pa.int64()),
    ("json_offset", pa.int64()), ("json_size", pa.int64()), ("caption_len", pa.int32()), ("status", pa.string()),
    ("content_hash", pa.uint64()),  # the example's identity for the privacy budget (privacy/budget.py)
])
# The scan's own columns, for finding duplicates: the key's digest and the image's alone.
SCAN_SCHEMA = SCHEMA.append(pa.field("key_hash", pa.uint64())).append(pa.field("image_hash", pa.uint64()))

# webdataset's rule: the key is the path up to the first dot of the file name, the rest is the extension.
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


class IndexMismatch(InputError, ValueError):
    """index.parquet does not describe the shards it points at."""


def split_member_name(name: str) -> tuple[str, str] | None:
    # A name not in UTF-8 (tar's surrogate escapes) keeps its odd bytes as \xNN: arrow refuses surrogates.
    m = _KEY_EXT.match(name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"))
    return (m.group(1), m.group(2).lower()) if m else None


def key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).digest(), "little")


def content_hash(image: bytes, caption: bytes) -> int:
    """An example's identity, whatever its key, shard or position: a digest of its image and caption
    bytes. The same examples re-sharded, rescanned or reordered keep theirs (privacy/budget.py)."""
    h = hashlib.blake2b(digest_size=8)
    for part in (len(image).to_bytes(8, "little"), image, caption):
        h.update(part)
    return int.from_bytes(h.digest(), "little")


# -- writing ---------------------------------------------------------------------------------------

# A reader decodes a whole row group of the columns it reads: small groups keep every pass over
# the index (the budget's content digests, the scan's statistics) flat in memory, whatever n.
ROW_GROUP_ROWS = 1 << 16


def open_index(path: str | Path) -> pq.ParquetFile:
    """An index for one streamed pass, a row group at a time. Without pre_buffer=False, pyarrow keeps
    every column chunk it has read until the file is closed: 10 bytes per row, 2 GB at 233M rows."""
    return pq.ParquetFile(path, pre_buffer=False)


@contextmanager
def index_writer(path: str | Path, shards: list[dict]):
    """Stream tables into an index file written atomically, then derive its usable.idx from it;
    `shards` is [{"url", "size"} and the store's version tags, if any] by shard_id."""
    schema = SCHEMA.with_metadata({META_KEY: json.dumps({"version": VERSION, "shards": shards})})
    pending = []  # tables gathered into row groups of ROW_GROUP_ROWS: a row group per write (a shard, and an empty
    # one for each shard that gives the eval split none) kept 25k groups' metadata open at 233M rows

    def flush() -> None:
        if pending:
            writer.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP_ROWS)
            pending.clear()

    def write(table: pa.Table) -> None:
        if len(table):
            pending.append(table.select(schema.names).cast(schema))
        if sum(map(len, pending)) >= ROW_GROUP_ROWS:
            flush()

    with atomic_path(path) as tmp:
        writer = pq.ParquetWriter(tmp, schema)
        try:
            yield write
            flush()
        finally:
            writer.close()
    write_usable(Path(path))


def write_index(path: str | Path, rows: list[dict], shards: list[dict]) -> Path:
    with index_writer(path, shards) as write:
        write(pa.Table.from_pylist(rows, schema=SCHEMA))
    return Path(path)


# -- reading ---------------------------------------------------------------------------------------

USABLE_COLUMNS = ["key", "shard_id", "image_ext", *[f"{m}_{f}" for m in MEMBERS for f in ("offset", "size")], "status"]


def _open(path: Path, columns: list[str]) -> tuple[dict, Iterable[pa.RecordBatch]]:
    pf = open_index(path)
    meta = json.loads((pf.schema_arrow.metadata or {}).get(META_KEY, b"{}"))
    if "image_offset" not in pf.schema_arrow.names:
        table, meta = _upgrade_v1(pf.read())
        return meta, table.select(columns).to_batches()
    return meta, pf.iter_batches(batch_size=ROW_GROUP_ROWS, columns=columns)


def _index_path(directory: Path) -> Path:
    path = directory / INDEX_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run the stage that writes these shards")
    return path


def _usable_batch(batch: pa.RecordBatch, exts: list[str], parquet: Path) -> tuple[dict, np.ndarray, pa.Buffer]:
    """A batch of usable rows as the writer's columns, keys as (offsets, bytes); `exts` grows."""
    ext = batch.column("image_ext")
    exts += [e for e in pc.unique(ext).to_pylist() if e not in exts]
    columns = {"shard_id": batch.column("shard_id").to_numpy(),
               "image_ext": pc.index_in(ext, value_set=pa.array(exts, pa.string())).to_numpy()}
    for m in MEMBERS:
        columns[f"{m}_offset"] = batch.column(f"{m}_offset").to_numpy()
        sizes = columns[f"{m}_size"] = batch.column(f"{m}_size").to_numpy()
        if len(sizes) and sizes.max() >= 2**31:
            raise ValueError(f"{parquet}: a member larger than 2 GiB is not a training example")
    keys = batch.column("key").cast(pa.large_string())
    _, offsets, data = keys.buffers()
    offsets = np.frombuffer(offsets, np.int64)[keys.offset:keys.offset + len(keys) + 1]
    return columns, offsets, data if data is not None else pa.py_buffer(b"")  # no buffer when every key is empty


def write_usable(parquet: Path) -> None:
    """Derive usable.idx from an index file in two streaming passes: count the usable rows (the
    file's layout needs the count up front), then write them batch by batch."""
    source = source_id(parquet)  # before reading: a parquet replaced meanwhile fails the next check
    _, batches = _open(parquet, ["status"])
    counts: dict[str, int] = {}
    for batch in batches:
        for s, c in zip(*_value_counts(batch.column("status"))):
            counts[s] = counts.get(s, 0) + c
    meta, batches = _open(parquet, USABLE_COLUMNS)
    exts: list[str] = []
    with usable_writer(parquet.parent / USABLE_NAME, counts.get("ok", 0)) as writer:
        for batch in batches:
            batch = batch.filter(pc.equal(batch.column("status"), "ok"))
            if batch.num_rows:
                writer.append(*_usable_batch(batch, exts, parquet))
        writer.finish(exts=exts, counts=counts, shards=meta["shards"], source=source)


def read_index(directory: str | Path) -> tuple[UsableRows, list[dict], dict]:
    """(usable rows, shards [{"url": resolved, "size", version tags}], counts by status) of a shard directory.

    The rows are mapped read-only from usable.idx, which is derived from index.parquet first where
    it is missing (an index written before it existed) or was derived from another index.parquet.
    """
    directory = Path(directory)
    parquet = _index_path(directory)
    usable = directory / USABLE_NAME
    if not derived_from(usable, parquet):
        with build_lock(parquet):
            if not derived_from(usable, parquet):  # another process may have built it meanwhile
                print(f"index: deriving {usable} from {parquet} (once)")
                try:
                    write_usable(parquet)
                except OSError as e:  # a read-only copy of the data, say
                    raise OSError(e.errno, f"{usable} is missing or out of date and cannot be written ({e}): "
                                           "re-run the shards stage, or make the directory writable") from e
    rows, footer = map_usable(usable)
    shards = [{**s, "url": resolve_shard(directory, s["url"]), "size": s.get("size")} for s in footer["shards"]]
    return rows, shards, footer["counts"]


def read_usable_table(directory: str | Path) -> pa.Table:
    """Every column of the usable rows: for small sets and inspection."""
    table = pq.read_table(_index_path(Path(directory)))
    if "image_offset" not in table.column_names:
        table, _ = _upgrade_v1(table)
    return table.filter(pc.equal(table.column("status"), "ok"))


def resolve_shard(directory: Path, name: str) -> str:
    """Shards written beside their index are stored by name; others by absolute path or URL."""
    if not remote.is_local(name) or Path(remote.local_path(name)).is_absolute():
        return name
    return str((directory / name).resolve())


def _upgrade_v1(table: pa.Table) -> tuple[pa.Table, dict]:
    """Indexes written before image formats were recorded: png members, no shard sizes."""
    names = sorted(set(table.column("shard").to_pylist()))
    ids = {s: i for i, s in enumerate(names)}
    cols = {c.replace("png_", "image_"): table.column(c) for c in table.column_names}
    cols["shard_id"] = pa.array([ids[s] for s in table.column("shard").to_pylist()], pa.int32())
    cols["image_ext"] = pa.array(["png"] * len(table), pa.string())
    for name in (f"{m}_{f}" for m in ("txt", "json") for f in ("offset", "size")):
        cols.setdefault(name, pa.array([-1] * len(table), pa.int64()))
    cols.setdefault("content_hash", pa.nulls(len(table), pa.uint64()))
    return pa.table(cols).select(SCHEMA.names).cast(SCHEMA), {"shards": [{"url": s} for s in names]}


def _value_counts(column) -> tuple[list, list]:
    vc = pc.value_counts(column)
    return vc.field("values").to_pylist(), vc.field("counts").to_pylist()


# -- scanning one shard ----------------------------------------------------------------------------

class _Sample:
    __slots__ = ("key", "members", "truncated")

    def __init__(self, key: str):
        self.key, self.members, self.truncated = key, {}, False


def _verdict(sample: _Sample, check_size: int) -> tuple[dict, str]:
    """The row's member columns and its status: the first problem found, or ok."""
    image_ext = next((e for e in sample.members if e in IMAGE_EXTS), None)
    cols = {"image_ext": image_ext or ""}
    for member, ext in (("image", image_ext), ("txt", "txt"), ("json", "json")):
        offset, size, _ = sample.members.get(ext, (-1, -1, None))
        cols[f"{member}_offset"], cols[f"{member}_size"] = offset, size
    try:
        caption = sample.members["txt"][2].decode("utf-8") if "txt" in sample.members else ""
        bad_caption = False
    except UnicodeDecodeError:
        caption, bad_caption = "", True
    cols["caption_len"] = len(caption)
    if sample.truncated:
        return cols, "truncated"
    if image_ext is None:
        return cols, "missing_image"
    if bad_caption:
        return cols, "bad_caption"
    if not caption.strip():
        return cols, "missing_caption"
    try:
        decode_image(sample.members[image_ext][2], check_size)
    except Exception:  # Pillow raises many types for bad bytes; every one means "cannot train on it"
        return cols, "corrupt_image"
    return cols, "ok"


def _check_end(url: str, end: int, size: int) -> str | None:
    """A complete archive continues with two zero blocks where the scan stopped; else say why not."""
    if size - end < 2 * tarfile.BLOCKSIZE:
        return f"ends at byte {size} without an end-of-archive marker (truncated?)"
    reader = remote.RangeReader([url])
    try:
        tail = reader.read(0, end, end + 2 * tarfile.BLOCKSIZE)
    finally:  # one descriptor per scanned shard, else (a scan of thousands in one process)
        reader.close()
    if tail.count(0) != len(tail):
        return f"unreadable tar header at byte {end}; the {size - end} bytes after it were not indexed (corrupt?)"
    return None


def scan_shard(url: str, check_size: int) -> tuple[pa.Table, dict]:
    """Index one tar in a single sequential pass, decoding every image once to prove it usable.

    Returns rows in SCAN_SCHEMA (with the key hash used to find duplicates) and the shard's info:
    its fingerprint and, when it is damaged, a `problem` (the samples before it stay usable).
    """
    info = {"url": url, **remote.retry(lambda: remote.fingerprint(url))}
    if info.get("size") is None:
        raise remote.ShardReadError(f"{url}: the store does not report a size, which random access needs")
    rows, problem, current = [], None, None

    def finish(sample):
        if sample is not None:
            cols, status = _verdict(sample, check_size)
            image = sample.members.get(cols["image_ext"], (0, 0, None))[2] if cols["image_ext"] else None
            caption = sample.members.get("txt", (0, 0, None))[2] or b""
            rows.append({"key": sample.key, "shard": url, "shard_id": -1, **cols, "status": status,
                         "key_hash": key_hash(sample.key),
                         "content_hash": None if image is None else content_hash(image, caption),
                         "image_hash": None if image is None else content_hash(image, b"")})

    with remote.open_stream(url) as f:
        try:
            tar = tarfile.open(fileobj=f, mode="r|")
        except tarfile.ReadError as e:
            raise remote.ShardReadError(f"{url} is not a tar archive ({e})") from None
        try:
            for m in tar:
                parsed = split_member_name(m.name) if m.isfile() else None
                if parsed is None:
                    continue
                key, ext = parsed
                if current is None or current.key != key or ext in current.members:
                    finish(current)
                    current = _Sample(key)
                keep = ext == "txt" or (ext in IMAGE_EXTS and not any(e in IMAGE_EXTS for e in current.members))
                current.members[ext] = (m.offset_data, m.size, tar.extractfile(m).read() if keep else None)
        except (tarfile.ReadError, EOFError) as e:
            problem = f"unreadable after byte {tar.offset} ({e}; truncated?)"
            if current is not None:
                current.truncated = True
        finish(current)
        end = tar.offset
    info["problem"] = problem or _check_end(url, end, info["size"])
    info["samples"] = len(rows)
    return pa.Table.from_pylist(rows, schema=SCAN_SCHEMA), info


# -- scanning many shards, with a per-shard cache -------------------------------------------------

def _piece_path(cache_dir: Path, url: str) -> Path:
    return cache_dir / f"{hashlib.sha1(url.encode()).hexdigest()[:24]}.parquet"


def _scan_cached(args) -> tuple[str | None, dict]:
    """Scan one shard unless the cache holds a scan of the same bytes; (piece path, info) or (None, error).

    info["cached"] says whether the cache had it (not stored: it describes this call).
    """
    url, cache_dir, check_size = args
    piece = _piece_path(Path(cache_dir), url)
    try:
        if piece.exists():
            cached = json.loads(pq.read_schema(piece).metadata[META_KEY])
            current = remote.retry(lambda: remote.fingerprint(url))
            if (cached["version"], cached["check_size"], cached["fingerprint"]) == (SCAN_VERSION, check_size, current):
                return str(piece), {**cached["info"], "cached": True}
        table, info = scan_shard(url, check_size)
    except Exception as e:  # unreachable or unreadable: skipped and counted, never a crash mid-scan
        return None, {"url": url, "error": f"{type(e).__name__}: {e}"}
    fp = {k: v for k, v in info.items() if k not in ("url", "problem", "samples")}
    meta = {"version": SCAN_VERSION, "check_size": check_size, "fingerprint": fp, "info": info}
    with atomic_path(piece) as tmp:
        pq.write_table(table.replace_schema_metadata({META_KEY: json.dumps(meta)}), tmp)
    return str(piece), {**info, "cached": False}


def scan_shards(urls: list[str], cache_dir: str | Path, workers: int, check_size: int) -> list[tuple[str | None, dict]]:
    """Scan every shard (in parallel processes), in the order given."""
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    jobs = [(u, str(cache_dir), check_size) for u in urls]
    results = []
    # The share done, never a count or a time: a shard's scan time is its content, and a downloaded or
    # img2dataset list's length, beside the published n, says how many rows failed.
    with ShareBar(len(jobs), "scan shards") as bar:
        if workers <= 1:
            mapped = map(_scan_cached, jobs)
        else:
            pool = ProcessPoolExecutor(max_workers=workers)
            mapped = pool.map(_scan_cached, jobs, chunksize=1)
        try:
            for piece, info in mapped:
                results.append((piece, info))
                # No count of samples, skips or cache hits: an unreadable shard is never cached, so
                # after the scan jobs the hits count (and their order places) the readable shards.
                bar.update(1)
        finally:
            if workers > 1:
                pool.shutdown()
    return results


def shard_group(urls: list[str], group: int, groups: int) -> list[str]:
    """Group `group` of `groups`: a contiguous slice of the list, the slices near-equal in size and in
    order, so the groups together are the list and every job computes the same split."""
    if not 0 <= group < groups:
        raise ValueError(f"scan group {group} is not in 0..{groups - 1}")
    return urls[group * len(urls) // groups:(group + 1) * len(urls) // groups]


def scan_group(urls: list[str], group: int, groups: int, cache_dir: str | Path, workers: int,
               check_size: int) -> dict:
    """Scan one group of the shard list into the per-shard cache, where build_index then finds every
    piece; returns a summary of the group (for a job's marker file and log)."""
    results = scan_shards([remote.canonical(u) for u in shard_group(urls, group, groups)], cache_dir, workers,
                          check_size)
    good = [info for piece, info in results if piece is not None]
    cached = sum(info["cached"] for info in good)
    return {"group": group, "groups": groups, "listed": len(urls), "shards": len(results), "cached": cached,
            "scanned": len(good) - cached,  # no sample count: it is a statistic of the private shards
            "skipped": [info for piece, info in results if piece is None]}


def _split_hash(hashes: np.ndarray, seed: int) -> np.ndarray:
    """A uniform 53-bit value per key, mixed with the public seed (splitmix64's finaliser)."""
    return mix64_np(hashes ^ np.uint64((seed * GOLDEN) & MASK64)) >> np.uint64(11)


def build_index(urls: list[str], out_dir: str | Path, *, eval_fraction: float, seed: int, cache_dir: str | Path,
                workers: int, check_size: int) -> dict:
    """Scan the shards, drop duplicate keys and contents, split by key hash and write
    `<out>/{private,eval}/index.parquet`.

    The split is a public function of (seed, key): stable when shards are added, and a key never
    lands on both sides. Returns the stats for stats.json.
    """
    if not urls:
        raise ParamsError(["no shards to index: the source resolved to an empty shard list"], source="shards source")
    urls = [remote.canonical(u) for u in urls]
    results = scan_shards(urls, cache_dir, workers, check_size)
    good = [(p, info) for p, info in results if p is not None]
    skipped = [info for p, info in results if p is None]
    # What could not be read, and what was damaged, are facts about the private data: the owner's log.
    for info in skipped:
        owner.note("shards", f"skipped {info['url']}: {info['error']}")
    if not good:
        raise ParamsError(["none of the shards could be read; why each failed is listed for the data "
                           f"owner only: {owner.OWNER_DIR}/shards.log"], source="shards source")
    damaged = [{"url": i["url"], "problem": i["problem"]} for _, i in good if i.get("problem")]
    for d in damaged:
        owner.note("shards", f"{d['url']} {d['problem']}")
    # After Snakemake's scan jobs (rules/scan.smk) every readable shard is cached and only the merge is
    # left, so the count of hits is the count of readable shards: the owner's, like the skips.
    owner.note("shards", f"{sum(info['cached'] for _, info in good)} of {len(urls)} shard scans found in the cache")
    print(f"shards: any shard skipped or damaged is listed for the data owner only: {owner.OWNER_DIR}/shards.log")

    out_dir = Path(out_dir)
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p, _ in good)

    def column(name: str, exclude=None):  # (hashes, usable rows less `exclude`'s) of each piece in turn
        start = 0
        for p, _ in good:
            t = pq.read_table(p, columns=["status", name])
            usable = pc.equal(t.column("status"), "ok").to_numpy(zero_copy_only=False)
            if exclude is not None:
                usable &= ~exclude.get(start, start + len(t))
            yield t.column(name).fill_null(0).to_numpy(), usable
            start += len(t)

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as buckets:  # inside the output: removed before it is renamed
        dup = duplicate_rows(column("key_hash"), rows, buckets)
        # The same image under another key (two shards of one crawl, another alt text) is one example: kept
        # twice, a step sampling both would add 2C of it against C (MAE reads no caption); the budget counts content.
        same_content = duplicate_rows(column("image_hash", exclude=dup), rows, buckets)

    shards = [{"url": info["url"], "size": info["size"], **{k: info[k] for k in remote.VERSION_TAGS if k in info}}
              for _, info in good]
    counts = {s: dict.fromkeys(STATUSES, 0) for s in ("private", "eval")}
    with index_writer(out_dir / "private" / INDEX_NAME, shards) as write_private, \
            index_writer(out_dir / "eval" / INDEX_NAME, shards) as write_eval:
        start = 0
        for shard_id, (piece, _) in enumerate(good):
            t = pq.read_table(piece)
            stop = start + len(t)
            status = pc.if_else(pa.array(dup.get(start, stop)), "duplicate_key",
                                pc.if_else(pa.array(same_content.get(start, stop)), "duplicate_content",
                                           t.column("status")))
            to_eval = _split_hash(t.column("key_hash").to_numpy(), seed) < np.uint64(int(eval_fraction * 2**53))
            t = t.set_column(t.schema.get_field_index("status"), "status", status)
            t = t.set_column(t.schema.get_field_index("shard_id"), "shard_id",
                             pa.array(np.full(len(t), shard_id, np.int32)))
            mask = pa.array(to_eval)
            for split, write, part in (("private", write_private, t.filter(pc.invert(mask))),
                                       ("eval", write_eval, t.filter(mask))):
                write(part)
                for s, c in zip(*_value_counts(part.column("status"))):
                    counts[split][s] += c
            start = stop
    stats = {split: {"usable": c["ok"], "rows": sum(c.values()),
                     "excluded": {s: n for s, n in c.items() if s != "ok" and n}} for split, c in counts.items()}
    stats["shards"] = {"listed": len(urls), "indexed": len(good), "skipped": skipped, "damaged": damaged}
    return stats
