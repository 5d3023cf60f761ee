"""Faults of the data stages: a real `kill -9` in the middle of a download and of synthetic
generation (a re-run resumes to what an uninterrupted run gives, without fetching finished shards
again), the temporary copy a killed writer leaves, and bad images (every mode decodes to the same RGB,
bombs and empty files are excluded and counted).

Stage processes run `dpfm` through tests/fault_hooks.py, which stops them at an exact point.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fault_hooks import complete, dpfm, kill_at_fault, log_tail, with_sets
from PIL import Image
from shard_data import excluded, good, index, raw_tar
from stage_runs import run_in_process

from pipeline.data.shards import ShardDataset
from pipeline.data.transforms import decode_image, encode_jpeg
from pipeline.io import atomic_dir, read_json
from pipeline.artifacts import artifact

ROOT = Path(__file__).resolve().parents[1]


def bare_project(work: Path) -> Path:
    """A project folder with the default params and their schema (stages run with `--set` overrides)."""
    shutil.copytree(ROOT / "schemas", work / "schemas")
    shutil.copy(ROOT / "params.yaml", work / "params.yaml")
    return work


# -- shards: kill -9 in the middle of a download -----------------------------------------------------

def test_kill_9_during_a_download_resumes_without_fetching_finished_shards_again(tmp_path, serve):
    rng = np.random.default_rng(0)
    (tmp_path / "www").mkdir()
    for i in range(12):
        picture = Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8))
        (tmp_path / "www" / f"img{i}.png").write_bytes(encoded(picture, "PNG"))
    server = serve(tmp_path / "www")
    table = tmp_path / "pairs.csv"
    table.write_text("url,caption\n" + "".join(f"{server.url}/img{i}.png,picture {i}\n" for i in range(12)))
    args = with_sets("shards", ["shards.source=download", f"shards.path={table}", "shards.image_size=16",
                                "shards.samples_per_shard=4", "shards.eval_fraction=0.25", "shards.workers=1",
                                "shards.download.threads=2"])
    ref, work = bare_project(tmp_path / "ref"), bare_project(tmp_path / "work")
    complete(dpfm(ref, args), ref)

    before = server.requests.copy()
    assert kill_at_fault(dpfm(work, args, "fetching:6"), work) == "fetching"  # row 6 is in shard 1 (rows 4-7)
    cache = work / "data/cache/download"
    assert sorted(p.name for p in cache.glob("pairs-*")) == ["pairs-000000.json", "pairs-000000.tar"]
    assert list(cache.glob(".pairs-000001.tar.*.tmp")), "the kill did not land inside shard 1's write"
    assert not (work / "data/shards").exists()
    killed_run = server.requests - before
    complete(dpfm(work, args), work)
    resumed_run = server.requests - before - killed_run
    assert all(resumed_run[f"/img{i}.png"] == 0 for i in range(4)), "a finished shard was downloaded again"
    assert all(resumed_run[f"/img{i}.png"] == 1 for i in range(4, 12))
    assert not list(cache.glob(".*.tmp"))  # the torn shard was reclaimed

    # The same shard bytes, dataset and stats as the uninterrupted run (but for the reuse count).
    for tar in (ref / "data/cache/download").glob("*.tar"):
        assert (cache / tar.name).read_bytes() == tar.read_bytes(), tar.name
    stats, ref_stats = (read_json(d / ".dpfm/owner/shards.json") for d in (work, ref))  # download counts: owner-only
    assert (stats["download"].pop("reused_shards"), ref_stats["download"].pop("reused_shards")) == (1, 0)
    assert stats == ref_stats and stats["private"]["usable"] + stats["eval"]["usable"] == 12
    for split in ("private", "eval"):
        got, expected = (ShardDataset(d / "data/shards" / split) for d in (work, ref))
        assert got.index["key"] == expected.index["key"]
        for i in range(len(got)):
            assert got.caption(i) == expected.caption(i) and np.array_equal(got.image(i), expected.image(i))


# -- synthetic: kill -9 of the parent and its worker processes -------------------------------------------

def test_kill_9_during_synthetic_generation_resumes_to_the_same_bytes(tmp_path):
    sets = ["synthetic.num_programs=24", "synthetic.frames_per_program=2", "synthetic.resolution=16",
            "synthetic.samples_per_shard=4", "synthetic.workers=2"]
    ref, work = bare_project(tmp_path / "ref"), bare_project(tmp_path / "killed")
    cwd = os.getcwd()
    os.chdir(ref)
    try:
        run_in_process("synthetic", sets[:-1] + ["synthetic.workers=1"])
    finally:
        os.chdir(cwd)
    args = with_sets("synthetic", sets)
    kill_at_fault(dpfm(work, args, "shards:3"), work)
    [staging] = (work / ".dpfm/state").glob("synthetic-*")
    assert len(list(staging.glob("*.json"))) == 3 and not (work / "data/synthetic").exists()
    damaged = staging / sorted(p.stem for p in staging.glob("*.json"))[0]  # its size kept: its sha256 tells
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    complete(dpfm(work, args), work)
    assert "resuming" in log_tail(work)
    assert f"staged {damaged.name} does not match its record; rendering it again" in log_tail(work)
    out, expected = work / artifact("synthetic"), ref / artifact("synthetic")
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in expected.iterdir())
    for p in expected.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name


def test_a_synthetic_job_that_fails_after_its_output_keeps_its_shards_for_the_rerun(tmp_path):
    """Killed as it logs to MLflow (its output in place, as a SIGTERM or a locked MLflow store finds it),
    the job fails and Snakemake deletes its output: the rerun assembles the staged shards again and
    renders none. The staging was deleted before the logging, so every shard was rendered again."""
    work = bare_project(tmp_path / "work")
    args = with_sets("synthetic", ["synthetic.num_programs=8", "synthetic.frames_per_program=2",
                                   "synthetic.resolution=16", "synthetic.samples_per_shard=4", "synthetic.workers=1"])
    assert kill_at_fault(dpfm(work, args, "published:shards_resumed"), work) == "published"
    first = (work / artifact("synthetic")).resolve()
    expected = {p.name: p.read_bytes() for p in first.iterdir()}
    shutil.rmtree(first)  # as Snakemake removes a failed job's output
    complete(dpfm(work, args), work)
    assert "synthetic: resuming, 4 of 4 shards already rendered" in log_tail(work)
    assert {p.name: p.read_bytes() for p in (work / artifact("synthetic")).iterdir()} == expected
    assert not list((work / ".dpfm/state").glob("synthetic-*"))  # spent once the job ends


# -- any stage output: the temporary copy a killed writer leaves is reclaimed --------------------------

def test_the_next_write_reclaims_what_a_killed_writer_left(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", (
        "import os, time\n"
        "from pipeline.io import atomic_dir\n"
        "with atomic_dir('shards') as out:\n"
        "    (out / 'private.tar').write_bytes(os.urandom(4096))\n"
        "    open('fault.reached', 'w').close()\n"
        "    time.sleep(600)\n")], cwd=tmp_path, start_new_session=True)
    kill_at_fault(writer, tmp_path)
    [stale] = tmp_path.glob(".shards.*.tmp")  # kill -9 skips atomic_dir's clean-up
    unrelated = tmp_path / ".synthetic.x1y2z3.tmp"
    unrelated.mkdir()
    with atomic_dir(tmp_path / "shards") as out:
        (out / "private.tar").write_text("whole")
    assert not stale.exists() and unrelated.exists()
    assert [p.name for p in (tmp_path / "shards").iterdir()] == ["private.tar"]


def test_a_file_is_on_disk_before_it_takes_its_name(tmp_path, monkeypatch):
    """A power cut just after the rename must not leave an empty file under the final name, which a later
    stage would take for a good one: its bytes are fsynced first."""
    from pipeline.io import atomic_path

    events, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda src, dst: events.append(("replace", str(src))) or real_replace(src, dst))
    with atomic_path(tmp_path / "verification.json") as tmp:
        tmp.write_text("{}")
    assert events == [("fsync", str(tmp)), ("replace", str(tmp))]


def test_a_writer_killed_between_its_two_renames_loses_no_output_and_leaves_no_copy(tmp_path):
    """atomic_dir moves the old output aside, then the new one in: killed between the two, neither was at
    its path, and the old one (of the private shards, a whole copy) stayed under a hidden name that no
    later write or clean-up removed. The next write puts it back first, and removes it once replaced."""
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards/private.tar").write_text("v1")
    writer = subprocess.Popen([sys.executable, "-c", (
        "import os, time\n"
        "from pipeline import io\n"
        "real, calls = os.replace, []\n"
        "def replace(a, b):\n"
        "    calls.append(a)\n"
        "    if len(calls) == 2:  # the old output is aside, the new one not yet in\n"
        "        open('fault.reached', 'w').close()\n"
        "        time.sleep(600)\n"
        "    return real(a, b)\n"
        "io.os.replace = replace\n"
        "with io.atomic_dir('shards') as out:\n"
        "    (out / 'private.tar').write_text('v2')\n")], cwd=tmp_path, start_new_session=True)
    kill_at_fault(writer, tmp_path)
    assert not (tmp_path / "shards").exists() and (tmp_path / ".shards.old/private.tar").read_text() == "v1"
    with pytest.raises(RuntimeError):  # a write that fails leaves the last good output in place
        with atomic_dir(tmp_path / "shards"):
            raise RuntimeError("the stage failed")
    assert (tmp_path / "shards/private.tar").read_text() == "v1" and not (tmp_path / ".shards.old").exists()
    with atomic_dir(tmp_path / "shards") as out:
        (out / "private.tar").write_text("v3")
    assert (tmp_path / "shards/private.tar").read_text() == "v3"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".shards")) == []


# -- bad images: every mode decodes to the same RGB, bombs and empty files are excluded and counted -----------

def encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def test_grey_rgba_cmyk_and_16_bit_images_decode_to_what_they_show():
    grey = np.arange(64, dtype=np.uint8).reshape(8, 8) * 4
    as_rgb = np.repeat(grey[..., None], 3, axis=-1)
    assert np.array_equal(decode_image(encoded(Image.fromarray(grey), "PNG")), as_rgb)
    rgba = Image.fromarray(as_rgb).convert("RGBA")
    assert np.array_equal(decode_image(encoded(rgba, "PNG")), as_rgb)
    # 16-bit grey: scaled to 8 bits, not clipped (convert("RGB") alone turns everything above 255 white).
    assert np.array_equal(decode_image(encoded(Image.fromarray(grey.astype(np.uint16) * 257), "PNG")), as_rgb)
    between = np.array([[200, 65535]], np.uint16)  # 200/257 = 0.78: rounded to 1, not cut to 0
    assert decode_image(encoded(Image.fromarray(between), "PNG"))[0, :, 0].tolist() == [1, 255]
    cmyk = decode_image(encoded(Image.fromarray(as_rgb).convert("CMYK"), "JPEG"))
    assert cmyk.shape == (8, 8, 3) and np.abs(cmyk.astype(int) - as_rgb).max() < 40


def test_image_modes_are_kept_and_bombs_and_empty_files_counted(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    picture = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow refuses above 2x this: a 64x64 image is a bomb
    members = (good("a", rng)
               + [("b.png", encoded(Image.fromarray(picture[..., 0]), "PNG")), ("b.txt", b"grey")]
               + [("c.png", encoded(Image.fromarray(picture).convert("RGBA"), "PNG")), ("c.txt", b"rgba")]
               + [("d.png", encoded(Image.fromarray(picture[..., 0].astype(np.uint16) * 257), "PNG")),
                  ("d.txt", b"16 bit")]
               + [("e.jpg", encoded(Image.fromarray(picture).convert("CMYK"), "JPEG")), ("e.txt", b"cmyk")]
               + [("f.png", encoded(Image.new("L", (64, 64)), "PNG")), ("f.txt", b"a bomb")]
               + [("g.jpg", b""), ("g.txt", b"zero bytes")]
               + [("h.jpg", encode_jpeg(picture)), ("h.txt", b"")])
    raw_tar(tmp_path / "modes.tar", members)
    stats, ds = index([tmp_path / "modes.tar"], tmp_path)
    assert ds.index["key"] == ["a", "b", "c", "d", "e"]
    assert excluded(stats) == {"corrupt_image": 2, "missing_caption": 1}
    assert stats["private"]["rows"] == 8


def test_to_tensor_puts_channels_first_and_normalises_each_by_imagenets_rgb_constants():
    """(N, H, W, 3) uint8 -> (N, 3, H, W) floats, channel c at (pixel/255 - MEAN[c]) / STD[c] with
    ImageNet's RGB mean and std, on a non-square image so that a swapped H and W shows."""
    import torch

    from pipeline.data.transforms import to_tensor

    img = np.random.default_rng(0).integers(0, 256, (1, 2, 3, 3), dtype=np.uint8)
    out = to_tensor(img)
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    assert out.shape == (1, 3, 2, 3) and out.dtype == torch.float32
    want = ((img / 255.0 - mean) / std).transpose(0, 3, 1, 2)
    assert np.allclose(out.numpy(), want, atol=1e-5)


