"""What DP training refuses from its params alone, refused as a workflow starts (rules/common.smk) and by
`dpfm validate`, not by dp-train once pretrain has held the GPUs for hours."""

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
