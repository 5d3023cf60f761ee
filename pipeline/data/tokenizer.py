"""The `tokenizer` stage: SentencePiece trained on public text only.

Training it on the private captions would put their vocabulary outside the DP guarantee, so the
corpus is public text that ships with the code: every caption of the labelled sets
(pipeline/data/labelled_sets.py: digits, fashion-mnist), the caption templates and class names of `caption_corpus.txt` (written for this project, in the style of CLIP's
zero-shot prompts), and text that ships with every Python interpreter — the language reference
topics of `pydoc_data` and the docstrings of the standard library. Nothing under the working
directory is read, so the vocabulary cannot depend on the private data.
"""

from __future__ import annotations

import ast
import functools
import io
import itertools
import re
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch

from pipeline.config import ParamsError
from pipeline.data import labelled_sets
from pipeline.errors import InputError


PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
MAX_CORPUS_CHARS = 3_000_000
MAX_NAMED = 5  # truncated texts named in one warning
# SentencePiece's result depends on its thread count: a fixed count makes it the same on every machine.
TRAIN_THREADS = 1
CAPTION_FILE = Path(__file__).with_name("caption_corpus.txt")
# SentencePiece 0.2.2 does not finish this corpus's unigram training (3 minutes here, 7.5 on a 16-core
# GPU machine, where 0.2.0, 0.2.1 and 0.2.3 take 5 s; its bpe takes 2 s): refused with a clear error,
# not a silent hang.
STALLING_UNIGRAM_VERSIONS = ("0.2.2",)
# Caption text is repeated so that it weighs about as much as the Python docs: with a few hundred
# pieces, caption words then become whole pieces instead of letters. The labelled sets' captions,
# the private captions and zero-shot prompts of the default source and eval set, weigh most.
REPEATS = {"labelled-captions": 50, "caption-templates": 8, "python-docs": 1}


def _useful(line: str) -> bool:
    return len(line) > 20 and not line.startswith((">>>", "..."))


def caption_file() -> tuple[list[str], list[str]]:
    """The shipped caption corpus: (templates with a {} slot, class names)."""
    lines = [line.strip() for line in CAPTION_FILE.read_text(encoding="utf-8").splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    return [line for line in lines if "{}" in line], [line for line in lines if "{}" not in line]


def python_docs() -> tuple[str, ...]:
    """Python's language reference topics, then stdlib docstrings (files in sorted order) up to
    MAX_CORPUS_CHARS: the same lines on every run of one Python version."""
    from pydoc_data.topics import topics

    lines = [line.strip() for name in sorted(topics) for line in topics[name].splitlines() if _useful(line.strip())]
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


def public_captions() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The public corpus's captions, once each: (the labelled sets' captions, each template of
    `caption_file` filled with each class name that is not among them)."""
    templates, names = caption_file()
    labelled = tuple(dict.fromkeys(c for s in labelled_sets.SETS.values() for c in s.captions()))
    filled = dict.fromkeys(t.format(n) for t in templates for n in names)
    return labelled, tuple(c for c in filled if c not in set(labelled))


@functools.lru_cache(maxsize=1)
def corpus_parts() -> dict[str, tuple[str, ...]]:
    """The public corpus by part, each part's lines repeated REPEATS[part] times."""
    templates, names = caption_file()
    parts = {"labelled-captions": tuple(c for s in labelled_sets.SETS.values() for c in s.captions()),
             "caption-templates": tuple(t.format(n) for t in templates for n in names),
             "python-docs": python_docs()}
    return {name: lines * REPEATS[name] for name, lines in parts.items()}


def public_corpus() -> tuple[str, ...]:
    """Every line the tokenizer trains on: caption text, then Python's docs."""
    return tuple(line for lines in corpus_parts().values() for line in lines)


def corpus_composition() -> dict:
    """What tokenizer.json records of each part: lines and characters trained on (repeats included)."""
    templates, names = caption_file()
    out = {name: {"lines": len(lines), "chars": sum(map(len, lines)), "repeats": REPEATS[name]}
           for name, lines in corpus_parts().items()}
    out["caption-templates"].update(file=CAPTION_FILE.name, templates=len(templates), class_names=len(names))
    return out


