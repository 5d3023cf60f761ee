"""A stage's start tags its MLflow run with DVC's hash of each input. At 233M examples the private
index alone is tens of GB and four stages start on it, so the md5 of a file that has not changed is
not read again; one that has changed always is, and the md5s of the private files stay owner-only."""

import os
import stat
from pathlib import Path

import pytest

from pipeline import tracking
from pipeline.privacy.budget import public_name


@pytest.fixture
def reads(monkeypatch, tmp_path):
    """The files whose bytes input_tag hashed, call by call, in a project at tmp_path."""
    monkeypatch.chdir(tmp_path)
    seen = []
    digest = tracking.file_digest

    def counting(path, algorithm="sha256"):
        seen.append(os.path.basename(path))
        return digest(path, algorithm)

    monkeypatch.setattr(tracking, "file_digest", counting)
    return seen


def write(path, data: bytes, mtime_ns: int | None = None):
    """Written as the stages write: to a temporary name, then renamed (a new inode)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    if mtime_ns is not None:
        os.utime(tmp, ns=(mtime_ns, mtime_ns))
    os.replace(tmp, path)


def plain_hash(path) -> str:
    """DVC's hash read from every byte, with no record of earlier calls."""
    return tracking.dvc_hash(path)


@pytest.mark.parametrize("private", [False, True], ids=["public input", "private shards"])
def test_an_unchanged_input_is_not_read_again_and_every_change_is_seen(reads, tmp_path, private):
    folder = tmp_path / ("data/shards" if private else "models/pretrain")
    (folder / "train").mkdir(parents=True)
    for name, data in [("index.parquet", b"rows" * 100), ("train/000000.tar", b"a" * 512), ("stats.json", b"{}")]:
        write(folder / name, data)
    rel = "data/shards/" if private else "models/pretrain"
    tag = tracking.input_tag(rel)
    assert sorted(reads) == ["000000.tar", "index.parquet", "stats.json"]
    as_published = public_name if private else (lambda h: h)
    assert tag == as_published(plain_hash(folder))

    reads.clear()
    assert tracking.input_tag(rel) == tag and reads == []  # nothing changed: nothing read

    shard = folder / "train/000000.tar"
    old = shard.stat()
    write(shard, b"b" * 512, mtime_ns=old.st_mtime_ns)  # same size, same mtime: a new inode only
    assert shard.stat().st_size == old.st_size and shard.stat().st_mtime_ns == old.st_mtime_ns
    reads.clear()
    tag2 = tracking.input_tag(rel)
    assert reads == ["000000.tar"] and tag2 == as_published(plain_hash(folder)) != tag

    index = folder / "index.parquet"
    with open(index, "r+b") as f:  # rewritten in place, same size, a later mtime
        f.write(b"ROWS")
    os.utime(index, ns=(index.stat().st_atime_ns, index.stat().st_mtime_ns + 1_000_000))
    reads.clear()
    tag3 = tracking.input_tag(rel)
    assert reads == ["index.parquet"] and tag3 == as_published(plain_hash(folder)) != tag2

    (folder / "stats.json").unlink()
    reads.clear()
    tag4 = tracking.input_tag(rel)
    assert reads == [] and tag4 == as_published(plain_hash(folder)) != tag3


def test_the_md5s_it_keeps_are_owner_only(reads, tmp_path):
    """They are plain digests of the private files: a published one would let anyone who knows all
    examples but one test guesses of the last (invariant 17)."""
    folder = tmp_path / "data/shards"
    folder.mkdir(parents=True)
    write(folder / "index.parquet", b"rows" * 100)
    tracking.input_tag("data/shards/")
    kept = sorted(p for p in tmp_path.rglob("*") if p.is_file() and folder not in p.parents)
    assert kept and all(".dpfm/owner" in str(p) or "data/budget" in str(p) for p in kept), kept
    record = tmp_path / ".dpfm/owner" / f"{tracking.FILE_DIGESTS}.json"
    assert record in kept and stat.S_IMODE(record.stat().st_mode) == 0o600
    assert stat.S_IMODE(record.parent.stat().st_mode) == 0o700


