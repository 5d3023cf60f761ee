"""Stopping a training loop cleanly when the job is told to end.

SLURM sends SIGTERM at a time limit or a preemption, then SIGKILL after its grace period; Ctrl-C
sends SIGINT. The first such signal asks the loop to finish the step in flight, save a checkpoint
and exit, so a re-run loses nothing (a kill -9 loses the steps since the last checkpoint). A second
signal acts as it would have without us, at once; except a second SIGTERM under torchrun, which is
the first one again: SLURM signals every process of the job step, the torchrun agent among them,
and the agent forwards its own to each rank.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from pipeline.distributed import World, collective_device
from pipeline.errors import Stopped

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """While entered, records the first SIGTERM/SIGINT instead of dying of it."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # Python delivers signals there only
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGTERM == self.signum and "TORCHELASTIC_RUN_ID" in os.environ:
            return  # the agent's copy of SLURM's SIGTERM (module docstring)
        if self.signum is not None:  # asked twice: behave as if we were not here
            signal.signal(signum, self._previous[signum])
            signal.raise_signal(signum)
            return
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def agreed(self, world: World) -> int | None:
        """The signal to stop for, the same on every rank: one rank told to stop stops them all at
        this step (else the others would wait for it in the next collective)."""
        if world.size == 1:
            return self.signum
        t = torch.tensor([self.signum or 0], device=collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item()) or None


def stop(signum: int, desc: str, step: int, total: int, checkpoint) -> Stopped:
    name = signal.Signals(signum).name
    return Stopped(signum, f"{desc} stopped by {name} after step {step} of {total}; {checkpoint} holds it: "
                           "re-run to resume")
