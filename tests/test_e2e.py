"""The whole DAG on a micro profile, then Snakemake's re-run plan after editing params."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from snakemake_project import MICRO, planned_rules, set_params, snakemake_project

from pipeline.io import file_digest
from pipeline.stages import STAGES, stage

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STAGE_RULES = ["shards", "synthetic", "tokenizer", "pretrain", "dp_train", "verify", "curve", "evaluate", "report"]


def snakemake(workdir: Path, *args: str) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([str(Path(sys.executable).parent / "snakemake"), "--cores", "2", *args],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """The DAG run once, scoring the digits and an image folder of two classes (a user's own eval set)."""
    pets = tmp_path_factory.mktemp("pets")
    for name, value in (("cat", 40), ("dog", 200)):
        (pets / name).mkdir()
        for i in range(24):  # 12 a class in probe-train: ten-shot takes ten
            Image.fromarray(np.full((8, 8, 3), value + i, np.uint8)).save(pets / name / f"{i}.png")
    sets = [{"name": "digits", "source": "digits"}, {"name": "pets", "source": "folder", "path": str(pets)}]
    work = dvc_project(tmp_path_factory.mktemp("project"), {"evaluate": {"sets": sets}})
    out = snakemake(work)
    return work, out


def dvc_project(work: Path, edits: dict | None = None) -> Path:
    """The workflow as a user's clone has it: a git and DVC repository, params at MICRO (and `edits`)."""
    snakemake_project(work, "dvc.yaml", ".gitignore", ".dvcignore")
    set_params(work, MICRO)
    set_params(work, edits or {})
    git(work, "init", "-q")  # DVC then checks what git ignores
    subprocess.run([str(BIN / "dvc"), "init", "-q"], cwd=work, check=True)
    shutil.copy(ROOT / ".dvc/config", work / ".dvc/config")  # the local remote, ../dvc-remote
    git(work, "add", "-A")
    git(work, "commit", "-qm", "project")
    return work


def git(work: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=ci@dpfm", "-c", "user.name=ci", *args], cwd=work, check=True,
                          capture_output=True, text=True).stdout


def dvc(work: Path, *args: str) -> str:
    """dvc as `make` runs it: with the environment's bin on PATH (dvc.yaml's commands call `dpfm`)."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([str(BIN / "dvc"), *args], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (args, proc.stdout[-3000:] + proc.stderr[-3000:])
    return proc.stdout + proc.stderr


@pytest.mark.e2e
def test_whole_dag_writes_every_artifact(finished_run):
    work, out = finished_run
    for path in ["data/shards/private/index.parquet", "data/shards/eval/index.parquet", "data/shards/stats.json",
                 "data/synthetic/index.parquet", "data/synthetic/contact_sheet.png", "models/tokenizer/spm.model",
                 "models/pretrain/checkpoint.pt", "models/dp/checkpoint.pt", "models/dp/ledger.json",
                 "results/privacy/verification.json", "results/curve/curve.json", "results/eval/metrics.json",
                 "results/report/report.html", "results/report/report.md"]:
        assert (work / path).is_file(), path
    assert "results/report/report.html" in out and "mlflow ui" in out
    for rule in STAGE_RULES:
        st = stage(rule.replace("_", "-"))
        assert (work / "logs" / f"{st.name}.log").exists()
        # Snakemake's benchmark: timing and bytes read, statistics of the private shards where it reads them
        benchmarks = work / (".dpfm/owner/benchmarks" if st.touches_private_data else "logs/benchmarks")
        assert (benchmarks / f"{st.name}.tsv").exists()
    assert stage("dp-train").touches_private_data and not stage("pretrain").touches_private_data


@pytest.mark.e2e
def test_mlflow_has_one_parent_with_a_child_per_stage(finished_run):
    work, _ = finished_run
    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dpfm")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("dpfm.pipeline") == "true"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(r.data.tags["dpfm.stage"] for r in children) == sorted(r.replace("_", "-") for r in STAGE_RULES)
    assert len(runs) == 1 + len(STAGE_RULES)
    # The parent: named after what ran, params.yaml as params, the headline figures, the report.
    parent = parents[0]
    # MICRO's curve has an ε = ∞ point (non-private training on the digits): NOT PRIVATE as a whole.
    assert re.fullmatch(r"NOT PRIVATE ViP ε=\d+\.\d\d σ=\d+\.\d\d", parent.info.run_name), parent.info.run_name
    assert parent.data.tags["dpfm.private"] == "false" and "ε = ∞" in parent.data.tags["dpfm.not_private"]
    assert parent.data.params["dp.epsilon"] == "8.0" and "dp.noise_seed" not in parent.data.params
    assert {"epsilon", "delta", "sigma", "linear_probe"} <= set(parent.data.metrics)
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"params.yaml", "report"}
    # The verified DP encoder is logged and registered with its ε and δ; no stage records system metrics
    # (MLflow samples the whole machine, where a job on the private shards may run beside it).
    [version] = client.search_model_versions("name='dpfm-mae'")
    assert float(version.tags["epsilon_run"]) == pytest.approx(parent.data.metrics["epsilon"], rel=1e-3)
    assert version.tags["epsilon"] == "inf" and version.tags["private"] == "false" and "delta" in version.tags
    dp = next(r for r in children if r.data.tags["dpfm.stage"] == "dp-train")
    pretrain = next(r for r in children if r.data.tags["dpfm.stage"] == "pretrain")
    for run in (pretrain, dp):
        assert not any(k.startswith("system/") for k in run.data.metrics), sorted(run.data.metrics)
    assert dp.data.params["dp.epsilon"] == "8.0" and "dp.noise_seed" not in dp.data.params
    assert dp.data.metrics["epsilon"] <= 8.0
    # The input hashes tagged on each stage are the ones DVC recorded for the producing stage; the
    # private shards' keyed with the owner's key (privacy/budget.public_name).
    lock = yaml.safe_load((work / "dvc.lock").read_text())["stages"]
    pretrain_md5 = next(o["md5"] for o in lock["pretrain"]["outs"] if o["path"] == "models/pretrain")
    assert dp.data.tags["dvc.input.models/pretrain"] == pretrain_md5
    # DVC tracks the shards' keyed digest in their place (dvc.lock, which git tracks, never holds
    # their plain md5 or size): the stage wrote it, and it is the tag.
    from pipeline.privacy import budget
    from pipeline.tracking import dvc_hash

    [shards_out] = lock["shards"]["outs"]
    assert shards_out["path"] == "data/shards.digest"
    assert all(d["path"] != "data/shards" for st in lock.values() for d in st.get("deps", []))
    plain = dvc_hash(work / "data/shards")
    cwd = os.getcwd()
    os.chdir(work)
    try:
        keyed = budget.public_name(plain)
    finally:
        os.chdir(cwd)
    assert dp.data.tags["dvc.input.data/shards"] == keyed == (work / "data/shards.digest").read_text().strip()
    assert plain.removesuffix(".dir") not in (work / "dvc.lock").read_text()


@pytest.mark.e2e
def test_editing_params_replans_exactly_the_dependent_stages(finished_run):
    work, _ = finished_run
    assert planned_rules(snakemake(work, "-n")) == set()
    original = (work / "params.yaml").read_text()
    try:
        set_params(work, {"evaluate": {"probe_c": 0.5}})  # the curve probes with evaluate's protocol
        assert planned_rules(snakemake(work, "-n")) == {"curve", "evaluate", "report"}
        (work / "params.yaml").write_text(original)
        set_params(work, {"curve": {"epsilons": [4]}})
        assert planned_rules(snakemake(work, "-n")) == {"curve", "evaluate", "report"}
        (work / "params.yaml").write_text(original)
        set_params(work, {"dp": {"clip_norm": 2.0}})
        assert planned_rules(snakemake(work, "-n")) == {"dp_train", "verify", "curve", "evaluate", "report"}
        (work / "params.yaml").write_text(original)
        # What only names or schedules a run re-runs nothing (a dp-train re-run would spend privacy again).
        set_params(work, {"run": {"experiment": "renamed", "threads": 1}, "shards": {"workers": 2, "scan_groups": 4}})
        assert planned_rules(snakemake(work, "-n")) == set()
        # Nor does how a stage computes (stages.HOW_IT_RUNS): a finished GPU job is not queued again.
        set_params(work, {"synthetic": {"workers": 3}, "pretrain": {"data_workers": 2, "checkpoint_every": 7},
                          "dp": {"physical_batch_size": 5, "data_workers": 2, "compile": True}})
        assert planned_rules(snakemake(work, "-n")) == set()
        # An eval set's files, not only its path: an image relabelled in place re-runs what scored it.
        params = yaml.safe_load(original)
        cat = Path(params["evaluate"]["sets"][1]["path"]) / "cat/0.png"
        kept, times = cat.read_bytes(), (cat.stat().st_atime_ns, cat.stat().st_mtime_ns)
        cat.write_bytes((cat.parent.parent / "dog/0.png").read_bytes())
        assert planned_rules(snakemake(work, "-n")) == {"curve", "evaluate", "report"}
        cat.write_bytes(kept)
        os.utime(cat, ns=times)
        assert planned_rules(snakemake(work, "-n")) == set()
    finally:
        (work / "params.yaml").write_text(original)


@pytest.mark.e2e
def test_restored_outputs_with_new_mtimes_are_touched_up_to_date(finished_run):
    """The DVC timestamp trap: `dvc checkout` rewrites files in no particular order."""
    work, _ = finished_run
    for path in ["data/shards", "data/synthetic", "models/tokenizer"]:  # upstream now newer than downstream
        for f in (work / path).rglob("*"):
            os.utime(f)
        os.utime(work / path)
    assert planned_rules(snakemake(work, "-n")) >= {"dp_train", "pretrain", "report"}
    snakemake(work, "--touch")  # what `make restore` runs after `dvc pull`
    assert planned_rules(snakemake(work, "-n")) == set()
    import mlflow  # a run in which no stage ran leaves no empty parent behind

    client = mlflow.tracking.MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("dpfm").experiment_id], max_results=100)
    assert all(r.info.run_name != "mae ε≤8" for r in runs)


@pytest.mark.e2e
def test_dry_run_of_a_fresh_clone_lists_all_nine_stages(tmp_path):
    snakemake_project(tmp_path)
    assert planned_rules(snakemake(tmp_path, "-n")) == set(STAGE_RULES)
    assert not (tmp_path / "mlflow.db").exists()  # a dry run opens no MLflow run


def dot_edges(dot: str, labels: bool) -> set[tuple[str, str]]:
    if labels:  # snakemake: numbered nodes with labels
        names = dict(re.findall(r'^\s*(\d+)\[label = "([\w-]+)"', dot, flags=re.M))
        edges = re.findall(r"^\s*(\d+) -> (\d+)", dot, flags=re.M)
        return {(names[a], names[b]) for a, b in edges if names[b] != "all"}
    return {(a.replace("-", "_"), b.replace("-", "_")) for a, b in re.findall(r'"([\w-]+)" -> "([\w-]+)"', dot)}


@pytest.mark.e2e
def test_dvc_and_snakemake_run_the_same_dag(tmp_path):
    snakemake_project(tmp_path, "dvc.yaml")
    bin_dir = Path(sys.executable).parent
    subprocess.run([str(bin_dir / "dvc"), "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    dvc_dot = subprocess.run([str(bin_dir / "dvc"), "dag", "--dot"], cwd=tmp_path, capture_output=True,
                             text=True, check=True).stdout
    rule_dot = snakemake(tmp_path, "--rulegraph")
    assert dot_edges(dvc_dot, labels=False) == dot_edges(rule_dot, labels=True)
    from pipeline.stages import STAGES

    producer = {out: s.name for s in STAGES for out in s.outputs + s.metrics}
    table = {(producer[i].replace("-", "_"), s.name.replace("-", "_")) for s in STAGES for i in s.inputs}
    assert dot_edges(dvc_dot, labels=False) == table


@pytest.mark.e2e
def test_dvc_versions_pushes_restores_and_runs_experiments_from_a_fresh_clone(finished_run, tmp_path):
    """After a run: dvc.lock is written (the run said so), `dvc status` is clean, `dvc push` and, with
    the outputs gone, `dvc pull` + `snakemake --touch` (`make restore`) bring back an up-to-date
    workspace, metrics included; the private shards stay with their owner, never in DVC's cache or
    remote; `dvc exp run -S` runs the affected stages and `dvc exp show` has params and metrics for
    every row."""
    work = tmp_path / "clone"
    shutil.copytree(finished_run[0], work, symlinks=True)  # this test changes the workspace
    [said] = [line for line in finished_run[1].splitlines() if line.startswith("DVC: outputs of ")]
    assert said.endswith("cached and recorded in dvc.lock (`git add dvc.lock`, then `dvc push`)")
    committed = said.removeprefix("DVC: outputs of ").split(" cached")[0].split(", ")
    assert sorted(committed) == sorted(s.name for s in STAGES)
    assert "up to date" in dvc(work, "status")
    git(work, "add", "dvc.lock")
    git(work, "commit", "-qm", "a run")
    dvc(work, "push")
    private = {file_digest(f, "md5") for f in (work / "data/shards").rglob("*") if f.is_file() and f.stat().st_size}
    stored = {f.parent.name + f.name for where in ("dvc-remote", ".dvc/cache") for f in (work / where).rglob("*")}
    assert private and not private & stored
    for path in ("data/synthetic", "models", "results"):
        shutil.rmtree(work / path)
    (work / "data/shards.digest").unlink()
    dvc(work, "pull")
    snakemake(work, "--touch")
    assert planned_rules(snakemake(work, "-n")) == set()
    assert (work / "results/privacy/verification.json").is_file()  # metrics are cached like outputs
    out = dvc(work, "exp", "run", "-S", "dp.epsilon=2")
    assert "Running stage 'dp-train'" in out and "Running stage 'shards'" not in out
    import json

    rows = json.loads(dvc(work, "exp", "show", "--json"))
    committed = rows[1]["data"]  # the commit of the run (row 0 is the workspace)
    assert committed["params"]["params.yaml"]["data"]["dp"]["epsilon"] == 8.0
    assert committed["metrics"]["results/privacy/verification.json"]["data"]["epsilon_reported"] <= 8.0
    [experiment] = rows[1]["experiments"]
    ran = experiment["revs"][0]["data"]
    assert ran["params"]["params.yaml"]["data"]["dp"]["epsilon"] == 2
    assert ran["metrics"]["results/privacy/verification.json"]["data"]["epsilon_reported"] <= 2.0
