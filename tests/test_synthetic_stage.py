"""The `synthetic` stage: byte-identical output whatever the worker count and however often it was
interrupted, a resumable staging area, and an index, manifest and quality figures that match the shards."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.data import synthetic
from pipeline.artifacts import artifact
from pipeline.stages import stage, synthetic as synthetic_stage
from pipeline.data.shards import ShardDataset
from recording import RecordingTracker

CFG = {"num_programs": 12, "frames_per_program": 3, "resolution": 16, "mix_k": 1, "mix_alpha": 1.0,
       "samples_per_shard": 8, "workers": 1}  # 36 images in 5 shards, the last one short
SHARDS = 5


def run_stage(workdir: Path, **overrides) -> RecordingTracker:
    """Run the stage in `workdir` (its outputs and .dpfm/state are relative to the working directory)."""
    ctx = SimpleNamespace(stage=stage("synthetic"), tracker=RecordingTracker(), threads=1, device="cpu")
    params = {"run": {"seed": 7}, "synthetic": {**CFG, **overrides}}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        synthetic_stage.run(params, ctx)
    return ctx.tracker


def output_bytes(workdir: Path) -> dict[str, bytes]:
    out = workdir / artifact("synthetic")
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted single-process run."""
    work = tmp_path_factory.mktemp("reference")
    tracker = run_stage(work)
    return work, tracker


def staged(workdir: Path) -> list[str]:
    return sorted(p.name for p in (workdir / ".dpfm/state").glob("synthetic-*/*.tar"))


def test_two_workers_write_the_same_bytes_as_one(reference, tmp_path):
    ref, _ = reference
    run_stage(tmp_path, workers=2)
    expected = output_bytes(ref)
    assert sorted(expected) == sorted([synthetic_stage.shard_name(i) for i in range(SHARDS)] + [
        "contact_sheet.png", "index.parquet", "manifest.json", "stats.json", "usable.idx"])
    assert output_bytes(tmp_path) == expected
    assert staged(tmp_path) == [] and staged(ref) == []  # staging is cleared once the output is whole


def patch_build(monkeypatch, fail_on=None, fail_after=None, exc=RuntimeError):
    """Replace build_shard (single-process runs call it directly) with one that records each shard it
    renders and raises at shard `fail_on` or once `fail_after` shards are done."""
    real_build, rendered = synthetic_stage.build_shard, []

    def build(staging, shard, cfg, seed):
        if shard == fail_on or len(rendered) == fail_after:
            raise exc(f"simulated crash before shard {shard}")
        rendered.append(shard)
        return real_build(staging, shard, cfg, seed)

    monkeypatch.setattr(synthetic_stage, "build_shard", build)
    return rendered


