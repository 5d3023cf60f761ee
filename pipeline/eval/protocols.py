"""What an evaluation asks of its eval set, asked before any model is trained for it: evaluate's extra
seeds and the curve's points are DP trainings charged to the budget, so a set that cannot answer must
stop the stage before them, not after."""

from __future__ import annotations

import numpy as np

from pipeline.config import ParamsError
from pipeline.eval.evalsets import EvalSet
from pipeline.eval.fewshot import kshot_subsets
from pipeline.eval.probe import blocks_read


def check_protocols(es: EvalSet, cfg: dict, seed: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Refuse (ParamsError, naming the keys) an eval set the evaluate protocol cannot run on: the blocks
    the features read of an encoder of `depth` blocks, the probe's split (returned), the few-shot shots."""
    problems = []
    try:
        blocks_read(depth, cfg["last_k_blocks"])
    except ValueError as e:
        problems.append(f"evaluate.{e}")
    try:
        split = es.split(cfg["probe_fraction"], seed)
    except ValueError as e:
        raise ParamsError([*problems, f"evaluate.probe_fraction={cfg['probe_fraction']} on eval set {es.name!r}: {e}"],
                          source="evaluate params") from None
    for key in ("fewshot", "finetune"):
        shots = cfg[key]["shots"] if key == "fewshot" or cfg[key]["enabled"] else []
        try:
            if shots:
                kshot_subsets(es.labels[split[0]], max(shots), 1, seed)
        except ValueError as e:
            problems.append(f"evaluate.{key}.shots on eval set {es.name!r}: {e}")
    if problems:
        raise ParamsError(problems, source="evaluate params")
    return split
