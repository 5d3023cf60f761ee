"""The `tokenizer` stage: SentencePiece trained on public text only.

Training it on the private captions would put their vocabulary outside the DP guarantee, so the
corpus is text that ships with every Python interpreter — the language reference topics of
`pydoc_data` and the docstrings of the standard library — plus the project's own caption templates.
Nothing under the working directory is read, so the vocabulary cannot depend on the private data.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import sysconfig
from pathlib import Path

import sentencepiece as spm
import torch


OUT_DIR = "models/tokenizer"
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
MAX_CORPUS_CHARS = 3_000_000
# SentencePiece's result depends on its thread count: a fixed count makes it the same on every machine.
TRAIN_THREADS = 1


def _useful(line: str) -> bool:
    return len(line) > 20 and not line.startswith((">>>", "..."))


@functools.lru_cache(maxsize=1)
def public_corpus() -> tuple[str, ...]:
    """Caption templates, Python's language reference topics, then stdlib docstrings (files in sorted
    order) up to MAX_CORPUS_CHARS: the same lines on every run of one Python version."""
    from pydoc_data.topics import topics

    from pipeline.stages.shards import CAPTION_TEMPLATES, NUMBER_WORDS

    lines = [t.format(w=w) for t in CAPTION_TEMPLATES for w in NUMBER_WORDS]
    lines += [line.strip() for name in sorted(topics) for line in topics[name].splitlines() if _useful(line.strip())]
    total = sum(map(len, lines))
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if total > MAX_CORPUS_CHARS:
            break
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                for line in (ast.get_docstring(node) or "").splitlines():
                    if _useful(line.strip()):
                        lines.append(line.strip())
                        total += len(line.strip())
    return tuple(lines)


def train_model(corpus, vocab_size: int, model_type: str) -> bytes:
    """The serialized SentencePiece model, with exactly `vocab_size` pieces."""
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus), model_writer=model, vocab_size=vocab_size, model_type=model_type,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, character_coverage=1.0,
            num_threads=TRAIN_THREADS, seed_sentencepiece_size=200000, minloglevel=2)
    except RuntimeError as e:
        most, least = re.search(r"<= (\d+)", str(e)), re.search(r"required_chars\. \d+ vs (\d+)", str(e))
        if most:
            raise ValueError(f"tokenizer.vocab_size={vocab_size} is more than the public corpus supports "
                             f"({len(corpus)} lines): at most {most.group(1)}") from None
        if least:
            raise ValueError(f"tokenizer.vocab_size={vocab_size} is less than the corpus's characters and "
                             f"special pieces need: at least {least.group(1)}") from None
        raise
    return model.getvalue()


class Tokenizer:
    """Captions -> fixed-length token ids: BOS, pieces, EOS, then PAD."""

    def __init__(self, directory: str | Path = OUT_DIR):
        self.sp = spm.SentencePieceProcessor(model_file=str(Path(directory) / "spm.model"))
        self.vocab_size = self.sp.get_piece_size()

    def encode(self, captions: list[str], max_len: int) -> torch.Tensor:
        """(N, max_len) ids; a caption longer than max_len - 2 pieces is cut, its EOS kept."""
        if max_len < 2:
            raise ValueError(f"max_len={max_len}: BOS and EOS alone need 2 positions")
        out = torch.full((len(captions), max_len), PAD_ID, dtype=torch.long)
        for i, ids in enumerate(self.sp.encode(list(captions))):
            ids = [BOS_ID] + ids[: max_len - 2] + [EOS_ID]
            out[i, : len(ids)] = torch.tensor(ids)
        return out

    def decode(self, ids: torch.Tensor) -> list[str]:
        """Token rows back to text (special ids dropped)."""
        return [self.sp.decode([i for i in row.tolist() if i > EOS_ID]) for row in ids]
