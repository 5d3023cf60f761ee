"""The privacy ledger: an append-only record of everything the accountant needs.

Line 1 is the header (the run's `Plan`: n, δ, q, σ, C, sensitivity, sampler, target ε); then one line per logical step
with its realised batch size, appended and fsynced *before* the step's update is applied. The file
lives in the run's state directory, never published; `public()` is what models/dp/ledger.json holds. A step
re-run after a crash redraws the same batch and noise (same key), so it is recorded once; the
ledger therefore never counts fewer steps than were applied.

A resumed run keeps the mechanism its header holds. σ calibrated again for the same target on another
machine or library build (a node a preempted job is requeued on, the GPU machine after the CPU) differs
in its last digits, since the accountant's FFTs round differently there: within `SAME_CALIBRATION` it is
the same run, and its header's σ, the noise the charged steps were drawn with, stays the noise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pipeline.errors import InputError
from pipeline.io import append_durably, drop_torn_tail
from pipeline.privacy import owner
from pipeline.privacy.plan import Plan

# Relative difference of σ (and of the noise std and planned ε it gives) between two calibrations of the
# same target: the accountants' rounding moves them by about 1e-11; any real change of σ is far larger.
SAME_CALIBRATION = 1e-9
CALIBRATED = ("sigma", "noise_std", "epsilon_planned")


class LedgerError(InputError, RuntimeError):
    """The ledger on disk cannot be continued by this run."""


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
            lines = self._read()
        if not lines:  # new, or killed while its header was being written
            self._append({"header": header})
        elif not same_mechanism(lines[0].get("header", {}), header):
            raise LedgerError(f"{self.path} was written for a different mechanism; refusing to mix ledgers")
        else:  # the run's own mechanism, as it began (its σ to the last digit)
            self.header = lines[0]["header"]
            self.plan = Plan.from_header(self.header)
        for rec in lines[1:]:
            self.batch_sizes[rec["step"]] = rec["batch_size"]

    def _read(self) -> list[dict]:
        """The header, then step 0, 1, 2, ... in order, each once: steps are appended in that order, so
        a line missing, edited or out of place means a damaged ledger, whose lost steps were charged and
        would go uncounted. Refused, naming the line (never its contents: batch sizes are the owner's)."""
        records = []
        for number, line in enumerate(self.path.read_text().splitlines(), 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            want = "the header" if number == 1 else f"step {number - 2}"
            ok = isinstance(record, dict) and (set(record) == {"header"} if number == 1 else (
                set(record) == {"step", "batch_size"} and record["step"] == number - 2
                and type(record["batch_size"]) is int and record["batch_size"] >= 0))
            if not ok:
                raise LedgerError(f"{self.path} line {number} is not {want}'s record: the ledger was damaged or "
                                  f"edited, and a step it lost was still charged (its ε would go uncounted); "
                                  f"restore the ledger, or delete {self.path.parent} to train from the start")
            records.append(record)
        return records

    def _append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            append_durably(f.fileno(), json.dumps(record, sort_keys=True) + "\n", self.path)

    def record_step(self, step: int, batch_size: int) -> None:
        """Charge step `step` before its update is applied."""
        if step in self.batch_sizes:
            if self.batch_sizes[step] != batch_size:  # the sizes are the owner's: named in their log only
                where = owner.note("dp-train", f"step {step} redrew a batch of {batch_size}, the ledger has "
                                               f"{self.batch_sizes[step]}")
                raise LedgerError(f"step {step} redrew a batch of another size than its ledger holds ({where}): "
                                  "the sampler is not deterministic")
            return
        if step > 0 and step - 1 not in self.batch_sizes:  # a checkpoint past the ledger: its steps were charged nowhere
            raise LedgerError(f"step {step} follows no charged step {step - 1}: {self.path} was lost or cut while the "
                              f"run's checkpoint survived, so updates it holds are on no ledger (their ε would go "
                              f"uncounted); restore the ledger, or delete {self.path.parent} to train from the start")
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


def same_mechanism(written: dict, planned: dict) -> bool:
    """Whether a ledger header and a new plan's header describe one mechanism: every field the same,
    and σ with what it gives the same up to the rounding of two calibrations (`SAME_CALIBRATION`)."""
    if written.keys() != planned.keys():
        return False
    return all(math.isclose(written[k], planned[k], rel_tol=SAME_CALIBRATION, abs_tol=0.0) if k in CALIBRATED
               else written[k] == planned[k] for k in planned)