def train_model(corpus, vocab_size: int, model_type: str) -> bytes:
    """The serialized SentencePiece model, with exactly `vocab_size` pieces."""
    if model_type == "unigram" and spm.__version__ in STALLING_UNIGRAM_VERSIONS:
        raise RuntimeError(f"sentencepiece {spm.__version__} does not finish training the unigram tokenizer "
                           "(7.5 minutes and counting, where other versions take seconds): install another, "
                           "e.g. pip install 'sentencepiece!=0.2.2'")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus), model_writer=model, vocab_size=vocab_size, model_type=model_type,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, character_coverage=1.0,
            num_threads=TRAIN_THREADS, seed_sentencepiece_size=200000, minloglevel=2)
    except RuntimeError as e:
        most, least = re.search(r"<= (\d+)", str(e)), re.search(r"required_chars\. \d+ vs (\d+)", str(e))
        if most:
            raise ParamsError([f"tokenizer.vocab_size={vocab_size} is more than the public corpus supports "
                               f"({len(corpus)} lines): at most {most.group(1)}"]) from None
        if least:
            raise ParamsError([f"tokenizer.vocab_size={vocab_size} is less than the corpus's characters and "
                               f"special pieces need: at least {least.group(1)}"]) from None
        raise
    return model.getvalue()


class CaptionsTruncated(UserWarning):
    """Public text (zero-shot prompts, caption templates) longer than the model's caption length."""


def warn_truncated(texts: list[str], pieces: list[list[int]], max_len: int) -> None:
    """A CaptionsTruncated warning naming the texts whose pieces do not fit between BOS and EOS."""
    cut = [(text, len(p)) for text, p in zip(texts, pieces) if len(p) > max_len - 2]
    if not cut:
        return
    named = "; ".join(f"{text!r} ({n} pieces)" for text, n in cut[:MAX_NAMED])
    more = f"; and {len(cut) - MAX_NAMED} more" if len(cut) > MAX_NAMED else ""
    warnings.warn(f"{len(cut)} of {len(texts)} texts have more pieces than max_len={max_len} holds "
                  f"({max_len - 2} + BOS/EOS) and lose their end: {named}{more}. "
                  "Raise model.max_caption_len", CaptionsTruncated, stacklevel=3)


class Tokenizer:
    """Captions -> fixed-length token ids: BOS, pieces, EOS, then PAD."""

    def __init__(self, directory: str | Path):
        model = Path(directory) / "spm.model"
        if not model.is_file():
            raise InputError(f"{model} is missing: the caption and clip objectives need the tokenizer "
                             "(dpfm tokenizer, or snakemake, makes it)")
        self.sp = spm.SentencePieceProcessor(model_file=str(model))
        self.vocab_size = self.sp.get_piece_size()

    def encode(self, captions: list[str], max_len: int, *, public: bool = False) -> torch.Tensor:
        """(N, max_len) ids; a caption longer than max_len - 2 pieces is cut, its EOS kept.

        Cut text is named in a CaptionsTruncated warning only when the caller says it is public
        (`public=True`: zero-shot prompts, caption templates). By default captions are cut
        silently, as private ones must be: which of them, or even how many, are cut is a statistic
        of the private data that no noise covers."""
        if max_len < 2:
            raise ValueError(f"max_len={max_len}: BOS and EOS alone need 2 positions")
        pieces = self.sp.encode(list(captions))
        if public:
            warn_truncated(list(captions), pieces, max_len)
        # One fill of the whole batch, row by row in the mask's order: a tensor per caption cost more
        # than SentencePiece itself (dp-train tokenizes every sampled caption in its own process).
        rows = [[BOS_ID, *ids[: max_len - 2], EOS_ID] for ids in pieces]
        lengths = np.fromiter(map(len, rows), np.int64, len(rows))
        out = np.full((len(rows), max_len), PAD_ID, np.int64)
        out[np.arange(max_len) < lengths[:, None]] = np.fromiter(itertools.chain.from_iterable(rows), np.int64,
                                                                 int(lengths.sum()))
        return torch.from_numpy(out)

    def decode(self, ids: torch.Tensor) -> list[str]:
        """Token rows back to text (special ids dropped)."""
        return [self.sp.decode([i for i in row.tolist() if i > EOS_ID]) for row in ids]
