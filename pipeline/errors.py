"""Errors the `dpfm` command reports as one clear line and a non-zero exit, without a traceback."""


class InputError(Exception):
    """An input the stage needs is missing, unreadable or inconsistent (a ledger, an index, the plan it
    was made for), and the message names it and what to do."""


class EvalSetError(InputError, ValueError):
    """An eval set named in `evaluate.sets` cannot be read as given: a missing part, an image that does
    not decode, a sample without its label."""


class VerificationFailed(RuntimeError):
    """A privacy check of `verify` failed: nothing downstream may publish the model as private."""


class Stopped(RuntimeError):
    """A SIGTERM or Ctrl-C stopped training at a step boundary, after a checkpoint; `dpfm` exits
    128 + signum, as a process killed by it would, so schedulers see the job as interrupted."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class Diverged(RuntimeError):
    """Non-private training's loss or gradients became non-finite: the weights are left as they were
    before the step, never saved as a model a DP run would warm-start from. Or a trained model's
    features or zero-shot scores on the eval images are: a probe or an argmax over them would score
    noise as an accuracy."""


def check_finite(values, what: str) -> None:
    """Raise Diverged, naming `what` and how many rows, where an (N, ...) array holds NaN or inf."""
    import numpy as np

    bad = int((~np.isfinite(values)).reshape(len(values), -1).any(axis=1).sum())
    if bad:
        raise Diverged(f"{what}: {bad} of {len(values)} rows are not finite (NaN or inf): the model diverged, and "
                       "an accuracy measured on them would be noise")


class StageBusy(RuntimeError):
    """Another process is running the same stage in this directory."""


class PrivateDataError(RuntimeError):
    """Training on the private data failed, and what failed would name private facts (a sampled
    example's key and bytes, a realised batch size): the details are in the owner-only zone, the
    message says where."""


class RanksDisagree(RuntimeError):
    """The ranks of one run would start from different states (another step, other weights) or sample
    from different data: a node that does not see the run's state directory or the shards, or sees a
    stale copy of them."""


class BudgetNotHere(RuntimeError):
    """A privacy budget was pushed (git tracks its data/budget.dvc) but is not in this checkout."""


class BudgetCorrupt(ValueError):
    """A charge in the privacy budget cannot be read."""
