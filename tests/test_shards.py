"""Shards and their index (pipeline/data/shards.py, index.py, index_mmap.py): byte-exact random
access, and every kind of bad input excluded with a count or stopped with a clear error, never a
silently wrong n.

Local files and fsspec's in-memory filesystem only; http(s) is tested in test_sources.py.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import pickle
import signal
import tarfile
import types
from collections import Counter
from pathlib import Path

import fsspec
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from shard_data import SIZE, excluded, good, index, picture, raw_tar, write_set

from pipeline.stages import shards as shards_stage, stage
from pipeline.data.dedup import duplicate_mask, duplicate_rows
from pipeline.data.index import (INDEX_NAME, MEMBERS, IndexMismatch, _split_hash, build_index, key_hash,
                                  read_index, read_usable_table)
from pipeline.data.index_mmap import MAGIC, TAIL, USABLE_NAME, CorruptIndex, read_footer, source_id
from pipeline.data.loader import BatchLoader
from pipeline.data.remote import ShardReadError, filesystem
from pipeline.data.shards import ShardDataset, ShardWriter, encode_png, write_shard
from pipeline.data.transforms import decode_image, encode_jpeg
from pipeline.io import read_json


# -- writer and reader -----------------------------------------------------------------------------

def test_index_round_trips_every_member_byte_for_byte(tmp_path):
    samples = write_set(tmp_path)
    ds = ShardDataset(tmp_path)
    assert len(ds) == len(samples)
    by_key = {ds.key(i): i for i in range(len(ds))}
    members = 0
    for tar_path in sorted(tmp_path.glob("*.tar")):
        with tarfile.open(tar_path) as t:
            for m in t.getmembers():
                key, ext = m.name.split(".", 1)
                assert ds.read_member(by_key[key], ext) == t.extractfile(m).read()
                members += 1
    assert members == 3 * len(samples)
    for i, (key, png, caption, meta) in enumerate(samples):
        item = ds[i]
        assert item["key"] == key and item["caption"] == caption and item["meta"] == meta
        assert np.array_equal(item["image"], np.asarray(Image.open(io.BytesIO(png))))
        assert ds.caption(i) == caption and ds.meta(i) == meta and ds.read_member(i, "png") == png
    assert ds.load_images().shape == (len(samples), SIZE, SIZE, 3)
    assert ds.index["key"] == [s[0] for s in samples]


def test_scan_finds_the_offsets_the_writer_recorded(tmp_path):
    write_set(tmp_path / "w")
    written = pq.read_table(tmp_path / "w" / INDEX_NAME).to_pylist()
    stats, ds = index(sorted((tmp_path / "w").glob("*.tar")), tmp_path)
    scanned = pq.read_table(tmp_path / "out/private" / INDEX_NAME).to_pylist()
    cols = ("key", "image_ext", "image_offset", "image_size", "txt_offset", "txt_size", "json_offset",
            "json_size", "caption_len", "status")
    assert [{c: r[c] for c in cols} for r in scanned] == [{c: r[c] for c in cols} for r in written]
    assert stats["shards"] == {"listed": 5, "indexed": 5, "skipped": [], "damaged": []}


def test_tars_are_byte_reproducible(tmp_path):
    write_set(tmp_path / "a")
    write_set(tmp_path / "b")
    for a in sorted((tmp_path / "a").glob("*.tar")):
        assert a.read_bytes() == (tmp_path / "b" / a.name).read_bytes()


def test_writer_rejects_duplicate_keys_and_dotted_keys(tmp_path):
    # Nothing half-written is left behind, not even a temporary file, while the error (whose traceback
    # holds the writer) is still being handled.
    with pytest.raises(ValueError, match="duplicate sample key") as handled:
        with ShardWriter(tmp_path) as w:
            w.write("a", b"x", "c", {})
            w.write("a", b"y", "c", {})
    assert handled.traceback and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="duplicate sample key") as handled:  # a shard written by a worker
        write_shard(tmp_path / "s-000000.tar", 0, [("a", b"x", "c", {}), ("a", b"y", "c", {})])
    assert handled.traceback and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="dot"):
        ShardWriter(tmp_path).write("a.b", b"x", "c", {})


def test_split_by_key_hash_is_disjoint_stable_and_near_the_fraction(tmp_path):
    write_set(tmp_path / "w", n=400, per_shard=100)
    urls = [str(u) for u in sorted((tmp_path / "w").glob("*.tar"))]
    stats = build_index(urls, tmp_path / "o", eval_fraction=0.25, seed=3, cache_dir=tmp_path / "c",
                        workers=1, check_size=SIZE)
    private, held = ShardDataset(tmp_path / "o/private"), ShardDataset(tmp_path / "o/eval")
    keys_p, keys_e = set(private.index["key"]), set(held.index["key"])
    assert not keys_p & keys_e and len(keys_p | keys_e) == 400
    assert 60 < len(keys_e) < 140 and stats["eval"]["usable"] == len(keys_e)
    hashes = _split_hash(np.array([key_hash(k) for k in sorted(keys_p | keys_e)], dtype=np.uint64), 3)
    assert keys_e == {k for k, h in zip(sorted(keys_p | keys_e), hashes) if h < 2**51}  # the keys below 0.25·2⁵³
    build_index(urls[::-1], tmp_path / "o2", eval_fraction=0.25, seed=3, cache_dir=tmp_path / "c",
                workers=1, check_size=SIZE)
    assert set(ShardDataset(tmp_path / "o2/eval").index["key"]) == keys_e  # order of shards does not matter
    build_index(urls, tmp_path / "o3", eval_fraction=0.25, seed=4, cache_dir=tmp_path / "c",
                workers=1, check_size=SIZE)
    assert set(ShardDataset(tmp_path / "o3/eval").index["key"]) != keys_e  # the public seed does


def test_scans_in_worker_processes_match_inline(tmp_path):
    write_set(tmp_path / "w", n=30)
    urls = sorted((tmp_path / "w").glob("*.tar"))
    _, inline = index(urls, tmp_path, "a", workers=1)
    _, pooled = index(urls, tmp_path, "b", workers=2)
    assert inline.index == pooled.index


# -- bad input: excluded with a count ----------------------------------------------------------------

def test_bad_samples_are_excluded_and_counted(tmp_path):
    rng = np.random.default_rng(1)
    truncated_jpeg = encode_jpeg(picture(rng, 64))[:300]
    members = (good("a", rng) + [("b.jpg", b"this is not an image"), ("b.txt", b"cap")]
               + [("c.jpg", truncated_jpeg), ("c.txt", b"cap")]
               + [("d.jpg", encode_jpeg(picture(rng, 16)))]                       # no caption
               + [("e.jpg", encode_jpeg(picture(rng, 16))), ("e.txt", b"   ")]    # blank caption
               + [("f.jpg", encode_jpeg(picture(rng, 16))), ("f.txt", b"\xff\xfe")]  # not UTF-8
               + [("g.txt", b"a caption without an image")]
               + good("h", rng))
    raw_tar(tmp_path / "bad.tar", members)
    stats, ds = index([tmp_path / "bad.tar"], tmp_path)
    assert ds.index["key"] == ["a", "h"]
    assert excluded(stats) == {"corrupt_image": 2, "missing_caption": 2, "bad_caption": 1, "missing_image": 1}
    assert stats["private"]["rows"] == 8


def test_duplicate_keys_keep_the_first_copy_within_and_across_shards(tmp_path):
    rng = np.random.default_rng(2)
    raw_tar(tmp_path / "1.tar", good("a", rng) + good("b", rng) + good("a", rng, "again"))
    raw_tar(tmp_path / "2.tar", good("b", rng, "copy") + good("c", rng))
    stats, ds = index([tmp_path / "1.tar", tmp_path / "2.tar"], tmp_path)
    assert ds.index["key"] == ["a", "b", "c"]
    assert [ds.caption(i) for i in range(3)] == ["a photo"] * 3  # the first copies
    assert excluded(stats) == {"duplicate_key": 2}


def test_which_copy_stays_follows_the_shards_given_order_and_each_rows_own_status(tmp_path):
    """A key's copy right after its first is a duplicate too; a copy dropped for its key does not make
    a later example with its image (p) a duplicate, or no copy of that image would stay; a later shard's
    content duplicate is judged at its own row; and the first copy is the first in the order the shards
    are listed, not their names' order."""
    rng = np.random.default_rng(6)
    x, y, q1, q2 = (encode_jpeg(picture(rng, 16)) for _ in range(4))
    raw_tar(tmp_path / "1.tar", good("a", image=x) + good("a", caption="again", image=q1) + good("b", image=y))
    raw_tar(tmp_path / "2.tar", good("a", caption="third", image=y) + good("c", image=y) + good("z", image=x))
    raw_tar(tmp_path / "3.tar", good("p", image=q1) + good("r", image=q2) + good("k", image=x))
    stats, ds = index([tmp_path / f"{i}.tar" for i in (1, 2, 3)], tmp_path)
    assert ds.index["key"] == ["a", "b", "p", "r"] and ds.caption(0) == "a photo"
    assert excluded(stats) == {"duplicate_key": 2, "duplicate_content": 3}  # a twice; c (b's image), z and k (a's)
    stats, ds = index([tmp_path / f"{i}.tar" for i in (3, 1, 2)], tmp_path, name="listed-otherwise")
    assert ds.index["key"] == ["p", "r", "k", "b"]  # k holds x first now: a's image is its duplicate
    assert excluded(stats) == {"duplicate_key": 2, "duplicate_content": 3}