def test_a_damaged_record_is_read_again_from_the_files(reads, tmp_path):
    """The record is a cache: a stage never fails on it, it reads the files instead and rewrites it."""
    folder = tmp_path / "models/pretrain"
    folder.mkdir(parents=True)
    write(folder / "encoder.pt", b"weights")
    tag = tracking.input_tag("models/pretrain")
    record = tmp_path / ".dpfm/owner" / f"{tracking.FILE_DIGESTS}.json"
    record.write_text('{"cut short')
    reads.clear()
    assert tracking.input_tag("models/pretrain") == tag and reads == ["encoder.pt"]
    reads.clear()
    assert tracking.input_tag("models/pretrain") == tag and reads == []


def test_the_hash_reads_every_byte_and_leaves_out_what_dvcignore_does(tmp_path):
    """Two inputs that share their first MiB are told apart; Snakemake's marker and the non-private twin,
    which .dvcignore leaves out of DVC's hash, are left out of the tag too, or it would not be DVC's."""
    import hashlib

    big = tmp_path / "d" / "shard.tar"
    big.parent.mkdir()
    data = bytearray(os.urandom(3 << 20))
    write(big, bytes(data))
    before, dir_before = plain_hash(big), plain_hash(big.parent)
    data[(5 << 20) // 2] ^= 1  # a byte past the first two MiB
    write(big, bytes(data))
    assert plain_hash(big) == hashlib.md5(bytes(data)).hexdigest() != before
    dir_now = plain_hash(big.parent)
    assert dir_now != dir_before
    for ignored in sorted(tracking.DVC_IGNORED):
        write(big.parent / ignored, b"not part of the data")
    assert plain_hash(big.parent) == dir_now


def test_a_stage_run_is_nested_under_the_pipelines_run_and_no_secret_reaches_either(local_mlflow, monkeypatch):
    import types

    import mlflow

    params = {"dp": {"objective": "mae", "epsilon": 8, "lr": 0.1, "noise_seed": 1234567}, "run": {"seed": 0}}
    parent = tracking.start_parent("nesting", params)
    monkeypatch.setenv(tracking.PARENT_ENV, parent)
    stage = types.SimpleNamespace(name="dp-train", input_paths=[], touches_private_data=False)
    with tracking.stage_run(stage, params, "nesting") as run:
        child = run.run_id
    client = mlflow.tracking.MlflowClient()
    assert client.get_run(child).data.tags["mlflow.parentRunId"] == parent
    for run_id in (parent, child):
        logged = client.get_run(run_id).data.params
        assert logged["dp.lr"] == "0.1" and not [k for k in logged if "noise_seed" in k]
        assert "1234567" not in logged.values()


def test_a_stage_run_on_the_private_shards_publishes_only_their_keyed_hash(local_mlflow, tmp_path):
    """The stage's run is published: its input tag for the private shards is the keyed hash, never the
    plain DVC hash against which anyone could test a guess of the private data."""
    import types

    import mlflow

    from pipeline.artifacts import ARTIFACTS
    from pipeline.stages import PRIVATE_ARTIFACT

    shards = Path(ARTIFACTS[PRIVATE_ARTIFACT])
    (tmp_path / shards / "train").mkdir(parents=True)
    (tmp_path / shards / "train/000000.tar").write_bytes(b"private bytes")
    stage = types.SimpleNamespace(name="dp-train", input_paths=[str(shards)], touches_private_data=True)
    with tracking.stage_run(stage, {"run": {"seed": 0}}, "dpfm") as run:
        pass
    tags = mlflow.tracking.MlflowClient().get_run(run.run_id).data.tags
    plain = tracking.dvc_hash(shards)
    assert tags[f"dvc.input.{shards}"] == public_name(plain) != plain
