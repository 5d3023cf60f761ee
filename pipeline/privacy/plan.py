"""The mechanism a DP training is accounted for, planned before any work, and its secret key.

`Plan` is the one description of the mechanism: `plan_mechanism` computes it from the dp params and
n (q, δ, σ calibrated to the target ε under the stated adjacency, and the ε they give); the step
adds the noise it says, the ledger writes it as its header, the budget charges it, and verify and
the report read it back from the published ledger with `Plan.from_header`.
`secret_key` is the randomness privacy rests on (who is sampled, the noise, the MAE masks): drawn
once per run, owner-only from its first byte, never in params or MLflow.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass

from pipeline.config import ParamsError
from pipeline.distributed import broadcast_floats
from pipeline.io import atomic_path
from pipeline.objectives import SENSITIVITY, objective
from pipeline.privacy import accounting
from pipeline.privacy.noise_edge import NOISE_EDGE, UNRECORDED_EDGE, check_noise_edge, largest_move
from pipeline.privacy.sampling import PoissonSampler


@dataclass(frozen=True)
class Plan:
    """What the accountant was told; the step must add exactly this noise for this sensitivity."""

    objective: str         # what is trained (mae | caption | clip; an audit names its own model)
    clipping: str          # per_sample | per_batch: sets the sensitivity K and the divisor
    n: int                 # usable private examples (public: the adjacency covers releasing it)
    sample_rate: float     # q: Poisson rate of every step
    sigma: float           # noise multiplier: noise std = σ·K·C
    clip_norm: float       # C
    steps: int             # the steps ε was paid for: a later step is refused
    delta: float
    accountant: str
    adjacency: str         # replace_one | add_remove
    target_epsilon: float
    epsilon: float         # what σ, q and `steps` give under `accountant` and `adjacency`
    sampler: str = PoissonSampler.name
    noise_edge: float = NOISE_EDGE  # where the noise's draws stop, in stds (noise.py): verify checks what it gives away

    @property
    def sensitivity(self) -> float:
        """K, in units of C (privacy/engine.py proves 1 per example, 2 per batch)."""
        return SENSITIVITY[self.clipping]

    @property
    def noise_std(self) -> float:
        return self.sigma * self.sensitivity * self.clip_norm

    @property
    def denominator(self) -> float:
        """The clipped sum is divided by the expected batch size q·n, never the realised |B_t|
        (private); a per-batch release is already a mean."""
        return 1.0 if self.clipping == "per_batch" else self.sample_rate * self.n

    @classmethod
    def unaccounted(cls, objective: str, clipping: str, sigma: float, clip_norm: float, n: int,
                    sample_rate: float = 1.0, steps: int = 1) -> "Plan":
        """A plan for a tool that measures the step instead of accounting it (the audits, the
        benchmarks): its ε and δ are not a number, and no budget or ledger takes it."""
        return cls(objective=objective, clipping=clipping, n=n, sample_rate=sample_rate, sigma=sigma,
                   clip_norm=clip_norm, steps=steps, delta=math.nan, accountant="none", adjacency="add_remove",
                   target_epsilon=math.nan, epsilon=math.nan)

    def without_noise(self, steps: int) -> "Plan":
        """The ε = ∞ twin: the same sampling, no noise, its own schedule. Never accounted."""
        return dataclasses.replace(self, sigma=0.0, steps=steps, epsilon=math.inf)

    def header(self) -> dict:
        """The ledger's header, the published mechanism (with the derived K and noise std written out,
        so a reader checks them without this code)."""
        fields = dataclasses.asdict(self)
        fields["planned_steps"], fields["epsilon_planned"] = fields.pop("steps"), fields.pop("epsilon")
        return {**fields, "sensitivity": self.sensitivity, "noise_std": self.noise_std}

    @classmethod
    def from_header(cls, header: dict) -> "Plan":
        """The plan a ledger header (or the published ledger.json) was written for; its derived values
        must be what the plan derives."""
        names = {f.name for f in dataclasses.fields(cls)} - {"steps", "epsilon"}
        header = {"noise_edge": UNRECORDED_EDGE, **header}  # written before the ledger recorded the edge
        plan = cls(**{k: header[k] for k in names if k in header}, steps=header["planned_steps"],
                   epsilon=header["epsilon_planned"])
        if not 0 < plan.noise_edge <= NOISE_EDGE:  # past the farthest dpfm's noise reaches: it would hide its edge
            raise ValueError(f"the ledger's noise_edge={plan.noise_edge} is not in (0, {NOISE_EDGE:.4g}]")
        for derived in ("sensitivity", "noise_std"):
            if derived in header and not math.isclose(header[derived], getattr(plan, derived), rel_tol=1e-9):
                raise ValueError(f"the ledger's {derived}={header[derived]} is not what its mechanism gives "
                                 f"({getattr(plan, derived)})")
        return plan


def agreed_plan(plan: Plan, world) -> Plan:
    """The main rank's σ (and the ε it gives) on every rank: each rank calibrates σ itself, and on nodes
    whose accountants round differently the last digits would differ, and so would the noise each adds."""
    sigma, epsilon = broadcast_floats([plan.sigma, plan.epsilon], world)
    return dataclasses.replace(plan, sigma=sigma, epsilon=epsilon)


def secret_key(directory, noise_seed: int | None) -> int:
    """The run's secret randomness key: created once, reused on resume, never logged."""
    if noise_seed is not None:
        return noise_seed
    path = directory / "secret.key"
    if not path.exists():  # owner-only from its first byte, and whole or absent (a kill leaves no half key)
        with atomic_path(path, mode=0o600) as tmp:
            tmp.write_text(str(secrets.randbits(63)))
    return int(path.read_text())


