"""Where the shards come from: a list of shard URLs, an img2dataset output folder, or a table of
(url, caption) rows downloaded into shards here. Each source resolves to a list of tar shards that
index.py scans; only a labelled set (data/labelled_sets.py, written by stages/shards.py) is written
without a scan.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from itertools import repeat
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
from braceexpand import braceexpand

from pipeline.config import ParamsError
from pipeline.data import remote
from pipeline.data.shards import TarShard
from pipeline.data.transforms import decode_image, encode_jpeg
from pipeline.io import file_digest, file_stamp, read_json, remove_stale_temps, write_json
from pipeline.privacy import owner
from pipeline.progress import ShareBar


TABLE_BATCH_ROWS = 65536  # rows of a (url, caption) table read at a time


class SourceError(ParamsError):
    """The configured source cannot be used (missing path, wrong format): `dpfm shards` says so in one
    line and exits 2, before anything is written."""

    def __init__(self, problem: str):
        super().__init__([problem], source="shards source")


USER_AGENT = "dpfm-downloader/0.1"
MAX_IMAGE_BYTES = 32 << 20
URI_SAFE = "/%:@!$&'()*+,;=~"  # reserved characters of a URL's path and query, and escapes, left as they are


# -- shard URL lists -------------------------------------------------------------------------------

def expand_urls(patterns: list[str]) -> list[str]:
    """Brace patterns (`.../{00000..00099}.tar`) to shard URLs; local paths made absolute.

    A shard listed twice would put its examples in the data twice (and double their privacy cost),
    so it is an error, as is an empty list.
    """
    try:
        urls = [remote.canonical(u) for p in patterns for u in braceexpand(p)]
    except Exception as e:  # braceexpand's UnbalancedBracesError
        raise SourceError(f"shards.urls: {e}") from None
    if not urls:
        raise SourceError("shards.urls is empty: list webdataset shard URLs or paths (brace patterns allowed)")
    seen = set()
    for u in urls:
        if u in seen:
            raise SourceError(f"shard {u} is listed twice in shards.urls: each shard must appear once")
        seen.add(u)
    for u in {u.split("://", 1)[0] if "://" in u else "": u for u in urls}.values():
        storage(u)  # once per protocol, before any scan: a missing package is no fact of the private data
    return urls


def storage(url: str):
    """remote.filesystem, with a missing storage package as a SourceError (one line, before any work)."""
    try:
        return remote.filesystem(url)
    except remote.ShardReadError as e:
        raise SourceError(str(e)) from None


# -- img2dataset output folders --------------------------------------------------------------------

def img2dataset_shards(folder: str, stats: bool = True) -> tuple[list[str], dict]:
    """The tars of an img2dataset output folder (output_format webdataset), used where they are.

    img2dataset writes `<id>_stats.json` once a shard is finished; a tar without it is left over
    from an interrupted run, so it is skipped and counted (owner-only). Two listings tell which are
    finished, and the stats files are read at once (concurrently from an object store): a request or
    two per shard, one after another, took minutes at 23k shards, in every scan job. `stats=False`
    (the scan jobs, which discard them) reads none.
    """
    fs, root = storage(folder)
    if not fs.isdir(root):
        raise SourceError(f"shards.path={folder} is not a folder (expected img2dataset output)")
    tars = sorted(fs.glob(f"{root.rstrip('/')}/*.tar"))
    if not tars:
        raise SourceError(f"{folder} has no .tar shards: is it img2dataset output with output_format=webdataset?")
    listed = set(fs.glob(f"{root.rstrip('/')}/*_stats.json"))
    stats_of = {t: t[:-len(".tar")] + "_stats.json" for t in tars}
    finished = [t for t in tars if stats_of[t] in listed]
    as_url = (lambda t: t) if remote.is_local(folder) else fs.unstrip_protocol
    incomplete = [as_url(t) for t in tars if stats_of[t] not in listed]
    totals = {"count": 0, "successes": 0, "failed_to_download": 0, "failed_to_resize": 0}
    contents = fs.cat([stats_of[t] for t in finished]) if stats and finished else {}
    for stats_path, data in sorted(contents.items()):
        try:
            shard_stats = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            raise SourceError(f"{stats_path}: not an img2dataset stats file ({e}): img2dataset writes it once the "
                              "shard is finished; run img2dataset again for that shard, or remove both files") from None
        for k in totals:
            totals[k] += int(shard_stats.get(k, 0) or 0)
    for u in incomplete if stats else []:  # a fact about the private data: the owner's log
        owner.note("shards", f"skipped {u}: no _stats.json beside it (img2dataset did not finish this shard)")
    return [as_url(t) for t in finished], {"img2dataset": totals, "incomplete_shards": incomplete}


# -- downloading a (url, caption) table ------------------------------------------------------------


class FetchFailed(Exception):
    def __init__(self, reason: str, transient: bool):
        super().__init__(reason)
        self.reason, self.transient = reason, transient


def _url_table_batches(path: str, url_column: str, caption_column: str) -> Iterator[tuple[list, list]]:
    """(urls, captions) of a parquet, CSV or TSV file (local or any fsspec URL), one record batch at a
    time: memory stays flat in the table's rows."""
    fs, p = remote.filesystem(path)
    if not fs.exists(p):
        raise SourceError(f"shards.path={path} does not exist")
    name = p.lower().removesuffix(".gz")
    if not name.endswith((".parquet", ".csv", ".tsv")):
        raise SourceError(f"shards.path={path}: expected a .parquet, .csv or .tsv table of (url, caption)")
    try:
        with fs.open(p, "rb", compression="infer") as f:
            if name.endswith(".parquet"):
                table = pq.ParquetFile(f, pre_buffer=False)  # else it keeps every chunk read (data/index.py)
                _check_columns(path, table.schema_arrow.names, url_column, caption_column)
                batches = table.iter_batches(batch_size=TABLE_BATCH_ROWS, columns=[url_column, caption_column])
            else:
                delimiter = "\t" if name.endswith(".tsv") else ","
                batches = pcsv.open_csv(f, parse_options=pcsv.ParseOptions(delimiter=delimiter),
                                        convert_options=pcsv.ConvertOptions(column_types={url_column: pa.string(),
                                                                                          caption_column: pa.string()}))
                _check_columns(path, batches.schema.names, url_column, caption_column)
            for batch in batches:
                yield batch.column(url_column).to_pylist(), batch.column(caption_column).to_pylist()
    except SourceError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        # A parser's message quotes the row it failed on: a private URL and caption, for the owner only.
        log = owner.note("shards", f"{path} could not be read: {type(e).__name__}: {e}")
        raise SourceError(f"shards.path={path} could not be read as a table (the parser's message, which "
                          f"may quote a row, is in {log})") from None


