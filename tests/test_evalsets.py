"""Eval sets (pipeline/eval/evalsets.py): folders, webdataset shards, official parts and the digits,
resized and cropped alike, split stratified, streamed with the pixels of eager loading, and an
unreadable image named by its file."""

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.errors import EvalSetError
from pipeline.eval import images
from pipeline.eval.evalsets import EvalSet, _encode_labels, load_eval_set, square
from pipeline.eval.images import Images

ROOT = Path(__file__).resolve().parents[1]
DIGITS_SHARDS = {"source": "digits", "path": None, "limit": None, "image_size": 8, "eval_fraction": 0.3}


def png_bytes(array):
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def test_square_resizes_the_short_side_and_centre_crops():
    wide = np.zeros((20, 40, 3), np.uint8)
    wide[:, 10:30] = 255  # the centre square is white
    out = square(Image.fromarray(wide), 10)
    assert out.shape == (10, 10, 3) and out.min() > 200


def test_folder_set_takes_classes_from_folder_names(tmp_path):
    for name, value in (("cat", 20), ("dog", 200)):
        for i in range(3):
            (tmp_path / name / "sub").mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((24, 24, 3), value, np.uint8)).save(tmp_path / name / "sub" / f"{i}.png")
    es = load_eval_set({"name": "pets", "source": "folder", "path": str(tmp_path)}, 16)
    assert es.classes == ["cat", "dog"] and es.images.shape == (6, 16, 16, 3)
    assert es.labels.tolist() == [0, 0, 0, 1, 1, 1] and (es.images[es.labels == 1] == 200).all()
    assert es.prompts()[1] == ["a photo of a dog."]


def test_a_16_bit_grey_eval_image_is_what_training_decodes(tmp_path):
    """A 16-bit PNG (medical, scientific sets) came out near-white in evaluation, clipped above 255, while
    training scaled it to 8 bits: the probe scored other images than the model was trained on."""
    from pipeline.data.transforms import decode_image

    ramp = (np.arange(16 * 16, dtype=np.uint16).reshape(16, 16) * 257)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for i in range(2):
            Image.fromarray(ramp).save(tmp_path / name / f"{i}.png")
    es = load_eval_set({"name": "grey16", "source": "folder", "path": str(tmp_path)}, 16)
    assert np.array_equal(es.images[0], decode_image(png_bytes(ramp), 16)) and es.images[0].mean() < 200


def write_tar(path, samples):
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_webdataset_set_reads_labels_from_json_or_text(tmp_path):
    img = png_bytes(np.zeros((8, 8, 3), np.uint8))
    samples = [(f"s{i:03d}", {"png": img, "json": json.dumps({"cls": i % 3}).encode(),
                              "txt": ["ant", "bee", "cow"][i % 3].encode()}) for i in range(9)]
    write_tar(tmp_path / "a.tar", samples[:5])
    write_tar(tmp_path / "b.tar", samples[5:])
    by_json = load_eval_set({"name": "w", "source": "webdataset", "path": str(tmp_path), "label": "json:cls",
                             "classes": ["ant", "bee", "cow"], "templates": ["{c} on a leaf"]}, 16)
    by_text = load_eval_set({"name": "w", "source": "webdataset", "path": str(tmp_path), "label": "text"}, 16)
    assert by_json.labels.tolist() == by_text.labels.tolist() == [i % 3 for i in range(9)]
    assert by_json.classes == by_text.classes == ["ant", "bee", "cow"]
    assert by_json.prompts()[2] == ["cow on a leaf"] and by_json.images.shape == (9, 16, 16, 3)
    assert by_json.named and by_text.named  # named by `classes`, or by the labels themselves
    with pytest.raises(ValueError, match="no json field 'species'"):
        load_eval_set({"name": "w", "source": "webdataset", "path": str(tmp_path), "label": "json:species"}, 16)


