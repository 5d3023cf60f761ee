"""What an evaluation asks of its eval set, asked before any model is trained for it: evaluate's extra
seeds and the curve's points are DP trainings charged to the budget, so a set that cannot answer must
stop the stage before them, not after."""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from pipeline.config import ParamsError
from pipeline.eval.evalsets import EvalSet, load_eval_set
from pipeline.eval.fewshot import kshot_subsets
from pipeline.eval.probe import blocks_read

DECODE_BATCH = 256  # images decoded at once by the check: memory stays flat in the set's size


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


def checked_eval_sets(specs: list[dict], cfg: dict, seed: int, image_size: int, depth: int, *,
                      decode: bool) -> list[tuple[EvalSet, tuple[np.ndarray, np.ndarray]]]:
    """Every set of `evaluate.sets` at `image_size`, with its probe split, each refused by
    `check_protocols` if the protocol `cfg` cannot run on it. With `decode` (DP trainings follow),
    every image is decoded once too, a batch at a time: a file that cannot be read would otherwise stop
    the stage when features are taken, after the trainings were charged."""
    sets = [load_eval_set(spec, image_size) for spec in specs]
    named = [es.name for es in sets]
    if len(set(named)) < len(named):  # metrics.json keys each set's results by its name
        raise ParamsError([f"evaluate.sets: two sets are named {sorted({n for n in named if named.count(n) > 1})}"],
                          source="evaluate params")
    checked = [(es, check_protocols(es, cfg, seed, depth)) for es in sets]
    for es in sets if decode else []:
        for start in tqdm(range(0, len(es.images), DECODE_BATCH), desc=f"decode {es.name}", leave=False):
            es.images[start:start + DECODE_BATCH]
    return checked
