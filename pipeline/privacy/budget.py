"""The privacy budget of one private dataset: every DP training run on it, composed.

Each dp-train run appends its mechanism (σ, q, planned steps, δ) to `.dpfm/budget/<fingerprint>.jsonl`
before its first step, keyed by the data's fingerprint (a digest of its index) and by the run's
identity (its state directory, itself a digest of the params and inputs): a resumed run is the same
entry, a re-run with other params or another objective is a new one. Planned steps are charged,
not applied ones: a run may go on to its plan at any later resume, so this is an upper bound.

`verify` and the report show the composed ε of all runs on the data beside the run's own: several
models trained on one dataset together release more than any one of them. Deleting `.dpfm/`
deletes this record too; keep it with the data.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from pipeline.data.index import INDEX_NAME
from pipeline.privacy import accounting
from pipeline.privacy.accountants import PLD_REL_TOL, PLD_START_INTERVAL

BUDGET_DIR = Path(".dpfm/budget")


def fingerprint(private_dir: str | Path) -> str:
    """The private data's identity: a digest of its index (which example lives where, and its bytes'
    digests), so a byte-identical re-download keeps it and any other data changes it."""
    h = hashlib.sha256()
    with open(Path(private_dir) / INDEX_NAME, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def record(data: str, run: str, mech: dict) -> None:
    """Charge run `run`'s planned mechanism to dataset `data` (once; fsynced before training)."""
    if any(entry["run"] == run for entry in runs(data)):
        return
    entry = {"run": run, "objective": mech["objective"], "sigma": mech["sigma"], "sample_rate": mech["sample_rate"],
             "steps": mech["planned_steps"], "delta": mech["delta"], "n": mech["n"], "recorded": time.time()}
    BUDGET_DIR.mkdir(parents=True, exist_ok=True)
    with open(BUDGET_DIR / f"{data}.jsonl", "a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def runs(data: str) -> list[dict]:
    """The DP runs charged to dataset `data` (a line torn by a kill is dropped: its run had not started)."""
    path = BUDGET_DIR / f"{data}.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def composed_epsilon(entries: list[dict], delta: float) -> float:
    """ε at δ of the runs' mechanisms applied one after another to the same data: PLD composition of
    Poisson-subsampled Gaussians (σ relative to the sensitivity), its discretisation halved until
    stable to 0.1%, and never above dp_accounting's RDP bound of the same composition."""
    if len(entries) == 1:
        e = entries[0]
        return accounting.epsilon(e["sigma"], e["sample_rate"], e["steps"], delta)
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    event = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(e["sample_rate"], dp_accounting.GaussianDpEvent(e["sigma"])), e["steps"])
        for e in entries if e["steps"] > 0])
    rdp = rdp_privacy_accountant.RdpAccountant().compose(event).get_epsilon(delta)
    interval, last = PLD_START_INTERVAL, None
    while interval > 1e-5:
        eps = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval).compose(event).get_epsilon(delta)
        if last is not None and abs(eps - last) <= PLD_REL_TOL * eps:
            return float(min(eps, rdp))
        last, interval = eps, interval / 2
    return float(rdp)


def composition(ledger: dict, delta: float) -> dict:
    """ε of every DP run charged to this run's private data, composed (budget.py); this run is
    counted even if the budget record was lost."""
    entries = runs(ledger["data_fingerprint"]) if "data_fingerprint" in ledger else []
    if not any(e["run"] == ledger.get("run") for e in entries):
        entries.append({"run": ledger.get("run"), "objective": ledger["objective"], "sigma": ledger["sigma"],
                        "sample_rate": ledger["sample_rate"], "steps": ledger["planned_steps"]})
    return {"epsilon": composed_epsilon(entries, delta), "runs": len(entries),
            "data_fingerprint": ledger.get("data_fingerprint"),
            "by_run": [{k: e[k] for k in ("run", "objective", "sigma", "sample_rate", "steps")} for e in entries]}
