"""Shard sources (pipeline/data/sources.py) and remote shards: URL lists with brace patterns, shards
over http with ranged reads, img2dataset folders, and the resumable (url, caption) downloader.

Network traffic stays on a loopback server started per test (127.0.0.1, an ephemeral port; the `serve`
fixture, tests/http_server.py), which speaks HTTP Range like S3 and web servers do, and can be told to
ignore it, to fail, to be slow.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import tarfile
import time
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from http_server import closed_port
from shard_data import img2dataset_folder, write_set

from pipeline.config import load_params, sections_of
from pipeline.data import remote, sources
from pipeline.stages import shards as shards_stage, stage
from pipeline.data.index import build_index
from pipeline.data.loader import BatchLoader
from pipeline.data.shards import ShardDataset, encode_png
from pipeline.io import file_digest
from pipeline.data.transforms import decode_image
from pipeline.io import read_json


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)


def scan(urls, tmp_path, name="out"):
    with contextlib.chdir(tmp_path):  # the owner's log of skipped and damaged shards: in the test's project
        return build_index(urls, tmp_path / name, eval_fraction=1e-9, seed=0, cache_dir=tmp_path / f"{name}-cache",
                           workers=1, check_size=8)


# -- URL lists ----------------------------------------------------------------------------------------

def test_brace_patterns_expand_in_order_and_local_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sources, "storage", lambda url: None)  # s3fs need not be installed to list s3:// shards
    urls = sources.expand_urls(["https://host/d/{00008..00011}.tar", "rel/s-{a,b}.tar", "s3://b/x.tar"])
    assert urls == ["https://host/d/00008.tar", "https://host/d/00009.tar", "https://host/d/00010.tar",
                    "https://host/d/00011.tar", str(tmp_path / "rel/s-a.tar"), str(tmp_path / "rel/s-b.tar"),
                    "s3://b/x.tar"]


def test_a_shard_listed_twice_or_no_shard_is_an_error(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="listed twice"):
        sources.expand_urls(["https://h/{0..3}.tar", "https://h/2.tar"])
    monkeypatch.chdir(tmp_path)  # one local shard under three spellings: a file URL, absolute, relative
    for again in (str(tmp_path / "d/0.tar"), "d/../d/0.tar"):
        with pytest.raises(ValueError, match="listed twice"):
            sources.expand_urls([f"file://{tmp_path}/d/{{0..1}}.tar", again])
    with pytest.raises(ValueError, match="empty"):
        sources.expand_urls([])


# -- shards over http -------------------------------------------------------------------------------

def test_http_shards_are_scanned_and_read_by_range(tmp_path, serve):
    write_set(tmp_path / "w", n=14)
    server = serve(tmp_path / "w")
    urls = sources.expand_urls([f"{server.url}/s-{{000000..000002}}.tar"])
    stats = scan(urls, tmp_path)
    remote_ds, local = ShardDataset(tmp_path / "out/private"), ShardDataset(tmp_path / "w")
    assert stats["private"]["usable"] == len(remote_ds) == len(local) == 14
    before = server.requests.copy()
    for i in (13, 0, 7):
        assert remote_ds.read_sample(i) == local.read_sample(i)
    assert sum((server.requests - before).values()) == 3  # one ranged GET per sample: members are adjacent
    assert all(np.array_equal(remote_ds.image(i), local.image(i)) for i in range(14))
    # Decoding workers are forked after the parent has used its http client: they open their own.
    batches = [np.array([0, 5, 13]), np.array([2, 3])]
    over_http = [x for _, (x,) in BatchLoader(remote_ds, 8, workers=2)(batches)]
    on_disk = [x for _, (x,) in BatchLoader(local, 8)(batches)]
    assert all(torch.equal(a, b) for a, b in zip(over_http, on_disk)) and len(over_http) == 2


def test_a_server_that_ignores_range_requests_is_refused_and_the_owner_is_told_why(tmp_path, serve):
    write_set(tmp_path / "w", n=3)
    server = serve(tmp_path / "w", ignore_range=True)
    with pytest.raises(ValueError, match="none of the shards could be read.*owner only") as refused:
        scan([f"{server.url}/s-000000.tar"], tmp_path)
    assert "ignores HTTP Range" not in str(refused.value)  # why a shard failed is the owner's to read
    assert "ignores HTTP Range requests" in (tmp_path / ".dpfm/owner/shards.log").read_text()


def test_unreachable_urls_are_skipped_and_counted(tmp_path, serve):
    write_set(tmp_path / "w", n=3)
    server = serve(tmp_path / "w")
    dead = f"http://127.0.0.1:{closed_port()}/s-000000.tar"
    stats = scan([f"{server.url}/s-000000.tar", f"{server.url}/nope.tar", dead], tmp_path)
    assert stats["private"]["usable"] == 3
    assert stats["shards"]["indexed"] == 1
    assert [s["url"] for s in stats["shards"]["skipped"]] == [f"{server.url}/nope.tar", dead]


# -- img2dataset output ----------------------------------------------------------------------------------

def test_img2dataset_folder_is_used_as_it_is(tmp_path, monkeypatch, capsys):
    img2dataset_folder(tmp_path / "laion", np.random.default_rng(0))
    monkeypatch.chdir(tmp_path)
    urls, info = sources.img2dataset_shards(str(tmp_path / "laion"))
    assert [Path(u).name for u in urls] == ["00000.tar", "00001.tar"]
    assert info["img2dataset"] == {"count": 7, "successes": 5, "failed_to_download": 2, "failed_to_resize": 0}
    assert [Path(u).name for u in info["incomplete_shards"]] == ["00002.tar"]
    # an unfinished shard of the private data is the owner's to know: logged for them, not printed
    assert "00002.tar" in (tmp_path / ".dpfm/owner/shards.log").read_text()
    assert "00002" not in "".join(capsys.readouterr())
    stats = scan(urls, tmp_path)
    ds = ShardDataset(tmp_path / "out/private")
    assert stats["private"]["usable"] == len(ds) == info["img2dataset"]["successes"]
    assert ds.caption(4) == "a photo 000010001" and ds.image(4).shape == (20, 30, 3)
    assert not list((tmp_path / "out/private").glob("*.tar"))  # indexed where they are, not copied


def test_an_img2dataset_folder_is_listed_in_calls_that_do_not_grow_with_its_shards(tmp_path, monkeypatch):
    """On an object store each call is a round trip: an exists and an open per shard, one after another,
    was some 46k sequential requests for 23k shards, in each of ~230 scan jobs. Two listings and one
    (concurrent) read of every stats file, whatever the count; the scan jobs read none."""
    calls = []

    class Counting:
        def __init__(self, fs):
            self.fs = fs

        def __getattr__(self, name):
            calls.append(name)
            return getattr(self.fs, name)

    real_storage = sources.storage
    monkeypatch.setattr(sources, "storage", lambda url: (lambda fs, root: (Counting(fs), root))(*real_storage(url)))
    seen = {}
    for shards in (3, 7):
        img2dataset_folder(tmp_path / f"i2d-{shards}", np.random.default_rng(0), counts=(1,) * shards, shape=(4, 4))
        for stats in (True, False):
            calls.clear()
            urls, info = sources.img2dataset_shards(str(tmp_path / f"i2d-{shards}"), stats)
            assert len(urls) == shards - 1 and info["img2dataset"]["successes"] == (shards - 1 if stats else 0)
            seen[shards, stats] = sorted(calls)
    assert seen[3, True] == seen[7, True] == ["cat", "glob", "glob", "isdir"]
    assert seen[3, False] == seen[7, False] == ["glob", "glob", "isdir"]


def test_the_source_files_tag_follows_the_private_sources_files_but_not_their_sizes(tmp_path):
    """Snakemake compares it as a param of the shards stage (rules/common.smk): a table edited in place,
    the shards img2dataset finished after a run, a local shard rewritten left the shards (and the model)
    up to date with the old data. Sizes are statistics of the examples: the tag never reads them."""
    from pipeline.stages import source_files_tag

    folder = tmp_path / "i2d"
    img2dataset_folder(folder, np.random.default_rng(0))
    table = tmp_path / "pairs.csv"
    table.write_text("url,caption\nhttp://x/a.png,a cat\n")
    configs = {"img2dataset": {"source": "img2dataset", "path": str(folder), "urls": []},
               "download": {"source": "download", "path": str(table), "urls": []},
               "urls": {"source": "urls", "path": None, "urls": [f"{folder}/{{00000..00001}}.tar",
                                                                 "https://example.com/00000.tar"]}}
    tags = {name: source_files_tag(cfg) for name, cfg in configs.items()}
    assert len(set(tags.values())) == 3 and {n: source_files_tag(c) for n, c in configs.items()} == tags

    def moved(path: Path, size_only: bool = False) -> None:  # rewritten in place, a second later
        stat = path.stat()
        if size_only:
            path.write_bytes(path.read_bytes() + b"\0")
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + (0 if size_only else 10**9)))

    moved(table, size_only=True)  # same name and time: the tag cannot tell, and must not read the size
    assert source_files_tag(configs["download"]) == tags["download"]
    moved(table)
    moved(folder / "00001.tar")
    changed = {name: source_files_tag(cfg) for name, cfg in configs.items()}
    assert all(changed[n] != tags[n] for n in tags)
    (folder / "00002_stats.json").write_text("{}")  # img2dataset finished the last shard
    assert source_files_tag(configs["img2dataset"]) != changed["img2dataset"]
    assert source_files_tag({"source": "digits", "path": None, "urls": []}) == source_files_tag(
        {"source": "urls", "path": None, "urls": ["{bad"]})  # nothing to follow (the stage names the bad pattern)


def test_img2dataset_folder_errors(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        sources.img2dataset_shards(str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="no .tar shards"):
        sources.img2dataset_shards(str(tmp_path))
    img2dataset_folder(tmp_path / "laion", np.random.default_rng(0))
    (tmp_path / "laion/00001_stats.json").write_text('{"count": 3, "successes"')  # cut mid-write
    with pytest.raises(sources.SourceError, match=r"00001_stats.json: not an img2dataset stats file"):
        sources.img2dataset_shards(str(tmp_path / "laion"))


def test_a_shard_list_that_cannot_be_read_is_one_line_naming_it_before_any_scan(tmp_path, monkeypatch, capsys):
    """Unbalanced braces, a storage package that is not installed: a traceback, or for the package an
    error per shard kept owner-only ("none of the shards could be read"), where one line says what to do."""
    from pipeline import cli

    with pytest.raises(sources.SourceError, match="Unbalanced braces"):
        sources.expand_urls(["/x/{0..3.tar"])
    monkeypatch.setattr(remote.fsspec.core, "url_to_fs", lambda url, **options: (_ for _ in ()).throw(ImportError("no s3fs")))
    with pytest.raises(sources.SourceError, match=r"s3:// protocol needs the package s3fs"):
        sources.expand_urls(["s3://bucket/{0..2}.tar"])
    import shutil

    root = Path(__file__).resolve().parents[1]
    shutil.copy(root / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(root / "schemas", tmp_path / "schemas")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert cli.main(["pretrain"]) == 1  # a missing input: one line naming it, no traceback
    assert "data/synthetic/index.parquet is missing" in capsys.readouterr().err


# -- downloading a (url, caption) table ------------------------------------------------------------------

def test_download_retries_skips_counts_and_resumes(tmp_path, serve, capsys, monkeypatch):
    rng = np.random.default_rng(0)
    (tmp_path / "www").mkdir()
    for i in range(11):  # img10: the flaky row's own image (the same image under another caption is a duplicate)
        (tmp_path / "www" / f"img{i}.png").write_bytes(encode_png(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)))
    (tmp_path / "www/notimage.png").write_bytes(b"<html>gone</html>")
    server = serve(tmp_path / "www")
    u = server.url
    rows = ([(f"{u}/img{i}.png", f"picture {i}") for i in range(10)]
            + [(f"{u}/missing1.png", "x"), (f"{u}/missing2.png", "y"), (f"{u}/slow/img0.png", "slow"),
               (f"{u}/flaky/img10.png", "flaky"), (f"{u}/notimage.png", "z"), (f"{u}/img2.png", ""),
               (f"http://127.0.0.1:{closed_port()}/img.png", "dead"), (f"{u}/img3.png", "  ")])
    table = tmp_path / "pairs.csv"

    def write_table():
        table.write_text("url,caption\n" + "".join(f'{a},"{b}"\n' for a, b in rows))
    write_table()
    kwargs = dict(image_size=16, samples_per_shard=6, threads=4, timeout_s=4.0, retries=1)
    out = tmp_path / "dl"

    shards, stats = sources.download(str(table), out, **kwargs)
    assert stats["download"] == {"rows": 18, "written": 11, "shards": 3, "reused_shards": 0, "failed": {
        "http_404": 2, "timeout": 1, "not_image": 1, "missing_caption": 2, "connection": 1}}
    # Its progress names no count: the rows less the usable (published) count is how many failed.
    printed = "".join(capsys.readouterr())
    assert "download" in printed and "100%" in printed
    printed = re.sub(r"\d+%", "", printed)  # the shares: every whole percent, whatever the total (below)
    assert not [c for c in ("18", "11", "6") if re.search(rf"(?<![\d.]){c}(?![\d])", printed)], printed
    assert server.requests["/flaky/img10.png"] == 2     # a 503 is retried...
    assert server.requests["/missing1.png"] == 1        # ...a 404 is not
    assert server.requests["/slow/img0.png"] == 2       # timed out twice (retries=1), then skipped
    index_stats = scan(shards, tmp_path)
    ds = ShardDataset(tmp_path / "out/private")
    assert index_stats["private"]["usable"] == len(ds) == 11
    assert ds.image(0).shape == (16, 16, 3) and ds.caption(10) == "flaky" and ds.meta(10)["row"] == 13

    # Resume: complete shards (size and sha256 as recorded) are kept without a request, and without
    # reading them back: their size, mtime and inode are as when their sha256 was taken.
    requests = sum(server.requests.values())
    read = []
    monkeypatch.setattr(sources, "file_digest", lambda path, *a: read.append(Path(path).name) or file_digest(path, *a))
    shards2, stats2 = sources.download(str(table), out, **kwargs)
    assert shards2 == shards and stats2["download"]["reused_shards"] == 3
    assert sum(server.requests.values()) == requests and read == []
    # A damaged shard is downloaded again; the others are still kept, unread.
    damaged = Path(shards[1])
    damaged.write_bytes(damaged.read_bytes()[:1000])
    _, stats3 = sources.download(str(table), out, **kwargs)
    assert stats3["download"]["reused_shards"] == 2 and stats3["download"]["written"] == 11
    assert server.requests["/img6.png"] == 2 and server.requests["/img0.png"] == 1
    assert read == [damaged.name]  # the new shard's own sha256, as it is written
    # Rewritten in place at its size (bytes flipped): the moved mtime sends it to its sha256, which
    # tells, and it is downloaded again.
    data = bytearray(damaged.read_bytes())
    data[600] ^= 0xFF
    damaged.write_bytes(bytes(data))
    os.utime(damaged, ns=(time.time_ns(), time.time_ns() + 10**9))
    read.clear()
    _, stats4 = sources.download(str(table), out, **kwargs)
    assert stats4["download"]["reused_shards"] == 2 and server.requests["/img6.png"] == 3
    assert read == [damaged.name, damaged.name]  # checked, then written again
    assert not list(out.glob(".*.tmp"))  # writes are atomic: no temporary files left
    # The table edited (a caption corrected in shard 0, a dead row's URL replaced in shard 1): those two
    # shards are downloaded again from the table's new rows, the third is kept.
    rows[1], rows[10] = (f"{u}/img1.png", "picture one, corrected"), (f"{u}/img10.png", "x")
    write_table()
    _, stats5 = sources.download(str(table), out, **kwargs)
    assert stats5["download"]["reused_shards"] == 1 and stats5["download"]["written"] == 12
    assert server.requests["/img10.png"] == 1 and server.requests["/img1.png"] == 2
    with tarfile.open(shards[0]) as t:
        assert t.extractfile("000000001.txt").read() == b"picture one, corrected"


@pytest.mark.parametrize("code, transient", [(408, True), (425, True), (429, True), (500, True), (502, True),
                                             (503, True), (400, False), (403, False), (404, False), (410, False)])
def test_a_server_error_or_throttling_is_retried_and_a_refusal_is_not(monkeypatch, code, transient):
    """A row lost to a passing 500 or 429 shrinks n for nothing; a 404 retried only wastes the table's time."""
    import urllib.error

    asked = []

    def refuse(request, timeout):
        asked.append(request.full_url)
        raise urllib.error.HTTPError(request.full_url, code, "", {}, None)
    monkeypatch.setattr(sources.urllib.request, "urlopen", refuse)
    with pytest.raises(sources.FetchFailed) as e:
        sources.fetch("http://host/a.jpg", timeout_s=1.0, retries=2)
    assert e.value.reason == f"http_{code}" and len(asked) == (3 if transient else 1)


