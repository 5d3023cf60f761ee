"""Does dp-train's memory stay flat as the private set grows? (pipeline/privacy/training.py)

    python -m benchmarks.dp_train_memory [--small 20000] [--factor 10] [--slope-factor 30] [--dir DIR]

Writes private shard sets of 32-px PNGs, n, factor·n and slope-factor·n examples, and runs the real dp-train
stage (MAE, micro ViT, a few DP steps of expected batch 256) on each in a fresh process, reporting
its peak private (anonymous) memory and its peak mapped file pages apart, from /proc
(benchmarks/peak_memory.py), with the kernel's peak RSS beside them. Beside them, the baseline: a
process that only loads the larger split into memory the way dp-train did before it streamed.
Target: private memory at factor·n and at slope-factor·n <= 1.1 x the private memory at n (file
pages may grow: they are the shards and the index, mapped and dropped by the kernel as it needs).
Two sizes cannot tell a constant from a slow per-example cost, so the third gives the slope between
the two largest sets, in bytes per example, and what it would add at 233M examples (sampling
/proc every 10 ms leaves a few MiB of noise: over 400k examples about ±15 B per example). Prints a
table, then ONE JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.peak_memory import growth_parser, peak_memory

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 1.1  # private memory at factor·n against n
MODULE = "dp_train_memory"
OVERRIDES = ["model.size=micro", "model.img_size=32", "model.patch_size=4", "model.decoder_width=32",
             "model.decoder_depth=1", "model.decoder_heads=2", "dp.objective=mae", "dp.init=random", "dp.steps=3",
             "dp.expected_batch_size=256", "dp.physical_batch_size=64", "dp.eval_every=1", "dp.checkpoint_every=3",
             "dp.noise_seed=1", "privacy.testing=true", "dp.sigma=1.0", "dp.epsilon=100", "run.device=cpu"]


def image(rng: np.random.Generator) -> np.ndarray:
    """A smooth 32-px picture with a little noise: a few hundred bytes as PNG, like small photos."""
    y, x = np.mgrid[0:32, 0:32]
    base = (np.stack([x, y, x + y], -1) * rng.uniform(2, 4, 3) + rng.uniform(0, 255, 3)) % 256
    return (base + rng.normal(0, 4, base.shape)).clip(0, 255).astype(np.uint8)


def write_project(directory: Path, n: int) -> Path:
    """A project holding private (n) and eval (64) shards, the schema and the default params."""
    from pipeline.data.shards import ShardWriter, encode_png
    from pipeline.io import write_json

    # The params and schema are this checkout's on every run: shards reused from an earlier run must not
    # bring an older params.yaml with them.
    shutil.rmtree(directory / "schemas", ignore_errors=True)
    shutil.copytree(ROOT / "schemas", directory / "schemas")
    shutil.copy(ROOT / "params.yaml", directory / "params.yaml")
    if (directory / "data/shards/stats.json").exists():
        return directory  # shards reused from an earlier run
    rng = np.random.default_rng(n)
    for split, count in (("private", n), ("eval", 64)):
        with ShardWriter(directory / "data/shards" / split, prefix=split, samples_per_shard=5000) as w:
            for i in range(count):
                w.write(f"{split}{i:09d}", encode_png(image(rng)), "a picture", {})
    write_json(directory / "data/shards/stats.json", {"source": "benchmark", "private": {"usable": n, "rows": n},
                                                      "eval": {"usable": 64, "rows": 64}})
    return directory


def child_dp_train(directory: Path) -> None:
    """Runs in the measured process: the dp-train stage as `dpfm dp-train` runs it, untracked."""
    os.chdir(directory)
    from pipeline.cli import StageContext
    from pipeline.config import load_params, sections_of
    from pipeline.stages import stage
    from pipeline.stages.dp_train import run
    from pipeline.tracking import NullRun

    st = stage("dp-train")
    run(sections_of(load_params("params.yaml", OVERRIDES), st.sections), StageContext(st, NullRun(), 1, "cpu"))


def child_in_memory(directory: Path) -> None:
    """The baseline: what dp-train held before it streamed, the whole split decoded to float32."""
    from pipeline.data.shards import ShardDataset
    from pipeline.data.transforms import to_tensor

    images = to_tensor(ShardDataset(directory / "data/shards/private").load_images(32))
    print(f"held {images.numel() * 4 / 2**20:.0f} MiB of images", file=sys.stderr)


def measure(small: int = 20_000, factor: int = 10, slope_factor: int = 0, directory: Path | None = None) -> dict:
    directory = Path(directory or tempfile.mkdtemp(prefix="dpfm-dp-mem-"))
    sizes = {"small": small, "large": small * factor, **({"largest": small * slope_factor} if slope_factor else {})}
    out = {}
    for name, n in sizes.items():
        t0 = time.time()
        project = write_project(directory / f"n{n}", n)
        print(f"  {name}: {n} private examples ready in {time.time() - t0:.0f} s", file=sys.stderr)
        shutil.rmtree(project / ".dpfm", ignore_errors=True)
        shutil.rmtree(project / "models", ignore_errors=True)
        out[f"dp_train_n_{name}"] = n
        out.update(flat(f"dp_train_{{}}_{name}", peak_memory(MODULE, "dp-train", project)))
    out.update(flat("inmemory_{}_large", peak_memory(MODULE, "in-memory", directory / f"n{sizes['large']}")))
    out["anon_ratio_large_vs_small"] = out["dp_train_anon_mb_large"] / out["dp_train_anon_mb_small"]
    out["rss_ratio_large_vs_small"] = out["dp_train_rss_mb_large"] / out["dp_train_rss_mb_small"]
    if slope_factor:
        out["anon_ratio_largest_vs_small"] = out["dp_train_anon_mb_largest"] / out["dp_train_anon_mb_small"]
        out["anon_bytes_per_example"] = ((out["dp_train_anon_mb_largest"] - out["dp_train_anon_mb_large"]) * 2**20
                                         / (sizes["largest"] - sizes["large"]))
        out["anon_mb_added_at_233m"] = out["anon_bytes_per_example"] * 233e6 / 2**20
    return out


def flat(pattern: str, peak) -> dict:
    return {pattern.format(k): v for k, v in vars(peak).items()}


def main() -> None:
    parser = growth_parser(__doc__, 20_000, 10, ["dp-train", "in-memory"], "shard sets")
    parser.add_argument("--slope-factor", type=int, default=30, help="a third set, for the per-example slope (0: none)")
    args = parser.parse_args()
    if args.child:
        (child_dp_train if args.child == "dp-train" else child_in_memory)(args.dir)
        return
    r = measure(args.small, args.factor, args.slope_factor, args.dir)
    print(f"{'MiB':<28}{'n':>12}{'private':>10}{'file':>8}{'shmem':>8}{'peak RSS':>10}{'s':>7}")
    rows = [("dp-train (streaming)", "dp_train", size) for size in ("small", "large", "largest")
            if f"dp_train_n_{size}" in r] + [("split in memory (before)", "inmemory", "large")]
    for label, who, size in rows:
        print(f"{label:<28}{r[f'dp_train_n_{size}']:>12}" + "".join(
            f"{r[f'{who}_{k}_{size}']:>{w}.0f}" for k, w in (("anon_mb", 10), ("file_mb", 8), ("shmem_mb", 8),
                                                             ("rss_mb", 10), ("seconds", 7))))
    print(f"private memory large/small {r['anon_ratio_large_vs_small']:.3f} (target <= {TARGET_RATIO}); "
          f"peak RSS large/small {r['rss_ratio_large_vs_small']:.3f}; in-memory/streaming private at "
          f"n={r['dp_train_n_large']}: {r['inmemory_anon_mb_large'] / r['dp_train_anon_mb_large']:.2f}x")
    if args.slope_factor:
        print(f"private memory largest/small {r['anon_ratio_largest_vs_small']:.3f} (target <= {TARGET_RATIO}); "
              f"slope between the two largest sets {r['anon_bytes_per_example']:+.1f} B per example, "
              f"{r['anon_mb_added_at_233m']:+.0f} MiB at 233M examples if it held")
    print(json.dumps({"benchmark": "dp_train_memory", **{k: round(v, 3) if isinstance(v, float) else v
                                                         for k, v in r.items()}, "target_ratio": TARGET_RATIO}))


if __name__ == "__main__":
    main()
