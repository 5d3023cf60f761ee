"""pipeline/processes.py: jobs spread over worker processes give what they give in this process, and
a job's error reaches the caller."""

from __future__ import annotations

import os
from pathlib import Path

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


def test_each_worker_computes_on_one_core():
    """Workers × torch's whole pool would put cores × workers threads on the cores. Run where torch's pool
    is its default (the tests' environment sets OMP_NUM_THREADS=1 for every process)."""
    import subprocess
    import sys

    count = ("import torch; from pipeline import processes; "
             "print(sorted(set(processes.unordered(torch.get_num_threads, [()] * 4, 2))))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", count], capture_output=True, text=True, timeout=120, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and done.stdout.strip() == "[1]", done.stderr[-2000:]


def fails_at_once_or_marks(k: int, marks: str) -> int:
    import time
    from pathlib import Path

    if k == 0:
        raise ValueError("job 0 failed")
    Path(marks, f"start-{k}").touch()
    time.sleep(0.2)  # a job's work: the error reaches the caller while most jobs still wait
    Path(marks, f"end-{k}").touch()
    return k


def test_the_jobs_still_waiting_when_one_fails_are_dropped(tmp_path):
    """The error surfaces once the running jobs end (they may be writing files the caller then cleans up),
    not after every queued job has run and written."""
    with pytest.raises(ValueError, match="job 0 failed"):
        list(processes.unordered(fails_at_once_or_marks, [(k, str(tmp_path)) for k in range(20)], 2))
    started, ended = ({p.name.split("-")[1] for p in tmp_path.glob(f"{mark}-*")} for mark in ("start", "end"))
    assert started and started == ended and len(ended) < 10


def the_first_waits_for_go(k: int, go: str) -> int:
    import time

    deadline = time.monotonic() + 20  # the first job ends once the caller has the second's result (or in 20 s)
    while k == 0 and not Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return k


def test_results_come_as_their_jobs_complete_not_in_the_order_given(tmp_path):
    go = tmp_path / "go"
    results = processes.unordered(the_first_waits_for_go, [(0, str(go)), (1, str(go))], 2)
    try:
        first = next(results)
        go.touch()
        assert (first, list(results)) == (1, [0])
    finally:
        go.touch()
        results.close()