def test_an_interrupted_run_resumes_to_the_same_bytes(reference, tmp_path, monkeypatch):
    ref, _ = reference
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    with monkeypatch.context() as m:
        patch_build(m, fail_after=2, exc=KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            run_stage(crashed)
    assert not (crashed / artifact("synthetic")).exists()  # nothing half-written is visible
    assert staged(crashed) == [synthetic_stage.shard_name(0), synthetic_stage.shard_name(1)]
    other = tmp_path / "other"
    shutil.copytree(crashed, other)

    with monkeypatch.context() as m:
        rendered = patch_build(m)
        tracker = run_stage(crashed)
    assert rendered == [2, 3, 4]  # only the missing shards
    assert tracker.metrics["shards_resumed"] == 2
    assert output_bytes(crashed) == output_bytes(ref)

    run_stage(other, workers=2)  # resuming with another worker count changes nothing either
    assert output_bytes(other) == output_bytes(ref)


def test_shards_finished_in_any_order_and_a_kill_9s_temporaries_give_the_same_output(reference, tmp_path,
                                                                                      monkeypatch):
    """Every shard rendered (the last one too), then a failure while the output was assembled, and a
    temporary tar that a kill -9 left: the rerun renders nothing, clears the temporary, and writes the
    same bytes; with the shards coming back in reverse order too."""
    ref, _ = reference

    def disk_gone(*args):
        raise RuntimeError("disk gone")
    with monkeypatch.context() as m:
        m.setattr(synthetic_stage, "assemble", disk_gone)
        with pytest.raises(RuntimeError, match="disk gone"):
            run_stage(tmp_path)
    staging = next((tmp_path / ".dpfm/state").glob("synthetic-*/"))
    stale = staging / f".{synthetic_stage.shard_name(2)}.x1y2z3.tmp"
    stale.write_bytes(b"half a tar")
    rendered = patch_build(monkeypatch)
    real_build_shards, real_assemble, stale_seen = synthetic_stage.build_shards, synthetic_stage.assemble, []
    monkeypatch.setattr(synthetic_stage, "build_shards", lambda *a: reversed(list(real_build_shards(*a))))
    monkeypatch.setattr(synthetic_stage, "assemble", lambda *a: stale_seen.append(stale.exists()) or real_assemble(*a))
    tracker = run_stage(tmp_path)
    assert rendered == [] and tracker.metrics["shards_resumed"] == SHARDS and stale_seen == [False]
    assert output_bytes(tmp_path) == output_bytes(ref)
    shutil.rmtree(tmp_path / artifact("synthetic"))
    run_stage(tmp_path)  # rendered afresh, in reverse order
    assert rendered == [0, 1, 2, 3, 4] and output_bytes(tmp_path) == output_bytes(ref)


def _flip_a_byte(tar):
    data = bytearray(tar.read_bytes())
    data[2000] ^= 0xFF  # same size, different content: only the sha256 can tell
    tar.write_bytes(bytes(data))


def _drop_its_record(tar):  # killed after the tar was written, before its record
    tar.with_name(tar.name + ".json").unlink()


@pytest.mark.parametrize("damage", [_flip_a_byte, _drop_its_record])
def test_a_damaged_staged_shard_is_rendered_again(reference, tmp_path, monkeypatch, damage):
    ref, _ = reference
    with monkeypatch.context() as m:
        patch_build(m, fail_on=3)
        with pytest.raises(RuntimeError, match="simulated crash"):
            run_stage(tmp_path)
    damage(next((tmp_path / ".dpfm/state").glob("synthetic-*/")) / synthetic_stage.shard_name(1))

    rendered = patch_build(monkeypatch)
    run_stage(tmp_path)
    assert rendered == [1, 3, 4]
    assert output_bytes(tmp_path) == output_bytes(ref)


def test_staging_is_keyed_by_what_decides_the_bytes():
    key = synthetic_stage.staging_dir(CFG, 7)
    assert synthetic_stage.staging_dir({**CFG, "workers": 8}, 7) == key
    assert synthetic_stage.staging_dir(CFG, 8) != key
    other = {"num_programs": 13, "frames_per_program": 4, "resolution": 32, "mix_k": 2, "mix_alpha": 0.5,
             "samples_per_shard": 9}
    assert set(other) == set(CFG) - {"workers"}  # every param but the worker count
    for k, v in other.items():
        assert synthetic_stage.staging_dir({**CFG, k: v}, 7) != key, k


def test_mixed_images_are_the_stages_params_blend(tmp_path):
    """shaders21k_6mixup's mixing, as the stage's params set it (partners from its own programs)."""
    run_stage(tmp_path, mix_k=2, mix_alpha=0.5)
    items = [(p, f) for p in range(CFG["num_programs"]) for f in range(CFG["frames_per_program"])]
    expected = synthetic.render_items(items, 16, base_seed=7, mix_k=2, mix_alpha=0.5, mix_pool=12).numpy()
    ds = ShardDataset(tmp_path / artifact("synthetic"))
    assert np.array_equal(ds.load_images(), expected)
    assert not np.array_equal(expected, synthetic.render_items(items, 16, base_seed=7).numpy())
    ds.close()


@pytest.mark.parametrize("part,value", [("torch", "9.9.9"), ("cpu", "DEFAULT"), ("pillow", "0.1")])
def test_staging_is_keyed_by_the_machine_that_renders(monkeypatch, part, value):
    """Resumed on a node whose torch picks other CPU kernels (or another torch or PNG encoder), the
    shards left by the first node are not taken as this one's."""
    key = synthetic_stage.staging_dir(CFG, 7)
    build = synthetic_stage.renderer_build()
    assert set(build) == {"torch", "cpu", "pillow"} and build[part] != value
    monkeypatch.setattr(synthetic_stage, "renderer_build", lambda: {**build, part: value})
    assert synthetic_stage.staging_dir(CFG, 7) != key


def test_staging_is_keyed_by_every_generator_module(tmp_path, monkeypatch):
    sources = synthetic_stage.generator_sources()
    package = Path(synthetic.__file__).parent
    assert [p for p in sources if p.parent == package] == sorted(package.glob("*.py"))
    assert {"__init__.py", "raymarch.py", "rng.py", "splitmix.py", "shards.py", "synthetic.py"} <= {p.name for p in sources}
    copies = []
    for p in sources:  # hash copies, so one can be edited
        copies.append(tmp_path / p.name)
        shutil.copyfile(p, copies[-1])
    monkeypatch.setattr(synthetic_stage, "generator_sources", lambda: copies)
    key = synthetic_stage.staging_dir(CFG, 7)
    assert key == synthetic_stage.staging_dir(CFG, 7)
    (tmp_path / "raymarch.py").write_text((tmp_path / "raymarch.py").read_text() + "\n# edited\n")
    assert synthetic_stage.staging_dir(CFG, 7) != key


def test_index_manifest_images_and_stats_agree(reference):
    ref, tracker = reference
    out = ref / artifact("synthetic")
    ds = ShardDataset(out)
    items = [(p, f) for p in range(CFG["num_programs"]) for f in range(CFG["frames_per_program"])]
    assert ds.index["key"] == [f"p{p:06d}-f{f:03d}" for p, f in items]
    assert [ds.meta(i) for i in range(len(ds))] == [{"program": p, "frame": f} for p, f in items]
    assert ds.caption(4) == synthetic.describe_program(1, 7)
    images = ds.load_images()
    assert images.shape == (36, 16, 16, 3) and images.dtype == np.uint8
    expected = synthetic.render_items(items, 16, base_seed=7).numpy()
    assert np.array_equal(images, expected)  # PNG round trip is lossless, shards hold what was rendered
    ds.close()

    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["shard"] for s in manifest["shards"]] == [synthetic_stage.shard_name(i) for i in range(SHARDS)]
    for entry in manifest["shards"]:
        data = (out / entry["shard"]).read_bytes()
        assert len(data) == entry["size"] and hashlib.sha256(data).hexdigest() == entry["sha256"]
    assert sum(s["images"] for s in manifest["shards"]) == pq.read_table(out / "index.parquet").num_rows == 36

    stats = json.loads((out / "stats.json").read_text())
    assert {k: stats[k] for k in ("images", "programs", "frames_per_program", "resolution", "shards")} == {
        "images": 36, "programs": 12, "frames_per_program": 3, "resolution": 16, "shards": SHARDS}
    assert stats["quality_sample"] == 36  # fewer images than the sample size: all of them
    assert stats["near_constant_fraction"] == synthetic.near_constant_fraction(images)
    assert stats["near_constant_fraction"] <= synthetic_stage.NEAR_CONSTANT_TARGET
    assert stats["diversity"] == pytest.approx(synthetic.diversity(images))
    assert np.isfinite(stats["diversity"]) and stats["diversity"] > 1.0
    sheet = np.asarray(Image.open(io.BytesIO((out / "contact_sheet.png").read_bytes())))
    assert sheet.shape == (5 * 18 + 2, 8 * 18 + 2, 3)  # 36 images, 8 a row, 2 px gaps
    assert {"near_constant_fraction", "diversity", "images", "images_per_s"} <= set(tracker.metrics)
    assert any(path.endswith("contact_sheet.png") for path, _ in tracker.artifacts)