def test_what_a_download_prints_does_not_depend_on_which_rows_stall_or_fail(tmp_path, capsys, monkeypatch,
                                                                            progress_clock):
    """Measured: a 40-row table downloaded twice, once with every row answering at once and once with
    one row stalling 30 s before it times out (as a dead host does) and another slow but fine, and a
    23-row table. What is printed is the same text: the share, every whole percent, no count, no time,
    no redraw the clock decides. It fails with a bar that shows elapsed time (the stall shows as an
    extra line where it happened) and with one that skips the percents a large step passes (the
    shares drawn would give the table's rows, and with the usable count how many failed)."""
    rng = np.random.default_rng(1)
    png = encode_png(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8))
    printed = {}
    for stalls, rows in ((False, 40), (True, 40), (False, 23)):
        table = tmp_path / f"pairs{rows}.csv"
        table.write_text("url,caption\n" + "".join(f"http://host/img{i}.png,picture {i}\n" for i in range(rows)))

        def fetch(url, timeout_s, retries, stalls=stalls):
            if stalls and url.endswith("/img7.png"):
                progress_clock.advance(30.0)
                raise sources.FetchFailed("timeout", transient=True)
            progress_clock.advance(9.0 if stalls and url.endswith("/img20.png") else 0.001)
            return png

        monkeypatch.setattr(sources, "fetch", fetch)
        _, stats = sources.download(str(table), tmp_path / f"dl{stalls}{rows}", image_size=16,
                                    samples_per_shard=8, threads=1, timeout_s=30.0, retries=0)
        assert stats["download"]["written"] == rows - stalls
        printed[stalls, rows] = "".join(capsys.readouterr())
    assert printed[False, 40] == printed[True, 40] == printed[False, 23], printed
    assert re.findall(r"(\d+)%", printed[True, 40]) == [str(p) for p in range(101)] + ["100"], printed
    assert not re.search(r"\d\d:\d\d|/s\b", printed[True, 40]), printed


