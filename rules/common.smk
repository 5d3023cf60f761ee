# Shared by every rule: params validation, the stage table, and the MLflow parent run.
import json
import os
import sys

from snakemake.settings.types import DeploymentMethod

from pipeline import dvc_commit, tracking
from pipeline.privacy import owner, release
from pipeline.privacy.params_check import check_dp_params, schedule_warnings
from pipeline.config import (ParamsError, load_schema, merge, numbers, read_resolved, read_yaml, typed, validate,
                             write_resolved)
from pipeline.launch import STOP_NOTICE_S
from pipeline.stages import SCAN_GROUP_SOURCES, STAGES, eval_files_tag, source_files_tag, stage, tracked

# The file of validated params every job reads (`--resolved "$DPFM_RESOLVED_PARAMS"`). An environment
# variable, not one of the params: its path changes with the config, and a param change re-runs a stage
# (the `tracked` params are what re-runs one).
RESOLVED_ENV = "DPFM_RESOLVED_PARAMS"

if workflow.is_main_process:
    # `--config dp='{epsilon: 2}'`: typed as params.yaml is (Snakemake passes nested values as strings),
    # and 1e-5 a number wherever it is written (config.numbers).
    config.update(numbers(merge(config, typed(workflow.config_settings.overwrite_config or {}))))
    # Validated once, here, against the schema (errors name the key path and the allowed values, one
    # line each; exit 2 as `dpfm` does), and written to a file named by its digest. Snakemake read the
    # files keeping the last of a key written twice: they are read again to refuse that.
    try:
        for configfile in workflow.configfiles:
            read_yaml(configfile)
        validate(config, load_schema(workflow.source_path("../schemas/params.schema.yaml")), source="config")
        release.check_asked_for(config)
        check_dp_params(config)  # torch on the meta device: about 3 s, once a workflow
        for warning in schedule_warnings(config):
            print(f"dpfm: warning: {warning}", file=sys.stderr)
    except ParamsError as e:
        print(f"dpfm: {e}", file=sys.stderr)
        sys.exit(2)
    os.environ[RESOLVED_ENV] = str(write_resolved(config))
else:
    # A job Snakemake spawned (a SLURM job reads the Snakefile again, and params.yaml as it is now): it
    # takes the params its workflow validated, whatever was edited since, and writes none.
    try:
        config.clear()
        config.update(read_resolved(os.environ.get(RESOLVED_ENV, "")))
    except ParamsError as e:
        print(f"dpfm: a job of a workflow: {e}", file=sys.stderr)
        sys.exit(2)



STAGE_ENV = "../envs/dpfm.yaml"
PYTHON = sys.executable  # the interpreter running Snakemake, by absolute path: jobs need no activated venv
# A job's interpreter: this one, or under `--sdm conda` its environment's own (envs/dpfm.yaml; its
# post-deploy script installs the project), which a node can reach where this venv may not be.
JOB_PYTHON = "python" if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method else PYTHON


# Outputs of these stages are registered for `snakemake --report` (captions in report/).
SNAKEMAKE_REPORT = {
    "evaluate": dict(caption="../report/metrics.rst", category="Evaluation"),
    "report": dict(caption="../report/report.rst", category="Report", htmlindex="report.html"),
}


def rule_outputs(st):
    spec = SNAKEMAKE_REPORT.get(st.name)
    if spec is None:
        return stage_outputs(st.name)
    # An HTML index is a folder's page: the report stage's privacy.json beside its folder is a plain output.
    files = st.file_outputs if "htmlindex" in spec else [report(p, **spec) for p in st.file_outputs]
    return [report(directory(p), **spec) for p in st.dir_outputs] + files


def stage_command(st, resources):
    """How a job starts its stage: by JOB_PYTHON (no activated environment needed), through
    pipeline/launch.py for the stages that ask for GPUs."""
    cli = f"{JOB_PYTHON} -m pipeline.cli {st.name}"
    if st.resources.gpu:
        return f"{JOB_PYTHON} -m pipeline.launch --nodes {resources.nodes} --gpus {resources.gpu} -- {cli}"
    return cli


def stage_outputs(name):
    st = stage(name)
    return [directory(p) for p in st.dir_outputs] + st.file_outputs


EVAL_FILES_TAGS = {}  # each eval set's files walked once per workflow parse, not once per rule that evaluates


