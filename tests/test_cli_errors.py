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
