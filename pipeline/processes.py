"""Independent jobs spread over worker processes, one core each: the stages that write shards."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Callable, Iterable, Iterator


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # one core per worker process


def unordered(fn: Callable, jobs: Iterable[tuple], workers: int) -> Iterator:
    """Yield fn(*job) for every job as it completes, in any order; in this process where workers <= 1.
    On an error the running jobs finish and the rest are dropped."""
    if workers <= 1:
        for job in jobs:
            yield fn(*job)
        return
    # forkserver: workers start from a clean process, not a fork of one whose OpenMP pool is running;
    # fn's module is imported once there, not in every worker.
    mp = multiprocessing.get_context("forkserver")
    mp.set_forkserver_preload([fn.__module__])
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp, initializer=_one_thread)
    try:
        futures = [pool.submit(fn, *job) for job in jobs]
        for future in as_completed(futures):
            yield future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
