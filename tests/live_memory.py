"""Peak bytes of the tensors a piece of code creates, counted exactly as ops return them (no RSS,
no allocator): a deterministic memory measure for tests."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Inside `with LiveTensorBytes() as live:`, `live.peak` is the most bytes of storage that ops
    had created and not yet freed at any one time (tensors made before the block do not count)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # storage address -> bytes
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live and storage.nbytes():
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    weakref.finalize(storage, self._freed, key)
        self.peak = max(self.peak, self.now)
        return out

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)
