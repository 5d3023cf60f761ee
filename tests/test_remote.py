"""Batched reads by byte range (pipeline/data/remote.py RangeReader.read_many, ShardDataset.read_samples):
the same bytes as one read at a time, in fewer requests, concurrently, retried range by range.

Remote shards are served by the loopback server of tests/http_server.py (the `serve` fixture), which
counts and records every request and can fail a given range once.
"""

from __future__ import annotations

import pickle

import fsspec
import numpy as np
import pytest
import torch
from aiohttp import ClientResponseError, RequestInfo
from http_server import closed_port
from shard_data import SIZE, index, write_set
from yarl import URL

from pipeline.data import remote
from pipeline.data.loader import BatchLoader
from pipeline.data.remote import RangeReader, ShardReadError
from pipeline.data.shards import ShardDataset
from pipeline.data.transforms import decode_image, to_tensor


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)


@pytest.fixture
def shards(tmp_path, serve):
    """(local directory, http server, local urls, http urls) of 4 shards of 10 samples."""
    write_set(tmp_path / "w", n=40, per_shard=10)
    server = serve(tmp_path / "w")
    names = sorted(p.name for p in (tmp_path / "w").glob("*.tar"))
    return tmp_path / "w", server, [str(tmp_path / "w" / n) for n in names], [f"{server.url}/{n}" for n in names]


def random_requests(rng, sizes, n):
    """Ranges of every kind: overlapping, nested, adjacent, a few bytes apart, far apart, across shards."""
    requests = []
    for _ in range(n):
        shard = int(rng.integers(len(sizes)))
        start = int(rng.integers(sizes[shard] - 1))
        requests.append((shard, start, int(rng.integers(start + 1, min(start + 3000, sizes[shard]) + 1))))
        if rng.random() < 0.3:  # one overlapping or touching the last
            _, s, e = requests[-1]
            s = int(rng.integers(s, e + 1))
            requests.append((shard, s, min(s + int(rng.integers(1, 200)), sizes[shard])))
    return requests


@pytest.mark.parametrize("where", ["local", "http"])
def test_read_many_returns_the_bytes_of_single_reads(shards, where):
    _, _, local_urls, http_urls = shards
    data = [open(u, "rb").read() for u in local_urls]
    reader = RangeReader(local_urls if where == "local" else http_urls)
    rng = np.random.default_rng(0)
    for max_gap in (0, 100, remote.MAX_GAP):
        reader.max_gap = max_gap
        requests = random_requests(rng, [len(d) for d in data], 40)
        got = reader.read_many(requests)
        assert got == [data[shard][start:end] for shard, start, end in requests]
        assert got[:5] == [reader.read(*r) for r in requests[:5]]
    assert reader.read_many([]) == []


OS_PREAD = remote.os.pread


def test_close_ranges_are_one_request(shards, monkeypatch):
    _, server, local_urls, http_urls = shards
    requests = [(0, 0, 100), (0, 100, 200), (0, 50, 150), (0, 250, 300), (0, 1000, 1100), (1, 0, 10), (0, 290, 400)]
    reader = RangeReader(http_urls, max_gap=100)
    reader.read_many(requests)
    s0, s1 = (u.rsplit("/", 1)[1] for u in http_urls[:2])
    assert sorted(server.ranges) == [(f"/{s0}", "bytes=0-399"), (f"/{s0}", "bytes=1000-1099"), (f"/{s1}", "bytes=0-9")]
    # Local shards too: one pread per span.
    preads = []
    monkeypatch.setattr(remote.os, "pread", lambda fd, n, at: preads.append(at) or OS_PREAD(fd, n, at))
    assert RangeReader(local_urls, max_gap=100).read_many(requests) == reader.read_many(requests)
    assert sorted(preads) == [0, 0, 1000]