def plan_mechanism(dp: dict, n: int, adjacency: str) -> Plan:
    """q, δ, σ and the ε they give under `adjacency`, checked for contradictions before any work."""
    q = dp["expected_batch_size"] / n
    if q > 1:
        raise ValueError(f"dp.expected_batch_size={dp['expected_batch_size']} exceeds the {n} usable private examples")
    delta = accounting.parse_delta(dp["delta"], n)
    accounting.check_delta(delta, n)
    # σ is the noise multiplier relative to the sensitivity: noise std = σ · sensitivity · C.
    acc = {"accountant": dp["accountant"], "adjacency": adjacency}
    sigma = dp["sigma"] or accounting.calibrate_sigma(dp["epsilon"], q, dp["steps"], delta, **acc)
    eps = accounting.epsilon(sigma, q, dp["steps"], delta, **acc)
    if eps > dp["epsilon"]:
        raise ValueError(f"dp.sigma={sigma} gives ε={accounting.bound_text(eps, 3)} after {dp['steps']} steps, above "
                         f"the target dp.epsilon={dp['epsilon']}: raise sigma or lower steps")
    check_noise_edge(sigma, q, dp["steps"], delta, move=largest_move(objective(dp["objective"]).sensitivity, adjacency, q))
    return Plan(objective=dp["objective"], clipping=objective(dp["objective"]).clipping, n=n, sample_rate=q,
                sigma=sigma, clip_norm=dp["clip_norm"], steps=dp["steps"], delta=delta, accountant=dp["accountant"],
                adjacency=adjacency, target_epsilon=dp["epsilon"], epsilon=eps)


def checked_plan(dp: dict, n: int, adjacency: str, what: str = "dp params") -> Plan:
    """`plan_mechanism`, its contradictions refused as params errors naming the keys (dp-train, `dpfm validate`)."""
    try:
        return plan_mechanism(dp, n, adjacency)
    except ValueError as e:
        raise ParamsError([str(e)], source=f"{what} (n={n} usable private examples)") from None
