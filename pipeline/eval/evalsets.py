"""Labelled evaluation sets: the bundled digits, or any labelled webdataset or image-folder
directory named in `evaluate.sets`, as one `path` (split here, seeded and stratified) or as its own
`train` and `test` parts (an official split, used as it is).

Digits follow the shards source: when the private data is digits, the held-out digits split
(data/shards/eval) that training never saw; otherwise all of scikit-learn's bundled digits.

Every set comes back as square uint8 images at the model's input size, integer labels, class
names and zero-shot prompt templates (with a `{c}` slot for the class name).
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.model_selection import train_test_split
from tqdm import tqdm

from pipeline.data.shards import INDEX_NAME, ShardDataset

DIGITS_EVAL, SHARD_STATS = "data/shards/eval", "data/shards/stats.json"
IMAGE_EXTS = ("png", "jpg", "jpeg", "webp", "bmp")
DEFAULT_TEMPLATES = ("a photo of a {c}.",)


@dataclass
class EvalSet:
    name: str
    images: np.ndarray          # (N, S, S, 3) uint8
    labels: np.ndarray          # (N,) int in [0, len(classes))
    classes: list[str]
    templates: tuple[str, ...]  # zero-shot prompts, "{c}" is replaced by the class name
    parts: tuple[np.ndarray, np.ndarray] | None = None  # (train, test) indices of an official split

    def prompts(self) -> list[list[str]]:
        """One list of prompts per class."""
        return [[t.format(c=c) for t in self.templates] for c in self.classes]

    @property
    def chance(self) -> float:
        """Accuracy of always predicting the most frequent class."""
        return float(np.bincount(self.labels).max() / len(self.labels))

    def split(self, train_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Probe-train / probe-test indices: the set's own parts, else a stratified seeded split."""
        if self.parts is not None:
            return self.parts
        counts = np.bincount(self.labels, minlength=len(self.classes))
        if counts.min() < 2:
            rare = [self.classes[i] for i in np.flatnonzero(counts < 2)]
            raise ValueError(f"eval set {self.name!r}: classes {rare} have fewer than 2 examples; "
                             f"a probe needs each class on both sides of the split")
        idx = np.arange(len(self.labels))
        tr, te = train_test_split(idx, train_size=train_fraction, stratify=self.labels, random_state=seed)
        return np.sort(tr), np.sort(te)


def square(image: Image.Image, size: int) -> np.ndarray:
    """Resize the shorter side to `size` and centre-crop (the papers' eval transform)."""
    image = image.convert("RGB")
    if image.size != (size, size):
        w, h = image.size
        s = size / min(w, h)
        image = image.resize((max(size, round(w * s)), max(size, round(h * s))), Image.BICUBIC)
        w, h = image.size
        left, top = (w - size) // 2, (h - size) // 2
        image = image.crop((left, top, left + size, top + size))
    return np.asarray(image)


def load_eval_set(spec: dict, image_size: int) -> EvalSet:
    """One entry of `evaluate.sets` -> EvalSet (images at `image_size`)."""
    source = spec["source"]
    if source == "digits":
        return _digits(spec, image_size)
    if source not in ("folder", "webdataset"):
        raise ValueError(f"evaluate.sets[{spec['name']}].source: unknown source {source!r}")
    parts = [key for key in ("train", "test") if key in spec]
    if parts and (len(parts) == 1 or "path" in spec):
        raise ValueError(f"evaluate.sets[{spec['name']}]: give `train` and `test` (an official split) or `path` "
                         "(split here), not " + " and ".join(sorted(set(parts) | ({"path"} & set(spec)))))
    loaded = [_load_part(spec, key, image_size) for key in (parts or ["path"])]
    images = np.concatenate([im for im, _ in loaded])
    labels, classes = _encode_labels([n for _, names in loaded for n in names], spec.get("classes"), spec["name"])
    split = None
    if parts:
        n_train = len(loaded[0][0])
        split = (np.arange(n_train), np.arange(n_train, len(images)))
    return EvalSet(spec["name"], images, labels, classes, tuple(spec.get("templates", DEFAULT_TEMPLATES)), split)


def _load_part(spec: dict, key: str, image_size: int) -> tuple[np.ndarray, list]:
    path = Path(spec[key])
    if not path.exists():
        raise FileNotFoundError(f"evaluate.sets[{spec['name']}].{key}: {path} does not exist")
    if spec["source"] == "folder":
        return _folder(path, image_size)
    return _webdataset(path, spec.get("label", "json:label"), image_size)


