"""The pretrain stage at micro scale: a project holding a few synthetic shards (`make_project`), the
micro model and a short schedule (as `--set` overrides: `micro_sets`), and the model it saved."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline import checkpoints
from pipeline.data.shards import ShardWriter, encode_png
from pipeline.artifacts import artifact

MICRO_MODEL = {"size": "micro", "img_size": 16, "patch_size": 4, "decoder_width": 32, "decoder_depth": 1,
               "decoder_heads": 2, "text_width": 32, "text_depth": 1, "text_heads": 2, "max_caption_len": 12}
# 6 steps of 8 from 20 images: batches cross epoch boundaries; a checkpoint every 2 steps.
SHORT = {"steps": 6, "batch_size": 8, "lr": 0.001, "warmup_steps": 2, "checkpoint_every": 2, "log_every": 1,
         "precision": "fp32"}
IMAGES = 20


def make_project(root: Path, image_seed: int = 0) -> Path:
    """A project directory with params, schema and a small set of synthetic shards."""
    root.mkdir(parents=True, exist_ok=True)
    repo = Path(__file__).resolve().parents[1]
    (root / "schemas").mkdir(exist_ok=True)
    (root / "schemas/params.schema.yaml").write_text((repo / "schemas/params.schema.yaml").read_text())
    (root / "params.yaml").write_text((repo / "params.yaml").read_text())
    rng = np.random.default_rng(image_seed)
    with ShardWriter(root / artifact("synthetic"), prefix="synthetic", samples_per_shard=8) as writer:
        for i in range(IMAGES):
            image = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
            writer.write(f"img{i:03d}", encode_png(image), "a procedural image", {"program": i})
    return root


def micro_sets(**pretrain_overrides) -> list[str]:
    """MICRO_MODEL and SHORT (updated by `pretrain_overrides`) as `--set` overrides."""
    sets = [f"model.{k}={json.dumps(v)}" for k, v in MICRO_MODEL.items()]
    return sets + [f"pretrain.{k}={json.dumps(v)}" for k, v in {**SHORT, **pretrain_overrides}.items()]


def saved(project: Path) -> checkpoints.Checkpoint:
    return checkpoints.load(project / artifact("pretrain") / "checkpoint.pt")
