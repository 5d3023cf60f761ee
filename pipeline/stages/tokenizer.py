"""The `tokenizer` stage: SentencePiece trained on public text only (never the private captions)."""

from __future__ import annotations

import hashlib

from pipeline.data.tokenizer import Tokenizer, corpus_composition, public_corpus, train_model
from pipeline.io import atomic_dir, atomic_path, write_json


def run(params: dict, ctx) -> None:
    cfg = params["tokenizer"]
    corpus = public_corpus()
    # said before the work, so that a stall shows where it is (SentencePiece prints nothing meanwhile)
    print(f"tokenizer: training {cfg['vocab_size']} {cfg['model_type']} pieces on {len(corpus)} public lines", flush=True)
    model = train_model(corpus, cfg["vocab_size"], cfg["model_type"])
    digest = hashlib.sha256("\n".join(corpus).encode()).hexdigest()
    with atomic_dir(ctx.stage.output("tokenizer")) as out:
        with atomic_path(out / "spm.model") as tmp:
            tmp.write_bytes(model)
        info = {"corpus": "labelled-captions+caption-templates+python-pydoc-topics+stdlib-docstrings",
                "lines": len(corpus), "chars": sum(map(len, corpus)), "sha256": digest,
                "composition": corpus_composition(), "model_type": cfg["model_type"],
                "vocab_size": Tokenizer(out).vocab_size}
        write_json(out / "tokenizer.json", info)
    ctx.tracker.log_metrics({"vocab_size": info["vocab_size"], "corpus_chars": info["chars"]})
    print(f"tokenizer: vocabulary of {info['vocab_size']} pieces from {info['lines']} public lines")