def test_what_the_shards_stage_prints_of_a_download_does_not_depend_on_how_many_rows_failed(tmp_path, capsys,
                                                                                          monkeypatch):
    """Measured on the whole stage (download, scan, index): two tables with the same 12 usable rows, one
    with no failed row and one with 20 more that fail, five more shards of 4 rows to download and scan.
    The published n is the same, so a count of rows or shards printed would give how many failed: what
    the stage prints is the same text. It failed with the scan's bar counting shards (3/3 against 8/8)."""
    def fetch(url, timeout_s, retries):
        if "/gone" in url:
            raise sources.FetchFailed("http_404", transient=False)
        image = int(re.search(r"img(\d+)", url)[1])  # an image of its own: one image is one example (dedup)
        return encode_png(np.random.default_rng([2, image]).integers(0, 256, (20, 20, 3), dtype=np.uint8))

    monkeypatch.setattr(sources, "fetch", fetch)
    tracker = types.SimpleNamespace(log_metrics=lambda *a, **k: None)
    printed = {}
    for failed in (0, 20):
        work = tmp_path / f"failed{failed}"
        work.mkdir()
        good = [f"http://host/img{i}.png,picture {i}\n" for i in range(12)]
        gone = [f"http://host/gone{i}.png,lost {i}\n" for i in range(failed)]
        (work / "pairs.csv").write_text("url,caption\n" + "".join(good[:6] + gone + good[6:]))
        params = load_params(overrides=["shards.source=download", "shards.path=pairs.csv", "shards.samples_per_shard=4",
                                        "shards.image_size=16", "shards.workers=1", "shards.download.threads=1"])
        with contextlib.chdir(work):
            shards_stage.run(sections_of(params, ("run", "shards")),
                             types.SimpleNamespace(stage=stage("shards"), tracker=tracker, threads=1))
            assert read_json("data/shards/stats.json")["private"]["usable"] == 12
            assert read_json(".dpfm/owner/shards.json")["download"]["shards"] == 3 + 5 * (failed > 0)
        printed[failed] = "".join(capsys.readouterr())
    assert "download" in printed[0] and "scan shards" in printed[0], printed[0]
    assert printed[0] == printed[20], printed


