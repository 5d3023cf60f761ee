"""Every artifact of the DAG and its path: the one place a data path is written. The stage table
(stages/__init__.py) names them as inputs and outputs; a stage reads its paths from its Stage."""

from __future__ import annotations

from pathlib import Path

# Every artifact of the DAG and its path (directories end with "/"): the only place a path is written.
ARTIFACTS = {
    "shards": "data/shards/",                             # private-train and eval shards, index, stats.json
    "shards_digest": "data/shards.digest",                # their DVC hash keyed with the owner's key: what DVC tracks
    "synthetic": "data/synthetic/",                       # procedural images
    "tokenizer": "models/tokenizer/",
    "pretrain": "models/pretrain/",                       # the synthetic warm start
    "dp": "models/dp/",                                   # the DP model, its published ledger and history
    "verification": "results/privacy/verification.json",  # this run's ε, checked (the budget as it was then)
    "privacy": "results/privacy/privacy.json",            # what everything the run released composes to
    "curve": "results/curve/curve.json",
    "metrics": "results/eval/metrics.json",
    "report": "results/report/",
}


def artifact(name: str) -> Path:
    """The path of an artifact, for code shared by several stages (a stage asks its Stage)."""
    try:
        return Path(ARTIFACTS[name].rstrip("/"))
    except KeyError:
        raise KeyError(f"unknown artifact {name!r}; artifacts: {', '.join(ARTIFACTS)}") from None
