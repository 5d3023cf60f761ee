"""The `tokenizer` stage: trained on public text only (private captions in the working directory do
not change a byte of it), deterministic, the vocabulary size it is asked for, BOS/EOS/PAD encoding;
the default one holds every caption of the labelled sets (digits, fashion-mnist: also their zero-shot
prompts) and default zero-shot prompt whole, and cut public text is named in a warning while cut
private captions are not."""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from pipeline.data import labelled_sets
from pipeline.data import tokenizer as tok
from pipeline.data.labelled_sets import DIGITS
from pipeline.data.transforms import tokenize
from pipeline.eval.evalsets import load_eval_set
from pipeline.privacy.training import check_labelled_captions
from pipeline.artifacts import artifact
from pipeline.stages import stage, tokenizer as tokenizer_stage
from pipeline.data.shards import ShardDataset, ShardWriter, encode_png
from recording import RecordingTracker

POISON = "wombatronic"  # a word no public corpus holds
PARAMS = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
FULL_CORPUS_CHARS = tok.MAX_CORPUS_CHARS


@pytest.fixture(autouse=True, scope="module")
def smaller_corpus():
    """The language reference topics and a few stdlib files (the full corpus takes seconds to parse)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tok, "MAX_CORPUS_CHARS", 600_000)
        tok.corpus_parts.cache_clear()
        yield
    tok.corpus_parts.cache_clear()


def run_stage(project: Path, monkeypatch, vocab_size=256, model_type="unigram") -> bytes:
    project.mkdir(parents=True, exist_ok=True)
    ctx = SimpleNamespace(stage=stage("tokenizer"), tracker=RecordingTracker(), threads=2, device="cpu")
    with monkeypatch.context() as m:
        m.chdir(project)
        tokenizer_stage.run({"run": {"seed": 0}, "tokenizer": {"vocab_size": vocab_size, "model_type": model_type}}, ctx)
    assert ctx.tracker.metrics["vocab_size"] == vocab_size
    return (project / artifact("tokenizer") / "spm.model").read_bytes()


@pytest.fixture(scope="module")
def clean_model(tmp_path_factory, smaller_corpus):
    with pytest.MonkeyPatch.context() as m:
        return run_stage(tmp_path_factory.mktemp("clean"), m)


def write_private_captions(project: Path) -> None:
    """Private shards whose captions repeat one made-up word, where the shards stage puts them."""
    image = np.zeros((8, 8, 3), np.uint8)
    for split in ("private", "eval"):
        with ShardWriter(project / "data/shards" / split, prefix=split, samples_per_shard=500) as writer:
            for i in range(1000):
                writer.write(f"{split}{i:05d}", encode_png(image), f"a {POISON} {POISON}ish {POISON}s photo", {})


def check_public_only(project: Path, clean: bytes, monkeypatch) -> None:
    """Train with private captions on disk; the model must be the one trained without them."""
    write_private_captions(project)
    tok.corpus_parts.cache_clear()  # build the corpus again, here, beside the private data
    poisoned = run_stage(project, monkeypatch)
    pieces = [p.lstrip("▁") for p in tok.Tokenizer(project / artifact("tokenizer")).sp.id_to_piece(list(range(256)))]
    assert not [p for p in pieces if len(p) >= 6 and p in POISON], "a piece of the private word is in the vocab"
    assert poisoned == clean, "the vocabulary changed when private captions were present"


def test_private_captions_do_not_change_the_vocabulary(clean_model, tmp_path, monkeypatch):
    check_public_only(tmp_path, clean_model, monkeypatch)


def test_the_check_catches_a_corpus_that_reads_the_private_captions(clean_model, tmp_path, monkeypatch):
    public = tok.public_corpus

    def leaky_corpus():  # a broken stage: it adds the captions it finds under data/shards
        ds = ShardDataset("data/shards/private")
        return public() + tuple(ds.caption(i) for i in range(len(ds)))

    monkeypatch.setattr(tokenizer_stage, "public_corpus", leaky_corpus)
    with pytest.raises(AssertionError, match="private word|vocabulary changed"):
        check_public_only(tmp_path, clean_model, monkeypatch)


def test_training_is_deterministic(clean_model, tmp_path, monkeypatch):
    assert run_stage(tmp_path, monkeypatch) == clean_model
    info = json.loads((tmp_path / artifact("tokenizer") / "tokenizer.json").read_text())
    assert info["vocab_size"] == 256 and info["chars"] > 600_000
    corpus = tok.public_corpus()  # what tokenizer.json says it was trained on, checkable by anyone
    assert (info["lines"], info["chars"]) == (len(corpus), sum(map(len, corpus)))
    assert info["sha256"] == hashlib.sha256("\n".join(corpus).encode()).hexdigest()
    assert sorted(p.name for p in (tmp_path / artifact("tokenizer")).iterdir()) == ["spm.model", "tokenizer.json"]


def test_the_vocabulary_size_param_is_honoured(tmp_path, monkeypatch):
    for size in (300, 1000):
        run_stage(tmp_path, monkeypatch, vocab_size=size, model_type="bpe")
        assert tok.Tokenizer(tmp_path / artifact("tokenizer")).vocab_size == size


def test_a_vocabulary_size_the_corpus_cannot_give_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"tokenizer.vocab_size=200000 is more than .* at most \d+"):
        run_stage(tmp_path, monkeypatch, vocab_size=200000, model_type="bpe")
    with pytest.raises(ValueError, match=r"tokenizer.vocab_size=64 is less than .* at least \d+"):
        run_stage(tmp_path, monkeypatch, vocab_size=64, model_type="bpe")


def test_a_sentencepiece_that_stalls_is_refused_before_training(tmp_path, monkeypatch):
    # 0.2.2's unigram trainer never finished this corpus (7.5 minutes on a GPU machine): a clear error
    monkeypatch.setattr(tok.spm, "__version__", "0.2.2")
    with pytest.raises(RuntimeError, match=r"sentencepiece 0\.2\.2 does not finish .*sentencepiece!=0\.2\.2"):
        run_stage(tmp_path, monkeypatch, vocab_size=300, model_type="unigram")
    assert not (tmp_path / artifact("tokenizer")).exists()
    run_stage(tmp_path, monkeypatch, vocab_size=300, model_type="bpe")  # its bpe finishes: not refused
    assert tok.Tokenizer(tmp_path / artifact("tokenizer")).vocab_size == 300


def test_encode_adds_bos_eos_pads_and_truncates(clean_model, tmp_path):
    (tmp_path / "spm.model").write_bytes(clean_model)
    t = tok.Tokenizer(tmp_path)
    caption = "The Number Seven, written by hand"  # encoded as written: case and punctuation kept
    pieces = t.sp.encode(caption)
    ids = t.encode([caption, ""], max_len=len(pieces) + 4)
    assert ids.dtype == torch.long and ids.shape == (2, len(pieces) + 4)
    assert ids[0].tolist() == [tok.BOS_ID, *pieces, tok.EOS_ID, tok.PAD_ID, tok.PAD_ID]
    assert ids[1].tolist() == [tok.BOS_ID, tok.EOS_ID] + [tok.PAD_ID] * (len(pieces) + 2)
    with pytest.warns(tok.CaptionsTruncated, match=caption):
        short = t.encode([caption], max_len=4, public=True)
    assert short[0].tolist() == [tok.BOS_ID, *pieces[:2], tok.EOS_ID]  # cut, but still ends with EOS
    assert t.decode(ids[:1]) == [caption]
    assert int(ids.max()) < t.vocab_size
    with pytest.raises(ValueError, match="max_len=1"):
        t.encode([caption], max_len=1)


# -- the default tokenizer and caption length --------------------------------------------------

@pytest.fixture(scope="module")
def default_project(tmp_path_factory, smaller_corpus):
    """The tokenizer stage as params.yaml configures it, on the whole public corpus."""
    project = tmp_path_factory.mktemp("default")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tok, "MAX_CORPUS_CHARS", FULL_CORPUS_CHARS)
        tok.corpus_parts.cache_clear()
        run_stage(project, m, **PARAMS["tokenizer"])
    tok.corpus_parts.cache_clear()
    return project


def default_prompts() -> list[str]:
    """The zero-shot prompts of every eval set in params.yaml (images at a token size: unused)."""
    sets = [load_eval_set(spec, 8) for spec in PARAMS["evaluate"]["sets"]]
    return [p for es in sets for ps in es.prompts() for p in ps]


def test_the_default_caption_length_holds_every_labelled_caption_and_default_prompt(default_project):
    """A labelled set's captions are also its zero-shot prompts (as a source, or as an eval set)."""
    t, max_len = tok.Tokenizer(default_project / artifact("tokenizer")), PARAMS["model"]["max_caption_len"]
    texts = [c for s in labelled_sets.SETS.values() for c in s.captions()] + default_prompts()
    longest = max(len(p) for p in t.sp.encode(texts))
    assert longest <= max_len - 2, f"{longest} pieces + BOS/EOS do not fit model.max_caption_len={max_len}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", tok.CaptionsTruncated)
        t.encode(texts, max_len, public=True)
        for name in labelled_sets.SETS:
            check_labelled_captions(t, max_len, name)
    assert all(len(t.sp.encode(w)) <= 2 for w in DIGITS.classes), "a digit word is split into letters"
    assert all(len(t.sp.encode(w)) <= 3 for w in labelled_sets.FASHION_CLASSES), "a clothes word is split up"