def test_unnamed_integer_labels_are_the_classes_found(tmp_path):
    """Labels 1..3 (no `classes`): three classes named by their values. Counting up from 0 made a phantom
    class "0" with no example, so the split refused the set and zero-shot ranked a fourth prompt."""
    img = png_bytes(np.zeros((8, 8, 3), np.uint8))
    write_tar(tmp_path / "a.tar", [(f"s{i:03d}", {"png": img, "json": json.dumps({"label": 1 + i % 3}).encode()})
                                   for i in range(9)])
    es = load_eval_set({"name": "w", "source": "webdataset", "path": str(tmp_path)}, 16)
    assert es.classes == ["1", "2", "3"] and es.labels.tolist() == [i % 3 for i in range(9)]
    assert len(es.prompts()) == 3 and es.prompts()[0] == ["a photo of a 1."]
    assert not es.named  # evaluate scores no zero-shot on prompts naming bare numbers
    tr, te = es.split(0.5, seed=0)
    assert sorted(es.labels[tr].tolist() + es.labels[te].tolist()) == sorted(es.labels.tolist())


def test_official_train_and_test_parts_are_used_as_they_are(tmp_path):
    for part, per_class in (("train", 3), ("test", 2)):
        for name, value in (("cat", 20), ("dog", 200)):
            (tmp_path / part / name).mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(np.full((24, 30, 3), value, np.uint8)).save(tmp_path / part / name / f"{i}.png")
    spec = {"name": "pets", "source": "folder", "train": str(tmp_path / "train"), "test": str(tmp_path / "test")}
    es = load_eval_set(spec, 16)
    tr, te = es.split(0.5, seed=3)  # the fraction and seed do not reshuffle an official split
    assert tr.tolist() == list(range(6)) and te.tolist() == list(range(6, 10))
    assert es.labels[te].tolist() == [0, 0, 1, 1] and es.images.shape == (10, 16, 16, 3)
    with pytest.raises(ValueError, match="`train` and `test`"):
        load_eval_set({**spec, "path": str(tmp_path / "train")}, 16)
    with pytest.raises(ValueError, match="`train` and `test`"):
        load_eval_set({"name": "pets", "source": "folder", "train": str(tmp_path / "train")}, 16)
    with pytest.raises(FileNotFoundError, match=r"evaluate.sets\[pets\].test"):
        load_eval_set({**spec, "test": str(tmp_path / "nope")}, 16)


def test_digits_set_follows_the_shards_source(tmp_path, monkeypatch):
    """Trained on digits: the held-out digits split only. Trained on anything else: every bundled
    digit, public and unseen (a web run never looks for data/shards/eval labels)."""
    from pipeline.data.shards import ShardDataset
    from pipeline.io import write_json
    from pipeline.stages.shards import write_labelled

    monkeypatch.chdir(tmp_path)
    write_json("data/shards/stats.json", {"source": "urls"})
    every = load_eval_set({"name": "digits", "source": "digits"}, 8)
    assert len(every.labels) == 1797 and every.images.shape[1:] == (8, 8, 3)
    write_labelled({**DIGITS_SHARDS, "samples_per_shard": 512}, 0, Path("data/shards"))
    write_json("data/shards/stats.json", {"source": "digits"})
    held = load_eval_set({"name": "digits", "source": "digits"}, 8)
    assert len(held.labels) == len(ShardDataset("data/shards/eval")) < 0.35 * 1797


def test_eval_set_split_is_stratified_and_needs_two_per_class():
    es = EvalSet("x", np.zeros((20, 4, 4, 3), np.uint8), np.repeat([0, 1], 10), ["a", "b"], ("{c}",))
    tr, te = es.split(0.5, 0)
    assert np.bincount(es.labels[tr]).tolist() == [5, 5] and not set(tr) & set(te)
    lonely = EvalSet("y", np.zeros((5, 4, 4, 3), np.uint8), np.array([0, 0, 0, 0, 1]), ["a", "b"], ("{c}",))
    with pytest.raises(ValueError, match=r"\['b'\] have fewer than 2"):
        lonely.split(0.5, 0)


