"""Labelled evaluation sets: a labelled set dpfm knows by name (digits, fashion-mnist:
pipeline/data/labelled_sets.py), or any labelled webdataset or image-folder directory named in
`evaluate.sets`, as one `path` (split here, seeded and stratified) or as its own `train` and `test`
parts (an official split, used as it is).

A named labelled set follows the shards source: when the private data is that set, its held-out
split (data/shards/eval) that training never saw; otherwise the whole set, public and unseen.
`limit` keeps a seeded, stratified subsample of either.

Every set comes back as square uint8 images at the model's input size, integer labels, class
names and zero-shot prompt templates (with a `{c}` slot for the class name). The images are
decoded batch by batch when read (`pipeline.eval.images.Images`), so memory does not grow with the
set: only file names or byte positions and the labels are held.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.model_selection import train_test_split
from tqdm import tqdm

from pipeline.config import ParamsError
from pipeline.data import labelled_sets, remote
from pipeline.data.index import read_index
from pipeline.data.shards import INDEX_NAME, ShardDataset
from pipeline.data.transforms import as_rgb, open_image
from pipeline.errors import EvalSetError
from pipeline.eval.images import Images, concat, decoded, fill

LIMIT_SEED = 0  # load_eval_set has no run seed: a fixed public one, so every run scores the same subsample
IMAGE_EXTS = ("png", "jpg", "jpeg", "webp", "bmp")
DEFAULT_TEMPLATES = ("a photo of a {c}.",)


@dataclass
class EvalSet:
    name: str
    images: Images              # (N, S, S, 3) uint8, decoded on demand; an ndarray is wrapped
    labels: np.ndarray          # (N,) int in [0, len(classes))
    classes: list[str]
    templates: tuple[str, ...]  # zero-shot prompts, "{c}" is replaced by the class name
    parts: tuple[np.ndarray, np.ndarray] | None = None  # (train, test) indices of an official split
    named: bool = True          # False: integer labels without `classes`, their names the bare numbers

    def __post_init__(self):
        self.images = Images.of(self.images)
        for template in self.templates:  # a prompt is template.format(c=class name): no other field
            try:
                template.format(c="")
            except (KeyError, IndexError, ValueError) as e:
                raise ParamsError([f"evaluate.sets[{self.name}].templates: {template!r} holds a field other than "
                                   f"{{c}} ({type(e).__name__}: {e}); write a literal brace twice, {{{{ or }}}}"], "evaluate params") from None

    def prompts(self) -> list[list[str]]:
        """One list of prompts per class."""
        return [[t.format(c=c) for t in self.templates] for c in self.classes]

    def split(self, train_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Probe-train / probe-test indices: the set's own parts, else a stratified seeded split."""
        if self.parts is not None:  # an official split: a probe can only answer the classes its train part holds
            train, test = (set(np.unique(self.labels[part]).tolist()) for part in self.parts)
            if len(train) < 2 or test - train:
                missing = [self.classes[i] for i in sorted(test - train)]
                raise ValueError(f"eval set {self.name!r}: its train part holds {len(train)} class(es)"
                                 + (f", none of {missing} its test part holds" if missing else "")
                                 + "; a probe needs two classes or more, each one it is scored on among them")
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
    image = as_rgb(image)  # 16-bit grey as training decodes it
    if image.size != (size, size):
        w, h = image.size
        s = size / min(w, h)
        image = image.resize((max(size, round(w * s)), max(size, round(h * s))), Image.BICUBIC)
        w, h = image.size
        left, top = (w - size) // 2, (h - size) // 2
        image = image.crop((left, top, left + size, top + size))
    return np.asarray(image)