def test_remote_requests_are_in_flight_together(shards, serve):
    directory, *_ = shards
    slow = serve(directory, latency_s=0.2)
    reader = RangeReader([f"{slow.url}/s-000000.tar"], max_gap=0)
    reader.read_many([(0, k * 1000, k * 1000 + 10) for k in range(8)])
    assert len(slow.ranges) == 8 and slow.max_in_flight >= 4


def test_a_failed_range_is_retried_alone_and_the_batch_succeeds(shards):
    _, server, local_urls, http_urls = shards
    requests = [(0, 0, 10), (1, 0, 10), (1, 5000, 5010), (2, 0, 10)]
    server.fail_once.add(("/s-000001.tar", 5000))
    got = RangeReader(http_urls, max_gap=0).read_many(requests)
    assert got == RangeReader(local_urls).read_many(requests)
    asked = [r for _, r in server.ranges]
    assert asked.count("bytes=5000-5009") == 2 and len(asked) == 5
    assert not server.fail_once


def test_a_permanent_failure_names_the_url_and_range(shards):
    _, server, _, http_urls = shards
    missing = f"{server.url}/gone.tar"
    with pytest.raises(ShardReadError, match=f"bytes 0-10 of {missing}: FileNotFoundError"):
        RangeReader([http_urls[0], missing]).read_many([(0, 0, 10), (1, 0, 10)])
    assert server.requests["/gone.tar"] == 1  # a missing file is not retried
    dead = f"http://127.0.0.1:{closed_port()}/s-000000.tar"
    with pytest.raises(ShardReadError, match=f"bytes 512-600 of {dead}"):
        RangeReader([http_urls[0], dead], attempts=2).read_many([(0, 0, 10), (1, 512, 600)])


def test_read_samples_is_read_sample_of_each(shards, tmp_path):
    directory, _, _, http_urls = shards
    _, over_http = index(http_urls, tmp_path)
    local = ShardDataset(directory)
    rng = np.random.default_rng(1)
    indices = [int(i) for i in rng.integers(len(local), size=25)] + [0, 0, -1, 39]
    for members in (("image", "txt", "json"), ("image",), ("txt", "json")):
        want = [local.read_sample(i, members) for i in indices]
        assert local.read_samples(indices, members) == want
        assert over_http.read_samples(np.array(indices), members) == want
    with pytest.raises(IndexError):
        local.read_samples([0, 40])


def test_one_request_per_shard_for_a_whole_shard_set(shards, tmp_path):
    _, server, _, http_urls = shards
    _, over_http = index(http_urls, tmp_path)
    before = sum(server.requests.values())
    over_http.read_samples(range(len(over_http)))
    assert sum(server.requests.values()) - before == len(http_urls)


class FakeTokenizer:
    def encode(self, captions, max_len, public=False):
        return torch.tensor([[len(c)] * max_len for c in captions])


def test_the_loader_gives_the_tensors_of_per_sample_reads(shards, tmp_path):
    *_, http_urls = shards
    _, over_http = index(http_urls, tmp_path)
    indices = np.array([3, 3, 17, 0, 39, 22])
    images, tokens = BatchLoader(over_http, SIZE - 2, tokenizer=FakeTokenizer(), max_len=2).load(indices)
    raws = [over_http.read_sample(int(i), ("image", "txt")) for i in indices]
    per_sample = np.stack([decode_image(r["image"], SIZE - 2) for r in raws])
    assert torch.equal(images, to_tensor(torch.from_numpy(per_sample)))
    assert tokens[:, 0].tolist() == [len(r["txt"].decode()) for r in raws]


