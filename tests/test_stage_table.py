import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from pipeline.cli import main
from pipeline.config import read_resolved
from pipeline.dvc_export import check_dvc_yaml, render_dvc_yaml
from pipeline.privacy import training
from pipeline.stages import HOW_IT_RUNS, STAGES, TRACKED, UNTRACKED, Stage, check_table, tracked

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EXPECTED = ["shards", "synthetic", "tokenizer", "pretrain", "dp-train", "verify", "curve", "evaluate", "report"]


def test_table_lists_the_nine_stages_in_dag_order():
    assert [s.name for s in STAGES] == EXPECTED
    check_table()


def test_committed_dvc_yaml_matches_table():
    assert check_dvc_yaml(ROOT / "dvc.yaml") == ""


def private_paths(paths: list[str]) -> list[str]:
    """Of `paths`, those in dpfm's own state and owner zone (.dpfm: the ledger's batch sizes, the
    exclusion counts), the private shards themselves, or a ledger with its batch sizes."""
    from pipeline.privacy import owner
    from pipeline.stages import ARTIFACTS, PRIVATE_ARTIFACT

    closed = (owner.OWNER_DIR.parent, Path(ARTIFACTS[PRIVATE_ARTIFACT].rstrip("/")))
    return [p for p in paths if any(Path(p) == c or c in Path(p).parents for c in closed) or "ledger.jsonl" in p]


def test_nothing_dvc_caches_and_pushes_is_private():
    """What dvc.yaml makes an output (`dvc push` uploads it with `make push`) is published: never the owner
    zone, the run state, the private shards or the owner's ledger (the shards are a keyed digest)."""
    stages = yaml.safe_load(render_dvc_yaml())["stages"]
    pushed = [p for st in stages.values() for key in ("outs", "metrics", "plots") for p in st.get(key, [])]
    assert "models/dp" in pushed and private_paths(pushed) == []
    # A dependency's md5 goes into dvc.lock, which git publishes: the shards' keyed digest, never the shards.
    deps = [p for st in stages.values() for p in st.get("deps", [])]
    assert "data/shards.digest" in deps and private_paths(deps) == []
    assert private_paths([".dpfm/owner", ".dpfm/state/dp-train-1/ledger.jsonl", "data/shards", "data/shards/private",
                          "results/x/ledger.jsonl"]) == [".dpfm/owner", ".dpfm/state/dp-train-1/ledger.jsonl",
                                                         "data/shards", "data/shards/private", "results/x/ledger.jsonl"]
    assert private_paths(["data/shards.digest", "models/dp", "results/eval/metrics.json"]) == []


def test_every_stage_that_reads_or_writes_the_private_shards_keeps_its_timing_private():
    """A stage's time and resource use on the private shards are statistics of them: the one that writes
    them and every one that reads them (dp-train, the curve, evaluate, the report) keeps them out of
    MLflow and logs/; the others publish theirs."""
    from pipeline.stages import PRIVATE_ARTIFACT

    touching = {st.name for st in STAGES if PRIVATE_ARTIFACT in st.inputs + st.outputs}
    assert {"shards", "dp-train", "curve", "evaluate", "report"} <= touching
    assert {st.name for st in STAGES if st.touches_private_data} == touching


def test_every_key_dvc_yaml_lists_is_one_params_yaml_must_hold():
    """dvc.yaml lists each stage's tracked keys from the schema: a key the schema left optional
    (shards.private_limit was) stops `dvc repro` and `dvc status` on a params.yaml without it, while
    dpfm itself accepts that file."""
    from pipeline.config import load_schema

    for name, section in load_schema()["properties"].items():
        assert sorted(section.get("required", [])) == sorted(section.get("properties", {})), name


def test_export_dvc_check_catches_a_table_change(tmp_path, monkeypatch, capsys):
    path = tmp_path / "dvc.yaml"
    path.write_text(render_dvc_yaml())
    assert main(["export-dvc", "--check", "--output", str(path)]) == 0
    import pipeline.dvc_export as dvc_export

    changed = STAGES[:-1] + (Stage("summary", "x", ("run",), outputs=("curve",)),)
    monkeypatch.setattr(dvc_export, "STAGES", changed)
    assert main(["export-dvc", "--check", "--output", str(path)]) == 1
    err = capsys.readouterr().err
    assert "+  summary:\n+    cmd: dpfm summary\n" in err and "-  report:\n" in err, err[-2000:]