def load_eval_set(spec: dict, image_size: int) -> EvalSet:
    """One entry of `evaluate.sets` -> EvalSet (images at `image_size`, decoded when read)."""
    source = spec["source"]
    if source in labelled_sets.SETS:
        return _labelled(spec, image_size)
    if "limit" in spec:
        raise EvalSetError(f"evaluate.sets[{spec['name']}].limit: only for the labelled sets "
                            f"({', '.join(labelled_sets.SETS)})")
    if source not in ("folder", "webdataset"):
        raise EvalSetError(f"evaluate.sets[{spec['name']}].source: unknown source {source!r}")
    parts = [key for key in ("train", "test") if key in spec]
    if parts and (len(parts) == 1 or "path" in spec):
        raise EvalSetError(f"evaluate.sets[{spec['name']}]: give `train` and `test` (an official split) or `path` "
                            "(split here), not " + " and ".join(sorted(set(parts) | ({"path"} & set(spec)))))
    loaded = [_load_part(spec, key, image_size) for key in (parts or ["path"])]
    images = concat([im for im, _ in loaded])
    raw = [n for _, names in loaded for n in names]
    labels, classes, named = _encode_labels(raw, spec.get("classes"), spec["name"])
    split = None
    if parts:
        n_train = len(loaded[0][0])
        split = (np.arange(n_train), np.arange(n_train, len(images)))
    return EvalSet(spec["name"], images, labels, classes, tuple(spec.get("templates", DEFAULT_TEMPLATES)), split, named)


def _load_part(spec: dict, key: str, image_size: int) -> tuple[Images, list]:
    path = Path(spec[key])
    if not path.exists():
        raise FileNotFoundError(f"evaluate.sets[{spec['name']}].{key}: {path} does not exist")
    if spec["source"] == "folder":
        return _folder(path, image_size)
    return _webdataset(path, spec.get("label", "json:label"), image_size, f"evaluate.sets[{spec['name']}].{key}")


def _labelled(spec: dict, image_size: int) -> EvalSet:
    from pipeline.io import read_json

    lset = labelled_sets.get(spec["source"])
    if spec.get("classes") and len(spec["classes"]) != len(lset.classes):  # names for its labels 0..K-1, in order
        raise ParamsError([f"evaluate.sets[{spec['name']}].classes names {len(spec['classes'])} classes; the "
                           f"{lset.name} set has {len(lset.classes)} ({', '.join(lset.classes)}, in label order)"], "evaluate params")
    shape = (image_size, image_size, 3)
    from pipeline.artifacts import artifact

    shards = artifact("shards")
    if (shards / "stats.json").exists() and read_json(shards / "stats.json").get("source") == lset.name:
        ds = ShardDataset(shards / "eval")  # the held-out part: the private part was trained on
        labels = np.array([ds.meta(i)["label"] for i in range(len(ds))])

        def read(rows: np.ndarray) -> np.ndarray:
            return fill((square(Image.fromarray(ds.image(i)), image_size) for i in rows.tolist()), len(rows), shape)
    else:  # private data from elsewhere: the whole set is public and unseen
        grey, labels = lset.load(spec.get("path"))

        def read(rows: np.ndarray) -> np.ndarray:
            return labelled_sets.rgb(grey[rows], image_size)
    keep = labelled_sets.subsample(labels, spec.get("limit"), LIMIT_SEED)
    # The training captions' own templates are the natural zero-shot prompts for the set.
    templates = tuple(spec.get("templates") or lset.templates)
    return EvalSet(spec["name"], Images(read, keep, shape), labels[keep], list(spec.get("classes") or lset.classes),
                   templates)


def _square(source, where: str, size: int) -> np.ndarray:
    """`square` of one encoded image (a file or a file object); decoding happens late, so errors say where."""
    try:
        with open_image(source) as image:
            return square(image, size)
    except OSError as e:  # unidentified or truncated image
        raise EvalSetError(f"{where}: cannot read the image ({e})") from e


def _folder(path: Path, image_size: int) -> tuple[Images, list]:
    """`path/<class name>/**/<image>`: the class is the name of the top-level folder."""
    files = sorted((d.name, f) for d in path.iterdir() if d.is_dir()
                   for f in d.rglob("*") if f.suffix.lower().lstrip(".") in IMAGE_EXTS)
    if not files:
        raise EvalSetError(f"{path}: no images found in class folders ({'/'.join(IMAGE_EXTS)} under {path}/<class>/)")
    paths = [str(f) for _, f in files]
    images = Images.decoded(lambda i: _square(paths[i], paths[i], image_size), len(paths), (image_size, image_size, 3))
    return images, [name for name, _ in files]


