"""Can a captioner read its captions? Zero-shot of a briefly trained non-private captioner on digits.

    python -m benchmarks.caption_zeroshot DIR:MAX_LEN [DIR:MAX_LEN ...] [--steps 100]

For each tokenizer directory (a `tokenizer` stage output) and caption length: a micro captioner at
16 px trained without DP (AdamW, batch 64) on the digits training split with the digits captions,
then zero-shot on the held-out split with the default digits prompts (pipeline/eval/zeroshot.py).
Cut prompts show as the tokenizer's CaptionsTruncated warning. Prints one line per tokenizer.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pipeline.data.labelled_sets import DIGITS, rgb
from pipeline.data.tokenizer import Tokenizer
from pipeline.data.transforms import to_tensor
from pipeline.eval import stats
from pipeline.eval.zeroshot import zero_shot_accuracy
from pipeline.models import build_model
from pipeline.stages.shards import split_indices

IMAGE_SIZE, BATCH = 16, 64


def train_captioner(tok: Tokenizer, max_len: int, images, labels, steps: int, seed: int = 0):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed + 1)
    tokens = tok.encode([DIGITS.caption_for(int(y), rng) for y in labels], max_len)
    x = to_tensor(images)
    model = build_model("caption", {"size": "micro", "img_size": IMAGE_SIZE, "patch_size": 4, "max_len": max_len,
                                    "vocab_size": tok.vocab_size, "text_width": 64, "text_depth": 2, "text_heads": 4})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    for _ in range(steps):
        b = torch.from_numpy(rng.integers(0, len(x), BATCH))
        loss = model(x[b], tokens[b]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="TOKENIZER_DIR:MAX_LEN")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    grey, labels = DIGITS.load()
    images = rgb(grey, IMAGE_SIZE)
    tr, te = split_indices(labels, 0.3, 0)
    prompts = [[t.format(c=c) for t in DIGITS.templates] for c in DIGITS.classes]
    chance = stats.chance(labels[te])
    for run in args.runs:
        directory, max_len = run.rsplit(":", 1)
        tok, max_len, t0 = Tokenizer(directory), int(max_len), time.time()
        model, loss = train_captioner(tok, max_len, images[tr], labels[tr], args.steps)
        acc = zero_shot_accuracy(model, "caption", images[te], labels[te], prompts, lambda c: tok.encode(c, max_len))
        print(f"{directory} max_len={max_len}: {args.steps} steps, loss {loss:.3f}, zero-shot {acc:.3f} on "
              f"{len(te)} held-out digits (chance {chance:.3f}), {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
