"""Per-example gradient norms at the warm start, on PUBLIC images: where to put C, the clip groups, and
how far one step's signal stands above its noise.

    python -m benchmarks.gradient_norms [--dir DIR] [--objectives mae caption] [--examples 1024] [--scale-schedule]
                                        [--views K] [--decoder-from CHECKPOINT]

For each objective, the model as dp-train starts it (the synthetic warm start; a new text tower for
the captioner), per-example gradients by torch.func on examples of the eval split (public, never
trained on), and prints the quantiles of the whole gradient's norm and of the image encoder's part,
and the encoder's share of the squared norm. Three choices read off it:
  - C: where most norms lie above C, every example is clipped and the noise σC is spent on signal
    of norm C; where most lie below, the noise is sized for signal the examples do not have;
  - dp.encoder_clip_share: where the encoder's share is small, one bound gives the encoder little
    of C (docs/privacy.md, "Clip groups");
  - which parts to train: the step's signal against its noise is read for the encoder's kinds of
    parameter and for each of its blocks;
  - dp.mask_views: `--views K` averages each example's gradient over K masks before clipping; where
    the masking's noise is much of the gradient, the clipped mean's norm (the step's signal) grows.
`--decoder-from` puts everything but the image encoder of a trained model of the same objective (a
dp-train checkpoint: models/dp/checkpoint.pt or a state directory's) around the warm-start encoder: how
much signal the encoder gets once its decoder has learnt, against the random text tower it starts under.
Run it in a scale_utility --dir's n-full directory, or a project that has run dp-train's inputs.
Read on public images only: these norms on the private split would be a statistic of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import torch
from torch.func import functional_call, grad, vmap

from benchmarks import scale_utility
from pipeline.config import load_params
from pipeline.data.tokenizer import Tokenizer
from pipeline.io import read_json
from pipeline.models import ModelConfig, build_model
from pipeline.objectives import objective
from pipeline.privacy.clipping import view_rows
from pipeline.privacy.plan import plan_mechanism
from pipeline.privacy.training import split_loader, warm_start

ROOT = Path(__file__).resolve().parent.parent
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def params_for(obj: str, scale_schedule: bool, sets: list[str]) -> dict:
    """The project's params with `sets` applied, after scale_utility's recipe and schedule if asked."""
    recipe = [*scale_utility.RECIPE, *scale_utility.SCHEDULES[obj]] if scale_schedule else []
    return load_params(str(ROOT / "params.yaml"), [*recipe, *sets], schema_path=ROOT / "schemas/params.schema.yaml")


def warm_model(obj: str, params: dict, tokenizer: Tokenizer | None) -> tuple[torch.nn.Module, ModelConfig]:
    mcfg = ModelConfig.from_params(params["model"], obj, tokenizer.vocab_size if tokenizer else None)
    torch.manual_seed(params["run"]["seed"])
    model = build_model(obj, mcfg)
    warm_start(model, obj)  # as dp-train starts it
    return model, mcfg


def per_example_grads(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], views: int = 1) -> dict[str, torch.Tensor]:
    """Each example's gradient, {name: (B, *shape)}; with `views`, the mean over its rows
    (clipping.view_rows: K consecutive rows per example), as dp-train clips it."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def loss_one(ps, *rows):
        return functional_call(model, ps, rows).mean()

    per_example = tuple(x.reshape(-1, views, *x.shape[1:]) for x in batch)
    return vmap(grad(loss_one), in_dims=(None,) + (0,) * len(batch))(params, *per_example)


