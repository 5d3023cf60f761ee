"""Settings of the one-run canary audit (canary_audit.py), apart from it so the CLI can show their defaults
without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AuditConfig:
    canaries: int = 5000
    steps: int = 300
    expected_batch_size: int = 512
    physical_batch_size: int = 128
    epsilon: float = 2.0               # the audited run's σ is calibrated to this ε (PLD)
    delta: float = 1e-5
    clip_norm: float = 1.0
    canary_gradient_norm: float = 10.0  # canary gradients before clipping, in units of C
    lr: float = 0.05
    clipping: str = "bookkeeping"      # the per-sample clipping method audited (as dp.clipping)
    confidence: float = 0.95
    seed: int = 0
    # Deliberate faults, so one can see the audit catch a broken engine:
    clipping_enabled: bool = True      # False: the clipper is built with an infinite clip norm
    noise_scale: float = 1.0           # 0.1: noise ten times below what was accounted

    def check(self) -> None:
        problems = []
        if self.canaries < 2:
            problems.append(f"canaries={self.canaries} must be ≥ 2")
        for name in ("steps", "expected_batch_size", "physical_batch_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be ≥ 1")
        for name in ("epsilon", "clip_norm", "lr", "noise_scale"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)} must be > 0")
        if not self.canary_gradient_norm >= 1:
            problems.append(f"canary_gradient_norm={self.canary_gradient_norm} must be ≥ 1 (a canary must reach C)")
        if not 0 < self.delta < 1:
            problems.append(f"delta={self.delta} must be in (0, 1)")
        if not 0.5 <= self.confidence < 1:
            problems.append(f"confidence={self.confidence} must be in [0.5, 1)")
        if problems:
            raise ValueError("audit settings are invalid: " + "; ".join(problems))
