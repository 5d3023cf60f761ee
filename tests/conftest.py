import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in a scratch project directory holding the schema and default params."""
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas/params.schema.yaml").write_text((ROOT / "schemas/params.schema.yaml").read_text())
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    return tmp_path
