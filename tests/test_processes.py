"""pipeline/processes.py: jobs spread over worker processes give what they give in this process, and
a job's error reaches the caller."""

from __future__ import annotations

import os

import pytest

from pipeline import processes


def square_and_pid(k: int) -> tuple[int, int, int]:
    return k, k * k, os.getpid()


def fails_on_three(k: int) -> int:
    if k == 3:
        raise ValueError(f"job {k} failed")
    return k


def test_workers_give_what_this_process_gives():
    here = list(processes.unordered(square_and_pid, [(k,) for k in range(8)], 1))
    assert [(k, sq) for k, sq, _ in here] == [(k, k * k) for k in range(8)]
    assert {pid for *_, pid in here} == {os.getpid()}
    spread = list(processes.unordered(square_and_pid, [(k,) for k in range(8)], 2))
    assert sorted((k, sq) for k, sq, _ in spread) == [(k, k * k) for k in range(8)]
    assert os.getpid() not in {pid for *_, pid in spread}


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failed_job_raises_its_error(workers):
    with pytest.raises(ValueError, match="job 3 failed"):
        list(processes.unordered(fails_on_three, [(k,) for k in range(6)], workers))