def test_a_prompt_template_with_another_field_is_refused_by_name():
    """A template is filled with `format(c=class name)`: another field stopped zero-shot on a bare
    KeyError (or IndexError) after every model was trained; a doubled brace is a literal one."""
    from pipeline.config import ParamsError

    def eval_set(template):
        return EvalSet("pets", np.zeros((2, 4, 4, 3), np.uint8), np.array([0, 1]), ["cat", "dog"], (template,))
    for template, error in (("a {c} in {style}", "KeyError"), ("{c}: {}", "IndexError"), ("{c} {", "ValueError")):
        with pytest.raises(ParamsError, match=rf"evaluate.sets\[pets\].templates: .* \({error}"):
            eval_set(template)
    assert eval_set("a {c} {{x}}").prompts() == [["a cat {x}"], ["a dog {x}"]]


def test_a_labelled_sets_class_names_must_name_every_label(tmp_path, monkeypatch):
    """`classes` renames a bundled set's labels 0..K-1: two names for the ten digits scored zero-shot
    over two classes and reported it, exit 0."""
    from pipeline.config import ParamsError

    monkeypatch.chdir(tmp_path)
    spec = {"name": "digits", "source": "digits", "limit": 50}
    with pytest.raises(ParamsError, match=r"evaluate.sets\[digits\].classes names 2 classes; the digits set has 10"):
        load_eval_set({**spec, "classes": ["a", "b"]}, 8)
    names = [f"n{i}" for i in range(10)]
    assert load_eval_set({**spec, "classes": names}, 8).classes == names


# -- eval sets stream their images -------------------------------------------------------------

def test_images_index_like_an_array_and_subsets_decode_nothing():
    arr = np.random.default_rng(0).integers(0, 256, (10, 4, 4, 3), dtype=np.uint8)
    reads = []
    images = Images(lambda rows: reads.append(rows.tolist()) or arr[rows], np.arange(10), (4, 4, 3))
    assert len(images) == 10 and images.shape == (10, 4, 4, 3)
    sub = images.subset(np.array([1, 3, 5, 7, 9]))
    subsub = sub.subset(np.array([True, False, True, False, True]))
    assert reads == [] and subsub.shape == (3, 4, 4, 3)
    np.testing.assert_array_equal(subsub[:], arr[[1, 5, 9]])
    np.testing.assert_array_equal(subsub[np.array([2, 0])], arr[[9, 1]])
    np.testing.assert_array_equal(sub[1:3], arr[[3, 5]])
    np.testing.assert_array_equal(sub[np.array([False, True, False, False, True])], arr[[3, 9]])
    np.testing.assert_array_equal(sub[-1], arr[9])
    assert reads[0] == [1, 5, 9] and reads[-1] == [9]  # only the rows asked for, in the order asked
    assert sub[np.array([], dtype=int)].shape == (0, 4, 4, 3)
    wrapped = EvalSet("x", arr, np.zeros(10, int), ["a"], ("{c}",)).images  # an array is wrapped
    np.testing.assert_array_equal(wrapped.subset(np.arange(10) % 2 == 0)[1:], arr[2::2])


def photo(rng, h, w, grey=False):
    """A smooth picture with noise, so resampling differences would show."""
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 5, y * 7, (x + y) * 3], -1) + rng.normal(0, 20, (h, w, 3))
    out = base.clip(0, 255).astype(np.uint8)
    return out[..., 0] if grey else out


def eager(encoded, size):
    """What evaluate loaded before it streamed: every image through `square`, stacked."""
    return np.stack([square(Image.open(io.BytesIO(b) if isinstance(b, bytes) else b), size) for b in encoded])


def test_folder_set_streams_the_same_pixels_as_eager_loading(tmp_path):
    rng = np.random.default_rng(0)
    for part in ("train", "test"):
        for c, (name, shape) in enumerate((("cat", (24, 30)), ("dog", (40, 20)), ("owl", (16, 16)))):
            (tmp_path / part / name / "sub").mkdir(parents=True)
            for i in range(3):
                ext = ("png", "jpg", "bmp")[i]
                Image.fromarray(photo(rng, *shape, grey=c == 2)).save(tmp_path / part / name / "sub" / f"{i}.{ext}")
    for spec in ({"path": str(tmp_path / "train")}, {"train": str(tmp_path / "train"), "test": str(tmp_path / "test")}):
        es = load_eval_set({"name": "pets", "source": "folder", **spec}, 16)
        parts = ["train"] if "path" in spec else ["train", "test"]
        files = [f for part in parts for f in sorted((tmp_path / part).rglob("*.*"))]
        expected = eager(files, 16)
        assert es.images.shape == expected.shape
        np.testing.assert_array_equal(es.images[:], expected)
        np.testing.assert_array_equal(es.images[np.arange(len(files))[::-1]], expected[::-1])  # across parts
        np.testing.assert_array_equal(es.images.subset(es.labels == 1)[:], expected[es.labels == 1])