def _webdataset(path: Path, label_spec: str, image_size: int, where: str) -> tuple[Images, list]:
    """Tar shards of `<key>.<ext>` members; the label is a json field (`json:<field>`) or the text.

    Labels are read up front; images are read back per batch, by the index when the shards have one
    (our own format), else by the byte positions one pass over the tars recorded.
    """
    kind, _, field = label_spec.partition(":")
    if kind not in ("json", "text") or (kind == "json" and not field):
        raise EvalSetError(f"label {label_spec!r}: use 'json:<field>' or 'text'")
    member = "json" if kind == "json" else "txt"

    def label(key: str, data: bytes | None):
        if kind == "json":
            meta = json.loads(b"{}" if data is None else data)
            if field not in meta:
                raise EvalSetError(f"{path}: sample {key!r} has no json field {field!r}")
            return meta[field]
        if data is None:
            raise EvalSetError(f"{path}: sample {key!r} has no .txt member to take the class from")
        return data.decode("utf-8").strip()

    if (path / INDEX_NAME).exists():
        ds = ShardDataset(path)
        _refuse_private_shards(path, [s["url"] for s in ds.shards], where)
        names = [label(ds.key(i), _member_or_none(ds, i, member))
                 for i in tqdm(range(len(ds)), desc=f"labels {path.name}", leave=False)]

        def read(rows: np.ndarray) -> list[tuple[str, bytes]]:
            return [(f"{path}: sample {ds.key(i)!r}", ds.read_member(i, "image")) for i in rows.tolist()]
    else:
        _refuse_private_shards(path, [str(t) for t in _tar_files(path)], where)
        read, names = _scan_tars(path, member, label)
    if not names:
        raise EvalSetError(f"{path}: no samples found")

    shape = (image_size, image_size, 3)

    def decode(rows: np.ndarray) -> np.ndarray:
        images = decoded(lambda item: _square(io.BytesIO(item[1]), item[0], image_size), read(rows))  # (where, bytes)
        return fill(images, len(rows), shape)

    return Images(decode, np.arange(len(names)), shape), names


def _refuse_private_shards(path: Path, files: list[str], where: str) -> None:
    """An eval set is public data training never saw: one read from the private training shards would
    score the model on its own training examples. The run's held-out split (data/shards/eval) shares a
    web source's shards but none of their rows, so it passes."""
    from pipeline.artifacts import artifact

    shards = artifact("shards")
    if path.resolve() == (shards / "eval").resolve() or not (shards / "private" / INDEX_NAME).exists():
        return
    _, private, _ = read_index(shards / "private")
    private_files = {remote.canonical(s["url"]) for s in private}
    shared = next((f for f in files if remote.canonical(f) in private_files), None)
    if shared is not None:
        raise EvalSetError(f"{where}: {path} holds the private training shards ({shared} is one of them); an eval "
                           "set must be public data that training never saw: point it at another set")


def _member_or_none(ds: ShardDataset, i: int, ext: str) -> bytes | None:
    try:
        return ds.read_member(i, ext)
    except KeyError:  # this sample has no such member
        return None


class _TarSpans:
    """Where each sample's image lies in tars without an index. Called with row ids, it reads those
    images back by position, as (where, bytes), opening each tar the batch touches once."""

    def __init__(self, tars: list[Path], tar_ids: list[int], offsets: list[int], sizes: list[int]):
        self.tars = tars
        self.tar_ids, self.offsets, self.sizes = np.array(tar_ids), np.array(offsets), np.array(sizes)

    def __call__(self, rows: np.ndarray) -> list[tuple[str, bytes]]:
        fds, out = {}, []
        try:
            for t, offset, size in zip(self.tar_ids[rows].tolist(), self.offsets[rows].tolist(),
                                       self.sizes[rows].tolist()):
                if t not in fds:
                    fds[t] = os.open(self.tars[t], os.O_RDONLY)
                data = os.pread(fds[t], size, offset)
                where = f"{self.tars[t]} at byte {offset}"
                if len(data) != size:
                    raise EvalSetError(f"{where}: expected an image of {size} bytes, found {len(data)}: "
                                        "the tar changed after its samples were listed")
                out.append((where, data))
        finally:
            for fd in fds.values():
                os.close(fd)
        return out