def stage_params(name):
    """The params a stage's results depend on: a change to them (only) re-runs the stage. Naming and
    scheduling keys (run.experiment, run.threads, run.device) re-run nothing. The stage itself reads
    the resolved params (RESOLVED_ENV); this JSON text is only what Snakemake compares with the last run's."""
    values = tracked(config, stage(name).sections)
    if "evaluate" in stage(name).sections:  # the eval sets' files, not only their paths
        sets = json.dumps(config["evaluate"]["sets"], sort_keys=True)
        if sets not in EVAL_FILES_TAGS:
            EVAL_FILES_TAGS[sets] = eval_files_tag(config["evaluate"]["sets"])
        values["evaluate_files"] = EVAL_FILES_TAGS[sets]
    if name == "shards":  # the private source's files (names and times), not only its paths
        values["source_files"] = source_files_tag(config["shards"])
    return json.dumps(values, sort_keys=True)


def stage_inputs(st):
    """The stage's inputs from the table; the shards stage also gathers the scan jobs' summaries."""
    return st.input_paths + (scan_summaries() if st.name == "shards" else [])


def scan_groups():
    """How many scan_shards jobs (rules/scan.smk) this config has: none for a labelled set and download."""
    return config["shards"]["scan_groups"] if config["shards"]["source"] in SCAN_GROUP_SOURCES else 0


def scan_summary():
    """A scan job's summary: beside the cached scans it vouches for, named by the group count, so a
    new count never takes an old group's summary for its own."""
    return os.path.join(config["shards"]["cache_dir"], "scan", "groups", f"{{group}}-of-{scan_groups()}.json")


def scan_summaries():
    return expand(scan_summary(), group=range(scan_groups()))


# What a scan job reads: changing another shards key re-runs `shards`, not the scan jobs.
SCAN_KEYS = ("source", "urls", "path", "image_size", "cache_dir")


def scan_params():
    """The params a scan job depends on (as stage_params: a change to them re-runs the job)."""
    return json.dumps({"shards": {k: config["shards"][k] for k in SCAN_KEYS}}, sort_keys=True)


# What a training job needs on SLURM to stay correct, whatever sizes the profile or the command line
# give it (a command-line --set-resources replaces the profile's whole set-resources block):
# SIGTERM 5 min before the time limit, so the step in flight ends and a checkpoint is saved, and
# no --ntasks-per-gpu, so SLURM starts the rule once (per node), not once per GPU. A command-line
# slurm_extra for a training job replaces this one, so it must carry the signal itself (docs/cluster.md).
TRAINING_ON_SLURM = {"slurm_extra": f"'--signal=TERM@{STOP_NOTICE_S}'", "tasks_per_gpu": 0}


def benchmark_file(name, private):
    """Snakemake's benchmark of a job (wall time, memory, bytes read): of a job on the private shards
    these are statistics of them, kept in the owner-only zone (pipeline/privacy/owner.py)."""
    return str(owner.OWNER_DIR / "benchmarks" / f"{name}.tsv") if private else f"logs/benchmarks/{name}.tsv"


def stage_resources(name):
    r = stage(name).resources
    # GPUs are asked for only on CUDA runs (set run.device: cuda on a GPU cluster); profiles/slurm sets
    # gpu and nodes per rule itself. `nodes` is the plugin's --nodes and pipeline/launch.py's node count.
    gpu = r.gpu if config["run"]["device"] == "cuda" else 0
    training = TRAINING_ON_SLURM if r.gpu else {}
    return {"mem_mb": r.mem_mb, "runtime": r.runtime, "gpu": gpu, "nodes": 1, **training}


onstart:
    if workflow.non_local_exec and tracking.tracking_uri().startswith("sqlite"):
        # Concurrent cluster jobs writing one SQLite file (often on NFS) lock or corrupt it.
        print(f"WARNING: cluster run logging to SQLite ({tracking.tracking_uri()}); start an MLflow "
              "tracking server and export MLFLOW_TRACKING_URI (docs/cluster.md: MLflow)")
    os.environ[tracking.PARENT_ENV] = tracking.start_parent(config["run"]["experiment"], config)
    owner.zone()  # owner-only before any benchmark of a private job lands in it


onsuccess:
    owner.seal()
    tracking.end_parent(config["run"]["experiment"], os.environ[tracking.PARENT_ENV], ok=True, params=config)
    # Version what this run produced: DVC records the outputs' hashes of the stages it ran in dvc.lock and its cache.
    if os.path.isdir(".dvc"):
        dvc_commit.commit_run(os.environ[tracking.PARENT_ENV], config, PYTHON)
    print("\nReport: results/report/report.html (open it in a browser)")
    uri = tracking.tracking_uri()
    if uri.startswith("sqlite"):
        print(f"MLflow: {PYTHON} -m mlflow ui --backend-store-uri {uri}  then http://127.0.0.1:5000")
    else:
        print(f"MLflow: {uri}")


onerror:
    owner.seal()
    if tracking.PARENT_ENV in os.environ:
        tracking.end_parent(config["run"]["experiment"], os.environ[tracking.PARENT_ENV], ok=False, params=config)
