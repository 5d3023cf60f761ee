"""Property-based tests (hypothesis) of what reads untrusted input: the shard reader, the index over
damaged tars, and the params loader. Each property holds for every input: a clean result or a clear,
expected error, never a crash of another kind or a silently wrong count. Example counts are modest
so each test runs in seconds."""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import numpy as np
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from shard_data import good, raw_tar

from pipeline.config import ParamsError, load_params
from pipeline.data.index import build_index
from pipeline.data.remote import ShardReadError
from pipeline.data.shards import ShardDataset, ShardWriter, encode_png

ROOT = Path(__file__).resolve().parents[1]
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
counter = itertools.count()  # a fresh directory per example (tmp_path is shared by all of them)

keys = st.text("abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=12)
captions = st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=40).filter(str.strip)


@FAST
@given(samples=st.lists(st.tuples(keys, captions, st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=8,
                        unique_by=lambda s: s[0]),
       per_shard=st.integers(1, 4))
def test_shard_reader_returns_exactly_what_was_written(tmp_path, samples, per_shard):
    out = tmp_path / f"set{next(counter)}"
    rng = np.random.default_rng(0)
    written = []
    with ShardWriter(out, prefix="s", samples_per_shard=per_shard) as w:
        for key, caption, h, wd in samples:
            image = encode_png(rng.integers(0, 256, (h, wd, 3), dtype=np.uint8))
            w.write(key, image, caption, {"h": h})
            written.append((key, image, caption, {"h": h}))
    ds = ShardDataset(out)
    assert len(ds) == len(samples)
    for i, (key, image, caption, meta) in enumerate(written):
        assert (ds.key(i), ds.read_member(i, "image"), ds.caption(i), ds.meta(i)) == (key, image, caption, meta)


def damage(data: bytes, cut: int | None, flips: list[tuple[int, int]]) -> bytes:
    data = bytearray(data[:cut] if cut is not None else data)
    for at, value in flips:
        if data:
            data[at % len(data)] = value
    return bytes(data)


@FAST
@given(cut=st.none() | st.integers(0, 20 * 512), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                                                 max_size=6))
def test_index_of_a_damaged_tar_counts_every_row_and_serves_only_readable_samples(tmp_path, cut, flips):
    run = tmp_path / f"run{next(counter)}"
    run.mkdir()
    rng = np.random.default_rng(1)
    raw_tar(run / "clean.tar", good("a", rng) + good("b", rng, "second") + good("c", rng, "third"))
    (run / "bad.tar").write_bytes(damage((run / "clean.tar").read_bytes(), cut, flips))
    try:
        with contextlib.chdir(run):  # the owner's log of damaged shards: in the test's project
            stats = build_index([str(run / "bad.tar")], run / "out", eval_fraction=1e-9, seed=0,
                                cache_dir=run / "cache", workers=1, check_size=8)
    except (ValueError, ShardReadError) as e:  # nothing readable: a clear error, not a crash
        assert str(e)
        event("refused")
        return
    ds = ShardDataset(run / "out/private")
    split = stats["private"]
    event(f"{split['usable']} usable")
    assert len(ds) == split["usable"] <= 3
    assert split["usable"] + sum(split["excluded"].values()) == split["rows"]
    for i in range(len(ds)):  # what the index calls usable really is
        assert ds.image(i, 8).shape == (8, 8, 3) and ds.caption(i).strip()


LEAVES = [f"{section}.{key}" for section, keys in yaml.safe_load((ROOT / "params.yaml").read_text()).items()
          for key in keys] + ["dp.no_such_key", "nosection.key", "dp", "run"]
yaml_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                        max_size=3), max_leaves=5)


@FAST
@given(overrides=st.lists(st.tuples(st.sampled_from(LEAVES), yaml_values), max_size=4))
def test_params_loader_accepts_or_names_the_problem(in_tmp, overrides):
    sets = [f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
            for key, value in overrides]
    try:
        params = load_params("params.yaml", sets)
    except ParamsError as e:
        assert e.problems and all(p.strip() for p in e.problems)
        return
    assert set(params) == set(yaml.safe_load(Path("params.yaml").read_text()))


@FAST
@given(text=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_params_file_of_any_text_is_loaded_or_refused_clearly(in_tmp, text):
    path = in_tmp / f"p{next(counter)}.yaml"
    path.write_text(text)
    try:
        load_params(path)
    except ParamsError as e:
        assert e.problems