@pytest.mark.parametrize("indexed", [True, False])
def test_webdataset_set_streams_the_same_pixels_as_eager_loading(tmp_path, indexed):
    from pipeline.data.shards import INDEX_NAME, ShardWriter
    from pipeline.data.transforms import encode_jpeg

    rng = np.random.default_rng(1)
    encoded = []
    with ShardWriter(tmp_path, prefix="eval", samples_per_shard=4) as w:
        for i in range(10):
            image = photo(rng, 20 + 3 * i, 30 - 2 * i)
            data, ext = (encode_jpeg(image), "jpg") if i % 3 == 0 else (png_bytes(image), "png")
            encoded.append(data)
            w.write(f"s{i:03d}", data, ["ant", "bee"][i % 2], {"cls": i % 2}, image_ext=ext)
    if not indexed:
        (tmp_path / INDEX_NAME).unlink()  # plain webdataset tars: read back by byte position
    es = load_eval_set({"name": "w", "source": "webdataset", "path": str(tmp_path), "label": "json:cls"}, 16)
    by_text = load_eval_set({"name": "w", "source": "webdataset", "path": str(tmp_path), "label": "text"}, 16)
    assert es.labels.tolist() == by_text.labels.tolist() == [i % 2 for i in range(10)]
    assert by_text.classes == ["ant", "bee"]
    np.testing.assert_array_equal(es.images[:], eager(encoded, 16))
    te = es.split(0.5, 0)[1]
    np.testing.assert_array_equal(es.images.subset(te)[1:], eager([encoded[i] for i in te[1:]], 16))


def test_digits_set_streams_the_same_pixels_as_eager_loading(tmp_path, monkeypatch):
    from pipeline.data.shards import ShardDataset
    from pipeline.io import write_json
    from pipeline.stages.shards import write_labelled

    monkeypatch.chdir(tmp_path)
    write_labelled({**DIGITS_SHARDS, "samples_per_shard": 200}, 0, Path("data/shards"))
    write_json("data/shards/stats.json", {"source": "digits"})
    es = load_eval_set({"name": "digits", "source": "digits"}, 12)
    ds = ShardDataset("data/shards/eval")
    expected = np.stack([square(Image.fromarray(ds.image(i)), 12) for i in range(len(ds))])
    np.testing.assert_array_equal(es.images[:], expected)
    mask = es.labels == 7
    np.testing.assert_array_equal(es.images[mask], expected[mask])