def test_tokenizer_json_records_the_corpus_composition(default_project):
    info = json.loads((default_project / artifact("tokenizer") / "tokenizer.json").read_text())
    parts = info["composition"]
    assert set(parts) == {"labelled-captions", "caption-templates", "python-docs"}
    assert sum(p["lines"] for p in parts.values()) == info["lines"]
    assert sum(p["chars"] for p in parts.values()) == info["chars"]
    templates, names = tok.caption_file()
    captions = parts["caption-templates"]
    assert captions["file"] == "caption_corpus.txt"
    assert (captions["templates"], captions["class_names"]) == (len(templates), len(names))
    assert captions["lines"] == len(templates) * len(names) * captions["repeats"]
    labelled = parts["labelled-captions"]
    assert labelled["lines"] == sum(len(s.captions()) for s in labelled_sets.SETS.values()) * labelled["repeats"]
    # Caption text weighs about as much as the Python docs, so that its words become whole pieces.
    assert 0.5 < (captions["chars"] + labelled["chars"]) / parts["python-docs"]["chars"] < 2


def test_truncated_public_text_is_named_in_a_warning(clean_model, tmp_path):
    (tmp_path / "spm.model").write_bytes(clean_model)
    t = tok.Tokenizer(tmp_path)
    long = "the digit seven in white ink on a black background"
    named = rf"'{long}' \({len(t.sp.encode(long))} pieces\)"
    with pytest.warns(tok.CaptionsTruncated, match=rf"1 of 2 texts .* max_len=6 .*{named}"):
        t.encode(["one", long], max_len=6, public=True)
    cut = sum(len(p) > 4 for p in t.sp.encode(DIGITS.captions()))
    more = f"; and {cut - tok.MAX_NAMED} more"  # the first MAX_NAMED are named
    with pytest.warns(tok.CaptionsTruncated, match=rf"{cut} of 50 texts .* max_len=6 .*{more}\."):
        check_labelled_captions(t, 6, "digits")