def test_a_shard_rewritten_since_its_scan_is_scanned_again(tmp_path):
    rng = np.random.default_rng(8)
    raw_tar(tmp_path / "1.tar", good("a", rng) + good("b", rng))
    _, ds = index([tmp_path / "1.tar"], tmp_path)
    assert ds.index["key"] == ["a", "b"]
    raw_tar(tmp_path / "1.tar", good("c", rng) + good("d", rng) + good("e", rng))  # another crawl's shard
    stats, ds = index([tmp_path / "1.tar"], tmp_path, name="again", cache="out")
    assert ds.index["key"] == ["c", "d", "e"] and stats["private"]["usable"] == 3


def test_the_same_image_under_another_key_is_one_example_whatever_its_caption(tmp_path):
    """Two shards of one crawl can hold an example twice under two keys, or one image under two alt
    texts. Kept twice, a step sampling both would add up to 2C of one image against a charge for C (to
    MAE the two rows are one input): the first copy stays, the other is excluded, so n and the budget's
    count (by content) agree; another image with the same caption is another example."""
    from pipeline.privacy import budget

    rng = np.random.default_rng(4)
    a, b, d = good("a", rng), good("b", rng), good("d", rng)  # d: another image, b's caption ("a photo")
    again = [(name.replace("a.", "z."), data) for name, data in a]  # a's bytes, key z
    recaptioned = [(name.replace("b.", "y."), b"another caption" if name.endswith(".txt") else data) for name, data in b]
    raw_tar(tmp_path / "1.tar", a + b)
    raw_tar(tmp_path / "2.tar", again + recaptioned + d + good("c", rng))
    stats, ds = index([tmp_path / "1.tar", tmp_path / "2.tar"], tmp_path)
    assert ds.index["key"] == ["a", "b", "d", "c"] and excluded(stats) == {"duplicate_content": 2}
    with contextlib.chdir(tmp_path):
        identity_n = budget.examples_identity(tmp_path / "out" / "private")
    assert stats["private"]["usable"] == len(ds) == 4 and identity_n[1].sum() == 4  # one sketch bit per example