def test_unreadable_images_name_their_file(tmp_path, monkeypatch):
    (tmp_path / "pets" / "cat").mkdir(parents=True)
    (tmp_path / "pets" / "cat" / "0.png").write_bytes(b"not a png")
    es = load_eval_set({"name": "pets", "source": "folder", "path": str(tmp_path / "pets")}, 16)
    with pytest.raises(ValueError, match=r"cat/0.png: cannot read the image"):
        es.images[:1]
    for i in range(1, 6):  # threads decode a batch; the error raised is the first bad image's in row order
        Image.new("RGB", (20, 20), (40 * i, 0, 0)).save(tmp_path / "pets" / "cat" / f"{i}.png")
    (tmp_path / "pets" / "cat" / "4.png").write_bytes(b"nor this")
    es = load_eval_set({"name": "pets", "source": "folder", "path": str(tmp_path / "pets")}, 16)
    monkeypatch.setattr(images, "DECODE_THREADS", 4)
    with pytest.raises(EvalSetError, match=r"cat/0.png: cannot read the image"):
        es.images[:]
    np.testing.assert_array_equal(es.images[[1, 2, 3, 5]], eager(sorted((tmp_path / "pets" / "cat").glob("[1235].png")), 16))
    with tarfile.open(tmp_path / "a.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("s0.png")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(ValueError, match=r"a.tar.gz: not an uncompressed tar"):
        load_eval_set({"name": "w", "source": "webdataset", "path": str(tmp_path / "a.tar.gz")}, 16)


# -- the stage ---------------------------------------------------------------------------------


def test_the_eval_files_tag_follows_every_file_under_a_sets_paths(tmp_path):
    """Snakemake compares it as a param of evaluate and the curve (rules/common.smk): the paths are params,
    the files under them were not, and images replaced or relabelled in place left the old accuracies."""
    import os

    from pipeline.stages import eval_files_tag

    for part in ("train", "test"):
        for name, value in (("cat", 20), ("dog", 200)):
            (tmp_path / part / name).mkdir(parents=True)
            for i in range(3):
                Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(tmp_path / part / name / f"{i}.png")
    sets = [{"name": "digits", "source": "digits"},
            {"name": "pets", "source": "folder", "train": str(tmp_path / "train"), "test": str(tmp_path / "test")}]
    seen = {eval_files_tag(sets)}
    assert eval_files_tag(sets) in seen  # nothing changed: the same tag
    cat = tmp_path / "test/cat/0.png"
    cat.write_bytes((tmp_path / "test/dog/0.png").read_bytes())  # relabelled in place: same size, new time
    os.utime(cat, ns=(cat.stat().st_atime_ns, cat.stat().st_mtime_ns + 10**9))
    seen.add(eval_files_tag(sets))
    (tmp_path / "train/dog/3.png").write_bytes(cat.read_bytes())  # one more
    seen.add(eval_files_tag(sets))
    (tmp_path / "train/cat/1.png").unlink()
    seen.add(eval_files_tag(sets))
    assert len(seen) == 4
    assert eval_files_tag([{"name": "gone", "source": "folder", "path": str(tmp_path / "nowhere")}])  # named when run


def test_an_eval_set_that_reads_the_private_training_shards_is_refused(in_tmp):
    """A webdataset eval set pointed at the private shards (their folder, one tar, or an index over
    them) would score the model on its training examples: refused, naming the key. The run's held-out
    split shares a web source's tars but not their rows, and a copy of the same images elsewhere is
    another file: both pass (the check is on the shards read, not on the pictures)."""
    from pipeline.data.index import build_index

    private = in_tmp / "private-wds"
    private.mkdir()
    for t in range(2):  # each image its own (one image is one example: copies are dropped as duplicates)
        images = [png_bytes(np.full((8, 8, 3), 30 * t + i, np.uint8)) for i in range(30)]
        write_tar(private / f"{t}.tar", [(f"s{t}{i:02d}", {"png": image, "txt": b"a cat", "json": b'{"label": 0}'})
                                         for i, image in enumerate(images)])
    tars = sorted(private.glob("*.tar"))
    build_index([str(t) for t in tars], in_tmp / "data/shards", eval_fraction=0.3, seed=0, cache_dir=in_tmp / "c",
                workers=1, check_size=8)
    (in_tmp / "link").symlink_to(private)  # the same shards under other spellings: relative, dotted, linked
    for path in (private, tars[1], in_tmp / "data/shards/private", "private-wds", "private-wds/1.tar",
                 "./data/../private-wds", "link", "link/0.tar"):
        with pytest.raises(EvalSetError, match=r"evaluate\.sets\[mine\]\.path: .*holds the private training shards"):
            load_eval_set({"name": "mine", "source": "webdataset", "path": str(path)}, 8)
    assert len(load_eval_set({"name": "held", "source": "webdataset", "path": "data/shards/eval"}, 8).labels) > 0
    copy = in_tmp / "public-wds"
    copy.mkdir()
    (copy / "0.tar").write_bytes(tars[0].read_bytes())
    assert len(load_eval_set({"name": "copy", "source": "webdataset", "path": str(copy)}, 8).labels) == 30


def test_a_split_whose_probe_train_part_lacks_a_class_is_refused_before_any_training():
    """An official split whose train part misses a class its test part holds (or holds one class only):
    the probe could never answer it, scored as if it could. Refused by the upfront check that runs
    before any DP training is charged, naming the set and the classes; a stratified split refuses a
    class of one image."""
    from pipeline.config import ParamsError, load_params
    from pipeline.eval.protocols import check_protocols

    cfg = load_params(ROOT / "params.yaml")["evaluate"]
    cfg = {**cfg, "fewshot": {**cfg["fewshot"], "shots": [1]}, "finetune": {**cfg["finetune"], "enabled": False}}
    images = np.zeros((8, 4, 4, 3), np.uint8)

    def official(train, test):
        labels = np.array(train + test)
        return EvalSet("pets", images[:len(labels)], labels, ["cat", "dog", "owl"], ("a {c}",),
                       (np.arange(len(train)), np.arange(len(train), len(labels))))

    for train, test, message in (([0, 0, 1, 1], [0, 1, 2, 2], r"2 class\(es\), none of \['owl'\]"),
                                 ([0, 0, 0, 0], [0, 1], r"1 class\(es\), none of \['dog'\]"),
                                 ([1, 1, 1], [1, 1], r"1 class\(es\);")):
        with pytest.raises(ParamsError, match=rf"eval set 'pets': its train part holds {message}"):
            check_protocols(official(train, test), cfg, seed=0, depth=12)
    assert check_protocols(official([0, 1, 2, 0], [0, 1]), cfg, seed=0, depth=12)[1].tolist() == [4, 5]
    stratified = EvalSet("pets", images, np.array([0, 0, 0, 1, 1, 1, 1, 2]), ["cat", "dog", "owl"], ("a {c}",))
    with pytest.raises(ParamsError, match=r"classes \['owl'\] have fewer than 2 examples"):
        check_protocols(stratified, cfg, seed=0, depth=12)
    # K shots are drawn from the probe-train part: 12 images a class in the set, 6 in that part.
    balanced = EvalSet("pets", np.zeros((24, 4, 4, 3), np.uint8), np.arange(24) % 2, ["cat", "dog"], ("a {c}",))
    few = {**cfg, "probe_fraction": 0.5, "fewshot": {**cfg["fewshot"], "shots": [8]}}
    with pytest.raises(ParamsError, match="evaluate.fewshot.shots on eval set 'pets'"):
        check_protocols(balanced, few, seed=0, depth=12)
    check_protocols(balanced, {**few, "fewshot": {**few["fewshot"], "shots": [6]}}, seed=0, depth=12)


def test_prompts_follow_the_classes_order_the_labels_index():
    """Zero-shot reads prompt list i as class i: the digits' and Fashion-MNIST's names are not in
    alphabetical order, and prompts sorted by name would score every image against another class."""
    ev = EvalSet("s", np.zeros((3, 4, 4, 3), np.uint8), np.array([0, 1, 2]), ["zero", "one", "two"], ("a {c}", "b {c}"))
    assert ev.prompts() == [["a zero", "b zero"], ["a one", "b one"], ["a two", "b two"]]


def test_labels_are_indices_into_the_classes_as_given():
    """A `classes` list in the user's order decides the indices (not its sorted order); integer labels
    above the names it gives are refused, one short included."""
    from pipeline.eval.evalsets import _encode_labels

    labels, classes, named = _encode_labels(["dog", "cat", "dog"], ["dog", "cat"], "s")
    assert labels.tolist() == [0, 1, 0] and classes == ["dog", "cat"] and named
    with pytest.raises(EvalSetError, match="`classes` names 2 classes but labels go up to 2"):
        _encode_labels([0, 1, 2], ["a", "b"], "s")
    assert _encode_labels([0, 1, 2], ["a", "b", "c"], "s")[0].tolist() == [0, 1, 2]


def test_a_labelled_set_prompts_with_its_own_templates_unless_the_set_names_others(tmp_path, monkeypatch):
    """A bundled set's zero-shot prompts are its training captions' templates; `templates` in its
    entry replaces them (it was read by folder and webdataset sets only)."""
    from pipeline.data import labelled_sets

    monkeypatch.chdir(tmp_path)
    spec = {"name": "digits", "source": "digits", "limit": 50}
    own = load_eval_set(spec, 8)
    assert own.templates == labelled_sets.DIGITS.templates
    assert own.prompts()[3][0] == "a handwritten digit three"
    mine = load_eval_set({**spec, "templates": ["{c} in ink"]}, 8)
    assert mine.prompts() == [[f"{c} in ink"] for c in labelled_sets.DIGITS.classes]


def test_webdataset_samples_in_different_folders_are_different_samples(tmp_path):
    """A webdataset key is the member's path up to the first dot of its name: `a/0.*` and `b/0.*` are
    two samples, each with its own label and image, not one sample whose members overwrite."""
    dark, light = png_bytes(np.zeros((8, 8, 3), np.uint8)), png_bytes(np.full((8, 8, 3), 200, np.uint8))
    write_tar(tmp_path / "a.tar", [("cats/0", {"png": dark, "txt": b"cat"}), ("dogs/0", {"png": light, "txt": b"dog"}),
                                   ("dogs/1", {"png": light, "txt": b"dog"})])
    es = load_eval_set({"name": "w", "source": "webdataset", "path": str(tmp_path), "label": "text"}, 8)
    assert es.classes == ["cat", "dog"] and es.labels.tolist() == [0, 1, 1]
    assert es.images[np.arange(3)].reshape(3, -1).max(1).tolist() == [0, 200, 200]


def test_an_unindexed_tar_that_shrinks_after_listing_is_named_not_read_short(tmp_path):
    """Images of tars without an index are read back by byte position: a tar cut short between the
    listing and the read names the tar and the byte, instead of decoding a partial image."""
    img = png_bytes(np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8))
    write_tar(tmp_path / "a.tar", [(f"s{i}", {"png": img, "txt": b"ant" if i % 2 else b"bee"}) for i in range(4)])
    es = load_eval_set({"name": "w", "source": "webdataset", "path": str(tmp_path), "label": "text"}, 8)
    assert es.images[np.arange(4)].shape == (4, 8, 8, 3)
    tar = tmp_path / "a.tar"
    with tarfile.open(tar) as t:
        last = t.getmember("s3.png")
    with open(tar, "r+b") as f:
        f.truncate(last.offset_data + len(img) // 2)
    with pytest.raises(EvalSetError, match=rf"a.tar at byte {last.offset_data}: expected an image of {len(img)} "
                                           rf"bytes, found {len(img) // 2}: the tar changed"):
        es.images[np.array([3])]


def test_finetunes_shots_are_checked_where_finetuning_is_enabled():
    """Fine-tuning draws its K shots from probe-train too: enabled, a K its set cannot give is refused before
    any training, by its own key; disabled, its shots ask nothing of the set."""
    from pipeline.config import ParamsError, load_params
    from pipeline.eval.protocols import check_protocols

    cfg = load_params(ROOT / "params.yaml")["evaluate"]
    balanced = EvalSet("pets", np.zeros((24, 4, 4, 3), np.uint8), np.arange(24) % 2, ["cat", "dog"], ("a {c}",))
    on = {**cfg, "probe_fraction": 0.5, "fewshot": {**cfg["fewshot"], "shots": [1]},
          "finetune": {**cfg["finetune"], "enabled": True, "shots": [8]}}  # 6 images a class in probe-train
    with pytest.raises(ParamsError, match="evaluate.finetune.shots on eval set 'pets'"):
        check_protocols(balanced, on, seed=0, depth=12)
    check_protocols(balanced, {**on, "finetune": {**on["finetune"], "enabled": False}}, seed=0, depth=12)
    check_protocols(balanced, {**on, "finetune": {**on["finetune"], "shots": [6]}}, seed=0, depth=12)


def test_two_eval_sets_of_one_name_are_refused(tmp_path):
    """metrics.json keys each set's results by its name: a second set of the same name would overwrite
    the first's, so the pair is refused by name before anything is trained."""
    from pipeline.config import ParamsError, load_params
    from pipeline.eval.protocols import checked_eval_sets

    for name, value in (("cat", 20), ("dog", 200)):
        (tmp_path / name).mkdir()
        for i in range(4):
            Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(tmp_path / name / f"{i}.png")
    cfg = load_params(ROOT / "params.yaml")["evaluate"]
    cfg = {**cfg, "probe_fraction": 0.5, "fewshot": {**cfg["fewshot"], "shots": [1]},
           "finetune": {**cfg["finetune"], "enabled": False}}
    spec = {"name": "pets", "source": "folder", "path": str(tmp_path)}
    assert len(checked_eval_sets([spec, {**spec, "name": "more"}], cfg, 0, 8, 12, decode=False)) == 2
    with pytest.raises(ParamsError, match=r"two sets are named \['pets'\]"):
        checked_eval_sets([spec, dict(spec)], cfg, 0, 8, 12, decode=False)


def test_a_split_keeps_the_probe_train_fraction_it_is_given():
    """probe_fraction is the share of the set the probe trains on: 0.75 of 40 images is 30 to train on and
    10 to score, each class in proportion, not the other way round."""
    es = EvalSet("x", np.zeros((40, 4, 4, 3), np.uint8), np.repeat([0, 1], 20), ["a", "b"], ("{c}",))
    tr, te = es.split(0.75, 0)
    assert len(tr) == 30 and len(te) == 10 and not set(tr) & set(te)
    assert np.bincount(es.labels[tr]).tolist() == [15, 15] and np.bincount(es.labels[te]).tolist() == [5, 5]


def test_folder_images_with_upper_case_extensions_are_read(tmp_path):
    """Cameras and Windows tools write IMG_0001.JPG: an extension is matched whatever its case, so no
    class folder loses its images (or the whole set) to it."""
    for name, ext in (("cat", "PNG"), ("dog", "JPG")):
        (tmp_path / name).mkdir()
        for i in range(2):
            Image.fromarray(np.full((8, 8, 3), 100, np.uint8)).save(tmp_path / name / f"{i}.{ext}",
                                                                    format="PNG" if ext == "PNG" else "JPEG")
    es = load_eval_set({"name": "pets", "source": "folder", "path": str(tmp_path)}, 8)
    assert es.classes == ["cat", "dog"] and es.labels.tolist() == [0, 0, 1, 1]


def test_text_labels_are_class_names_without_surrounding_whitespace(tmp_path):
    """A caption file ending in a newline names the same class as one without: "cat\\n" and "cat" are
    one class, not two that the probe and zero-shot would score apart."""
    img = png_bytes(np.zeros((8, 8, 3), np.uint8))
    write_tar(tmp_path / "a.tar", [("s0", {"png": img, "txt": b"cat\n"}), ("s1", {"png": img, "txt": b"cat"}),
                                   ("s2", {"png": img, "txt": b" dog \n"}), ("s3", {"png": img, "txt": b"dog"})])
    es = load_eval_set({"name": "w", "source": "webdataset", "path": str(tmp_path), "label": "text"}, 8)
    assert es.classes == ["cat", "dog"] and es.labels.tolist() == [0, 0, 1, 1]


def test_a_webdataset_members_extension_is_everything_after_the_first_dot(tmp_path):
    """`s0.png`, `s0.txt` and `s0.meta.json` are one sample (key `s0`): an extra member with a dotted
    extension is not a sample of its own (one without an image, which refused the whole set)."""
    img = png_bytes(np.zeros((8, 8, 3), np.uint8))
    write_tar(tmp_path / "a.tar", [(f"s{i}", {"png": img, "txt": [b"ant", b"bee"][i % 2], "meta.json": b"{}"})
                                   for i in range(4)])
    es = load_eval_set({"name": "w", "source": "webdataset", "path": str(tmp_path), "label": "text"}, 8)
    assert es.labels.tolist() == [0, 1, 0, 1] and es.images.shape == (4, 8, 8, 3)


def test_labels_that_classes_cannot_index_are_refused():
    """With `classes` given, a negative integer label would silently index the last name, a string label
    it lacks would fail on a bare KeyError, and true/false are not class indices: each is refused by name."""
    with pytest.raises(EvalSetError, match="integer labels must be >= 0, found -1"):
        _encode_labels([-1, 0, 1], ["a", "b", "c"], "s")
    with pytest.raises(EvalSetError, match=r"labels \['owl'\] are not in `classes`"):
        _encode_labels(["cat", "owl"], ["cat", "dog"], "s")
    with pytest.raises(EvalSetError, match=r"all integers or all strings, got \['bool'\]"):
        _encode_labels([True, False, True], None, "s")
