"""Progress bars over work on private data: how far it is, never how long its pieces took.

tqdm shows elapsed time, a rate and an estimate, and redraws when enough time has passed (its monitor
thread too, after `maxinterval`), so which lines a log holds follows how fast each piece went: over
private data, how big a shard was, whether it could be read, which download stalled, how large a
sampled batch was. These bars show no time and redraw by the work done whatever the clock says, so
what they print depends only on how much is done. A whole stage's wall time stays visible
(docs/privacy.md, "Two zones").
"""

from __future__ import annotations

import math
from typing import Iterable

from tqdm import tqdm

UNTIMED = {"mininterval": 0, "maxinterval": math.inf}  # redraws decided by the count alone


class _CountBar(tqdm):
    def close(self):
        # Cut short (a piece failed): tqdm redraws at the count reached, which names the failing piece
        # (a DP step: when a private example was first sampled); the bar stays at its last redraw.
        if self.total is not None and self.n < self.total:
            self.n = self.last_print_n
        super().close()


def untimed_bar(total: int, desc: str, *, iterable: Iterable | None = None, initial: int = 0,
                unit: str = "") -> tqdm:
    """A bar over `total` pieces that shows the count, redrawn every hundredth of the work."""
    return _CountBar(iterable, desc=desc, total=total, initial=initial, miniters=max(1, (total - initial) // 100),
                bar_format="{l_bar}{bar}|" + f" {{n_fmt}}/{{total_fmt}} {unit}".rstrip(), **UNTIMED)


class ShareBar:
    """The share done, where the total itself is the data owner's (the rows of a URL table, less the
    published usable count, are how many failed): drawn at every whole percent passed, one line each,
    so it prints the same 0% to 100% whatever the total."""

    def __init__(self, total: int, desc: str):
        self.total, self.done = max(1, total), 0
        self.bar = tqdm(total=100, desc=desc, bar_format="{l_bar}{bar}|", miniters=1, **UNTIMED)

    def update(self, n: int = 1) -> None:
        self.done += n
        for _ in range(min(100, 100 * self.done // self.total) - self.bar.n):
            self.bar.update(1)

    def __enter__(self):
        return self

    def __exit__(self, kind, *exc):
        for _ in range(100 - self.bar.n if kind is None else 0):  # no piece at all (an empty scan group): its
            self.bar.update(1)                                    # bar, done, reads as any other's
        self.bar.close()