def test_truncated_private_captions_are_cut_silently(clean_model, tmp_path, capsys):
    """dp-train's loader tokenises private captions: which, or how many, are cut is private."""
    (tmp_path / "spm.model").write_bytes(clean_model)
    t = tok.Tokenizer(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids = tokenize(t, [f"a {POISON} photo of a private caption"], max_len=4)
    assert ids[0, -1] == tok.EOS_ID and capsys.readouterr() == ("", "")


def test_clip_public_negatives_are_every_labelled_caption_then_a_fixed_draw(clean_model, tmp_path):
    """clip-public's negatives: public captions only, every labelled set's first (the classes an image
    must be told apart from), the same on every call (every rank, every run), and a clear error when
    more are asked for than the corpus holds."""
    from pipeline.config import ParamsError
    from pipeline.models import ModelConfig
    from pipeline.privacy.training import public_negative_tokens

    (tmp_path / "spm.model").write_bytes(clean_model)
    t = tok.Tokenizer(tmp_path)
    labelled, others = tok.public_captions()
    assert set(labelled) == {c for s in labelled_sets.SETS.values() for c in s.captions()}
    assert not set(labelled) & set(others)
    cfg = ModelConfig.of({"size": "micro", "max_len": 14, "public_negatives": 256})
    ids = public_negative_tokens(t, cfg)
    assert ids.shape == (256, 14) and torch.equal(ids, public_negative_tokens(t, cfg))
    assert torch.equal(ids[:len(labelled)], t.encode(list(labelled), 14))
    encoded = {tuple(row) for row in t.encode(list(others), 14).tolist()}
    assert all(tuple(row) in encoded for row in ids[len(labelled):].tolist())
    with pytest.raises(ParamsError, match="model.public_negatives=100000, but the public caption corpus holds"):
        public_negative_tokens(t, ModelConfig.of({"size": "micro", "public_negatives": 100_000}))


def test_a_missing_tokenizer_is_one_line_naming_it_and_what_makes_it(tmp_path):
    """dp-train of a caption or clip objective before the tokenizer stage ended in sentencepiece's
    traceback (RuntimeError: NOT_FOUND)."""
    from pipeline.data.tokenizer import Tokenizer
    from pipeline.errors import InputError

    with pytest.raises(InputError, match=r"spm.model is missing: .*dpfm tokenizer"):
        Tokenizer(tmp_path / "models/tokenizer")


def test_a_labelled_sets_caption_that_max_len_cuts_is_named(default_project):
    """A labelled set's captions are public templates: a max_len that cuts one is named (CaptionsTruncated),
    where a private caption would be cut silently."""
    t = tok.Tokenizer(default_project / artifact("tokenizer"))
    with pytest.warns(tok.CaptionsTruncated):
        check_labelled_captions(t, 3, "digits")


def test_sentencepiece_is_trained_on_a_fixed_thread_count(monkeypatch):
    """SentencePiece's result depends on its thread count: one thread, whatever the machine's cores."""
    seen = {}

    def train(**kwargs):
        seen.update(kwargs)
        kwargs["model_writer"].write(b"model")

    monkeypatch.setattr(tok.spm.SentencePieceTrainer, "train", train)
    assert tok.train_model(["a public line"] * 3, 300, "bpe") == b"model"
    assert seen["num_threads"] == 1
    assert (seen["pad_id"], seen["unk_id"], seen["bos_id"], seen["eos_id"]) == (0, 1, 2, 3)


def test_a_vocabulary_size_error_names_the_corpus_limit_not_the_asked_size(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"at most \d+") as big:
        run_stage(tmp_path, monkeypatch, vocab_size=200000, model_type="bpe")
    most = int(re.search(r"at most (\d+)", str(big.value)).group(1))
    with pytest.raises(ValueError, match=r"at least \d+") as small:
        run_stage(tmp_path, monkeypatch, vocab_size=64, model_type="bpe")
    least = int(re.search(r"at least (\d+)", str(small.value)).group(1))
    assert 64 < least < most < 200000
    run_stage(tmp_path, monkeypatch, vocab_size=least, model_type="bpe")  # the bound it names is trainable


def test_public_text_that_just_fits_is_not_named(clean_model, tmp_path):
    (tmp_path / "spm.model").write_bytes(clean_model)
    t = tok.Tokenizer(tmp_path)
    text = "the digit seven in white ink on a black background"
    pieces = t.sp.encode(text)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tok.CaptionsTruncated)
        ids = t.encode([text], max_len=len(pieces) + 2, public=True)  # BOS, every piece, EOS
    assert ids[0].tolist() == [tok.BOS_ID, *pieces, tok.EOS_ID]
    with pytest.warns(tok.CaptionsTruncated, match=rf"1 of 1 texts .* max_len={len(pieces) + 1} "):
        t.encode([text], max_len=len(pieces) + 1, public=True)