def test_atomic_writes_reach_the_disk_before_their_name_and_get_the_modes_of_ordinary_writes(tmp_path, monkeypatch):
    """A file is fsynced before it is renamed into place (else a crash can leave the final name on
    empty blocks); the published outputs then carry the umask's modes, not mkstemp's owner-only ones
    (a group sharing a project reads them), and an explicit mode wins."""
    from pipeline import io as pio

    events, fsync, replace = [], pio.os.fsync, pio.os.replace
    monkeypatch.setattr(pio.os, "fsync", lambda fd: events.append("fsync") or fsync(fd))
    monkeypatch.setattr(pio.os, "replace", lambda a, b: events.append(f"replace {Path(b).name}") or replace(a, b))
    before = os.umask(0o027)
    try:
        pio.write_json(tmp_path / "metrics.json", {"a": 1})
        pio.write_json(tmp_path / "owner.json", {"a": 1}, mode=0o600)
        with pio.atomic_dir(tmp_path / "shards") as out:
            (out / "x").write_text("x")
    finally:
        os.umask(before)
    assert events[:2] == ["fsync", "replace metrics.json"]
    assert oct(os.stat(tmp_path / "metrics.json").st_mode & 0o777) == oct(0o640)
    assert oct(os.stat(tmp_path / "owner.json").st_mode & 0o777) == oct(0o600)
    assert oct(os.stat(tmp_path / "shards").st_mode & 0o777) == oct(0o750)