def test_a_download_meets_its_deadline_reads_web_urls_only_and_escapes_non_ascii(tmp_path, serve):
    """A server sending a byte every 50 ms never trips a 1 s socket timeout: read(64 KiB) waited for the
    whole 64 KiB (or the end), so one slow URL held its shard, and the download, until the server chose
    to stop (here 20 s; a real one, days). A row of the table may not make the downloader read its own
    files (file:) or other services (ftp:). A URL with a non-ASCII path (common in crawls) was refused
    by urllib as bad_url; it is sent percent-encoded, as browsers send it."""
    (tmp_path / "www").mkdir()
    image = encode_png(np.arange(192, dtype=np.uint8).reshape(8, 8, 3))
    (tmp_path / "www/slow.png").write_bytes(image[:400])
    (tmp_path / "www/café ü.png").write_bytes(image)
    server = serve(tmp_path / "www")
    start = time.monotonic()
    with pytest.raises(sources.FetchFailed) as failed:
        sources._get(f"{server.url}/trickle/slow.png", timeout_s=1.0)
    assert failed.value.reason == "timeout" and time.monotonic() - start < 5
    assert sources.fetch(f"{server.url}/café ü.png", timeout_s=4.0, retries=0) == image
    assert server.requests["/café ü.png"] == 1
    for url in (f"file://{tmp_path}/www/café ü.png", "ftp://127.0.0.1/a.png", "/etc/hostname", "http:///a.png"):
        with pytest.raises(sources.FetchFailed) as failed:
            sources.fetch(url, timeout_s=1.0, retries=2)
        assert failed.value.reason == "bad_url", url
    assert (sources.web_uri("http://bücher.example:80/a b/ä.png?q=ü&x=%20#top")
            == "http://xn--bcher-kva.example:80/a%20b/%C3%A4.png?q=%C3%BC&x=%20")