def _digits(spec: dict, image_size: int) -> EvalSet:
    from pipeline.io import read_json
    from pipeline.stages.shards import CAPTION_TEMPLATES, NUMBER_WORDS, load_digits_rgb

    if Path(SHARD_STATS).exists() and read_json(SHARD_STATS).get("source") == "digits":
        ds = ShardDataset(DIGITS_EVAL)  # the held-out part: the private part was trained on
        images = np.stack([square(Image.fromarray(ds.image(i)), image_size) for i in range(len(ds))])
        labels = np.array([ds.meta(i)["label"] for i in range(len(ds))])
    else:  # private data from elsewhere: every bundled digit is public and unseen
        images, labels = load_digits_rgb(image_size)
    # The training captions' own templates are the natural zero-shot prompts for digits.
    templates = tuple(spec.get("templates") or (t.format(w="{c}") for t in CAPTION_TEMPLATES))
    return EvalSet(spec["name"], images, labels, list(spec.get("classes") or NUMBER_WORDS), templates)


def _folder(path: Path, image_size: int) -> tuple[np.ndarray, list]:
    """`path/<class name>/**/<image>`: the class is the name of the top-level folder."""
    files = sorted((d.name, f) for d in path.iterdir() if d.is_dir()
                   for f in d.rglob("*") if f.suffix.lower().lstrip(".") in IMAGE_EXTS)
    if not files:
        raise ValueError(f"{path}: no images found in class folders ({'/'.join(IMAGE_EXTS)} under {path}/<class>/)")
    images = [square(Image.open(f), image_size) for _, f in tqdm(files, desc=f"load {path.name}", leave=False)]
    return np.stack(images), [name for name, _ in files]


def _webdataset(path: Path, label_spec: str, image_size: int) -> tuple[np.ndarray, list]:
    """Tar shards of `<key>.<ext>` members; the label is a json field (`json:<field>`) or the text."""
    kind, _, field = label_spec.partition(":")
    if kind not in ("json", "text") or (kind == "json" and not field):
        raise ValueError(f"label {label_spec!r}: use 'json:<field>' or 'text'")
    images, names = [], []
    for key, members in tqdm(_samples(path), desc=f"load {path.name}", leave=False):
        image_ext = next((e for e in IMAGE_EXTS if e in members), None)
        if image_ext is None:
            raise ValueError(f"{path}: sample {key!r} has no image member ({', '.join(IMAGE_EXTS)})")
        if kind == "json":
            meta = json.loads(members.get("json", b"{}"))
            if field not in meta:
                raise ValueError(f"{path}: sample {key!r} has no json field {field!r}")
            names.append(meta[field])
        else:
            if "txt" not in members:
                raise ValueError(f"{path}: sample {key!r} has no .txt member to take the class from")
            names.append(members["txt"].decode("utf-8").strip())
        images.append(square(Image.open(io.BytesIO(members[image_ext])), image_size))
    if not images:
        raise ValueError(f"{path}: no samples found")
    return np.stack(images), names


def _samples(path: Path):
    """(key, {ext: bytes}) per sample; through the index when the shards have one (our own format)."""
    if (path / INDEX_NAME).exists():
        ds = ShardDataset(path)
        exts = [e for e in ("png", "txt", "json") if f"{e}_offset" in ds.index]
        for i in range(len(ds)):
            yield ds.index["key"][i], {e: ds.read_member(i, e) for e in exts}
        return
    tars = sorted(path.glob("*.tar")) if path.is_dir() else [path]
    if not tars:
        raise ValueError(f"{path}: no .tar shards")
    for tar_path in tars:
        with tarfile.open(tar_path) as tar:
            key, members = None, {}
            for info in tar:
                if not info.isfile():
                    continue
                # Webdataset convention: the key is everything before the first dot of the file name.
                dirname, _, base = info.name.rpartition("/")
                stem, _, ext = base.partition(".")
                k = f"{dirname}/{stem}" if dirname else stem
                if k != key and members:
                    yield key, members
                    members = {}
                key = k
                members[ext.lower()] = tar.extractfile(info).read()
            if members:
                yield key, members


def _encode_labels(names: list, class_names: list | None, set_name: str) -> tuple[np.ndarray, list[str]]:
    """Raw labels (ints, or class-name strings) -> (int labels, class names)."""
    if all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in names):
        labels = np.asarray(names, dtype=int)
        if labels.min() < 0:
            raise ValueError(f"eval set {set_name!r}: integer labels must be >= 0, found {labels.min()}")
        num = int(labels.max()) + 1
        if class_names is not None and len(class_names) < num:
            raise ValueError(f"eval set {set_name!r}: `classes` names {len(class_names)} classes "
                             f"but labels go up to {num - 1}")
        return labels, list(class_names or (str(i) for i in range(num)))
    if not all(isinstance(n, str) for n in names):
        raise ValueError(f"eval set {set_name!r}: labels must be all integers or all strings, got "
                         f"{sorted({type(n).__name__ for n in names})}")
    classes = list(class_names) if class_names else sorted(set(names))
    unknown = sorted(set(names) - set(classes))
    if unknown:
        raise ValueError(f"eval set {set_name!r}: labels {unknown[:5]} are not in `classes`")
    lookup = {c: i for i, c in enumerate(classes)}
    return np.array([lookup[n] for n in names]), classes