def test_a_truncation_warning_names_at_most_max_named_texts(clean_model, tmp_path):
    (tmp_path / "spm.model").write_bytes(clean_model)
    t = tok.Tokenizer(tmp_path)
    texts = [f"the digit seven in white ink on a black background, number {i}" for i in range(tok.MAX_NAMED + 1)]
    with pytest.warns(tok.CaptionsTruncated) as exactly:
        t.encode(texts[:tok.MAX_NAMED], max_len=6, public=True)
    message = str(exactly[0].message)
    assert all(repr(text) in message for text in texts[:tok.MAX_NAMED]) and "more." not in message
    with pytest.warns(tok.CaptionsTruncated) as one_more:
        t.encode(texts, max_len=6, public=True)
    message = str(one_more[0].message)
    assert all(repr(text) in message for text in texts[:tok.MAX_NAMED]) and repr(texts[-1]) not in message
    assert message.count(" pieces)") == tok.MAX_NAMED and "; and 1 more." in message


def test_decode_drops_the_unknown_piece_with_the_other_special_ids(clean_model, tmp_path):
    (tmp_path / "spm.model").write_bytes(clean_model)
    t = tok.Tokenizer(tmp_path)
    pieces = t.sp.encode("seven")
    row = torch.tensor([[tok.BOS_ID, *pieces, tok.UNK_ID, tok.EOS_ID, tok.PAD_ID]])
    assert t.decode(row) == ["seven"]


