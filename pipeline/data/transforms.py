"""Decoding and transforms: encoded image bytes -> model-resolution pixels -> normalised tensors.

Normalisation uses fixed public constants (ImageNet's), never statistics of the private data: those
would leave the DP boundary unaccounted. The resize is a deterministic centre crop, so the same
example always gives the same pixels (no data-dependent augmentation policy either).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch
from PIL import Image

# Pillow's warnings are about one image: a possible decompression bomb with its exact pixel count
# (above 89M pixels; above twice that it raises, and the read is handled as unreadable), a palette with
# byte transparency, a TIFF tag past the end of the file and its number. Of a private image each would
# reach stderr and the stage's log, a fact about one example, so none is shown. The filters are
# process-wide, not a catch_warnings per call, which threads would race on.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
warnings.filterwarnings("ignore", module=r"PIL\.")

# The formats images are read in. Pillow otherwise guesses from the bytes among all it knows: EPS among
# them, which it renders by running Ghostscript, on bytes a web table or a shard's `.jpg` member supplies.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "PPM", "TIFF", "GIF")

MEAN = torch.tensor([0.485, 0.456, 0.406])
STD = torch.tensor([0.229, 0.224, 0.225])


def as_rgb(im: Image.Image) -> Image.Image:
    """RGB, 16-bit grey scaled to 8 bits: convert("RGB") alone would clip every value above 255 to white."""
    if im.mode.startswith("I"):
        im = Image.fromarray((np.asarray(im, dtype=np.float64) / 257.0).round().clip(0, 255).astype(np.uint8))
    return im.convert("RGB")


def open_image(source) -> Image.Image:
    """Image.open of a file or file object, in IMAGE_FORMATS only (any other is an unreadable image)."""
    return Image.open(source, formats=IMAGE_FORMATS)


def decode_image(data: bytes, size: int | None = None) -> np.ndarray:
    """Encoded image -> (H, W, 3) uint8; with `size`, the centred square scaled to (size, size).

    Raises on undecodable or truncated bytes (Pillow's LOAD_TRUNCATED_IMAGES stays off), so the
    scan that builds the index and the loader that trains agree on what is usable.
    """
    with open_image(io.BytesIO(data)) as im:
        if size:
            im.draft("RGB", (size, size))  # JPEG: decode at the smallest DCT scale still >= size
        rgb = as_rgb(im)
    if size and rgb.size != (size, size):
        w, h = rgb.size
        s = min(w, h)
        left, top = (w - s) // 2, (h - s) // 2
        # Crop first: resize(box=...) would blend in pixels from outside the square at its edges.
        rgb = rgb.crop((left, top, left + s, top + s)).resize((size, size), Image.BICUBIC, reducing_gap=3.0)
    return np.asarray(rgb)


def encode_jpeg(image: np.ndarray, quality: int = 95) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def to_tensor(images_uint8: np.ndarray | torch.Tensor) -> torch.Tensor:
    """(N, H, W, 3) uint8 -> (N, 3, H, W) float32, normalised, on the device the images are on."""
    x = torch.as_tensor(images_uint8).float().div_(255.0)
    x = (x - MEAN.to(x.device)) / STD.to(x.device)
    return x.permute(0, 3, 1, 2).contiguous()


def tokenize(tokenizer, captions: list[str], max_len: int) -> torch.Tensor:
    """Private captions -> (N, max_len) token ids with the tokenizer stage's model (trained on public
    text). Those longer than max_len are cut without a word: a count of them would be a statistic of
    the private data (dp-train checks a labelled set's public templates against max_len instead)."""
    return tokenizer.encode(list(captions), max_len)  # private: cut silently