def dry_run(tmp_path, *args) -> str:
    """`snakemake -n -p --forceall` in a copy of the project (with more arguments)."""
    for item in ("Snakefile", "rules", "schemas", "envs", "profiles", "params.yaml", "report"):
        src = ROOT / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / item)
    cmd = [str(BIN / "snakemake"), "-n", "-p", "--forceall", "--cores", "2", *args]
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = "/usr/bin:/bin"  # no activated environment: the rules must not need one
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_every_stage_has_a_generated_rule_calling_its_stage_by_absolute_interpreter(tmp_path):
    out = dry_run(tmp_path)
    python = (BIN / "snakemake").read_text().splitlines()[0][2:]
    for st in STAGES:
        block = out.split(f"\nrule {st.name.replace('-', '_')}:\n")[1].split("\n\n")[0]
        assert f"log: logs/{st.name}.log" in block
        command = out.split(f"{python} -m pipeline.cli {st.name} --threads ")[1].splitlines()[0]
        assert '--resolved "$DPFM_RESOLVED_PARAMS"' in command and f"tee logs/{st.name}.log" in command
        launched = f"{python} -m pipeline.launch --nodes 1 --gpus 0 -- {python} -m pipeline.cli {st.name} " in out
        assert launched == bool(st.resources.gpu), st.name


def test_the_curve_runs_after_dp_train_whose_run_it_shares(tmp_path):
    """The curve's point at dp-train's ε is dp-train's run, one state directory. Run beside it (the
    curve's one GPU free before dp-train's eight), the curve took the run's lock and trained the 8-GPU
    recipe on one, and dp-train stopped busy. In Snakemake's graph the curve now follows dp-train."""
    for item in ("Snakefile", "rules", "schemas", "envs", "profiles", "params.yaml", "report"):
        src = ROOT / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / item)
    dot = subprocess.run([str(BIN / "snakemake"), "--rulegraph", "dot", "--", "results/curve/curve.json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120).stdout
    label = dict(re.findall(r'(\d+)\[label = "(\w+)"', dot))
    edges = {(label[a], label[b]) for a, b in re.findall(r"(\d+) -> (\d+)", dot)}
    assert ("pretrain", "curve") in edges and ("dp_train", "curve") in edges, edges


def test_brace_patterns_and_templates_pass_through_the_dag_unchanged(tmp_path):
    """A URL brace pattern and a `{c}` template are not Snakemake wildcards (they once crashed the DAG)."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["shards"].update(source="urls", urls=["s3://b/laion/{00000..00099}.tar"])
    params["curve"]["epsilons"] = [1, 8]  # an ε = ∞ point on a web source is refused as the run starts
    params["evaluate"]["sets"] = [{"name": "pets", "source": "folder", "path": "/data/pets",
                                   "templates": ["a photo of a {c}."]}]
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(params))
    dry_run(tmp_path, "--configfile", "edited.yaml")
    (resolved,) = (tmp_path / ".dpfm/params").iterdir()
    resolved = read_resolved(resolved)
    assert resolved["shards"]["urls"] == ["s3://b/laion/{00000..00099}.tar"]
    assert resolved["evaluate"]["sets"][0]["templates"] == ["a photo of a {c}."]


FAKE_CONDA = """#!/bin/sh
case "$*" in
  "info --json") echo '{"conda_version": "25.1.0", "platform": "linux-64", "root_prefix": "/nowhere", "conda_prefix": "/nowhere", "envs_dirs": [], "pkgs_dirs": []}';;
  "--version") echo "conda 25.1.0";;
  *"config --get"*) echo '{"get": {"channel_priority": "strict"}}';;
  *) echo '{}';;
