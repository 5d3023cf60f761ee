"""The privacy ledger: an append-only record of everything the accountant needs.

Line 1 is the header (the run's `Plan`: n, δ, q, σ, C, sensitivity, sampler, target ε); then one line per logical step
with its realised batch size, appended and fsynced *before* the step's update is applied. The file
lives in the run's state directory, never published; `public()` is what models/dp/ledger.json holds. A step
re-run after a crash redraws the same batch and noise (same key), so it is recorded once; the
ledger therefore never counts fewer steps than were applied.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.io import drop_torn_tail
from pipeline.privacy.plan import Plan


class LedgerError(RuntimeError):
    pass


class Ledger:
    def __init__(self, path: str | Path, plan: Plan):
        self.path = Path(path)
        self.plan, self.header = plan, plan.header()
        header = self.header
        self.batch_sizes: dict[int, int] = {}
        lines = []
        if self.path.exists():
            # Its fsync never returned, so that step's update was never applied: it is charged again
            # when re-run (and kept, it would make the ledger unreadable, the run unresumable).
            drop_torn_tail(self.path)
            lines = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        if not lines:  # new, or killed while its header was being written
            self._append({"header": header})
        elif lines[0] != {"header": header}:
            raise LedgerError(f"{self.path} was written for a different mechanism; refusing to mix ledgers")
        for rec in lines[1:]:
            self.batch_sizes[rec["step"]] = rec["batch_size"]

    def _append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def record_step(self, step: int, batch_size: int) -> None:
        """Charge step `step` before its update is applied."""
        if step in self.batch_sizes:
            if self.batch_sizes[step] != batch_size:
                raise LedgerError(f"step {step} redrew a batch of {batch_size}, the ledger has "
                                  f"{self.batch_sizes[step]}: the sampler is not deterministic")
            return
        self._append({"step": step, "batch_size": batch_size})
        self.batch_sizes[step] = batch_size

    @property
    def steps(self) -> int:
        return len(self.batch_sizes)

    def to_dict(self) -> dict:
        """Everything: the mechanism and every step's realised batch size (owner-only: privacy/owner.py)."""
        return {**self.public(), "batch_sizes": [self.batch_sizes[s] for s in sorted(self.batch_sizes)]}

    def public(self) -> dict:
        """What may be published: the mechanism and the number of steps charged, not the batch sizes
        (they reveal the sampling that the accountant assumes is secret)."""
        return {**self.header, "steps": self.steps}