def open_descriptors() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def test_a_reader_of_thousands_of_local_shards_holds_few_open(tmp_path):
    """One descriptor per local shard touched, never closed, ran past the usual limit of 1,024 open
    files at 23k shards (random sampling touches every one), in each process and loader worker; the
    index scan's end-of-archive check leaked one per shard scanned."""
    from pipeline.data.index import _check_end

    files = []
    for i in range(3 * remote.MAX_OPEN):
        path = tmp_path / f"{i:04d}.bin"
        path.write_bytes(bytes([i % 251]) * 64 + bytes(2 * 512))
        files.append(str(path))
    before = open_descriptors()
    reader = RangeReader(files)
    for rounds in range(2):  # every shard read twice: reopened where it was closed, the same bytes
        for i in np.random.default_rng(rounds).permutation(len(files)):
            assert reader.read(int(i), 10, 20) == bytes([int(i) % 251]) * 10
            assert open_descriptors() - before <= remote.MAX_OPEN
    reader.close()
    assert open_descriptors() == before
    for path in files:
        assert _check_end(path, 64, 64 + 2 * 512) is None
    assert open_descriptors() == before


def test_a_stalled_read_is_given_up_on_and_named(shards, monkeypatch):
    """A server that accepts the request and never answers (tests/http_server.py's /slow/) held a
    micro-batch for aiohttp's 300 s an attempt, and the other ranks' NCCL watchdog killed them first
    with an error naming no shard. Each attempt now waits READ_TIMEOUT_S for the next byte."""
    import time

    _, server, _, _ = shards
    monkeypatch.setattr(remote, "READ_TIMEOUT_S", 0.3)
    reader = RangeReader([f"{server.url}/slow/s-000000.tar"], max_gap=0)
    started = time.monotonic()
    with pytest.raises(ShardReadError, match="/slow/s-000000.tar"):
        reader.read_many([(0, 0, 512)])
    assert time.monotonic() - started < 30
    assert server.requests["/slow/s-000000.tar"] >= 2  # timed out, retried, timed out


def test_an_answer_a_retry_would_get_again_is_not_retried():
    """An expired credential (403) or a forbidden file was retried like a dropped connection, ~3.5 s of
    backoff a micro-batch before the error; a throttled (429), timed-out (408) or failing (5xx) server
    still is."""
    from aiohttp import ClientResponseError, RequestInfo
    from yarl import URL

    def answer(status):
        return ClientResponseError(RequestInfo(URL("http://h/s.tar"), "GET", {}), (), status=status)

    calls = []

    def failing(e):
        def fn():
            calls.append(e)
            raise e
        return fn

    for permanent in (answer(403), answer(416), PermissionError("denied"), FileNotFoundError("gone")):
        calls.clear()
        with pytest.raises(type(permanent)):
            remote.retry(failing(permanent))
        assert len(calls) == 1, permanent
    for passing in (answer(503), answer(429), answer(408), ConnectionResetError(), TimeoutError()):
        calls.clear()
        with pytest.raises(type(passing)):
            remote.retry(failing(passing))
        assert len(calls) == 4, passing


def test_a_remote_shard_rewritten_in_place_is_refused_before_training(tmp_path, serve):
    """Two images of one size swapped inside a remote shard: every member keeps its name and size, so
    each read's header check passes and training would read bytes the scan never decoded and the
    budget never counted. The index keeps the store's ETag, and dp-train's first open asks again."""
    from pipeline.data.index import IndexMismatch

    write_set(tmp_path / "w", n=10, per_shard=10)
    server = serve(tmp_path / "w")
    _, ds = index([f"{server.url}/s-000000.tar"], tmp_path)
    assert ds.shards[0]["ETag"]  # kept from the scan
    ShardDataset(tmp_path / "out" / "private", check_versions=True)  # unchanged: opens

    local = ShardDataset(tmp_path / "w")
    sizes, offsets = local._rows.sizes["image"], local._rows.offsets["image"]
    a, b = next((a, b) for a in range(10) for b in range(a + 1, 10) if sizes[a] == sizes[b])
    tar = tmp_path / "w" / "s-000000.tar"
    data, size = bytearray(tar.read_bytes()), int(sizes[a])
    (oa, ob) = (int(offsets[a]), int(offsets[b]))
    data[oa:oa + size], data[ob:ob + size] = data[ob:ob + size], data[oa:oa + size]
    tar.write_bytes(bytes(data))

    assert len(ds.read_samples([a, b], ("image",))) == 2  # a read alone does not notice
    with pytest.raises(IndexMismatch, match="s-000000.tar is not the shard .* version tag has changed"):
        ShardDataset(tmp_path / "out" / "private", check_versions=True)