def test_python_docs_do_not_depend_on_the_directory_listing_order(monkeypatch):
    """The stdlib files are read in sorted order: a filesystem that lists them otherwise gives the same corpus."""
    first = tok.python_docs()
    listed = Path.glob
    monkeypatch.setattr(Path, "glob", lambda self, pattern: reversed(list(listed(self, pattern))))
    assert tok.python_docs() == first


def test_public_captions_are_each_caption_once(monkeypatch):
    """A labelled set listed twice, and a class name that fills a template into a labelled caption: once each."""
    captions = DIGITS.captions()
    monkeypatch.setattr(tok.labelled_sets, "SETS", {"digits": DIGITS, "digits-again": DIGITS})
    monkeypatch.setattr(tok, "caption_file", lambda: (["{}", "a photo of {}"], [captions[0], "a cat", "a cat"]))
    labelled, others = tok.public_captions()
    assert labelled == tuple(captions)
    assert others == ("a cat", f"a photo of {captions[0]}", "a photo of a cat")


def test_a_failure_while_writing_the_tokenizer_leaves_no_output(tmp_path, monkeypatch):
    def disk_full(*args):
        raise OSError("disk full")

    monkeypatch.setattr(tokenizer_stage, "write_json", disk_full)
    with pytest.raises(OSError, match="disk full"):
        run_stage(tmp_path, monkeypatch, vocab_size=300, model_type="bpe")
    assert not (tmp_path / artifact("tokenizer")).exists()  # no spm.model without its tokenizer.json
