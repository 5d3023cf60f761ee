"""pipeline/preemption.py's StopRequests: the first SIGTERM or SIGINT (Ctrl-C) is recorded for the loop
to stop after its step with a checkpoint, a second acts as without it, and leaving it gives the
signals back to whoever had them."""

from __future__ import annotations

import signal

import pytest
from ranks import on_two_ranks

from pipeline.distributed import World
from pipeline.preemption import StopRequests

SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what a job is told to stop by: SLURM's notice, Ctrl-C


@pytest.fixture
def received():
    """A recording handler for SIGTERM and SIGINT in place of the defaults (which would end the test run),
    the one StopRequests finds on entering; the defaults restored after."""
    got = []
    before = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in SIGNALS}
    yield got
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_first_signal_is_recorded_a_second_goes_where_it_went_before(received, signum):
    with StopRequests() as stop:
        signal.raise_signal(signum)
        assert stop.signum == signum and received == []  # recorded: the step in flight finishes
        signal.raise_signal(signum)
        assert received == [signum]  # asked twice: as if StopRequests were not there


def test_leaving_gives_each_signal_back_to_its_earlier_handler(received):
    before = {s: signal.getsignal(s) for s in SIGNALS}
    with StopRequests() as stop:
        assert all(signal.getsignal(s) != before[s] for s in SIGNALS)
    assert {s: signal.getsignal(s) for s in SIGNALS} == before
    signal.raise_signal(signal.SIGTERM)  # after the training: no longer recorded for a loop that has ended
    assert received == [signal.SIGTERM] and stop.signum is None


def test_under_torchrun_a_second_sigterm_is_the_agents_copy_and_a_ctrl_c_still_acts_at_once(received, monkeypatch):
    """SLURM's SIGTERM reaches the rank and the torchrun agent, which forwards its own: one request."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with StopRequests() as stop:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and received == []
        signal.raise_signal(signal.SIGINT)
        assert received == [signal.SIGINT]


def told_on_rank_1(world: World):
    with StopRequests() as stop:
        if world.rank == 1:
            signal.raise_signal(signal.SIGTERM)
        return stop.agreed(world)


def test_a_signal_to_one_rank_stops_every_rank(tmp_path):
    assert on_two_ranks(tmp_path, told_on_rank_1) == signal.SIGTERM