def _scan_tars(path: Path, member: str, label) -> tuple[_TarSpans, list]:
    """One pass over the tars: each sample's label (from `member`) and where its image's bytes are."""
    tars = _tar_files(path)
    if not tars:
        raise EvalSetError(f"{path}: no .tar shards")
    tar_ids, offsets, sizes, names = [], [], [], []
    for t, tar, key, members in tqdm(_tar_samples(tars), desc=f"scan {path.name}", leave=False):
        image_ext = next((e for e in IMAGE_EXTS if e in members), None)
        if image_ext is None:
            raise EvalSetError(f"{path}: sample {key!r} has no image member ({', '.join(IMAGE_EXTS)})")
        names.append(label(key, tar.extractfile(members[member]).read() if member in members else None))
        tar_ids.append(t)
        offsets.append(members[image_ext].offset_data)
        sizes.append(members[image_ext].size)
    return _TarSpans(tars, tar_ids, offsets, sizes), names


def _tar_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.tar")) if path.is_dir() else [path]


def _tar_samples(tars: list[Path]):
    """(tar number, open tar, key, {ext: TarInfo}) per sample, a sample's members being adjacent."""
    for t, tar_path in enumerate(tars):
        try:
            tar = tarfile.open(tar_path, "r:")  # uncompressed only: images are read back by byte position
        except tarfile.ReadError as e:
            raise EvalSetError(f"{tar_path}: not an uncompressed tar ({e}); eval sets read images from tars "
                                "by position, so decompress it") from e
        with tar:
            key, members = None, {}
            for info in tar:
                if not info.isfile():
                    continue
                # Webdataset convention: the key is everything before the first dot of the file name.
                dirname, _, base = info.name.rpartition("/")
                stem, _, ext = base.partition(".")
                k = f"{dirname}/{stem}" if dirname else stem
                if k != key and members:
                    yield t, tar, key, members
                    members = {}
                key = k
                members[ext.lower()] = info
            if members:
                yield t, tar, key, members


def _encode_labels(names: list, class_names: list | None, set_name: str) -> tuple[np.ndarray, list[str], bool]:
    """Raw labels (ints, or class-name strings) -> (int labels, class names, whether they are names).
    Unnamed integer labels are classes by their values, as found: labels 1..10 make ten classes
    "1".."10", never a phantom "0" that a split refuses, a probe head keeps and zero-shot ranks against."""
    if all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in names):
        labels = np.asarray(names, dtype=int)
        if class_names is None:
            values, labels = np.unique(labels, return_inverse=True)
            return labels, [str(v) for v in values], False
        if labels.min() < 0:
            raise EvalSetError(f"eval set {set_name!r}: integer labels must be >= 0, found {labels.min()}")
        num = int(labels.max()) + 1
        if class_names is not None and len(class_names) < num:
            raise EvalSetError(f"eval set {set_name!r}: `classes` names {len(class_names)} classes "
                                f"but labels go up to {num - 1}")
        return labels, list(class_names), True
    if not all(isinstance(n, str) for n in names):
        raise EvalSetError(f"eval set {set_name!r}: labels must be all integers or all strings, got "
                            f"{sorted({type(n).__name__ for n in names})}")
    classes = list(class_names) if class_names else sorted(set(names))
    unknown = sorted(set(names) - set(classes))
    if unknown:
        raise EvalSetError(f"eval set {set_name!r}: labels {unknown[:5]} are not in `classes`")
    lookup = {c: i for i, c in enumerate(classes)}
    return np.array([lookup[n] for n in names]), classes, True