def _check_columns(path: str, names: list[str], url_column: str, caption_column: str) -> None:
    for col, key in ((url_column, "url_column"), (caption_column, "caption_column")):
        if col not in names:
            raise SourceError(f"{path} has no column {col!r} (columns: {', '.join(names)}); set shards.download.{key}")


def url_table_slices(path: str, url_column: str, caption_column: str, rows: int) -> Iterator[tuple[list, list]]:
    """(urls, captions) of `rows` consecutive rows of the table at a time, in table order (the last
    slice may be shorter)."""
    urls, captions = [], []
    for batch_urls, batch_captions in _url_table_batches(path, url_column, caption_column):
        urls += batch_urls
        captions += batch_captions
        while len(urls) >= rows:
            yield urls[:rows], captions[:rows]
            del urls[:rows], captions[:rows]
    if urls:
        yield urls, captions


def web_uri(url: str) -> str:
    """An http(s) URL as urllib sends it: a non-ASCII path or query percent-encoded (UTF-8), a non-ASCII
    host in IDNA, as a browser does; escapes already there are kept. Any other scheme (file:, ftp:) is
    refused: a row of a web table must not read the downloading machine's files or services."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) URL: {url!r}")
    netloc = parts.netloc if parts.netloc.isascii() else parts.netloc.encode("idna").decode("ascii")
    return urllib.parse.urlunsplit((parts.scheme, netloc, urllib.parse.quote(parts.path, safe=URI_SAFE),
                                    urllib.parse.quote(parts.query, safe=URI_SAFE + "?"), ""))


def _get(url: str, timeout_s: float) -> bytes:
    """One GET with a deadline on the whole transfer: a socket timeout bounds each wait for a byte,
    and read1 returns what one wait brought, so a server sending a byte at a time meets the deadline."""
    deadline = time.monotonic() + timeout_s
    try:
        request = urllib.request.Request(web_uri(url), headers={"User-Agent": USER_AGENT})
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            chunks, total = [], 0
            while chunk := r.read1(1 << 16):
                total += len(chunk)
                if total > MAX_IMAGE_BYTES:
                    raise FetchFailed("too_large", transient=False)
                if time.monotonic() > deadline:
                    raise FetchFailed("timeout", transient=True)
                chunks.append(chunk)
            return b"".join(chunks)
    except urllib.error.HTTPError as e:
        raise FetchFailed(f"http_{e.code}", transient=e.code in (408, 425, 429) or e.code >= 500) from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, (TimeoutError, socket.timeout)):
            raise FetchFailed("timeout", transient=True) from None
        if isinstance(e.reason, FileNotFoundError):
            raise FetchFailed("not_found", transient=False) from None
        raise FetchFailed("connection", transient=True) from None
    except ValueError:  # not a URL urllib can fetch
        raise FetchFailed("bad_url", transient=False) from None
    except (TimeoutError, socket.timeout):
        raise FetchFailed("timeout", transient=True) from None
    except (ConnectionError, http.client.HTTPException, OSError):
        raise FetchFailed("connection", transient=True) from None


def fetch(url: str, timeout_s: float, retries: int) -> bytes:
    """GET with up to `retries` retries of transient failures (timeouts, resets, 408/429/5xx),
    exponential backoff with jitter; permanent failures (404, bad URL) fail at once."""
    for attempt in range(retries):
        try:
            return _get(url, timeout_s)
        except FetchFailed as e:
            if not e.transient:
                raise
        remote.backoff(attempt)
    return _get(url, timeout_s)


def _fetch_row(url, caption, image_size: int, timeout_s: float, retries: int) -> tuple[bytes | None, str]:
    """(JPEG of the centre square at image_size, "ok") or (None, why it was skipped)."""
    if not url:
        return None, "missing_url"
    if caption is None or not str(caption).strip():
        return None, "missing_caption"
    try:
        data = fetch(str(url), timeout_s, retries)
    except FetchFailed as e:
        return None, e.reason
    try:
        return encode_jpeg(decode_image(data, image_size)), "ok"
    except Exception:  # not an image Pillow can decode
        return None, "not_image"


def _rows_digest(urls, captions, image_size: int) -> str:
    h = hashlib.sha256(f"{image_size}\n".encode())
    for u, c in zip(urls, captions):
        h.update(f"{u}\t{c}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _finished(out_dir: Path, name: str, digest: str) -> dict | None:
    """The shard's manifest if its tar is complete: same input rows, same size and sha256. The sha256 is
    read again only when the tar's size, mtime or inode moved since it was recorded (as DVC's state
    does): a re-run of a 233M-row table would otherwise read every finished shard back, terabytes."""
    manifest, tar = out_dir / f"{name}.json", out_dir / f"{name}.tar"
    if not (manifest.exists() and tar.exists()):
        return None
    m = read_json(manifest)
    stamp = file_stamp(tar)
    if m.get("rows_sha256") != digest or stamp[0] != m.get("size"):
        return None
    if m.get("stamp") != stamp:
        if file_digest(tar) != m.get("sha256"):
            return None
        m["stamp"] = stamp  # checked: the next run need not read it
        write_json(manifest, m)
    return m


def download(table_path: str, out_dir: str | Path, *, image_size: int, samples_per_shard: int,
             url_column: str = "url", caption_column: str = "caption", threads: int = 16,
             timeout_s: float = 10.0, retries: int = 3) -> tuple[list[str], dict]:
    """Download a (url, caption) table into `<out_dir>/<prefix>-NNNNNN.tar` shards; resumable.

    Rows [j·S, (j+1)·S) go to shard j, in table order, under key = row number. A shard whose
    manifest matches its rows and whose tar has the recorded size and sha256 is kept; any other is
    downloaded again and written atomically (tar first, manifest last). Failed rows are skipped and
    counted by reason (http_404, timeout, connection, not_image, ...).
    """
    table = (table_path, url_column, caption_column)
    total = sum(len(urls) for urls, _ in _url_table_batches(*table))  # one pass: a table that cannot be read stops here
    if not total:
        raise SourceError(f"{table_path} has no rows")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out_dir)  # shards a killed run was writing: they are downloaded again
    prefix = Path(table_path.rstrip("/")).name.split(".")[0] or "download"
    shards, failed, written, reused = [], {}, 0, 0
    with ThreadPoolExecutor(max_workers=threads) as pool, \
            ShareBar(total, "download") as bar:
        for j, (urls, captions) in enumerate(url_table_slices(*table, samples_per_shard)):
            name = f"{prefix}-{j:06d}"
            rows = range(j * samples_per_shard, j * samples_per_shard + len(urls))
            digest = _rows_digest(urls, captions, image_size)
            manifest = _finished(out_dir, name, digest)
            if manifest is None:
                results = pool.map(_fetch_row, urls, captions, repeat(image_size), repeat(timeout_s), repeat(retries))
                manifest = _write_shard(out_dir, name, rows, urls, captions, results, digest, bar)
            else:
                reused += 1
                bar.update(len(rows))
            shards.append(str((out_dir / f"{name}.tar").resolve()))
            written += manifest["written"]
            for reason, count in manifest["failed"].items():
                failed[reason] = failed.get(reason, 0) + count
    return shards, {"download": {"rows": total, "written": written, "failed": failed,
                                 "shards": len(shards), "reused_shards": reused}}


def _write_shard(out_dir: Path, name: str, rows: range, urls: list, captions: list, results, digest: str,
                 bar) -> dict:
    """Shard `name` of the table's rows `rows` (their urls and captions, and each one's fetched JPEG or
    why it failed, in order)."""
    shard = TarShard(out_dir / f"{name}.tar")
    written, failed = 0, {}
    try:
        for r, url, caption, (jpeg, status) in zip(rows, urls, captions, results):
            bar.update(1)
            if jpeg is None:
                failed[status] = failed.get(status, 0) + 1
                continue
            key = f"{r:09d}"
            shard.add(f"{key}.jpg", jpeg)
            shard.add(f"{key}.txt", str(caption).encode("utf-8"))
            shard.add(f"{key}.json", json.dumps({"row": r, "url": url}, sort_keys=True).encode("utf-8"))
            written += 1
    except BaseException as e:
        shard.abort(type(e), e, e.__traceback__)
        raise
    size = shard.close()
    tar = out_dir / f"{name}.tar"
    manifest = {"shard": f"{name}.tar", "size": size, "sha256": file_digest(tar), "stamp": file_stamp(tar),
                "first_row": rows.start, "rows": len(rows), "rows_sha256": digest, "written": written,
                "failed": failed}
    write_json(out_dir / f"{name}.json", manifest)
    return manifest