def test_a_member_name_not_in_utf8_costs_no_sample_of_its_shard(tmp_path):
    """tar hands back a name that is not UTF-8 with surrogate escapes, which arrow refuses: one such
    member once made the scan skip its whole shard, every good sample in it lost to n."""
    rng = np.random.default_rng(5)
    odd = [(name.replace("odd", "odd\udcff"), data) for name, data in good("odd", rng)]  # the byte 0xff
    raw_tar(tmp_path / "1.tar", odd + good("k9", rng))
    stats, ds = index([tmp_path / "1.tar"], tmp_path)
    assert ds.index["key"] == ["odd\\xff", "k9"] and stats["shards"]["skipped"] == [] and excluded(stats) == {}


def test_duplicate_check_keeps_a_later_copy_when_the_first_is_unusable():
    hashes = np.array([5, 7, 5, 5, 7], dtype=np.uint64)
    usable = np.array([False, True, True, True, True])
    assert duplicate_mask(hashes, usable).tolist() == [False, False, False, True, True]


@pytest.mark.parametrize("bucket_rows", [10**9, 4096, 37])  # one bucket; 16 buckets; 1,024
def test_duplicates_found_in_buckets_on_disk_are_those_of_one_sort_of_the_whole_column(tmp_path, bucket_rows):
    """build_index once sorted every row's hash at once (52 bytes a row: 12 GB at 233M rows); in buckets
    by the hash's top bits, sorted one at a time, it must mark exactly the rows the one sort marks (the
    first usable row of each hash kept), across pieces of any size, empty ones too."""
    rng = np.random.default_rng(0)
    sizes = [0, 1, 500, 3, 7000, 0, 4000, 2]
    n = sum(sizes)
    hashes = rng.choice(rng.integers(0, 2**64, 3000, dtype=np.uint64, endpoint=False), n)  # many repeats
    hashes[:40] = np.uint64(2**64 - 1)  # a hash in the top bucket, and 0 in the bottom one
    hashes[40:80] = 0
    usable = rng.random(n) < 0.8
    bounds = np.cumsum([0, *sizes])
    pieces = ((hashes[a:b], usable[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
    found = duplicate_rows(pieces, n, tmp_path / "buckets", bucket_rows=bucket_rows)
    expected = duplicate_mask(hashes, usable)
    assert expected.sum() > n // 2 and np.array_equal(found.get(0, n), expected)
    assert all(np.array_equal(found.get(a, b), expected[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
    assert not list((tmp_path / "buckets").iterdir())


def test_tar_truncated_inside_a_member(tmp_path):
    rng = np.random.default_rng(3)
    raw_tar(tmp_path / "t.tar", good("a", rng) + good("b", rng) + good("c", rng))
    data = (tmp_path / "t.tar").read_bytes()
    cut = data.index(b"c.jpg") + 512 + 100  # 100 bytes into c's image
    (tmp_path / "t.tar").write_bytes(data[:cut])
    stats, ds = index([tmp_path / "t.tar"], tmp_path)
    assert ds.index["key"] == ["a", "b"]
    assert excluded(stats) == {"truncated": 1}
    assert "truncated" in stats["shards"]["damaged"][0]["problem"]


def test_tar_truncated_between_members_or_corrupt_midway(tmp_path):
    rng = np.random.default_rng(4)
    raw_tar(tmp_path / "t.tar", good("a", rng) + good("b", rng) + good("c", rng))
    data = (tmp_path / "t.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[:data.index(b"c.jpg")])  # a clean cut before c
    raw_tar(tmp_path / "g.tar", good("x", rng) + good("y", rng) + good("z", rng))
    bad = bytearray((tmp_path / "g.tar").read_bytes())
    at = bad.index(b"y.jpg")
    bad[at:at + 512] = b"\x07" * 512  # a garbage header: tarfile alone would just stop here
    (tmp_path / "garbled.tar").write_bytes(bytes(bad))
    stats, ds = index([tmp_path / "cut.tar", tmp_path / "garbled.tar"], tmp_path)
    assert ds.index["key"] == ["a", "b", "x"]
    assert excluded(stats) == {}
    problems = {d["url"].rsplit("/", 1)[1]: d["problem"] for d in stats["shards"]["damaged"]}
    assert "end-of-archive" in problems["cut.tar"]
    assert "unreadable tar header" in problems["garbled.tar"]


def test_no_readable_shard_or_empty_list_is_an_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the owner's log: in the test's project
    with pytest.raises(ValueError, match="empty shard list"):
        build_index([], tmp_path / "o", eval_fraction=0.1, seed=0, cache_dir=tmp_path / "c", workers=1, check_size=8)
    (tmp_path / "cut.tar").write_bytes(b"not a tar archive")
    with pytest.raises(ValueError, match="none of the shards could be read") as raised:
        build_index([str(tmp_path / "nope.tar"), str(tmp_path / "cut.tar")], tmp_path / "o", eval_fraction=0.1,
                    seed=0, cache_dir=tmp_path / "c", workers=1, check_size=8)
    # Why a shard failed is a fact about the private data: the owner's log has each, the error none.
    kept = (tmp_path / ".dpfm/owner/shards.log").read_text()
    assert "nope.tar" in kept and "cut.tar" in kept
    assert "nope.tar" not in str(raised.value) and "cut.tar" not in str(raised.value)


# -- an index that does not match its shards ------------------------------------------------------------

def test_index_of_changed_shards_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the owner's log: in the test's project
    write_set(tmp_path / "a", n=10, per_shard=10, seed=1)
    shard = tmp_path / "a/s-000000.tar"
    original = shard.read_bytes()
    shard.write_bytes(original + b"\0" * 512)
    with pytest.raises(IndexMismatch, match="re-run the shards stage") as refused:
        ShardDataset(tmp_path / "a")
    # The shard's size is a statistic of its examples: the owner's log has it, the error does not.
    sizes = (str(len(original)), str(len(original) + 512))
    assert not [n for n in sizes if n in str(refused.value)], str(refused.value)
    assert all(n in (tmp_path / ".dpfm/owner/shards.log").read_text() for n in sizes)
    # Same size, other content (members shifted): caught at the read, by the tar header check.
    shifted = original[1024:] + b"\0" * 1024
    shard.write_bytes(shifted)
    ds = ShardDataset(tmp_path / "a")
    with pytest.raises(IndexMismatch, match="expects member 's0000.png'"):
        ds.read_member(0, "png")
    shard.unlink()
    with pytest.raises(ShardReadError, match="missing"):
        ShardDataset(tmp_path / "a")


def test_header_check_catches_a_stale_offset(tmp_path):
    """The check itself can fail: shifting one offset in the index makes reads refuse."""
    write_set(tmp_path, n=4, per_shard=4)
    table = pq.read_table(tmp_path / INDEX_NAME)
    rows = table.to_pylist()
    rows[1]["image_offset"] += 512
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), tmp_path / INDEX_NAME)
    (tmp_path / USABLE_NAME).unlink()  # a hand edit keeps the parquet's footer: usable.idx is derived anew
    ds = ShardDataset(tmp_path)
    assert ds.read_member(0, "png")
    with pytest.raises(IndexMismatch):
        ds.read_member(1, "png")


def test_header_check_catches_a_member_of_another_size(tmp_path):
    """A member rewritten in place at another length (the name and offset still right) is stale too:
    read as indexed, the image would be cut short or run into the next member."""
    write_set(tmp_path, n=4, per_shard=4)
    table = pq.read_table(tmp_path / INDEX_NAME)
    rows = table.to_pylist()
    rows[2]["image_size"] -= 1
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), tmp_path / INDEX_NAME)
    (tmp_path / USABLE_NAME).unlink()
    ds = ShardDataset(tmp_path)
    assert ds.read_member(1, "png")
    with pytest.raises(IndexMismatch, match="bytes"):
        ds.read_member(2, "png")


def test_missing_index_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="run the stage"):
        ShardDataset(tmp_path)


# -- the memory-mapped index (usable.idx) -----------------------------------------------------------

def assert_mapped_rows_equal_parquet(directory):
    rows, _, counts = read_index(directory)
    usable = read_usable_table(directory).to_pydict()
    assert [rows.keys[i] for i in range(len(rows.keys))] == usable["key"]
    assert rows.shard_id.tolist() == usable["shard_id"]
    assert [rows.exts[c] for c in rows.image_ext] == usable["image_ext"]
    for m in MEMBERS:
        assert rows.offsets[m].tolist() == usable[f"{m}_offset"] and rows.sizes[m].tolist() == usable[f"{m}_size"]
    assert counts == Counter(pq.read_table(directory / INDEX_NAME, columns=["status"])["status"].to_pylist())
    return rows


def test_mapped_index_holds_exactly_the_parquets_usable_rows(tmp_path):
    rng = np.random.default_rng(6)
    raw_tar(tmp_path / "1.tar", good("a", rng) + [("b.png", encode_png(picture(rng))), ("b.txt", b"a png")]
            + [("c.jpg", b"not an image"), ("c.txt", b"cap")] + [("d.webp", b""), ("d.txt", b"cap")]
            + [("e.jpg", encode_jpeg(picture(rng, 16))), ("e.txt", "ünïcode key's caption".encode())])
    raw_tar(tmp_path / "2.tar", good("a", rng, "copy") + [("f.png", encode_png(picture(rng))), ("f.txt", b"cap")]
            + good("g/nested", rng))
    stats, ds = index([tmp_path / "1.tar", tmp_path / "2.tar"], tmp_path)
    assert excluded(stats) == {"corrupt_image": 2, "duplicate_key": 1}
    rows = assert_mapped_rows_equal_parquet(tmp_path / "out/private")
    assert rows.exts == ["jpg", "png"] and rows.offsets["json"].tolist()[1:4] == [-1, -1, -1]
    assert [ds.key(i) for i in range(len(ds))] == ["a", "b", "e", "f", "g/nested"] and ds.key(-1) == "g/nested"
    # Written by ShardWriter, with several image formats among the rows.
    with ShardWriter(tmp_path / "w", samples_per_shard=2) as w:
        for i, ext in enumerate(["png", "jpg", "png", "webp", "jpg"]):
            w.write(f"k{i}", b"image bytes", f"caption {i}", {"i": i}, image_ext=ext)
    assert assert_mapped_rows_equal_parquet(tmp_path / "w").exts == ["png", "jpg", "webp"]


def test_empty_index_maps_to_no_rows(tmp_path):
    raw_tar(tmp_path / "bad.tar", [("x.jpg", b"not an image"), ("x.txt", b"cap")])
    stats, ds = index([tmp_path / "bad.tar"], tmp_path)
    assert len(ds) == 0 and ds.status_counts == {"corrupt_image": 1}


def test_a_pickled_dataset_carries_the_path_not_the_rows(tmp_path):
    sizes = []
    for n in (10, 2000):
        write_set(tmp_path / str(n), n=n, per_shard=n // 2)
        ds = ShardDataset(tmp_path / str(n))
        blob = pickle.dumps(ds)
        sizes.append(len(blob))
        copy = pickle.loads(blob)
        assert len(copy) == n and copy.key(7) == ds.key(7) and copy.read_sample(7) == ds.read_sample(7)
        assert not copy._rows.offsets["image"].flags.writeable  # mapped read-only, not unpickled
    assert sizes[0] < 2000 and abs(sizes[1] - sizes[0]) < 16, sizes  # the same whatever n is


def test_index_without_a_usable_file_derives_the_same_one(tmp_path):
    write_set(tmp_path, n=9, per_shard=4)
    written = (tmp_path / USABLE_NAME).read_bytes()
    (tmp_path / USABLE_NAME).unlink()  # as an index written before usable.idx existed
    ds = ShardDataset(tmp_path)
    assert [ds.key(i) for i in range(9)] == [f"s{i:04d}" for i in range(9)] and ds.caption(8) == "caption number 8"
    assert (tmp_path / USABLE_NAME).read_bytes() == written


def _with_footer(data: bytes, footer: bytes) -> bytes:
    length = TAIL.unpack(data[-TAIL.size:])[0]
    return data[:-TAIL.size - length] + footer + TAIL.pack(len(footer), MAGIC)


def _with_key_offset(data: bytes, path, i: int, value: int) -> bytes:
    offset = read_footer(path)[0]["columns"]["key_offsets"][0] + 8 * i
    return data[:offset] + np.int64(value).tobytes() + data[offset + 8:]


def _footer_with(path, **changes) -> bytes:
    return json.dumps({**read_footer(path)[0], **changes}).encode()


@pytest.mark.parametrize("damage, message", [
    (lambda data, path: data[:-1], "no end marker"),
    (lambda data, path: data[:len(data) // 2], "no end marker"),
    (lambda data, path: b"", "only 0 bytes"),
    (lambda data, path: _with_footer(data, b"{not json" + b" " * 40), "unreadable footer"),
    (lambda data, path: _with_footer(data, _footer_with(path, rows=10_000)), "does not describe the columns"),
    (lambda data, path: _with_footer(data, _footer_with(path, columns={
        **read_footer(path)[0]["columns"], "image_size": [len(data), "<i4", 9]})), "column image_size runs past"),
    (lambda data, path: _with_footer(data, _footer_with(path, columns={  # its last 4 bytes inside the footer
        **read_footer(path)[0]["columns"], "image_size": [read_footer(path)[1] - 32, "<i4", 9]})),
     "column image_size runs past"),
    (lambda data, path: data[:-TAIL.size] + TAIL.pack(len(data), MAGIC), "no end marker"),  # longer than the file
    (lambda data, path: _with_key_offset(data, path, 0, 1), "the key offsets do not span"),
    (lambda data, path: _with_key_offset(data, path, 9, 10**6), "the key offsets do not span"),
])
def test_a_damaged_usable_file_is_a_clear_error_naming_it(tmp_path, damage, message):
    write_set(tmp_path, n=9, per_shard=4)
    path = tmp_path / USABLE_NAME
    path.write_bytes(damage(path.read_bytes(), path))
    with pytest.raises(CorruptIndex, match=message) as e:
        ShardDataset(tmp_path)
    assert str(path) in str(e.value) and "delete it" in str(e.value)


def test_damaged_key_offsets_raise_instead_of_reading_outside_the_map(tmp_path):
    write_set(tmp_path, n=9, per_shard=4)
    path = tmp_path / USABLE_NAME
    offset = read_footer(path)[0]["columns"]["key_offsets"][0]
    data = bytearray(path.read_bytes())
    data[offset + 8 * 3:offset + 8 * 4] = np.int64(1 << 40).tobytes()  # key 2 ends, key 3 starts far past the end
    path.write_bytes(bytes(data))
    ds = ShardDataset(tmp_path)
    assert ds.key(1) == "s0001"
    with pytest.raises(CorruptIndex, match="key 2 lies outside"):
        ds.key(2)


# -- remote shards through fsspec (in-memory filesystem) --------------------------------------------

def test_memory_filesystem_shards_scan_and_read_by_range(tmp_path):
    write_set(tmp_path / "w", n=12, per_shard=5)
    fs = fsspec.filesystem("memory")
    urls = []
    for p in sorted((tmp_path / "w").glob("*.tar")):
        fs.pipe(f"/dpfm-test/{p.name}", p.read_bytes())
        urls.append(f"memory:///dpfm-test/{p.name}")
    try:
        stats, ds = index(urls, tmp_path)
        local = ShardDataset(tmp_path / "w")
        assert ds.index["key"] == local.index["key"]
        assert all(ds.read_sample(i) == local.read_sample(i) for i in range(len(ds)))
        fs.pipe("/dpfm-test/s-000000.tar", b"\0" * 512 + (tmp_path / "w/s-000000.tar").read_bytes()[:-512])
        with pytest.raises(IndexMismatch):  # remote shards are checked on every read
            ShardDataset(tmp_path / "out/private").read_member(0, "png")
    finally:
        fs.rm("/dpfm-test", recursive=True)


def test_s3_without_s3fs_names_the_missing_package():
    try:
        import s3fs  # noqa: F401
        pytest.skip("s3fs is installed")
    except ImportError:
        pass
    with pytest.raises(ShardReadError, match="s3fs"):
        filesystem("s3://bucket/shard-000000.tar")


# -- decoding and loading ----------------------------------------------------------------------------------

def test_decode_centre_crops_to_the_model_resolution():
    image = np.zeros((40, 80, 3), np.uint8)
    image[:, 20:60] = 255  # the centre square is white, the sides black
    out = decode_image(encode_png(image), 16)
    assert out.shape == (16, 16, 3) and out.min() >= 250
    assert decode_image(encode_png(image)).shape == (40, 80, 3)
    with pytest.raises(Exception):
        decode_image(b"not an image", 16)
    odd = np.zeros((41, 80, 3), np.uint8)  # an odd margin (39 columns): the square starts at column 19
    odd[:, 19:60] = 255
    assert decode_image(encode_png(odd), 16).min() >= 250


def test_a_jpeg_is_decoded_at_a_scale_no_smaller_than_the_model_resolution():
    """JPEG's reduced-scale decoding (draft) saves time, but below the model resolution it would blur
    every web image: the result stays near a full decode scaled down."""
    stripes = (127.5 + 127.5 * np.sin(np.arange(256) / 1.3)).astype(np.uint8)  # an 8-pixel period
    jpeg = encode_jpeg(np.repeat(np.tile(stripes, (256, 1))[..., None], 3, axis=2))
    full = Image.fromarray(decode_image(jpeg)).resize((100, 100), Image.BICUBIC, reducing_gap=3.0)
    assert np.abs(decode_image(jpeg, 100).astype(float) - np.asarray(full, float)).mean() < 15


class FakeTokenizer:
    def encode(self, captions, max_len, public=False):
        return torch.tensor([[len(c)] * max_len for c in captions])


def test_batch_loader_workers_start_by_spawn_as_on_macos(tmp_path):
    """Where processes start by spawn (macOS, Windows), the workers get the dataset pickled, not forked."""
    import multiprocessing

    write_set(tmp_path, n=12, per_shard=5)
    ds = ShardDataset(tmp_path)
    batches = [np.arange(i, i + 3) for i in range(0, 12, 3)]
    before = multiprocessing.get_start_method()
    multiprocessing.set_start_method("spawn", force=True)
    try:
        spawned = list(BatchLoader(ds, 4, workers=2, prefetch=1)(batches))
    finally:
        multiprocessing.set_start_method(before, force=True)
    assert [i.tolist() for i, _ in spawned] == [b.tolist() for b in batches]
    assert all(torch.equal(x, ds_x) for (_, (x,)), (_, (ds_x,)) in zip(spawned, BatchLoader(ds, 4)(batches)))


def test_batch_loader_in_workers_matches_in_process_and_keeps_order(tmp_path):
    write_set(tmp_path, n=20, per_shard=6)
    ds = ShardDataset(tmp_path)
    batches = [np.array([3, 1, 19]), np.array([], dtype=np.int64), np.arange(0, 20, 2)]
    inline = list(BatchLoader(ds, 4, tokenizer=FakeTokenizer(), max_len=3)(batches))
    pooled = list(BatchLoader(ds, 4, tokenizer=FakeTokenizer(), max_len=3, workers=2)(iter(batches)))
    assert len(inline) == len(pooled) == 3
    for b, (idx_a, (img_a, tok_a)), (idx_b, (img_b, tok_b)) in zip(batches, inline, pooled):
        assert idx_a.tolist() == idx_b.tolist() == b.tolist()
        assert img_a.shape == (len(b), 3, 4, 4) and torch.equal(img_a, img_b) and torch.equal(tok_a, tok_b)
    assert tok_a[0, 0].item() == len(ds.caption(0))
    # Normalised with the fixed public (ImageNet) constants, whatever the data's own statistics.
    (x,) = BatchLoader(ds, SIZE).load(np.array([5]))
    pixels = torch.tensor(ds.image(5)).float() / 255
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    assert torch.allclose(x[0], ((pixels - mean) / std).permute(2, 0, 1), atol=1e-6)



def test_an_example_that_no_longer_decodes_is_named(tmp_path, monkeypatch):
    """Bytes changed after the scan (a shard rewritten in place): the error names the example, so the
    data owner, who alone reads it (dp-train's owner log), can find it; it said only 'cannot identify
    image file <_io.BytesIO ...>'."""
    write_set(tmp_path, n=8, per_shard=4)
    ds = ShardDataset(tmp_path)
    read = ds.read_samples

    def zeroed(indices, members):
        return [{**raw, "image": bytes(len(raw["image"]))} if i == 5 else raw
                for i, raw in zip(indices, read(indices, members))]

    monkeypatch.setattr(ds, "read_samples", zeroed)
    with pytest.raises(ValueError, match=f"example {ds.key(5)} \\(row 5\\) no longer decodes"):
        BatchLoader(ds, 4).load(np.array([1, 5]))


# -- the stage ----------------------------------------------------------------------------------------------

def run_digits(eval_fraction=0.3) -> None:
    params = {"run": {"seed": 0}, "shards": {"source": "digits", "path": None, "limit": None, "image_size": 8,
                                              "eval_fraction": eval_fraction, "samples_per_shard": 300, "workers": 0}}
    tracker = types.SimpleNamespace(log_metrics=lambda *a, **k: None)
    shards_stage.run(params, types.SimpleNamespace(stage=stage("shards"), tracker=tracker, threads=1))


def test_shards_replaced_by_a_stage_stopped_before_its_digest_have_no_digest(in_tmp, monkeypatch):
    """The digest (what DVC tracks of the shards) vouches for the shards beside it. Run by hand and killed
    after the new shards are in place but before their digest is written (a fault at that point), the
    stage once left the old digest beside the new shards, so DVC took them for the old ones."""
    run_digits()
    assert Path("data/shards.digest").is_file()

    def killed(*a, **k):
        raise KeyboardInterrupt("killed before the digest")

    monkeypatch.setattr(shards_stage, "input_tag", killed)
    with pytest.raises(KeyboardInterrupt):
        run_digits(eval_fraction=0.5)
    assert read_json("data/shards/stats.json")["eval_fraction"] == 0.5  # the new shards are in place
    assert not Path("data/shards.digest").exists()


def test_digits_stage_writes_splits_and_stats(in_tmp):
    run_digits()
    stats = read_json("data/shards/stats.json")
    private, held = ShardDataset("data/shards/private"), ShardDataset("data/shards/eval")
    assert stats["private"]["usable"] == len(private) and stats["eval"]["usable"] == len(held)
    assert len(private) + len(held) == 1797 and stats["private"]["classes"] == 10
    assert not set(private.index["key"]) & set(held.index["key"])
    # Keys are named by their split, so disjoint keys prove nothing: no image of the set is on both sides.
    origin = [{ds.meta(i)["source_index"] for i in range(len(ds))} for ds in (private, held)]
    assert not origin[0] & origin[1] and len(origin[0] | origin[1]) == 1797
    assert json.loads(private.read_member(0, "json"))["label"] == private.meta(0)["label"]


def test_digits_shards_are_the_pinned_bytes(in_tmp):
    """The digits shards byte for byte: tars, usable.idx and stats.json, the index row for row (its
    parquet footer names the pyarrow version). Re-pinned when the index gained each example's
    content digest (the privacy budget's identity), when stats.json lost the owner-only counts, when
    it gained the digest of the params the shards were built with (dpfm validate's check of n), and when
    the eval split's captions got a generator of their own (the private shards' bytes unchanged).
    usable.idx's footer names the parquet it was derived from by a digest of that parquet's footer, which
    names the pyarrow version too: it is checked against the parquet beside it and pinned without it."""
    run_digits(eval_fraction=None)
    digest = hashlib.sha256()
    for f in sorted(f for f in Path("data/shards").rglob("*") if f.is_file()):
        data = f.read_bytes()
        if f.name == INDEX_NAME:
            data = json.dumps(pq.read_table(f).to_pylist(), sort_keys=True).encode()
        elif f.name == USABLE_NAME:
            footer, start = read_footer(f)
            assert footer.pop("source") == source_id(f.with_name(INDEX_NAME))
            data = data[:start] + json.dumps(footer, sort_keys=True).encode()
        digest.update(f"{f.relative_to('data/shards')}\n".encode() + data)
    assert digest.hexdigest() == "7872bbc1ec09831f7bea32d06b529a9b20de32026c7564bf1b2ab638437e4e24"


def test_index_dict_keeps_per_format_offset_columns(tmp_path):
    write_set(tmp_path, n=3)
    ds = ShardDataset(tmp_path)
    assert ds.index["png_offset"] == ds.index["image_offset"] and ds.index["png_size"] == ds.index["image_size"]
    assert all(ds.read_member(i, "png")[:4] == b"\x89PNG" for i in range(3))


def test_index_written_before_image_formats_were_recorded_still_reads(tmp_path):
    samples = write_set(tmp_path, n=7, per_shard=3)
    rows = pq.read_table(tmp_path / INDEX_NAME).to_pylist()
    old = [{"key": r["key"], "shard": r["shard"], "caption_len": r["caption_len"], "status": r["status"],
            "png_offset": r["image_offset"], "png_size": r["image_size"], "txt_offset": r["txt_offset"],
            "txt_size": r["txt_size"], "json_offset": r["json_offset"], "json_size": r["json_size"]} for r in rows]
    old[2]["status"] = "corrupt"
    pq.write_table(pa.Table.from_pylist(old), tmp_path / INDEX_NAME)
    ds = ShardDataset(tmp_path)
    assert len(ds) == 6 and ds.status_counts == {"ok": 6, "corrupt": 1}
    assert [ds.caption(i) for i in range(6)] == [s[2] for j, s in enumerate(samples) if j != 2]
    assert ds.read_member(5, "png") == samples[6][1]


def test_key_hash_and_split_hash_are_pinned():
    """The eval split is a public function of (seed, key): these values must never change."""
    keys = ["a", "p000001-f002", "sample/0042", "ünï"]
    hashes = [key_hash(k) for k in keys]
    assert hashes == [3405396810240292928, 17999449861128510578, 7046866633665362826, 10938549402560586072]
    hashes = np.array(hashes, dtype=np.uint64)
    assert _split_hash(hashes, 0).tolist() == [5176070045968237, 6130894691748742, 1071556014825212,
                                               2991454428176193]
    assert _split_hash(hashes, 3).tolist() == [1438132064806915, 1740191441288700, 3457767380144349,
                                               6774793315003243]
    assert _split_hash(hashes, -1).tolist() == [8814952727909403, 443484150666229, 8625889468561468,
                                                3346392537386807]
    assert _split_hash(hashes, 2**40).tolist() == [1086391519962111, 3935090871261176, 3975415982119241,
                                                   8336609483162168]


def test_an_image_in_both_splits_under_two_keys_stays_on_one_side_only(tmp_path):
    """The split is by key, the dedup by image: an image whose first copy lands in the private split and
    a copy under another key in the eval split must be dropped from eval too, or the model is evaluated
    on an example it trained on (and the eval split holds a private example twice over)."""
    rng = np.random.default_rng(11)
    images = [encode_jpeg(picture(rng, 16)) for _ in range(12)]
    raw_tar(tmp_path / "1.tar", [m for i, x in enumerate(images) for m in good(f"k{i}a", image=x)])
    raw_tar(tmp_path / "2.tar", [m for i, x in enumerate(images) for m in good(f"k{i}b", caption="other", image=x)])
    held_out = _split_hash(np.array([key_hash(f"k{i}{c}") for i in range(12) for c in "ab"], dtype=np.uint64), 0)
    held_out = (held_out < 2**52).reshape(12, 2)  # eval_fraction 0.5: the keys below 2⁵²
    assert any(not a and b for a, b in held_out)  # a first copy private, its later copy in eval
    with contextlib.chdir(tmp_path):
        stats = build_index([str(tmp_path / "1.tar"), str(tmp_path / "2.tar")], tmp_path / "o", eval_fraction=0.5,
                            seed=0, cache_dir=tmp_path / "c", workers=1, check_size=SIZE)
    private, held = ShardDataset(tmp_path / "o/private"), ShardDataset(tmp_path / "o/eval")
    seen = [{hashlib.sha256(ds.read_member(i, "jpg")).hexdigest() for i in range(len(ds))} for ds in (private, held)]
    assert not seen[0] & seen[1] and len(private) + len(held) == 12 == len(seen[0] | seen[1])
    assert stats["private"]["usable"] + stats["eval"]["usable"] == 12


def test_an_unusable_first_copy_does_not_make_a_later_good_copy_a_duplicate(tmp_path):
    """Only usable rows compete for a key or an image: a first copy that is corrupt (or has no caption)
    is excluded for that reason, and the later good copy is the example, not a duplicate of nothing."""
    rng = np.random.default_rng(12)
    x = encode_jpeg(picture(rng, 16))
    raw_tar(tmp_path / "1.tar", [("a.jpg", b"not an image"), ("a.txt", b"cap"), ("m.jpg", x), ("m.txt", b"  ")]
            + good("b", rng))
    raw_tar(tmp_path / "2.tar", good("a", rng, "second") + good("n", image=x))
    stats, ds = index([tmp_path / "1.tar", tmp_path / "2.tar"], tmp_path)
    assert ds.index["key"] == ["b", "a", "n"] and ds.caption(1) == "second"
    assert excluded(stats) == {"corrupt_image": 1, "missing_caption": 1}


def test_writer_rejects_a_key_repeated_in_a_later_shard(tmp_path):
    """Keys are unique across the whole set, not per tar: the same key in two shards is the same example
    written twice (counted twice in n)."""
    with pytest.raises(ValueError, match="duplicate sample key"):
        with ShardWriter(tmp_path, samples_per_shard=1) as w:
            for key in ("a", "b", "a"):
                w.write(key, encode_png(picture(np.random.default_rng(0))), "c", {})


def test_a_shard_interrupted_mid_write_leaves_no_temporary_file(tmp_path):
    """A worker stopped by Ctrl-C (KeyboardInterrupt, not an Exception) while writing its shard removes
    the half-written tar at once, like any other failure."""
    def samples():
        yield "a", encode_png(picture(np.random.default_rng(0))), "c", {}
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as handled:
        write_shard(tmp_path / "s-000000.tar", 0, samples())
    assert handled.traceback and not list(tmp_path.iterdir())


def test_a_scan_killed_while_caching_a_shard_leaves_nothing_the_next_scan_takes_for_a_scan(tmp_path, monkeypatch):
    """A scan stopped while writing a shard's cached scan (kill, Ctrl-C) must leave no half-written piece:
    the next build would find it, fail to read it, and skip the whole shard (its examples lost to n)."""
    from pipeline.data import index as index_module

    write_set(tmp_path / "w", n=10, per_shard=5)
    urls = sorted((tmp_path / "w").glob("*.tar"))
    real = index_module.pq.write_table

    def killed(table, where, *a, **k):
        real(table, where, *a, **k)
        Path(where).write_bytes(Path(where).read_bytes()[:100])  # half of it on disk
        raise KeyboardInterrupt

    monkeypatch.setattr(index_module.pq, "write_table", killed)
    with pytest.raises(KeyboardInterrupt):
        index(urls, tmp_path)
    monkeypatch.setattr(index_module.pq, "write_table", real)
    stats, ds = index(urls, tmp_path, name="again", cache="out")
    assert len(ds) == 10 and stats["shards"]["skipped"] == []


def test_index_writer_holds_at_most_a_row_group_of_rows_at_a_time(tmp_path, monkeypatch):
    """Memory flat in n: the index is written a row group at a time as the shards are read, never
    gathered whole (233M rows) before the first write."""
    from pipeline.data import index as index_module

    write_set(tmp_path / "w", n=40, per_shard=5)
    monkeypatch.setattr(index_module, "ROW_GROUP_ROWS", 8)
    gathered, concat = [], index_module.pa.concat_tables
    monkeypatch.setattr(index_module.pa, "concat_tables", lambda ts, *a, **k: gathered.append(sum(map(len, ts)))
                        or concat(ts, *a, **k))
    _, ds = index(sorted((tmp_path / "w").glob("*.tar")), tmp_path)
    assert len(ds) == 40 and sum(gathered) == 40 and max(gathered) < 8 + 5  # a group, and at most a shard more


def test_header_check_catches_an_offset_onto_another_samples_member_of_the_same_size(tmp_path):
    """A stale offset can land on another sample's member of the very same size (two samples' json of
    one length): only the member's name in the tar header tells, else the read returns another
    example's bytes as this one's."""
    write_set(tmp_path, n=4, per_shard=4)
    table = pq.read_table(tmp_path / INDEX_NAME)
    rows = table.to_pylist()
    assert rows[0]["json_size"] == rows[1]["json_size"]
    rows[0]["json_offset"] = rows[1]["json_offset"]
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), tmp_path / INDEX_NAME)
    (tmp_path / USABLE_NAME).unlink()  # derived anew from the edited parquet
    ds = ShardDataset(tmp_path)
    assert ds.meta(1) == {"label": 1}
    with pytest.raises(IndexMismatch, match="expects member 's0000.json'"):
        ds.meta(0)


def test_starting_decoding_workers_leaves_the_training_process_stop_signals_unblocked(tmp_path):
    """The stop signals are blocked only while the workers start; left blocked, a SIGTERM from SLURM
    would stay pending in the training process for the whole run and it would never checkpoint."""
    write_set(tmp_path, n=12, per_shard=6)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    batches = BatchLoader(ShardDataset(tmp_path), 4, workers=2, prefetch=1)([np.arange(3), np.arange(3, 6)])
    next(batches)  # the workers have started
    try:
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
    finally:
        batches.close()


def test_a_worker_error_stops_the_decoding_workers_while_the_error_is_still_held(tmp_path):
    """A worker's decoding error reaches the caller with a traceback that holds the loader's iterator;
    unless the loader stops its workers itself they (stop signals ignored) outlive it, and the
    process's exit waits on them for ever."""
    write_set(tmp_path, n=12, per_shard=6)
    ds = ShardDataset(tmp_path)
    size, offset = int(ds._rows.sizes["image"][5]), int(ds._rows.offsets["image"][5])
    shard = sorted(tmp_path.glob("*.tar"))[0]
    data = bytearray(shard.read_bytes())
    data[offset:offset + size] = bytes(size)  # example 5 no longer decodes; its tar header still checks out
    shard.write_bytes(bytes(data))
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(ValueError, match="no longer decodes") as held:
        for _ in BatchLoader(ShardDataset(tmp_path), 4, workers=2, prefetch=1)([np.arange(4, 8)]):
            pass
    assert held.value is not None  # the traceback (and the frames it holds) are alive here
    left = [p.pid for p in psutil.Process().children() if p.pid not in before]
    del held  # let go, so that workers left running here stop and do not hang the session's exit
    gc.collect()
    assert left == []
