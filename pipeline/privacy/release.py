"""What may run outside ε, and how a run that did so is labelled.

Three things make a run's outputs, as a whole, NOT differentially private even when every DP
training in it is: training without DP on the private shards (the curve's ε = ∞ points,
`dp.nonprivate_baseline`), a known noise key (`dp.noise_seed`: whoever knows it can subtract the
noise), and an eval split carved out of a web source (`shards.eval_fraction`). Each is refused
unless asked for by name in `privacy`, and a run that has any of them says NOT PRIVATE in the
report's headline, on the MLflow parent and in the registry, with composed ε = ∞.

The bundled labelled sets (digits, Fashion-MNIST) are public data standing in for private data:
non-private training on them is allowed by default (`privacy.nonprivate_on_private_data: null`),
and still labelled.
"""

from __future__ import annotations

import math
from pathlib import Path

from pipeline.config import ParamsError
from pipeline.io import read_json
from pipeline.privacy.accounting import bound_text
from pipeline.data import labelled_sets


def public_set(source: str | None) -> str | None:
    """`source` when it is a labelled set a package ships (digits, Fashion-MNIST): public data, which the
    pipeline treats as private only to show what a run on private data does."""
    return source if source in labelled_sets.SETS else None


def nonprivate_allowed(privacy: dict, source: str | None) -> bool:
    """Whether training without DP on the private shards of `source` may run."""
    explicit = privacy["nonprivate_on_private_data"]
    return public_set(source) is not None if explicit is None else bool(explicit)


def check_nonprivate(privacy: dict, source: str | None, what: str) -> None:
    """Refuse `what` (a non-private training on the private shards) unless it is allowed."""
    if nonprivate_allowed(privacy, source):
        return
    why = ("privacy.nonprivate_on_private_data is false" if privacy["nonprivate_on_private_data"] is False else
           f"shards.source={source} is private data")
    raise ParamsError([f"{what} trains WITHOUT differential privacy on the private shards, and {why}: drop it, or "
                       "set privacy.nonprivate_on_private_data: true (the run is then labelled NOT PRIVATE)"],
                      source="privacy")


def public_params(params: dict) -> dict:
    """Params as they may be published (the report, a checkpoint's config): a known noise seed would let
    anyone who reads it subtract the noise."""
    shown = {k: dict(v) if isinstance(v, dict) else v for k, v in params.items()}
    if shown.get("dp", {}).get("noise_seed") is not None:
        shown["dp"]["noise_seed"] = "(set; hidden)"
    return shown


def check_noise_seed(dp: dict, privacy: dict) -> None:
    """A known noise key lets anyone who knows it remove the noise: only for tests and public data."""
    if dp["noise_seed"] is not None and not privacy["testing"]:
        raise ParamsError(["dp.noise_seed fixes the noise key, so whoever knows it can subtract the noise: leave it "
                           "null (a secret key), or set privacy.testing: true for a test or public-data run (labelled "
                           "NOT PRIVATE, never registered as private)"], source="privacy")


def curve_trains_nonprivate(curve: dict) -> bool:
    """The curve trains its ε = ∞ point (without DP) for each init: with `inits: []` it trains none."""
    return bool(curve.get("inits")) and any(math.isinf(e) for e in curve.get("epsilons", []))


def check_asked_for(params: dict) -> None:
    """What dp-train and the curve refuse before they train (check_noise_seed, check_nonprivate), refused
    from the params alone when a workflow starts: the curve refused a web source's ε = ∞ point only once
    it ran, after pretrain and dp-train had held GPUs for days."""
    check_noise_seed(params["dp"], params["privacy"])
    source = params["shards"]["source"]  # the shards stage records it as it is (stats.json's `source`)
    if curve_trains_nonprivate(params["curve"]):
        check_nonprivate(params["privacy"], source, "curve.epsilons' ε = ∞ point")
    if params["dp"]["nonprivate_baseline"]:
        check_nonprivate(params["privacy"], source, "dp.nonprivate_baseline")


def not_private_reasons(params: dict, stats: dict, composition: dict | None = None) -> list[str]:
    """Why this run's outputs, as a whole, are not covered by its ε (empty when they are). `composition`
    (budget.composition): the releases outside DP that the budget records, this run's or earlier ones'."""
    reasons = []
    if composition and composition.get("outside_dp"):
        reasons.append("data/budget records releases of its examples made without DP, here or in an earlier run ("
                       + "; ".join(composition["outside_dp"]) + "): every ε composed over it is ∞")
    if params["privacy"]["testing"] or params["dp"]["noise_seed"] is not None:
        reasons.append("a test run (privacy.testing; a known dp.noise_seed voids the noise)")
    if curve_trains_nonprivate(params.get("curve", {})):  # verify's params have no curve
        reasons.append("the curve's ε = ∞ point trains without DP on the private shards")
    if params["dp"]["nonprivate_baseline"]:
        reasons.append("dp.nonprivate_baseline trains without DP on the private shards")
    if params["dp"]["log_private_stats"]:
        reasons.append("dp.log_private_stats publishes the non-finite count outside ε")
    if stats.get("eval_from_private"):
        reasons.append("the eval split is carved out of the private data (shards.eval_fraction)")
    if params["privacy"]["adjacency"] == "add_remove":  # n is in the ledger, MLflow and the report
        reasons.append("privacy.adjacency add_remove: its ε does not cover the exact n the run publishes "
                       "(replace_one covers it)")
    return reasons


def not_private_tags(reasons: list[str]) -> dict:
    """A stage run's MLflow tags for `reasons` (not_private_reasons): NOT PRIVATE beside the figures it
    logs; none when there are none."""
    return {"dpfm.private": "false", "dpfm.not_private": "; ".join(reasons)} if reasons else {}


def known_before_the_report(params: dict, stats_path: Path, verification: dict | None) -> list[str]:
    """not_private_reasons as far as a stage before the report (or a parent run whose report did not run)
    can know them: the params, the shards' stats when written, and the budget as verify found it (the
    curve's points and evaluate's seeds may charge more; the report's verdict is final)."""
    stats = read_json(stats_path) if stats_path.is_file() else {}
    return not_private_reasons(params, stats, (verification or {}).get("composition_at_verify"))


def registry_tags(epsilon_composed: float, delta_composed: float, runs: int, reasons: list[str]) -> dict:
    """The tags every registered model on this budget carries (tracking.tag_dp_models): what all DP runs
    charged to it compose to now (ε at δ = `delta_composed`, the smallest of theirs: budget.composition),
    how many, and NOT PRIVATE with its reasons once anything left DP."""
    return ({"epsilon": "inf" if reasons else bound_text(epsilon_composed, 4),
             "delta_composed": bound_text(delta_composed, 3, exponent=True),
             "dp_runs_on_data": runs, "private": str(not reasons).lower()}
            | ({"not_private": "; ".join(reasons)} if reasons else {}))
