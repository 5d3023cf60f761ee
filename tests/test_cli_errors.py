"""What `dpfm` prints when a stage refuses: the refusals written for the user (a ledger this run cannot
continue, a step past its plan, an index that no longer describes its shards) are one line and exit 1,
not a traceback."""

from __future__ import annotations

import pytest

from pipeline import cli
from pipeline.data.index import IndexMismatch
from pipeline.data.index_mmap import CorruptIndex
from pipeline.privacy.budget import IdentityError
from pipeline.privacy.engine import StepRefused
from pipeline.privacy.ledger import LedgerError


@pytest.mark.parametrize("error", [LedgerError, StepRefused, IdentityError, IndexMismatch, CorruptIndex])
def test_a_refusal_is_one_line_and_exit_1(monkeypatch, capsys, error):
    def refuse(args):
        raise error("models/dp/ledger.json was written for a different mechanism")

    monkeypatch.setattr(cli, "_owner_composition", refuse)
    assert cli.main(["owner-composition"]) == 1
    assert capsys.readouterr().err == "dpfm: models/dp/ledger.json was written for a different mechanism\n"


def test_a_ledger_that_is_not_one_is_named(tmp_path, capsys):
    for name, text in (("params.yaml", "dp:\n  epsilon: 8\n"), ("other.json", "{}")):
        (tmp_path / name).write_text(text)
        assert cli.main(["owner-composition", "--ledger", str(tmp_path / name)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"dpfm: --ledger {tmp_path / name}: not a dp-train ledger") and err.count("\n") == 1


def test_a_full_disk_names_the_file_being_written(tmp_path, monkeypatch, capsys):
    """atomic_path and the ledger's append put the file in the message; a copy or a link elsewhere (the
    synthetic stage's assembly falls back to copying) keeps it in the error's filename alone."""
    import errno

    from pipeline.io import atomic_path

    monkeypatch.chdir(tmp_path)

    def copy_fails(args):
        raise OSError(errno.ENOSPC, "No space left on device", "data/.synthetic.ab12.tmp/s-000003.tar")

    monkeypatch.setattr(cli, "_owner_composition", copy_fails)
    assert cli.main(["owner-composition"]) == 1
    assert capsys.readouterr().err == "dpfm: No space left on device: data/.synthetic.ab12.tmp/s-000003.tar\n"

    def write_fails(args):
        with atomic_path("results/x.json"):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cli, "_owner_composition", write_fails)
    assert cli.main(["owner-composition"]) == 1
    err = capsys.readouterr().err
    assert err.count("results/x.json") == 1 and err.count("\n") == 1, err


def test_a_json_write_that_fails_half_way_leaves_the_previous_file(tmp_path, monkeypatch):
    """write_json (stats.json, manifests, verification.json): a write cut by a full disk names the file
    and leaves the previous version whole, and no temporary file beside it."""
    import errno
    from pathlib import Path

    from pipeline.io import read_json, write_json

    path = tmp_path / "stats.json"
    write_json(path, {"v": 1})
    real = Path.write_text

    def half(self, text, *args, **kw):
        real(self, text[:len(text) // 2], *args, **kw)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half)
    with pytest.raises(OSError, match=f"while writing {path}"):
        write_json(path, {"v": 2, "more": list(range(100))})
    monkeypatch.undo()
    assert read_json(path) == {"v": 1} and [p.name for p in tmp_path.iterdir()] == ["stats.json"]


def test_each_kind_of_stop_has_its_exit_code_and_one_line(capsys):
    """Schedulers and snakemake read the code: 2 bad params, 3 a failed privacy check, 128 + signum a
    stop by signal (as a process killed by it), 1 a refusal; a command's own code passes through."""
    import signal

    from pipeline.config import ParamsError
    from pipeline.errors import PrivateDataError, Stopped, VerificationFailed

    cases = [(ParamsError(["dp.steps: 0"]), 2), (VerificationFailed("ε above target"), 3),
             (Stopped(signal.SIGTERM, "stopped at step 4"), 128 + signal.SIGTERM),
             (Stopped(signal.SIGINT, "stopped at step 4"), 128 + signal.SIGINT),
             (PrivateDataError("decoding failed"), 1)]
    for error, code in cases:
        def fail(args, error=error):
            raise error
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cli, "_owner_composition", fail)
            assert cli.main(["owner-composition"]) == code, error
        assert capsys.readouterr().err == f"dpfm: {error}\n"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "_owner_composition", lambda args: 5)
        assert cli.main(["owner-composition"]) == 5
