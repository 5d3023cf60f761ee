"""Tokenizing sampled captions (pipeline/data/tokenizer.py, Tokenizer.encode), as dp-train does for
every micro-batch of the captioner and CLIP in its own process.

    python -m benchmarks.caption_tokens [--captions 100000] [--max-len 14] [--vocab-size 512]

Trains the tokenizer stage's model on its public corpus, then encodes --captions digits captions
with Tokenizer.encode and with the baseline it replaced (one tensor per caption, the encode of
before 2026-12-05), checks that both give the same ids, and prints µs per caption and the ratio
side by side, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.data.labelled_sets import DIGITS
from pipeline.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, public_corpus, train_model


def per_caption(tok: Tokenizer, captions: list[str], max_len: int) -> torch.Tensor:
    """The baseline: the ids of each caption written into the batch with a tensor of its own."""
    out = torch.full((len(captions), max_len), PAD_ID, dtype=torch.long)
    for i, ids in enumerate(tok.sp.encode(captions)):
        ids = [BOS_ID] + ids[: max_len - 2] + [EOS_ID]
        out[i, : len(ids)] = torch.tensor(ids)
    return out


def best_of(fn, repeats: int = 3) -> tuple[float, torch.Tensor]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--captions", type=int, default=100_000)
    ap.add_argument("--max-len", type=int, default=14)
    ap.add_argument("--vocab-size", type=int, default=512)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    captions = [DIGITS.caption_for(int(y), rng) for y in rng.integers(0, 10, args.captions)]
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "spm.model").write_bytes(train_model(public_corpus(), args.vocab_size, "unigram"))
        tok = Tokenizer(directory)
        base_s, base = best_of(lambda: per_caption(tok, captions, args.max_len))
        new_s, new = best_of(lambda: tok.encode(captions, args.max_len))
    if not torch.equal(base, new):
        raise SystemExit("tokenize: Tokenizer.encode and the per-caption baseline gave different ids")
    us = {name: s / len(captions) * 1e6 for name, s in (("per_caption", base_s), ("encode", new_s))}
    print(f"{'':<24}{'µs per caption':>16}")
    print(f"{'per caption (baseline)':<24}{us['per_caption']:>16.1f}")
    print(f"{'Tokenizer.encode':<24}{us['encode']:>16.1f}   {base_s / new_s:.2f}× faster, same ids")
    print(json.dumps({"captions": len(captions), "max_len": args.max_len,
                      "us_per_caption_baseline": round(us["per_caption"], 2), "us_per_caption": round(us["encode"], 2),
                      "speedup": round(base_s / new_s, 2)}))


if __name__ == "__main__":
    main()