def test_a_reader_used_before_a_fork_reads_in_the_forked_worker(shards):
    """Loader workers are forked from a process whose reader already holds fsspec clients: those are
    bound to the parent's event loop thread, which the child lacks, so the child opens its own."""
    import multiprocessing
    import multiprocessing.connection

    _, _, local_urls, http_urls = shards
    reader = RangeReader(http_urls)
    expected = open(local_urls[1], "rb").read()[10:500]
    assert reader.read(1, 10, 500) == expected  # the parent's client exists now
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=lambda: send.send(reader.read(1, 10, 500)))
    child.start()
    try:  # the answer, or the worker's end: whichever comes first
        multiprocessing.connection.wait([receive, child.sentinel], timeout=60)
        assert receive.poll(), f"the forked worker's read never came back (exit code {child.exitcode})"
        assert receive.recv() == expected
    finally:
        child.kill()
        child.join()


def test_ranges_at_most_max_gap_apart_are_one_span_and_one_byte_more_are_two():
    spans = remote.coalesce([(0, 0, 10), (0, 110, 120), (0, 221, 230), (1, 230, 240)], max_gap=100)
    assert [(s.shard_id, s.start, s.end, s.positions) for s in spans] == [
        (0, 0, 120, [0, 1]), (0, 221, 230, [2]), (1, 230, 240, [3])]


def test_retries_wait_twice_as_long_each_time_with_jitter(monkeypatch):
    """Waits of BACKOFF_S·2^k, each scaled by a jitter in [0.5, 1.5) so that readers do not retry in step."""
    waits = []
    monkeypatch.setattr(remote.time, "sleep", waits.append)
    monkeypatch.setattr(remote.random, "random", lambda: 0.25)
    calls = []

    def flaky():
        calls.append(1)
        raise ConnectionError("reset")
    with pytest.raises(ConnectionError):
        remote.retry(flaky, attempts=4)
    assert len(calls) == 4 and waits == pytest.approx([0.01 * 0.75, 0.02 * 0.75, 0.04 * 0.75])


@pytest.fixture
def memory_shard():
    """The url of a 4 KiB shard in fsspec's in-memory filesystem, and its bytes."""
    data = bytes(range(256)) * 16
    fs = fsspec.filesystem("memory")
    fs.pipe("/dpfm-remote-test/s.tar", data)
    yield "memory:///dpfm-remote-test/s.tar", data
    fs.rm("/dpfm-remote-test", recursive=True)


def failing_first(reader, times: int, error=ConnectionResetError) -> list:
    """Make the reader's first `times` fetches fail with `error` for every span; the list counts fetches."""
    calls, real = [], reader._fetch

    def fetch(spans):
        calls.append(len(spans))
        return [error("injected") for _ in spans] if len(calls) <= times else real(spans)

    reader._fetch = fetch
    return calls


@pytest.mark.parametrize("attempts", [2, 4])
def test_a_range_is_asked_for_exactly_attempts_times(memory_shard, attempts):
    """A range that fails attempts-1 times is still read; one that fails every time is given up on after
    `attempts` requests, no more and no fewer."""
    url, data = memory_shard
    reader = RangeReader([url], attempts=attempts)
    calls = failing_first(reader, attempts - 1)
    assert reader.read(0, 100, 300) == data[100:300] and len(calls) == attempts
    reader = RangeReader([url], attempts=attempts)
    calls = failing_first(reader, attempts)
    with pytest.raises(ShardReadError, match="bytes 100-300 of memory:///dpfm-remote-test/s.tar"):
        reader.read(0, 100, 300)
    assert len(calls) == attempts