def test_an_image_in_a_format_outside_the_list_is_not_opened():
    """Pillow guesses a format from the bytes: an EPS file under a .jpg name opened as EPS, and reading
    it runs Ghostscript on bytes a web page or a shard supplied. Only the listed formats are opened."""
    from PIL import Image, UnidentifiedImageError

    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n0 0 moveto 8 8 lineto stroke\n%%EOF\n"
    assert Image.open(io.BytesIO(eps)).format == "EPS"  # what Pillow makes of them, left to guess
    with pytest.raises(UnidentifiedImageError):
        decode_image(eps, 8)
    assert decode_image(encode_png(np.zeros((8, 8, 3), np.uint8)), 8).shape == (8, 8, 3)


def test_download_table_problems_are_clear_errors(tmp_path):
    (tmp_path / "t.csv").write_text("link,text\nhttp://x/a.png,hi\n")
    with pytest.raises(ValueError, match="no column 'url'.*link, text.*url_column"):
        sources.download(str(tmp_path / "t.csv"), tmp_path / "o", image_size=8, samples_per_shard=4)
    (tmp_path / "t.json").write_text("{}")
    with pytest.raises(ValueError, match="expected a .parquet, .csv or .tsv"):
        sources.download(str(tmp_path / "t.json"), tmp_path / "o", image_size=8, samples_per_shard=4)
    with pytest.raises(ValueError, match="does not exist"):
        sources.download(str(tmp_path / "none.parquet"), tmp_path / "o", image_size=8, samples_per_shard=4)


