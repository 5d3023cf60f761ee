"""Per-example gradient norms at the warm start, on PUBLIC images: where to put C and the clip groups.

    python -m benchmarks.gradient_norms [--dir DIR] [--objectives mae caption] [--examples 256]

For each objective, the model as dp-train starts it (the synthetic warm start; a new text tower for
the captioner), per-example gradients by torch.func on examples of the eval split (public, never
trained on), and prints the quantiles of the whole gradient's norm and of the image encoder's part,
and the encoder's share of the squared norm. Two choices read off it:
  - C: where most norms lie above C, every example is clipped and the noise σC is spent on signal
    of norm C; where most lie below, the noise is sized for signal the examples do not have;
  - dp.encoder_clip_share: where the encoder's share is small, one bound gives the encoder little
    of C (docs/privacy.md, "Clip groups").
Run it in a scale_utility --dir's n-full directory, or a project that has run dp-train's inputs.
Read on public images only: these norms on the private split would be a statistic of it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.func import functional_call, grad, vmap

from pipeline.config import load_params
from pipeline.data.tokenizer import Tokenizer
from pipeline.models import ModelConfig, build_model
from pipeline.objectives import objective
from pipeline.privacy.training import split_loader, warm_start

ROOT = Path(__file__).resolve().parent.parent
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def warm_model(obj: str, params: dict, tokenizer: Tokenizer | None) -> tuple[torch.nn.Module, ModelConfig]:
    mcfg = ModelConfig.from_params(params["model"], obj, tokenizer.vocab_size if tokenizer else None)
    torch.manual_seed(params["run"]["seed"])
    model = build_model(obj, mcfg)
    warm_start(model, obj)  # as dp-train starts it
    return model, mcfg


def squared_norms(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(whole, encoder part) squared norms of each example's gradient."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def loss_one(ps, *sample):
        return functional_call(model, ps, tuple(x.unsqueeze(0) for x in sample))[0]

    grads = vmap(grad(loss_one), in_dims=(None,) + (0,) * len(batch))(params, *batch)
    sq = {n: g.flatten(1).pow(2).sum(1) for n, g in grads.items()}
    return sum(sq.values()), sum(v for n, v in sq.items() if n.startswith("encoder."))


def measure(obj: str, params: dict, examples: int, chunk: int = 32) -> dict:
    tokenizer = Tokenizer("models/tokenizer") if objective(obj).tokens else None
    model, mcfg = warm_model(obj, params, tokenizer)
    loader = split_loader("eval", mcfg, tokenizer)
    ids = np.sort(np.random.default_rng(0).choice(len(loader.dataset), min(examples, len(loader.dataset)),
                                                  replace=False))
    whole, encoder = [], []
    for start in range(0, len(ids), chunk):
        batch = tuple(loader.load(ids[start:start + chunk]))
        if mcfg.reads_masks(obj):  # masks as dp-train draws them: uniform noise per patch
            g = torch.Generator().manual_seed(start)
            batch += (torch.rand(len(batch[0]), (mcfg.img_size // mcfg.patch_size) ** 2, generator=g),)
        w, e = squared_norms(model, batch)
        whole.append(w)
        encoder.append(e)
    whole, encoder = torch.cat(whole), torch.cat(encoder)
    q = torch.tensor(QUANTILES, dtype=whole.dtype)
    return {"objective": obj, "examples": len(ids),
            "norm_quantiles": [round(v, 4) for v in whole.sqrt().quantile(q).tolist()],
            "encoder_norm_quantiles": [round(v, 4) for v in encoder.sqrt().quantile(q).tolist()],
            "encoder_share_of_sq_norm_median": round(float((encoder / whole).median()), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".", help="where dp-train's inputs are (data/shards, models/): default here")
    ap.add_argument("--objectives", nargs="+", default=["mae", "caption"], choices=["mae", "caption", "clip"])
    ap.add_argument("--examples", type=int, default=256)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="as `dpfm --set`")
    args = ap.parse_args()
    params = load_params(str(ROOT / "params.yaml"), args.set, schema_path=ROOT / "schemas/params.schema.yaml")
    os.chdir(args.dir)
    rows = [measure(obj, params, args.examples) for obj in args.objectives]
    print(f"{'objective':<9} {'norm at quantiles ' + str(QUANTILES):<44} {'encoder part':<36} encoder's share of norm²")
    for r in rows:
        print(f"{r['objective']:<9} {str(r['norm_quantiles']):<44} {str(r['encoder_norm_quantiles']):<36} "
              f"{r['encoder_share_of_sq_norm_median']:.3f} (median)")
    print(json.dumps({"benchmark": "gradient_norms", "rows": rows}))


if __name__ == "__main__":
    main()
