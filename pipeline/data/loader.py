"""Batches of model inputs for given example indices, decoded in parallel worker processes.

The Poisson sampler decides *which* examples (and how many) form each batch; this only turns index
arrays into tensors, in the order given, so the loader can never change the sampling. Each worker
decodes whole micro-batches: reads them by byte range (all of a batch at once), decodes, centre-crops
to the model resolution.
Normalisation (fixed public constants) and caption tokenisation run in the calling process.
"""

from __future__ import annotations

import signal
from typing import Iterable, Iterator

import numpy as np
import torch

from pipeline.data.shards import ShardDataset
from pipeline.data.transforms import decode_image, to_tensor, tokenize


class _Decoded(torch.utils.data.Dataset):
    """dataset[indices] -> (indices, (B, S, S, 3) uint8, captions)."""

    def __init__(self, dataset: ShardDataset, image_size: int, captions: bool):
        self.dataset, self.image_size, self.captions = dataset, image_size, captions

    def __getitem__(self, indices):
        indices = np.asarray(indices, dtype=np.int64)
        members = ("image", "txt") if self.captions else ("image",)
        images = np.empty((len(indices), self.image_size, self.image_size, 3), np.uint8)
        captions = []
        # The whole micro-batch in one read_samples: its remote reads overlap instead of queueing.
        for j, raw in enumerate(self.dataset.read_samples(indices.tolist(), members)):
            try:
                images[j] = decode_image(raw["image"], self.image_size)
            except Exception as e:  # which example: dp-train keeps this line for the data owner only
                raise ValueError(f"example {self.dataset.key(int(indices[j]))} (row {int(indices[j])}) no longer "
                                 f"decodes, though its shard's scan decoded it: {type(e).__name__}: {e}") from e
            if self.captions:
                captions.append(raw["txt"].decode("utf-8"))
        return indices, torch.from_numpy(images), captions


def _as_is(batch):
    return batch


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _worker_init(_):
    torch.set_num_threads(1)  # one core per decoding process
    # A SIGTERM or Ctrl-C reaches the whole process group: the training process decides when to stop
    # (after a checkpoint) and its workers must keep serving the step in flight until then. They were
    # started with the signals blocked (BatchLoader.__call__), so one sent while a worker was still
    # starting is pending: ignoring it discards it, then the signals are unblocked.
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class BatchLoader:
    """`loader(batches)` yields (indices, inputs) per index array, in order; inputs are
    (images,) or, with a tokenizer, (images, tokens): what the models' forward takes, on `device`.

    On a GPU the decoded uint8 images travel in page-locked memory with a non-blocking copy, and are
    normalised there: a quarter of the bytes of float32 over PCIe, and the host is not held up."""

    def __init__(self, dataset: ShardDataset, image_size: int, *, tokenizer=None, max_len: int | None = None,
                 workers: int = 0, prefetch: int = 4, device: str | torch.device = "cpu"):
        if tokenizer is not None and not max_len:
            raise ValueError("a tokenizer needs max_len (the model's caption length)")
        self.dataset, self.image_size = dataset, image_size
        self.tokenizer, self.max_len = tokenizer, max_len
        self.workers, self.prefetch = workers, prefetch
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._decoded = _Decoded(dataset, image_size, tokenizer is not None)

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        if not self.pinned:
            return x.to(self.device)
        return (x if x.is_pinned() else x.pin_memory()).to(self.device, non_blocking=True)

    def _inputs(self, images: torch.Tensor, captions: list[str]) -> tuple[torch.Tensor, ...]:
        x = to_tensor(self._to_device(images))
        if self.tokenizer is None:
            return (x,)
        return x, self._to_device(tokenize(self.tokenizer, captions, self.max_len))

    def load(self, indices: np.ndarray) -> tuple[torch.Tensor, ...]:
        """One batch, decoded in this process."""
        _, images, captions = self._decoded[indices]
        return self._inputs(images, captions)

    def __call__(self, batches: Iterable[np.ndarray]) -> Iterator[tuple[np.ndarray, tuple[torch.Tensor, ...]]]:
        if self.workers == 0:
            for b in batches:
                yield np.asarray(b, dtype=np.int64), self.load(b)
            return
        # batch_size=None: each element of `batches` is one whole batch, handed to one worker.
        loader = torch.utils.data.DataLoader(self._decoded, batch_size=None, sampler=batches,
                                             num_workers=self.workers, prefetch_factor=self.prefetch,
                                             worker_init_fn=_worker_init, collate_fn=_as_is,
                                             pin_memory=self.pinned)
        # The workers start in iter() (forked, or spawned on macOS): with the stop signals blocked meanwhile,
        # none can die of one before _worker_init ignores it. This process gets any that arrived once they
        # are unblocked.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            batches_in_flight = iter(loader)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        try:
            for indices, images, captions in batches_in_flight:
                yield indices, self._inputs(images, captions)
        finally:  # at once, however this ends: the traceback of a worker's error holds the iterator, whose
            # workers (stop signals ignored) then outlived it, and the exit waited on them for ever
            batches_in_flight._shutdown_workers()