@pytest.mark.parametrize("name, text", [
    ("t.csv", "url,caption\nhttp://x/a.png,hi\nhttp://secret.example/b.png,the secret, with a comma\n"),
    ("t.tsv", "url\tcaption\nhttp://secret.example/b.png\tthe secret\tand a third field\n"),
    ("t.parquet", "http://secret.example/b.png the secret: not a parquet file"),
])
def test_a_table_that_cannot_be_parsed_is_an_error_that_quotes_no_row(tmp_path, monkeypatch, name, text):
    """The parser's message quotes the row it failed on, a private URL and caption: the owner's log
    has it, the error names the file only."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(text)
    with pytest.raises(sources.SourceError, match="could not be read as a table") as refused:
        sources.download(str(tmp_path / name), tmp_path / "o", image_size=8, samples_per_shard=4)
    assert "secret" not in str(refused.value)
    assert "secret" in (tmp_path / ".dpfm/owner/shards.log").read_text() or name.endswith(".parquet")


@pytest.mark.parametrize("name", ["t.parquet", "t.csv", "t.tsv.gz"])
def test_a_table_is_read_a_slice_at_a_time_in_order_across_its_batches(tmp_path, monkeypatch, name):
    """`download` holds one shard's rows of the table, not the table (benchmarks/url_table_memory.py):
    slices of 4 rows from record batches of 3 are the table's rows in order."""
    import gzip

    monkeypatch.setattr(sources, "TABLE_BATCH_ROWS", 3)
    urls, captions = [f"http://x/{i}.png" for i in range(10)], [f"caption {i}" for i in range(10)]
    if name.endswith(".parquet"):
        pq.write_table(pa.table({"url": urls, "caption": captions}), tmp_path / name, row_group_size=3)
    else:
        sep = "\t" if ".tsv" in name else ","
        text = "".join(f"{u}{sep}{c}\n" for u, c in zip(["url", *urls], ["caption", *captions]))
        (tmp_path / name).write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    slices = list(sources.url_table_slices(str(tmp_path / name), "url", "caption", 4))
    assert [len(u) for u, _ in slices] == [4, 4, 2]
    assert sum((u for u, _ in slices), []) == urls and sum((c for _, c in slices), []) == captions


def test_parquet_table_with_other_column_names(tmp_path, serve):
    (tmp_path / "www").mkdir()
    (tmp_path / "www/a.png").write_bytes(encode_png(np.full((9, 9, 3), 200, np.uint8)))
    server = serve(tmp_path / "www")
    pq.write_table(pa.table({"URL": [f"{server.url}/a.png"], "TEXT": ["grey"]}), tmp_path / "t.parquet")
    shards, stats = sources.download(str(tmp_path / "t.parquet"), tmp_path / "o", image_size=8,
                                     samples_per_shard=4, url_column="URL", caption_column="TEXT")
    assert stats["download"]["written"] == 1
    with tarfile.open(shards[0]) as t:
        image = decode_image(t.extractfile("000000000.jpg").read())
    assert image.shape == (8, 8, 3) and abs(int(image.mean()) - 200) <= 2


# -- the stage -------------------------------------------------------------------------------------

