# Shared by every rule: params validation, the stage table, and the MLflow parent run.
import json
import os
import shutil
import subprocess

from snakemake.utils import validate

from pipeline import tracking
from pipeline.config import load_schema
from pipeline.config import validate as check_params
from pipeline.stages import stage

# Readable errors first (key path and allowed values), then Snakemake's own schema validation.
check_params(config, load_schema(workflow.source_path("../schemas/params.schema.yaml")), source="config")
validate(config, "../schemas/params.schema.yaml")

STAGE_ENV = "../envs/dpfm.yaml"


def stage_inputs(name):
    return stage(name).input_paths


def stage_outputs(name):
    st = stage(name)
    return [directory(p) for p in st.dir_outputs] + st.file_outputs


def stage_params(name):
    """The params sections a stage reads, as JSON: a change to them (only) re-runs the stage."""
    st = stage(name)
    return json.dumps({s: config[s] for s in st.sections}, sort_keys=True)


def stage_resources(name):
    r = stage(name).resources
    # GPUs are asked for only on CUDA runs (set run.device: cuda on a GPU cluster); profiles/slurm sets
    # gpu and nodes per rule itself. `nodes` is the plugin's --nodes and pipeline/launch.py's node count.
    gpu = r.gpu if config["run"]["device"] == "cuda" else 0
    return {"mem_mb": r.mem_mb, "runtime": r.runtime, "gpu": gpu, "nodes": 1}


onstart:
    if workflow.non_local_exec and tracking.tracking_uri().startswith("sqlite"):
        # Concurrent cluster jobs writing one SQLite file (often on NFS) lock or corrupt it.
        print(f"WARNING: cluster run logging to SQLite ({tracking.tracking_uri()}); start an MLflow "
              "tracking server and export MLFLOW_TRACKING_URI (README: Running on a SLURM cluster)")
    os.environ[tracking.PARENT_ENV] = tracking.start_parent(config["run"]["experiment"])


onsuccess:
    tracking.end_parent(config["run"]["experiment"], os.environ[tracking.PARENT_ENV], ok=True)
    # Version what this run produced: DVC records the outputs' hashes in dvc.lock and its cache.
    if os.path.isdir(".dvc") and shutil.which("dvc"):
        subprocess.run(["dvc", "commit", "--force", "--quiet"], check=False)
    print("\nReport: results/report/report.html (open it in a browser)")
    print("MLflow: .venv/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db  then http://127.0.0.1:5000")


onerror:
    if tracking.PARENT_ENV in os.environ:
        tracking.end_parent(config["run"]["experiment"], os.environ[tracking.PARENT_ENV], ok=False)
