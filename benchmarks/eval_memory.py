"""Does evaluate's memory stay flat as an eval set grows? (pipeline/eval/evalsets.py, images.py)

    python -m benchmarks.eval_memory [--small 2000] [--factor 10] [--dir DIR]

Writes two image folders (`class/*.png`, 10 classes) of 64-px PNGs, n and factor·n images, and in a
fresh process per measurement extracts features for the whole set through `load_eval_set` +
`extract_features` with a micro encoder at 224 px: the model size at which the old eager array is
big (20k x 224 x 224 x 3 = 3 GB). Beside it, the eager baseline: the same set loaded as evaluate did
before it streamed (every image through `square`, then np.stack), then the same features.
Target: streamed private (anonymous) memory at factor·n <= 1.25 x at n (the features themselves grow
with n: n x width floats), measured from /proc apart from mapped file pages (benchmarks/peak_memory.py).
Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.peak_memory import growth_parser, measure_growth, print_growth

TARGET_RATIO = 1.25
IMAGE_SIZE, STORED_SIZE, CLASSES = 224, 64, 10
ENCODER = dict(size="micro", img_size=IMAGE_SIZE, patch_size=16)


def write_folder(directory: Path, n: int) -> Path:
    """n smooth, slightly noisy 64-px PNGs in CLASSES class folders (kept for later runs)."""
    from PIL import Image

    done = directory / "complete"
    if done.exists():
        return directory
    rng = np.random.default_rng(n)
    y, x = np.mgrid[0:STORED_SIZE, 0:STORED_SIZE]
    for c in range(CLASSES):
        (directory / f"class{c}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        base = (np.stack([x, y, x + y], -1) * rng.uniform(2, 4, 3) + rng.uniform(0, 255, 3)) % 256
        image = (base + rng.normal(0, 4, base.shape)).clip(0, 255).astype(np.uint8)
        Image.fromarray(image).save(directory / f"class{i % CLASSES}" / f"{i:07d}.png")
    done.touch()
    return directory


def child(mode: str, directory: Path) -> None:
    """Runs in the measured process: features of every image of the folder set at 224 px."""
    import torch
    from PIL import Image

    from pipeline.eval.evalsets import load_eval_set, square
    from pipeline.eval.probe import extract_features
    from pipeline.models import build_encoder

    torch.set_num_threads(1)  # a shared machine; peak memory does not depend on it
    torch.manual_seed(0)
    encoder = build_encoder(ENCODER)
    if mode == "streamed":
        images = load_eval_set({"name": "bench", "source": "folder", "path": str(directory)}, IMAGE_SIZE).images
    else:  # what evalsets._folder did before it streamed
        files = sorted(f for f in directory.rglob("*.png"))
        images = np.stack([square(Image.open(f), IMAGE_SIZE) for f in files])
        print(f"held {images.nbytes / 2**20:.0f} MiB of images", file=sys.stderr)
    features = extract_features(encoder, images)
    print(f"{mode}: features {features.shape}", file=sys.stderr)


def measure(small: int = 2000, factor: int = 10, directory: Path | None = None) -> dict:
    directory = Path(directory or tempfile.mkdtemp(prefix="dpfm-eval-mem-"))
    inputs = {}
    for name, n in (("small", small), ("large", small * factor)):
        t0 = time.time()
        inputs[name] = (n, write_folder(directory / f"n{n}", n))
        print(f"  {name}: {n} images ready in {time.time() - t0:.0f} s", file=sys.stderr)
    return measure_growth("eval_memory", ["streamed", "eager"], inputs)


def main() -> None:
    args = growth_parser(__doc__, 2000, 10, ["streamed", "eager"], "image folders").parse_args()
    if args.child:
        child(args.child, args.dir)
        return
    r = measure(args.small, args.factor, args.dir)
    print_growth(r, "features at 224 px", {"streamed": "streamed (now)", "eager": "eager array (before)"})
    print(f"streamed private-memory ratio large/small {r['streamed_ratio_large_vs_small']:.3f} (target <= {TARGET_RATIO}); "
          f"eager {r['eager_ratio_large_vs_small']:.2f}; eager/streamed at n={r['n_large']}: "
          f"{r['eager_anon_mb_large'] / r['streamed_anon_mb_large']:.2f}x")
    print(json.dumps({"benchmark": "eval_memory", **{k: round(v, 3) if isinstance(v, float) else v
                                                     for k, v in r.items()}, "target_ratio": TARGET_RATIO}))


if __name__ == "__main__":
    main()