def test_shards_stage_with_a_url_list(in_tmp):
    write_set(in_tmp / "ext", n=40, per_shard=10)
    with tarfile.open(in_tmp / "ext/s-000004.tar", "w") as t:  # one more shard, with a corrupt image
        for name, data in (("bad.png", b"not a png"), ("bad.txt", b"caption")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    pattern = str(in_tmp / "ext/s-{000000..000004}.tar")
    # The params as `dpfm shards --set ...` would validate them; the MLflow tracker is stubbed (slow).
    params = load_params(overrides=["shards.source=urls", f"shards.urls=['{pattern}']",
                                    "shards.eval_fraction=0.25", "shards.workers=1"])
    tracker = types.SimpleNamespace(log_metrics=lambda *a, **k: None)
    shards_stage.run(sections_of(params, ("run", "shards")), types.SimpleNamespace(stage=stage("shards"), tracker=tracker, threads=1))
    stats = read_json("data/shards/stats.json")
    private, held = ShardDataset("data/shards/private"), ShardDataset("data/shards/eval")
    assert stats["private"]["usable"] == len(private) and stats["eval"]["usable"] == len(held)
    assert len(private) + len(held) == 40
    # What was excluded, and why, is a statistic of the private data: published stats.json holds n only.
    assert set(stats["private"]) == {"usable"} and "shards" not in stats
    owner = read_json(".dpfm/owner/shards.json")
    assert sum(owner[s]["excluded"].get("corrupt_image", 0) for s in ("private", "eval")) == 1
    assert owner["shards"]["indexed"] == 5 and stats["source"] == "urls"


def test_a_source_with_no_usable_private_example_stops_the_stage_and_leaves_no_shards(in_tmp):
    from shard_data import raw_tar

    (in_tmp / "ext").mkdir()
    for s in range(2):  # every sample's image is corrupt
        raw_tar(in_tmp / f"ext/s-{s}.tar", [m for i in range(3) for m in ((f"b{s}{i}.jpg", b"x"),
                                                                           (f"b{s}{i}.txt", b"a"))])
    params = load_params(overrides=["shards.source=urls", f"shards.urls=['{in_tmp}/ext/s-{{0..1}}.tar']",
                                    "shards.workers=1"])
    ctx = types.SimpleNamespace(stage=stage("shards"), tracker=types.SimpleNamespace(log_metrics=print), threads=1)
    with pytest.raises(ValueError, match="no usable private examples"):
        shards_stage.run(sections_of(params, ("run", "shards")), ctx)
    assert not (in_tmp / "data/shards").exists() and not (in_tmp / "data/shards.digest").exists()
    assert read_json(".dpfm/owner/shards.json")["private"]["excluded"] == {"corrupt_image": 6}


@pytest.mark.parametrize("split, fraction", [("private", 0), ("eval", 0.5)])
def test_an_index_that_does_not_hold_the_counted_rows_is_refused_and_names_no_count(in_tmp, monkeypatch, split,
                                                                                    fraction):
    """n for accounting is the count the stage kept as it wrote the index: an index that lost (or gained)
    a row against it would train on another n than the one ε is computed for. Both splits are checked, and
    the message names no count (the parenthesis too): a web source's eval split is private data too."""
    write_set(in_tmp / "ext", n=20, per_shard=10)
    written = shards_stage.build_index

    def one_row_short(urls, out, **kw):
        stats = written(urls, out, **kw)
        index = out / split / "index.parquet"
        pq.write_table(pq.read_table(index).slice(1), index)
        return stats
    monkeypatch.setattr(shards_stage, "build_index", one_row_short)
    params = load_params(overrides=["shards.source=urls", f"shards.urls=['{in_tmp}/ext/s-{{000000..000001}}.tar']",
                                    f"shards.eval_fraction={fraction}", "shards.workers=1"])
    ctx = types.SimpleNamespace(stage=stage("shards"), tracker=types.SimpleNamespace(log_metrics=print), threads=1)
    with pytest.raises(RuntimeError, match=f"the {split} index does not hold the rows the stage counted") as e:
        shards_stage.run(sections_of(params, ("run", "shards")), ctx)
    assert not re.search(r"\d", str(e.value)), str(e.value)  # the counts go to the owner's log only
    held, counted = re.search(r"holds (\d+) rows, the stage counted (\d+)",
                              (in_tmp / ".dpfm/owner/shards.log").read_text()).groups()
    assert int(held) == int(counted) - 1  # for the owner
    assert not (in_tmp / "data/shards").exists()


def test_what_the_shards_stage_publishes_does_not_depend_on_how_many_samples_it_excluded(in_tmp, capsys):
    """Measured: two private sources of the same 30 usable samples, one with 1 corrupt image a shard and
    one with 6, a sample without a caption, a key twice, an image twice under two keys and a shard that
    is not a tar: what the stage prints, the metrics it logs and stats.json are the same. A count of the
    excluded samples, the duplicates or the unreadable shards anywhere in them ("6 skipped") differs."""
    from shard_data import good, raw_tar

    published, owner_side = [], []
    for bad in (1, 6):
        rng = np.random.default_rng(3)  # the same 30 good samples both times
        for built in ("data/shards", "data/cache", "ext"):  # the budget (and the owner's key) stay
            shutil.rmtree(in_tmp / built, ignore_errors=True)
        (in_tmp / "ext").mkdir()
        for s in range(3):
            members = [m for i in range(10) for m in good(f"k{s}{i:02d}", rng)]
            members += [m for i in range(bad) for m in ((f"bad{s}{i}.jpg", b"not a jpeg"), (f"bad{s}{i}.txt", b"a"))]
            if bad > 1:  # the second copy of a key, and of an image under a new key, are dropped
                again = good(f"k{s}00", np.random.default_rng(9))
                members += [(f"nocap{s}.jpg", members[0][1]), *again, (f"dup{s}.jpg", members[3][1]),
                            (f"dup{s}.txt", b"a photo")]
            raw_tar(in_tmp / f"ext/s-{s}.tar", members)
        junk = in_tmp / "ext/s-3.tar"  # a fourth shard: one corrupt sample, or no tar at all
        junk.write_bytes(b"not a tar " * 100) if bad > 1 else raw_tar(junk, [("bad.jpg", b"x"), ("bad.txt", b"a")])
        params = load_params(overrides=["shards.source=urls", f"shards.urls=['{in_tmp}/ext/s-{{0..3}}.tar']",
                                        "shards.workers=1", "shards.image_size=16"])
        logged = []
        tracker = types.SimpleNamespace(log_metrics=lambda metrics, **k: logged.append(metrics))
        capsys.readouterr()
        shards_stage.run(sections_of(params, ("run", "shards")),
                         types.SimpleNamespace(stage=stage("shards"), tracker=tracker, threads=1))
        kept = read_json(".dpfm/owner/shards.json")
        owner_side.append((kept["private"]["excluded"], kept["shards"]["damaged"] + kept["shards"]["skipped"]))
        published.append((capsys.readouterr(), logged, read_json("data/shards/stats.json")))
    assert published[0][2]["private"]["usable"] == 30
    (few, none), (many, damaged) = owner_side  # the owner's record does differ
    assert few == {"corrupt_image": 4} and not none and len(damaged) == 1
    assert many == {"corrupt_image": 18, "duplicate_content": 3, "duplicate_key": 3, "missing_caption": 3}
    assert published[0] == published[1]


@pytest.mark.parametrize("fraction, held_out", [(None, False), (0.25, True)])
def test_a_web_source_trains_on_all_private_data_unless_an_eval_split_is_asked_for(in_tmp, capsys, fraction,
                                                                                  held_out):
    write_set(in_tmp / "ext", n=40, per_shard=10)
    params = load_params(overrides=["shards.source=urls", f"shards.urls=['{in_tmp}/ext/s-{{000000..000003}}.tar']",
                                    f"shards.eval_fraction={'null' if fraction is None else fraction}",
                                    "shards.workers=1"])
    tracker = types.SimpleNamespace(log_metrics=lambda *a, **k: None)
    shards_stage.run(sections_of(params, ("run", "shards")), types.SimpleNamespace(stage=stage("shards"), tracker=tracker, threads=1))
    stats = read_json("data/shards/stats.json")
    assert stats["eval_from_private"] is held_out
    assert (stats["eval"]["usable"] > 0) is held_out and stats["private"]["usable"] + stats["eval"]["usable"] == 40
    assert ("NOT protected" in capsys.readouterr().out) is held_out


def test_digits_need_a_held_out_part(in_tmp):
    params = load_params(overrides=["shards.eval_fraction=0"])
    with pytest.raises(ValueError, match="eval_fraction=0 with source digits"):
        shards_stage.run(sections_of(params, ("run", "shards")), types.SimpleNamespace(stage=stage("shards"), threads=1))


def test_a_source_with_no_usable_private_example_says_so_without_a_count(in_tmp):
    """The error names where the owner's record is, never how many rows were read or excluded."""
    from shard_data import raw_tar

    (in_tmp / "ext").mkdir()
    raw_tar(in_tmp / "ext/s-0.tar", [m for i in range(7) for m in ((f"b{i}.jpg", b"x"), (f"b{i}.txt", b"a"))])
    params = load_params(overrides=["shards.source=urls", f"shards.urls=['{in_tmp}/ext/s-0.tar']", "shards.workers=1"])
    ctx = types.SimpleNamespace(stage=stage("shards"), tracker=types.SimpleNamespace(log_metrics=print), threads=1)
    with pytest.raises(ValueError, match="no usable private examples") as e:
        shards_stage.run(sections_of(params, ("run", "shards")), ctx)
    assert not re.search(r"\d", str(e.value)), str(e.value)


def test_a_download_at_another_image_size_is_not_taken_from_the_last_ones_shards(tmp_path, serve):
    """A finished shard is reused only for the same rows at the same image_size: the shards hold the
    images resized, so a resolution change must download them again, not train on the old size."""
    rng = np.random.default_rng(1)
    (tmp_path / "www").mkdir()
    for i in range(3):
        (tmp_path / "www" / f"img{i}.png").write_bytes(encode_png(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)))
    u = serve(tmp_path / "www").url
    table = tmp_path / "pairs.csv"
    table.write_text("url,caption\n" + "".join(f"{u}/img{i}.png,picture {i}\n" for i in range(3)))
    kwargs = dict(samples_per_shard=2, threads=2, timeout_s=4.0, retries=0)
    sources.download(str(table), tmp_path / "dl", image_size=16, **kwargs)
    shards, stats = sources.download(str(table), tmp_path / "dl", image_size=8, **kwargs)
    assert stats["download"]["reused_shards"] == 0
    with tarfile.open(shards[0]) as t:
        assert decode_image(t.extractfile("000000000.jpg").read()).shape == (8, 8, 3)
