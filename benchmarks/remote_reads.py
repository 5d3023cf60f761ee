"""Sampled examples/s read from shards behind a distant object store (pipeline/data/remote.py, shards.py).

    python -m benchmarks.remote_reads [--latency-ms 20] [--samples 20000] [--batch 256] [--batches 8]

Writes webdataset shards of 32 px PNGs and captions (ShardWriter), serves them over HTTP with Range
requests from a loopback server in a child process (its CPU is not this process's, as a real store's
is not) that answers every request `latency_ms` late, and indexes them over http as the shards stage
does. Then, in this one process, reads Poisson-style batches (random indices, sorted, scattered over
every shard; at this density most examples are their own request, as at web scale) three ways:
  batched      ShardDataset.read_samples: raw bytes of the batch, requests coalesced and concurrent
  decoded      BatchLoader(workers=0).load: the same plus PNG decode and normalisation
  per-sample   read_sample one index at a time (the path before read_samples: one request each)
Prints a table, then ONE JSON line; `measure()` returns the same figures for other benchmarks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/http_server.py: the loopback server the tests use
from http_server import serving, stop  # noqa: E402

from pipeline.data.index import build_index  # noqa: E402
from pipeline.data.loader import BatchLoader  # noqa: E402
from pipeline.data.shards import ShardDataset, ShardWriter, encode_png  # noqa: E402

TARGET_EXAMPLES_PER_S = 2000.0
IMAGE_SIZE = 32


def write_shards(directory: Path, samples: int, per_shard: int) -> list[str]:
    """Shard file names; noise PNGs (~3 kB, the size incompressible 32 px images have) from a palette."""
    rng = np.random.default_rng(0)
    palette = [encode_png(rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)) for _ in range(64)]
    with ShardWriter(directory, prefix="bench", samples_per_shard=per_shard) as w:
        for i in range(samples):
            w.write(f"img{i:07d}", palette[i % len(palette)], f"a photo of thing {i}", {"label": i % 10})
    return sorted(p.name for p in directory.glob("*.tar"))


def _serve(root: Path, latency_s: float, conn) -> None:
    """Child process: serve `root`, send the URL, then answer each "requests" with the count so far."""
    start, started = serving()
    server = start(root, latency_s=latency_s)
    conn.send(server.url)
    try:
        while conn.recv() == "requests":
            conn.send(sum(server.requests.values()))
    except EOFError:  # the parent is done
        pass
    stop(started)


def rate(read, batches) -> float:
    """Examples/s of read(indices) over the batches."""
    t0 = time.perf_counter()
    for b in batches:
        read(b)
    return sum(len(b) for b in batches) / (time.perf_counter() - t0)


def measure(latency_ms: float = 20, samples: int = 20000, per_shard: int = 2500, batch: int = 256,
            batches: int = 8, per_sample: int = 100, seed: int = 0) -> dict:
    """Examples/s of batched, decoded and per-sample reads over http with `latency_ms` per request."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        names = write_shards(tmp / "shards", samples, per_shard)
        fork = multiprocessing.get_context("fork")
        parent, child = fork.Pipe()
        server = fork.Process(target=_serve, args=(tmp / "shards", latency_ms / 1e3, child), daemon=True)
        server.start()
        try:
            url = parent.recv()
            with contextlib.chdir(tmp):  # the scan's owner log goes with its scratch, not into the project
                build_index([f"{url}/{n}" for n in names], tmp / "index", eval_fraction=0, seed=0,
                            cache_dir=tmp / "cache", workers=1, check_size=IMAGE_SIZE)
            ds = ShardDataset(tmp / "index/private")
            rng = np.random.default_rng(seed)

            def draw():  # as the Poisson sampler hands them out: sorted, scattered over every shard
                return np.sort(rng.choice(len(ds), batch, replace=False))

            ds.read_samples(draw())  # warm-up: connections opened
            parent.send("requests")
            before = parent.recv()
            batched = rate(ds.read_samples, [draw() for _ in range(batches)])
            parent.send("requests")
            requests = parent.recv() - before
            loader = BatchLoader(ds, IMAGE_SIZE, workers=0)
            decoded = rate(loader.load, [draw() for _ in range(batches)])
            single = rate(lambda b: [ds.read_sample(int(i)) for i in b], [draw()[:per_sample]])
        finally:
            parent.close()
            server.join(timeout=10)
    return {"remote_latency_ms": latency_ms, "remote_examples_per_s": round(batched, 1),
            "remote_examples_per_s_decoded": round(decoded, 1), "per_sample_examples_per_s": round(single, 1),
            "speedup": round(batched / single, 1), "requests_per_batch": round(requests / batches, 1),
            "batch": batch, "samples": len(ds), "shards": len(names), "target_examples_per_s": TARGET_EXAMPLES_PER_S,
            "target_met": batched >= TARGET_EXAMPLES_PER_S}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latency-ms", type=float, default=20, help="delay of every request at the server")
    ap.add_argument("--samples", type=int, default=20000, help="examples in the shard set")
    ap.add_argument("--batch", type=int, default=256, help="examples per sampled batch")
    ap.add_argument("--batches", type=int, default=8, help="batches timed per batched path")
    args = ap.parse_args(argv)
    fig = measure(args.latency_ms, args.samples, batch=args.batch, batches=args.batches)
    print(f"{fig['samples']} examples in {fig['shards']} shards over http, {fig['remote_latency_ms']:g} ms "
          f"per request, batches of {fig['batch']} random indices ({fig['requests_per_batch']:g} requests per batch)")
    for name, key in (("batched (read_samples)", "remote_examples_per_s"),
                      ("batched + decoded (BatchLoader)", "remote_examples_per_s_decoded"),
                      ("per-sample (read_sample)", "per_sample_examples_per_s")):
        print(f"{name:>34}: {fig[key]:>9.1f} examples/s")
    print(f"speedup {fig['speedup']:g}x; target >= {TARGET_EXAMPLES_PER_S:.0f} examples/s per process: "
          f"{'met' if fig['target_met'] else 'MISSED'} (timings on a shared machine are noisy)")
    print(json.dumps(fig))
    return fig


if __name__ == "__main__":
    main()