esac
"""


def test_under_sdm_conda_jobs_run_the_environments_python_which_installs_the_project(tmp_path):
    """Snakemake builds envs/dpfm.yaml from a copy under .snakemake/conda/, where a relative pip path
    (`-e ..`) names .snakemake/: the project is installed by the post-deploy script, from the project's
    directory, and the jobs run the environment's `python`, not this venv's (which a node may not
    see). Planned under `--sdm conda` with a stand-in `conda` that answers Snakemake's checks (conda's
    channels are unreachable here)."""
    env = yaml.safe_load((ROOT / "envs/dpfm.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert not [p for p in pip if p.startswith(("-e", ".", "/", "file:"))], pip
    script = ROOT / "envs/dpfm.post-deploy.sh"
    assert os.access(script, os.X_OK) and "python -m pip install --quiet -c constraints.txt -e ." in script.read_text()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/conda").write_text(FAKE_CONDA)
    (tmp_path / "bin/conda").chmod(0o755)
    for item in ("Snakefile", "rules", "schemas", "envs", "profiles", "params.yaml", "report"):
        (shutil.copytree if (ROOT / item).is_dir() else shutil.copy)(ROOT / item, tmp_path / item)
    plan = subprocess.run([str(BIN / "snakemake"), "-n", "-p", "--forceall", "--cores", "2", "--sdm", "conda"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr[-3000:]
    commands = [line for line in plan.stdout.splitlines() if "-m pipeline.cli " in line]
    assert len(commands) == len(STAGES) and all(" python -m pipeline." in c for c in commands), commands
    assert str(BIN) not in "".join(commands)
    assert "-m pipeline.launch --nodes 1 --gpus 0 -- python -m pipeline.cli dp-train" in plan.stdout


def test_cli_has_a_subcommand_per_stage(capsys):
    for name in EXPECTED:
        try:
            main([name, "--help"])
        except SystemExit as e:
            assert e.code == 0
        assert re.search(r"--set", capsys.readouterr().out)


def test_naming_and_scheduling_keys_are_untracked_and_the_rest_tracked():
    schema = yaml.safe_load((ROOT / "schemas/params.schema.yaml").read_text())["properties"]
    for section, keys in UNTRACKED.items():
        assert set(keys) | set(TRACKED[section]) == set(schema[section]["properties"])
        assert not set(keys) & set(TRACKED[section])
    params = {"run": {"seed": 3, "experiment": "x", "threads": 4, "device": "cuda"}, "dp": {"epsilon": 8}}
    assert tracked(params, ("run", "dp")) == {"run": {"seed": 3}, "dp": {"epsilon": 8}}
    assert render_dvc_yaml().count("- run.seed") == len(STAGES) and "- run\n" not in render_dvc_yaml()


def test_how_a_stage_computes_re_runs_nothing_and_what_it_makes_re_runs_it():
    """Edited one at a time from params.yaml: each HOW_IT_RUNS key leaves every stage's tracked params
    (what Snakemake compares) and dvc.yaml's list alone; the keys beside them still move them."""
    schema = yaml.safe_load((ROOT / "schemas/params.schema.yaml").read_text())["properties"]
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    dvc = render_dvc_yaml()
    for section, keys in HOW_IT_RUNS.items():
        assert set(keys) <= set(schema[section]["properties"]) and not set(keys) & set(UNTRACKED.get(section, ()))
        users = [st for st in STAGES if section in st.sections]
        for key in keys:
            edited = {**params, section: {**params[section], key: "another"}}
            assert all(tracked(edited, st.sections) == tracked(params, st.sections) for st in users), (section, key)
            assert f"- {section}.{key}\n" not in dvc
        other = next(k for k in schema[section]["properties"] if k not in keys)
        edited = {**params, section: {**params[section], other: "another"}}
        assert all(tracked(edited, st.sections) != tracked(params, st.sections) for st in users), (section, other)
        assert f"- {section}.{other}\n" in dvc
    assert set(HOW_IT_RUNS["dp"]) < set(training.HOW_IT_RUNS)  # and dp-train's state key leaves them out too


def test_no_stage_imports_another_stage():
    """The stages call the privacy boundary (privacy/training.py), never each other: the curve and the
    extra seeds once reached DP training through the dp-train and curve stage modules."""
    import ast

    from pipeline.stages import STAGES

    modules = {st.module for st in STAGES}
    for st in STAGES:
        tree = ast.parse(Path(ROOT / (st.module.replace(".", "/") + ".py")).read_text())
        named = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        named |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                  for a in n.names}
        named |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not (named & (modules - {st.module})), (st.name, sorted(named & modules))


def test_export_dvc_writes_exactly_what_the_check_wants(tmp_path):
    """`dpfm export-dvc` (no --check) must write the file --check accepts, byte for byte."""
    path = tmp_path / "dvc.yaml"
    assert main(["export-dvc", "--output", str(path)]) == 0
    assert path.read_text() == render_dvc_yaml() and check_dvc_yaml(path) == ""
    path.write_text(render_dvc_yaml() + "\n")  # any drift, even a blank line, is drift
    assert check_dvc_yaml(path) != ""


def test_the_check_of_a_missing_dvc_yaml_is_the_whole_file_to_add(tmp_path):
    diff = check_dvc_yaml(tmp_path / "dvc.yaml")
    added = [line[1:] for line in diff.splitlines(True) if line.startswith("+") and not line.startswith("+++")]
    assert added == render_dvc_yaml().splitlines(True)