def test_range_retries_wait_with_backoff(memory_shard, monkeypatch):
    """Retried at once, a batch's failed ranges hammer a struggling store; each retry waits
    BACKOFF_S·2^k (times the jitter), as `retry` does."""
    url, data = memory_shard
    waits = []
    monkeypatch.setattr(remote.time, "sleep", waits.append)
    monkeypatch.setattr(remote.random, "random", lambda: 0.25)
    reader = RangeReader([url], attempts=4)
    failing_first(reader, 2)
    assert reader.read(0, 0, 10) == data[:10]
    assert waits == pytest.approx([remote.BACKOFF_S * 0.75, remote.BACKOFF_S * 2 * 0.75])


def test_an_error_that_is_neither_network_nor_missing_file_is_not_retried(memory_shard):
    """Only the network's errors are worth another request: a ValueError from the client library is a bug
    that every retry meets again, after seconds of backoff."""
    url, _ = memory_shard
    reader = RangeReader([url], attempts=4)
    calls = failing_first(reader, 4, error=ValueError)
    with pytest.raises(ShardReadError, match="ValueError"):
        reader.read(0, 0, 10)
    assert len(calls) == 1


def test_a_pickled_reader_keeps_its_attempts(memory_shard):
    """Loader workers get the reader pickled: one set to give up sooner (or later) must do so there too."""
    url, _ = memory_shard
    copy = pickle.loads(pickle.dumps(RangeReader([url], attempts=2, max_gap=0)))
    calls = failing_first(copy, 10)
    with pytest.raises(ShardReadError):
        copy.read(0, 0, 10)
    assert len(calls) == 2


def test_the_error_names_the_permanent_failure_among_transient_ones(shards):
    """A batch with an unreachable range and a missing file: retrying cannot help, and the error must
    say which file is missing, not which connection dropped first."""
    _, server, _, _ = shards
    dead, missing = f"http://127.0.0.1:{closed_port()}/s-000000.tar", f"{server.url}/gone.tar"
    with pytest.raises(ShardReadError, match=f"of {missing}: FileNotFoundError"):
        RangeReader([dead, missing]).read_many([(0, 0, 10), (1, 0, 10)])


def test_server_errors_from_500_up_are_retried_and_client_errors_below_are_not():
    """The boundary of `transient`: 500 itself is the commonest server error (a store's internal error)
    and is retried; 499 and below (except 408, 425, 429) get the same answer again."""
    def answer(status):
        return ClientResponseError(RequestInfo(URL("http://h/s.tar"), "GET", {}), (), status=status)

    assert [remote.transient(answer(s)) for s in (400, 404, 499, 500, 502, 599, 408, 425, 429)] == \
        [False, False, False, True, True, True, True, True, True]


def test_a_shard_read_again_and_again_stays_open_while_others_come_and_go(tmp_path, monkeypatch):
    """The MAX_OPEN descriptors kept are the most recently read: a hot shard read between each of many
    others is opened once, not again each time MAX_OPEN others have passed."""
    files = []
    for i in range(3 * remote.MAX_OPEN):
        path = tmp_path / f"{i:04d}.bin"
        path.write_bytes(bytes([i % 251]) * 64)
        files.append(str(path))
    opened, real_open = [], remote.os.open
    monkeypatch.setattr(remote.os, "open", lambda path, *a: opened.append(path) or real_open(path, *a))
    reader = RangeReader(files)
    for i in range(1, len(files)):
        assert reader.read(0, 0, 4) == bytes(4) and reader.read(i, 0, 4) == bytes([i % 251]) * 4
    reader.close()
    assert opened.count(files[0]) == 1 and len(opened) == len(files)


def test_s3_clients_get_the_connect_and_read_timeouts():
    """Without them botocore waits 60 s to connect and retries on its own; a stalled GET must be given
    up on in READ_TIMEOUT_S, for s3:// and s3a:// alike."""
    for protocol in ("s3", "s3a"):
        options = remote.storage_options(protocol)["config_kwargs"]
        assert (options["connect_timeout"], options["read_timeout"]) == (remote.CONNECT_TIMEOUT_S,
                                                                         remote.READ_TIMEOUT_S)
