import re
from pathlib import Path

from pipeline.cli import main
from pipeline.dvc_export import check_dvc_yaml, render_dvc_yaml
from pipeline.stages import STAGES, Stage, check_table

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = ["shards", "synthetic", "tokenizer", "pretrain", "dp-train", "verify", "evaluate", "report"]


def test_table_lists_the_eight_stages_in_dag_order():
    assert [s.name for s in STAGES] == EXPECTED
    check_table()


def test_committed_dvc_yaml_matches_table():
    assert check_dvc_yaml(ROOT / "dvc.yaml") == ""


def test_export_dvc_check_catches_a_table_change(tmp_path, monkeypatch, capsys):
    path = tmp_path / "dvc.yaml"
    path.write_text(render_dvc_yaml())
    assert main(["export-dvc", "--check", "--output", str(path)]) == 0
    import pipeline.dvc_export as dvc_export

    changed = STAGES[:-1] + (Stage("report", "x", "pipeline.report", ("run",), outputs=("results/other/",)),)
    monkeypatch.setattr(dvc_export, "STAGES", changed)
    assert main(["export-dvc", "--check", "--output", str(path)]) == 1
    assert "results/other" in capsys.readouterr().err


def test_every_stage_has_a_rule_with_the_required_directives():
    rules = "\n".join(p.read_text() for p in sorted((ROOT / "rules").glob("*.smk")))
    for name in EXPECTED:
        body = rules.split(f"rule {name.replace('-', '_')}:")[1].split("\nrule ")[0]
        for directive in ("log:", "benchmark:", "resources:", "conda:", "threads:", "params:", "output:"):
            assert directive in body, (name, directive)
        assert f'stage_params("{name}")' in body and f"dpfm {name} " in body


def test_cli_has_a_subcommand_per_stage(capsys):
    for name in EXPECTED:
        try:
            main([name, "--help"])
        except SystemExit as e:
            assert e.code == 0
        assert re.search(r"--set", capsys.readouterr().out)
