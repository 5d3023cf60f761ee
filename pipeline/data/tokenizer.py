"""The `tokenizer` stage: SentencePiece trained on public text only.

Training it on the private captions would put their vocabulary outside the DP guarantee, so the
corpus is the docstrings of Python's standard library (ships with every interpreter) plus the
project's own caption templates.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from pathlib import Path

import sentencepiece as spm
import torch

from pipeline.io import atomic_dir, write_json

OUT_DIR = "models/tokenizer"
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
MAX_CORPUS_CHARS = 3_000_000


def public_corpus() -> list[str]:
    """Sentences from stdlib docstrings (sorted files: the corpus is the same on every run)."""
    from pipeline.data.shards_stage import CAPTION_TEMPLATES, NUMBER_WORDS

    lines = [t.format(w=w) for t in CAPTION_TEMPLATES for w in NUMBER_WORDS]
    total = sum(map(len, lines))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                for line in (doc or "").splitlines():
                    line = line.strip()
                    if len(line) > 20 and not line.startswith((">>>", "...")):
                        lines.append(line)
                        total += len(line)
        if total > MAX_CORPUS_CHARS:
            break
    return lines


def run(params: dict, ctx) -> None:
    cfg = params["tokenizer"]
    corpus = public_corpus()
    text = "\n".join(corpus)
    with atomic_dir(OUT_DIR) as out:
        (out / "corpus.txt").write_text(text)
        spm.SentencePieceTrainer.train(
            input=str(out / "corpus.txt"), model_prefix=str(out / "spm"), vocab_size=cfg["vocab_size"],
            model_type=cfg["model_type"], pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            character_coverage=1.0, num_threads=ctx.threads, seed_sentencepiece_size=200000,
            hard_vocab_limit=False, minloglevel=2)
        (out / "corpus.txt").unlink()
        info = {"corpus": "python-stdlib-docstrings+caption-templates", "lines": len(corpus),
                "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest(),
                "vocab_size": spm.SentencePieceProcessor(model_file=str(out / "spm.model")).get_piece_size()}
        write_json(out / "tokenizer.json", info)
    ctx.tracker.log_metrics({"vocab_size": info["vocab_size"], "corpus_chars": info["chars"]})
    print(f"tokenizer: vocabulary of {info['vocab_size']} pieces from {info['lines']} public lines")


class Tokenizer:
    """Captions -> fixed-length token ids: BOS, pieces, EOS, then PAD."""

    def __init__(self, directory: str | Path = OUT_DIR):
        self.sp = spm.SentencePieceProcessor(model_file=str(Path(directory) / "spm.model"))
        self.vocab_size = self.sp.get_piece_size()

    def encode(self, captions: list[str], max_len: int) -> torch.Tensor:
        out = torch.full((len(captions), max_len), PAD_ID, dtype=torch.long)
        for i, ids in enumerate(self.sp.encode(captions)):
            ids = [BOS_ID] + ids[: max_len - 2] + [EOS_ID]
            out[i, : len(ids)] = torch.tensor(ids)
        return out
