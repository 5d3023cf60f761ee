"""MLflow tracking: one parent run per pipeline invocation, one nested child run per stage.

The Snakefile's `onstart` opens the parent and exports its id in DPFM_PARENT_RUN_ID, which every
stage process inherits. `MLFLOW_TRACKING_URI` is honoured (use a server on clusters); the default
is a SQLite store at the project root.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from pipeline.errors import Stopped
from pipeline.io import file_digest

PARENT_ENV = "DPFM_PARENT_RUN_ID"


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlflow.db').resolve()}"


def _mlflow(experiment: str):
    import mlflow  # slow to import: only when tracking is used

    mlflow.set_tracking_uri(tracking_uri())
    if mlflow.get_experiment_by_name(experiment) is None:
        uri = tracking_uri()
        # Local stores keep artifacts beside the database; servers choose their own location.
        location = Path("mlartifacts").resolve().as_uri() if uri.startswith(("sqlite", "file")) else None
        try:
            mlflow.create_experiment(experiment, artifact_location=location)
        except Exception:  # another stage created it first
            pass
    mlflow.set_experiment(experiment)
    return mlflow


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def dvc_hash(path: str | Path) -> str:
    """The md5 DVC records for a file, or its `<md5>.dir` hash for a directory."""
    path = Path(path)
    if path.is_file():
        return file_digest(path, "md5")
    entries = [{"md5": file_digest(p, "md5"), "relpath": p.relative_to(path).as_posix()}
               for p in sorted(path.rglob("*")) if p.is_file()]
    entries.sort(key=lambda e: e["relpath"])
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode()).hexdigest() + ".dir"


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class StageRun:
    """What a stage logs to its MLflow child run."""

    def __init__(self, mlflow, run_id: str):
        self._mlflow = mlflow
        self.run_id = run_id

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        _retry(lambda: self._mlflow.log_metrics(clean, step=step))

    def log_series(self, name: str, values, steps) -> None:
        """A whole curve in one batched call (fewer SQLite writes than one call per point)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(name, float(v), now, int(s)) for v, s in zip(values, steps)]
        client = self._mlflow.tracking.MlflowClient()
        for i in range(0, len(batch), 900):
            _retry(lambda: client.log_batch(self.run_id, metrics=batch[i:i + 900]))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            _retry(lambda: self._mlflow.log_artifacts(str(path), artifact_path))
        elif path.exists():
            _retry(lambda: self._mlflow.log_artifact(str(path), artifact_path))

    def set_tags(self, tags: dict) -> None:
        _retry(lambda: self._mlflow.set_tags({k: str(v) for k, v in tags.items()}))


class NullRun:
    """For non-main ranks of a torchrun job: one MLflow run per stage, logged by rank 0 only."""

    run_id = None

    def log_metrics(self, metrics, step=None): ...
    def log_series(self, name, values, steps): ...
    def log_artifact(self, path, artifact_path=None): ...
    def set_tags(self, tags): ...


def _retry(fn, attempts: int = 8):
    """SQLite allows one writer at a time: parallel stages retry on 'database is locked'."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as e:  # mlflow wraps sqlalchemy's OperationalError in its own types
            if "locked" not in str(e).lower() or i == attempts - 1:
                raise
            time.sleep(0.2 * 2 ** i)


@contextmanager
def stage_run(stage, params: dict, experiment: str):
    """Open the stage's MLflow run (nested under the pipeline's parent run when there is one)."""
    mlflow = _mlflow(experiment)
    parent = os.environ.get(PARENT_ENV)
    tags = {"dpfm.stage": stage.name, "mlflow.source.git.commit": git_commit()}
    if parent:
        tags["mlflow.parentRunId"] = parent
    for path in stage.inputs:
        if Path(path).exists():
            tags[f"dvc.input.{path.rstrip('/')}"] = dvc_hash(path)
    run = _retry(lambda: mlflow.start_run(run_name=stage.name, tags=tags))
    try:
        # Secrets never reach the tracking store.
        flat = {k: v for k, v in flatten(params).items() if not k.endswith("noise_seed")}
        _retry(lambda: mlflow.log_params({k: json.dumps(v) if isinstance(v, (list, dict)) else v
                                          for k, v in flat.items()}))
        yield StageRun(mlflow, run.info.run_id)
    except BaseException as e:
        status = "KILLED" if isinstance(e, (Stopped, KeyboardInterrupt)) else "FAILED"
        _retry(lambda: mlflow.end_run(status=status))
        raise
    _retry(lambda: mlflow.end_run(status="FINISHED"))


def start_parent(experiment: str, name: str = "pipeline") -> str:
    """Open the pipeline's parent run. Called under Snakemake's lock on this workdir."""
    mlflow = _mlflow(experiment)
    client = mlflow.tracking.MlflowClient()
    exp_id = mlflow.get_experiment_by_name(experiment).experiment_id
    workdir = str(Path.cwd().resolve())
    mark_killed_runs(client, exp_id, workdir)
    run = _retry(lambda: client.create_run(exp_id, run_name=name, tags={
        "dpfm.pipeline": "true", "dpfm.workdir": workdir, "mlflow.source.git.commit": git_commit()}))
    return run.info.run_id


def mark_killed_runs(client, experiment_id: str, workdir: str) -> list[str]:
    """A pipeline killed with -9 (a preempted job) never ends its runs: they would show as running
    forever. We hold Snakemake's lock on `workdir`, so its runs still open are dead: mark them KILLED,
    with their open stage runs."""
    open_runs = _retry(lambda: client.search_runs(
        [experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=10_000))
    parents = {r.info.run_id for r in open_runs
               if r.data.tags.get("dpfm.pipeline") == "true" and r.data.tags.get("dpfm.workdir") == workdir}
    killed = [r.info.run_id for r in open_runs
              if r.info.run_id in parents or r.data.tags.get("mlflow.parentRunId") in parents]
    for run_id in killed:
        _retry(lambda: client.set_terminated(run_id, status="KILLED"))
    if parents:
        print(f"MLflow: marked {len(parents)} pipeline run(s) of this workdir that were killed as KILLED")
    return killed


def end_parent(experiment: str, run_id: str, ok: bool) -> None:
    mlflow = _mlflow(experiment)
    client = mlflow.tracking.MlflowClient()
    _retry(lambda: client.set_terminated(run_id, status="FINISHED" if ok else "FAILED"))
