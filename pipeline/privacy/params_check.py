"""What DP training refuses from its params alone, refused as a workflow starts (rules/common.smk) and by
`dpfm validate`, not by dp-train once pretrain has held the GPUs for hours; and the schedules they warn about."""

from __future__ import annotations

import torch

from pipeline.config import ParamsError
from pipeline.models import ModelConfig, build_model
from pipeline.objectives import objective
from pipeline.privacy import release
from pipeline.privacy.clipping import group_bounds
from pipeline.privacy.engine import check_clipping
from pipeline.train import freeze


def check_dp_params(params: dict, mcfg: ModelConfig | None = None) -> torch.nn.Module:
    """Refuse (ParamsError) the noise key, clipper, masked views, frozen modules or clip groups that DP
    training would refuse. The model it returns is built on the meta device: names checked, no weight
    made (dp-train checks the warm start's tensors fit it)."""
    dp = params["dp"]
    mcfg = mcfg or ModelConfig.from_params(params["model"], dp["objective"])  # names need no vocabulary
    release.check_noise_seed(dp, params["privacy"])
    if dp["mask_views"] > 1 and not mcfg.reads_masks(dp["objective"]):
        raise ParamsError([f"dp.mask_views={dp['mask_views']} averages masked views, but the {dp['objective']} model "
                           "masks nothing (mae; caption with model.caption_mask_ratio > 0): its views would be "
                           "copies"], source="dp params")
    try:
        check_clipping(dp["clipping"], dp["precision"], dp["encoder_clip_share"], dp["mask_views"],
                       objective(dp["objective"]).clipping, dp["objective"])
        with torch.device("meta"):
            model = build_model(dp["objective"], mcfg)
            freeze(model, dp["frozen"])
            group_bounds(model, dp["clip_norm"], dp["encoder_clip_share"])
    except ValueError as e:
        raise ParamsError([str(e)], source="dp params") from None
    return model


def nonprivate_params(params: dict) -> dict:
    """The ε = ∞ twin's params: the recipe, with `dp.nonprivate`'s schedule where it sets one."""
    schedule = {k: v for k, v in params["dp"]["nonprivate"].items() if v is not None}
    return {**params, "dp": {**params["dp"], **schedule}}


def schedule_warnings(params: dict) -> list[str]:
    """Schedules whose warm-up outlasts their steps: the rate climbs for the whole run and ends below its
    lr. Warned, not refused: tests and quick looks run a few steps on purpose; a real DP run so set spends
    its ε at a fraction of the rate it asked for."""
    twin = nonprivate_params(params)["dp"]
    schedules = {"pretrain": params["pretrain"], "dp": params["dp"]}
    if any(params["dp"]["nonprivate"][k] is not None for k in ("steps", "warmup_steps")):
        schedules["dp.nonprivate (the ε = ∞ twin)"] = twin
    return [f"{name}: warmup_steps={s['warmup_steps']} outlasts steps={s['steps']}, so the learning rate climbs for "
            f"the whole run and peaks at {s['steps'] / s['warmup_steps']:.2g} × its lr"
            for name, s in schedules.items() if s["warmup_steps"] > s["steps"]]