def squared_norms(grads: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(whole, encoder part) squared norms of each example's gradient."""
    sq = {n: g.flatten(1).pow(2).sum(1) for n, g in grads.items()}
    return sum(sq.values()), sum(v for n, v in sq.items() if n.startswith("encoder."))


# The parts of the model whose step signal is read: the whole, the encoder, and the encoder's kinds of
# parameter (a part that carried the signal above the rest could be trained alone).
PARTS = {
    "whole": lambda name: True,
    "encoder": lambda name: name.startswith("encoder."),
    "encoder norms": lambda name: name.startswith("encoder.") and "norm" in name,
    "encoder biases": lambda name: name.startswith("encoder.") and "norm" not in name and name.endswith(".bias"),
    "encoder weights": lambda name: name.startswith("encoder.") and "norm" not in name and not name.endswith(".bias"),
}


def depth_parts(names) -> dict:
    """The image encoder split by depth, one part each: its stem (patch embedding, tokens, positions),
    every block, its last norm. A block whose step is nearly all noise takes a random walk from its warm
    start under DP-Adam for little signal (dp.frozen keeps it there)."""
    blocks = sorted({int(m.group(1)) for n in names if (m := re.match(r"encoder\.blocks\.(\d+)\.", n))})
    parts = {"encoder stem": lambda n: n.startswith("encoder.") and not n.startswith(("encoder.blocks.", "encoder.norm."))}
    parts.update({f"encoder block {b}": (lambda n, b=b: n.startswith(f"encoder.blocks.{b}.")) for b in blocks})
    parts["encoder last norm"] = lambda n: n.startswith("encoder.norm.")
    return parts


class ClippedMean:
    """‖E clip_C(g)‖² over any part of the parameters, without the bias of a finite sample:
    ‖Σ c_i‖² − Σ ‖c_i‖² over N(N − 1) keeps only the cross terms c_i·c_j (i ≠ j), each an unbiased
    estimate of ‖E c‖² for independent examples."""

    def __init__(self, clip_norm: float):
        self.clip_norm, self.total, self.own, self.count = clip_norm, {}, {}, 0

    def add(self, grads: dict[str, torch.Tensor], whole_sq: torch.Tensor) -> None:
        factor = (self.clip_norm / whole_sq.sqrt().clamp_min(1e-12)).clamp(max=1.0)
        for name, g in grads.items():
            clipped = (g * factor.view(-1, *[1] * (g.dim() - 1))).double()  # the difference below cancels
            self.total[name] = self.total.get(name, 0) + clipped.sum(0)
            self.own[name] = self.own.get(name, 0.0) + float(clipped.pow(2).sum())
        self.count += len(whole_sq)

    def parameters(self, part) -> int:
        return sum(self.total[n].numel() for n in self.total if part(n))

    def squared_norm(self, part) -> float:
        """For the parameters whose names `part` accepts."""
        names = [n for n in self.total if part(n)]
        cross = sum(float(self.total[n].pow(2).sum()) - self.own[n] for n in names)
        return cross / (self.count * (self.count - 1))


def with_decoder_from(model: torch.nn.Module, path: str) -> None:
    """Everything but the image encoder from the trained model in checkpoint `path`; the encoder stays."""
    trained = torch.load(path, map_location="cpu", weights_only=False)["model"]
    try:
        missing, unexpected = model.load_state_dict({k: v for k, v in trained.items() if not k.startswith("encoder.")},
                                                    strict=False)
    except RuntimeError as e:  # shapes that differ
        raise SystemExit(f"{path} is not a trained {type(model).__name__} of this size: {e}") from None
    if unexpected or any(not k.startswith("encoder.") for k in missing):
        raise SystemExit(f"{path} is not a trained {type(model).__name__} of this size: "
                         f"missing {[k for k in missing if not k.startswith('encoder.')]}, unexpected {unexpected}")


def measure(obj: str, params: dict, examples: int, chunk: int = 32, views: int = 1,
            decoder_from: str | None = None) -> dict:
    tokenizer = Tokenizer("models/tokenizer") if objective(obj).tokens else None
    model, mcfg = warm_model(obj, params, tokenizer)
    if decoder_from:
        with_decoder_from(model, decoder_from)
    loader = split_loader("eval", mcfg, tokenizer)
    ids = np.sort(np.random.default_rng(0).choice(len(loader.dataset), min(examples, len(loader.dataset)),
                                                  replace=False))
    whole, encoder = [], []
    mean = ClippedMean(params["dp"]["clip_norm"])
    for start in range(0, len(ids), chunk):
        batch, masks = tuple(loader.load(ids[start:start + chunk])), None
        if mcfg.reads_masks(obj):  # masks as dp-train draws them: uniform noise per patch, `views` per example
            g = torch.Generator().manual_seed(start)
            masks = torch.rand(len(batch[0]), views, (mcfg.img_size // mcfg.patch_size) ** 2, generator=g)
        grads = per_example_grads(model, view_rows(batch, masks, views), views)
        w, e = squared_norms(grads)
        mean.add(grads, w)
        whole.append(w)
        encoder.append(e)
    whole, encoder = torch.cat(whole), torch.cat(encoder)
    q = torch.tensor(QUANTILES, dtype=whole.dtype)
    n = read_json("data/shards/stats.json")["private"]["usable"]  # the plan's n, published with the mechanism
    plan = plan_mechanism({**params["dp"], "objective": obj}, n, params["privacy"]["adjacency"])
    signal = {}
    for part, accepts in {**PARTS, **depth_parts(mean.total)}.items():
        d, norm = mean.parameters(accepts), math.sqrt(max(mean.squared_norm(accepts), 0.0))
        noise = plan.noise_std * math.sqrt(d) / plan.denominator
        signal[part] = {"parameters": d, "clipped_mean_norm": round(norm, 4), "noise_norm": round(noise, 4),
                        "signal_over_noise": round(norm / noise, 3)}
    return {"objective": obj, "examples": len(ids), "batch": params["dp"]["expected_batch_size"],
            "steps": params["dp"]["steps"], "sigma": round(plan.sigma, 4), "step_signal": signal,
            "norm_quantiles": [round(v, 4) for v in whole.sqrt().quantile(q).tolist()],
            "encoder_norm_quantiles": [round(v, 4) for v in encoder.sqrt().quantile(q).tolist()],
            "encoder_share_of_sq_norm_median": round(float((encoder / whole).median()), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".", help="where dp-train's inputs are (data/shards, models/): default here")
    # CLIP clips per batch: its loss couples the examples, so it has no per-example gradient to read.
    ap.add_argument("--objectives", nargs="+", default=["mae", "caption"], choices=["mae", "caption"])
    ap.add_argument("--examples", type=int, default=1024)
    ap.add_argument("--views", type=int, default=1, help="masks per example, their gradients averaged before "
                    "clipping (dp.mask_views)")
    ap.add_argument("--scale-schedule", action="store_true",
                    help="each objective on benchmarks/scale_utility's recipe and schedule (before any --set)")
    ap.add_argument("--decoder-from", metavar="CHECKPOINT", help="all but the encoder from this trained model "
                    "(a dp-train checkpoint of one objective), the encoder at its warm start")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="as `dpfm --set`")
    args = ap.parse_args()
    if args.decoder_from and len(args.objectives) > 1:
        raise SystemExit("--decoder-from: name the checkpoint's one objective with --objectives")

    params = {obj: params_for(obj, args.scale_schedule, args.set) for obj in args.objectives}  # before leaving ROOT
    decoder_from = os.path.abspath(args.decoder_from) if args.decoder_from else None
    os.chdir(args.dir)
    rows = [measure(obj, params[obj], args.examples, views=args.views, decoder_from=decoder_from)
            for obj in args.objectives]
    print(f"{'objective':<9} {'norm at quantiles ' + str(QUANTILES):<44} {'encoder part':<36} encoder's share of norm²")
    for r in rows:
        print(f"{r['objective']:<9} {str(r['norm_quantiles']):<44} {str(r['encoder_norm_quantiles']):<36} "
              f"{r['encoder_share_of_sq_norm_median']:.3f} (median)")
    print("\none step of B examples at σ: ‖E clip_C(g)‖ against the noise's norm σ·C·√d/B")
    for r in rows:
        for part, v in r["step_signal"].items():
            print(f"{r['objective']:<9} {part:<18} B={r['batch']} T={r['steps']} σ={r['sigma']:.3f} d={v['parameters']:,}: "
                  f"{v['clipped_mean_norm']:.4f} against {v['noise_norm']:.4f}, signal/noise {v['signal_over_noise']:.3f}")
    print(json.dumps({"benchmark": "gradient_norms", "rows": rows}))


if __name__ == "__main__":
    main()
