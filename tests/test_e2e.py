"""The whole DAG on a micro profile, then Snakemake's re-run plan after editing params."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
STAGE_RULES = ["shards", "synthetic", "tokenizer", "pretrain", "dp_train", "verify", "evaluate", "report"]
MICRO = {
    "shards": {"image_size": 16},
    "synthetic": {"num_programs": 24, "frames_per_program": 2, "resolution": 16, "samples_per_shard": 20},
    "tokenizer": {"vocab_size": 128},
    "model": {"size": "micro", "img_size": 16, "patch_size": 4, "decoder_width": 32, "decoder_depth": 1,
              "decoder_heads": 2, "text_width": 32, "text_depth": 1, "text_heads": 2, "max_caption_len": 12},
    "pretrain": {"steps": 6, "batch_size": 16, "warmup_steps": 2, "checkpoint_every": 3, "log_every": 2},
    "dp": {"steps": 4, "expected_batch_size": 32, "physical_batch_size": 16, "warmup_steps": 1,
           "eval_every": 2, "checkpoint_every": 2},
}


def snakemake(workdir: Path, *args: str) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([str(Path(sys.executable).parent / "snakemake"), "--cores", "2", *args],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


def planned_rules(output: str) -> set[str]:
    return set(re.findall(r"^(?:local)?rule (\w+):", output, flags=re.M)) - {"all"}


def set_params(workdir: Path, edits: dict) -> None:
    params = yaml.safe_load((workdir / "params.yaml").read_text())
    for section, values in edits.items():
        params[section].update(values)
    (workdir / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("project")
    for item in ("Snakefile", "rules", "schemas", "envs", "profiles", "params.yaml"):
        src = ROOT / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / item)
    set_params(work, MICRO)
    shutil.copy(ROOT / "dvc.yaml", work / "dvc.yaml")
    subprocess.run([str(Path(sys.executable).parent / "dvc"), "init", "--no-scm", "-q"], cwd=work, check=True)
    out = snakemake(work)
    return work, out


@pytest.mark.e2e
def test_whole_dag_writes_every_artifact(finished_run):
    work, out = finished_run
    for path in ["data/shards/private/index.parquet", "data/shards/eval/index.parquet", "data/shards/stats.json",
                 "data/synthetic/index.parquet", "data/synthetic/contact_sheet.png", "models/tokenizer/spm.model",
                 "models/pretrain/checkpoint.pt", "models/dp/checkpoint.pt", "models/dp/ledger.json",
                 "results/privacy/verification.json", "results/eval/metrics.json",
                 "results/report/report.html", "results/report/report.md"]:
        assert (work / path).is_file(), path
    assert "results/report/report.html" in out and "mlflow ui" in out
    for rule in STAGE_RULES:
        assert (work / "logs" / f"{rule.replace('_', '-')}.log").exists()
        assert (work / "logs/benchmarks" / f"{rule.replace('_', '-')}.tsv").exists()


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
    dp = next(r for r in children if r.data.tags["dpfm.stage"] == "dp-train")
    assert dp.data.params["dp.epsilon"] == "8.0" and "dp.noise_seed" not in dp.data.params
    assert dp.data.metrics["epsilon"] <= 8.0
    # The input hashes tagged on each stage are the ones DVC recorded for the producing stage.
    lock = yaml.safe_load((work / "dvc.lock").read_text())["stages"]
    shards_md5 = next(o["md5"] for o in lock["shards"]["outs"] if o["path"] == "data/shards")
    assert dp.data.tags["dvc.input.data/shards"] == shards_md5


@pytest.mark.e2e
def test_editing_params_replans_exactly_the_dependent_stages(finished_run):
    work, _ = finished_run
    assert planned_rules(snakemake(work, "-n")) == set()
    original = (work / "params.yaml").read_text()
    try:
        set_params(work, {"evaluate": {"probe_c": 0.5}})
        assert planned_rules(snakemake(work, "-n")) == {"evaluate", "report"}
        (work / "params.yaml").write_text(original)
        set_params(work, {"dp": {"clip_norm": 2.0}})
        assert planned_rules(snakemake(work, "-n")) == {"dp_train", "verify", "evaluate", "report"}
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


@pytest.mark.e2e
def test_dry_run_of_a_fresh_clone_lists_all_eight_stages(tmp_path):
    for item in ("Snakefile", "rules", "schemas", "envs", "profiles", "params.yaml"):
        src = ROOT / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / item)
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
    for item in ("Snakefile", "rules", "schemas", "envs", "profiles", "params.yaml", "dvc.yaml"):
        src = ROOT / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / item)
    bin_dir = Path(sys.executable).parent
    subprocess.run([str(bin_dir / "dvc"), "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    dvc_dot = subprocess.run([str(bin_dir / "dvc"), "dag", "--dot"], cwd=tmp_path, capture_output=True,
                             text=True, check=True).stdout
    rule_dot = snakemake(tmp_path, "--rulegraph")
    assert dot_edges(dvc_dot, labels=False) == dot_edges(rule_dot, labels=True)
    from pipeline.stages import STAGES

    producer = {out: s.name for s in STAGES for out in s.all_outputs}
    table = {(producer[i].replace("-", "_"), s.name.replace("-", "_")) for s in STAGES for i in s.inputs}
    assert dot_edges(dvc_dot, labels=False) == table