def test_quality_sample_is_seeded_and_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic_stage, "STATS_SAMPLE", 10)
    run_stage(tmp_path)
    stats = json.loads((tmp_path / artifact("synthetic") / "stats.json").read_text())
    assert stats["quality_sample"] == 10
    first = synthetic_stage.quality_sample(tmp_path / artifact("synthetic"), 36, 7)
    again = synthetic_stage.quality_sample(tmp_path / artifact("synthetic"), 36, 7)
    assert first.shape == (10, 16, 16, 3) and np.array_equal(first, again)
    shutil.rmtree(tmp_path / ".dpfm", ignore_errors=True)


def test_a_finished_run_removes_what_another_configurations_killed_run_left(reference, tmp_path, monkeypatch, capsys):
    """Killed at 32 px, then run to the end at 16 px: the 32 px shards would never be resumed by it,
    and at ViP's scale they are ~70 GB of .dpfm/state."""
    ref, _ = reference
    with monkeypatch.context() as m:
        patch_build(m, fail_after=2)
        with pytest.raises(RuntimeError, match="simulated crash"):
            run_stage(tmp_path, resolution=32)
    assert len(staged(tmp_path)) == 2
    run_stage(tmp_path)
    assert staged(tmp_path) == [] and list((tmp_path / ".dpfm/state").glob("synthetic-*")) == []
    assert "2 shards another configuration's unfinished run left" in capsys.readouterr().out
    assert output_bytes(tmp_path) == output_bytes(ref)



def test_the_workers_param_sets_the_render_processes(tmp_path, monkeypatch):
    """synthetic.workers, when set, wins over the job's threads (ctx.threads=1 here); capped at the shards to do."""
    seen, real = [], synthetic_stage.build_shards

    def build_shards(staging, todo, cfg, seed, workers):
        seen.append(workers)
        return real(staging, todo, cfg, seed, workers)

    monkeypatch.setattr(synthetic_stage, "build_shards", build_shards)
    for name, workers in (("two", 2), ("many", 64)):
        (tmp_path / name).mkdir()
        run_stage(tmp_path / name, workers=workers)
    assert seen == [2, SHARDS]


def test_a_mostly_near_constant_sample_is_warned_about(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(synthetic, "near_constant_fraction", lambda images: 0.5)
    run_stage(tmp_path)
    assert f"WARNING 0.500 of sampled images are near-constant (target ≤ {synthetic_stage.NEAR_CONSTANT_TARGET})" in (
        capsys.readouterr().out)


def test_a_finished_run_keeps_other_stages_state(tmp_path):
    """Only another synthetic configuration's staging is removed: dp-train's and pretrain's resumable state stays."""
    kept = [tmp_path / ".dpfm/state" / name for name in ("dp-train-0123456789abcdef", "pretrain-0123456789abcdef")]
    for path in kept:
        path.mkdir(parents=True)
        (path / "checkpoint.pt").write_bytes(b"weights")
    run_stage(tmp_path)
    assert all((path / "checkpoint.pt").read_bytes() == b"weights" for path in kept)
