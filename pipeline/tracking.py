"""MLflow tracking: one parent run per pipeline invocation, one nested child run per stage.

The Snakefile's `onstart` opens the parent and exports its id in DPFM_PARENT_RUN_ID, which every
stage process inherits. At the end the parent is named after what ran (e.g. `ViP ε=7.99 σ=0.34`)
and holds params.yaml as params, the headline metrics and the report; a parent under which no stage
ran (`snakemake --touch`) is deleted. `MLFLOW_TRACKING_URI` is honoured (use a server on clusters);
the default is a SQLite store at the project root.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import yaml

from pipeline.errors import Stopped
from pipeline.eval.stats import released
from pipeline.privacy.accounting import bound_text
from pipeline.io import file_digest, file_stamp

PARENT_ENV = "DPFM_PARENT_RUN_ID"
FILE_DIGESTS = "file-digests"  # owner record: the md5s input_tag read, by file stamp


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


# The empty file Snakemake leaves in a directory output after its job: not content, and .dvcignore
# keeps it out of DVC's hashes too (the shards stage's digest is taken before Snakemake writes it).
SNAKEMAKE_MARKER = ".snakemake_timestamp"
# dp-train's non-private twin (dp.nonprivate_baseline) sits beside the DP model for evaluate, but is
# trained without DP on the private shards: .dvcignore keeps it out of the pushed output.
NONPRIVATE_TWIN = "nonprivate.pt"
DVC_IGNORED = frozenset({SNAKEMAKE_MARKER, NONPRIVATE_TWIN})  # file names, as .dvcignore has them


def dvc_hash(path: str | Path, known: dict | None = None) -> str:
    """The md5 DVC records for a file, or its `<md5>.dir` hash for a directory (without Snakemake's
    marker and the non-private twin, as .dvcignore has it). `known` (resolved path -> [size, mtime_ns,
    inode, md5], updated in place) spares reading a file that has not changed since an earlier call,
    as DVC's state database does."""
    path = Path(path)
    md5 = (lambda p: file_digest(p, "md5")) if known is None else (lambda p: known_md5(p, known))
    if path.is_file():
        return md5(path)
    entries = [{"md5": md5(p), "relpath": p.relative_to(path).as_posix()}
               for p in sorted(path.rglob("*")) if p.is_file() and p.name not in DVC_IGNORED]
    entries.sort(key=lambda e: e["relpath"])
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode()).hexdigest() + ".dir"


def known_md5(path: Path, known: dict) -> str:
    """`path`'s md5, read again only when its size, mtime or inode moved (shards are written to a
    temporary name and renamed, so a rewrite has a new inode). Stat before reading: a file changed
    during the read is recorded under its old stamp and read again next time."""
    stamp = file_stamp(path)
    key = str(path.resolve())
    if known.get(key, [None])[:3] != stamp:
        known[key] = [*stamp, file_digest(path, "md5")]
    return known[key][3]


def recorded_md5s() -> dict:
    """input_tag's record in the owner's zone; an unreadable one (edited by hand, say) is only a cache."""
    from pipeline.privacy import owner

    try:
        return owner.read(FILE_DIGESTS) or {}
    except (OSError, ValueError):
        return {}


def input_tag(path: str) -> str:
    """DVC's hash of an input; keyed (privacy/budget.public_name) for the private shards, whose plain
    hash would let anyone test a guess of the private data against it. Files unchanged since an earlier
    stage are not read again: at 233M examples the private index alone is tens of GB, and four stages
    start on it. Their md5s are plain digests of the private data, so they stay in the owner's zone."""
    from pipeline.artifacts import ARTIFACTS
    from pipeline.privacy import owner
    from pipeline.stages import PRIVATE_ARTIFACT

    known = recorded_md5s()
    before = dict(known)
    digest = dvc_hash(path, known)
    if changed := {k: v for k, v in known.items() if before.get(k) != v}:
        owner.write(FILE_DIGESTS, {**recorded_md5s(), **changed})  # with what a parallel stage recorded
    if Path(path) != Path(ARTIFACTS[PRIVATE_ARTIFACT]):
        return digest
    from pipeline.privacy.budget import public_name

    return public_name(digest)


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
    """What a stage logs to its MLflow child run.

    A stage on the private data stamps every metric with one time, its start: MLflow would otherwise
    stamp each with the time of its call, and a stage that trains several times (the curve's points,
    evaluate's extra seeds) would publish how long each training took, which follows the batch sizes
    it sampled. The stage's wall time, from its run's start and end, stays visible."""

    def __init__(self, mlflow, run_id: str, stamp: int | None = None):
        self._mlflow = mlflow
        self.run_id = run_id
        self.stamp = stamp  # ms: every metric's timestamp, on private data; else the time of the call

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        """At the stage's stamp on private data (the time between calls must not show), else at the call's time."""
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        _retry(lambda: self._mlflow.log_metrics(clean, step=step, timestamp=self.stamp))

    def log_series(self, name: str, values, steps) -> None:
        """A whole curve in one batched call (fewer SQLite writes than one call per point)."""
        from mlflow.entities import Metric

        now = self.stamp if self.stamp is not None else int(time.time() * 1000)
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

    def log_dict(self, data: dict, name: str) -> None:
        _retry(lambda: self._mlflow.log_dict(data, name))

    def log_dp_model(self, checkpoint: str | Path, epsilon: float, delta: float, epsilon_composed: float | None = None,
                     delta_composed: float | None = None, private: bool = True, budget: str | None = None) -> str:
        """The DP encoder (images -> features) as an MLflow model, registered as `dpfm-<objective>`
        with its ε and δ as version tags. Only verified models get here (the verify stage). `private`
        False: the run's outputs as a whole are not covered (release.not_private_reasons), so the
        composed ε is tagged ∞. `budget` (budget.registry_id): the budget its examples are charged to."""
        import torch
        from mlflow.models import infer_signature

        from pipeline import checkpoints

        ckpt = checkpoints.load(checkpoint)
        if not ckpt.private:
            raise ValueError(f"{checkpoint} is not private: it is never registered as a DP model")
        encoder = ckpt.build_encoder()
        encoder.eval()
        example = torch.zeros(2, 3, encoder.img_size, encoder.img_size)
        with torch.no_grad():
            signature = infer_signature(example.numpy(), encoder(example).numpy())
        name = f"dpfm-{ckpt.objective}"
        info = _retry(lambda: self._mlflow.pytorch.log_model(
            encoder, name="dp_encoder", signature=signature,
            serialization_format="pickle", code_paths=[str(Path(__file__).parent)],  # the classes travel with it
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "numpy"]))
        # `epsilon` is what all DP runs on the examples compose to (the report updates it after the
        # curve's and the seeds' trainings); `epsilon_run` is this model's own.
        composed = math.inf if not private else epsilon if epsilon_composed is None else epsilon_composed
        composed_at = delta if delta_composed is None else delta_composed
        tags = {"epsilon": bound_text(composed, 4), "delta_composed": bound_text(composed_at, 3, True),
                "epsilon_run": bound_text(epsilon, 4), "delta": bound_text(delta, 3, exponent=True),
                "private": str(private).lower()} | ({"budget": budget} if budget else {})
        # The version is created with its tags in one write: registered first and tagged after, a failure or
        # a kill between the two left a published version with no ε and no NOT PRIVATE mark.
        _retry(lambda: self._mlflow.register_model(info.model_uri, name, tags=tags))
        return name

    def tag_dp_models(self, tags: dict, budget: str | None = None) -> int:
        """Set `tags` (release.registry_tags) on every model version whose examples are charged to `budget`
        (budget.registry_id), whichever run registered it, and on those registered under this pipeline's
        parent run; how many. A version tagged NOT PRIVATE stays so (its own run may have had a reason
        this one lacks) and keeps its reasons, and its composed ε never falls."""
        parent = os.environ.get(PARENT_ENV)
        client = self._mlflow.tracking.MlflowClient()
        tagged = 0
        for model in _retry(lambda: client.search_registered_models(filter_string="name LIKE 'dpfm-%'")):
            for v in _retry(lambda: client.search_model_versions(f"name='{model.name}'")):
                ours = (budget is not None and v.tags.get("budget") == budget) or (
                    parent and v.run_id and client.get_run(v.run_id).data.tags.get("mlflow.parentRunId") == parent)
                if not ours or (v.tags.get("private") == "false" and tags.get("private") != "false"):
                    continue
                new = dict(tags)
                if "epsilon" in new and "epsilon" in v.tags and float(v.tags["epsilon"]) > float(new["epsilon"]):
                    new["epsilon"] = v.tags["epsilon"]  # and the δ it holds at
                    new.pop("delta_composed", None)
                    new |= {"delta_composed": v.tags["delta_composed"]} if "delta_composed" in v.tags else {}
                if "not_private" in new and "not_private" in v.tags:  # its own reasons kept
                    new["not_private"] = "; ".join(dict.fromkeys(v.tags["not_private"].split("; ")
                                                                 + new["not_private"].split("; ")))
                for key, value in new.items():
                    _retry(lambda: client.set_model_version_tag(model.name, v.version, key, str(value)))
                tagged += 1
        return tagged


class NullRun:
    """For non-main ranks of a torchrun job: one MLflow run per stage, logged by rank 0 only."""

    run_id = None

    def log_metrics(self, metrics, step=None): ...
    def log_series(self, name, values, steps): ...
    def log_artifact(self, path, artifact_path=None): ...
    def set_tags(self, tags): ...
    def log_dict(self, data, name): ...
    def log_dp_model(self, checkpoint, epsilon, delta, epsilon_composed=None, delta_composed=None, private=True,
                     budget=None): ...
    def tag_dp_models(self, tags, budget=None): return 0


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
    """Open the stage's MLflow run (nested under the pipeline's parent run when there is one), tagged with
    the git commit, the SLURM job and the DVC hashes of the stage's inputs."""
    mlflow = _mlflow(experiment)
    parent = os.environ.get(PARENT_ENV)
    tags = {"dpfm.stage": stage.name, "mlflow.source.git.commit": git_commit()}
    from pipeline import slurm

    if (job := slurm.job_id()) is not None:  # to find the job's SLURM log from its MLflow run
        tags["slurm.job_id"] = job
    if parent:
        tags["mlflow.parentRunId"] = parent
    for path in stage.input_paths:
        if Path(path).exists():
            tags[f"dvc.input.{path}"] = input_tag(path)
    # No system metrics, for any stage (even over MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING): MLflow samples
    # the whole machine (CPU, memory, disk, network, every GPU), so a stage on public data beside a job
    # on the private shards (scan, dp-train) would publish that job's bytes written and its load.
    run = _retry(lambda: mlflow.start_run(run_name=stage.name, tags=tags, log_system_metrics=False))
    try:
        # Secrets never reach the tracking store.
        flat = {k: v for k, v in flatten(params).items() if not k.endswith("noise_seed")}
        _retry(lambda: mlflow.log_params({k: json.dumps(v) if isinstance(v, (list, dict)) else v
                                          for k, v in flat.items()}))
        yield StageRun(mlflow, run.info.run_id, run.info.start_time if stage.touches_private_data else None)
    except BaseException as e:
        status = "KILLED" if isinstance(e, (Stopped, KeyboardInterrupt)) else "FAILED"
        _retry(lambda: mlflow.end_run(status=status))
        raise
    _retry(lambda: mlflow.end_run(status="FINISHED"))


def start_parent(experiment: str, params: dict | None = None) -> str:
    """Open the pipeline's parent run, with params.yaml as its params. Called under Snakemake's lock
    on this workdir."""
    mlflow = _mlflow(experiment)
    client = mlflow.tracking.MlflowClient()
    exp_id = mlflow.get_experiment_by_name(experiment).experiment_id
    workdir = str(Path.cwd().resolve())
    mark_killed_runs(client, exp_id, workdir)
    params = params or {}
    dp = params.get("dp")
    name = f"{dp['objective']} ε≤{dp['epsilon']:g}" if dp else "pipeline"  # renamed after what ran (end_parent)
    run = _retry(lambda: client.create_run(exp_id, run_name=name, tags={
        "dpfm.pipeline": "true", "dpfm.workdir": workdir, "mlflow.source.git.commit": git_commit(),
        "dpfm.host": socket.gethostname(), "dpfm.pid": str(os.getpid())}))  # who runs it (mark_killed_runs)
    flat = {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in flatten(params).items()
            if not k.endswith("noise_seed")}  # secrets never reach the tracking store
    from mlflow.entities import Param

    items = [Param(k, str(v)) for k, v in flat.items()]
    for i in range(0, len(items), 90):
        _retry(lambda: client.log_batch(run.info.run_id, params=items[i:i + 90]))
    return run.info.run_id


def headline(verification: dict | None, metrics: dict | None, privacy: dict | None = None) -> dict:
    """The numbers a run is compared by: ε, δ, σ, the ε all DP runs on the data compose to (as the
    report, the last stage, computed it), and the DP model's linear probe and zero-shot on the first
    eval set."""
    out = {}
    if verification:
        out.update(epsilon=verification["epsilon_reported"], delta=verification["delta"], sigma=verification["sigma"])
    if privacy and privacy.get("private"):  # a run that is NOT PRIVATE as a whole has composed ε = ∞ (a tag)
        out["epsilon_composed"] = privacy["epsilon_composed"]
    if metrics and metrics.get("sets"):
        dp = metrics["sets"][metrics["primary_set"]]["results"].get("dp", {})
        dp = released(dp)  # beside the model's ε: that model's figures, not a mean over seeds
        out.update({key: dp[key] for key in ("linear_probe", "zero_shot") if isinstance(dp.get(key), (int, float))})
    return out


def not_private_by_config(params: dict, verification: dict | None) -> dict | None:
    """privacy.json's NOT PRIVATE verdict as far as the validated config, the shards' stats and verify's
    composition give it, for a run whose report did not run (a test run, the curve's ε = ∞ point, an eval
    split carved from the private data, an earlier release outside DP on the budget, ...); None when they
    give none, which is no proof of private: the curve and the seeds may charge more after verify."""
    from pipeline.artifacts import artifact
    from pipeline.privacy.release import known_before_the_report

    reasons = known_before_the_report(params, artifact("shards") / "stats.json", verification)
    return {"private": False, "not_private": reasons} if reasons else None


def mark_killed_runs(client, experiment_id: str, workdir: str) -> list[str]:
    """A pipeline killed with -9 (a preempted job) never ends its runs: they would show as running
    forever. Mark this workdir's open ones KILLED, with their open stage runs, unless their Snakemake is
    still running on this machine: Snakemake locks the files a run makes, not the workdir, so two runs
    of disjoint targets (`snakemake data/synthetic` beside `snakemake data/shards`) run at once. One on
    another machine (a requeued job on another node, most often) cannot be asked: it is marked."""
    open_runs = _retry(lambda: client.search_runs(
        [experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=10_000))
    parents = {r.info.run_id for r in open_runs
               if r.data.tags.get("dpfm.pipeline") == "true" and r.data.tags.get("dpfm.workdir") == workdir
               and not _running_here(r.data.tags)}
    killed = [r.info.run_id for r in open_runs
              if r.info.run_id in parents or r.data.tags.get("mlflow.parentRunId") in parents]
    for run_id in killed:
        _retry(lambda: client.set_terminated(run_id, status="KILLED"))
    if parents:
        print(f"MLflow: marked {len(parents)} pipeline run(s) of this workdir that were killed as KILLED")
    return killed


def _running_here(tags: dict) -> bool:
    """Whether the Snakemake that opened a parent run (its tags) still runs on this machine."""
    if tags.get("dpfm.host") != socket.gethostname() or not tags.get("dpfm.pid", "").isdigit():
        return False
    try:
        os.kill(int(tags["dpfm.pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def end_parent(experiment: str, run_id: str, ok: bool, params: dict | None = None) -> None:
    """Close the parent: delete it if no stage ran under it (`--touch`, nothing to do); else name it
    after what ran and attach the headline metrics, the params (`params`: the workflow's validated
    config, which its jobs ran with; params.yaml as it is now, edited since, otherwise) and the report."""
    from pipeline.io import read_json
    from pipeline.objectives import recipe_name

    mlflow = _mlflow(experiment)
    client = mlflow.tracking.MlflowClient()
    exp_id = client.get_run(run_id).info.experiment_id
    children = _retry(lambda: client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'",
                                                 max_results=1))
    if not children:
        _retry(lambda: client.delete_run(run_id))
        return
    if ok:
        started_s = client.get_run(run_id).info.start_time / 1000

        def load(path):
            """An output of this run; one left by an earlier run (a partial target) names nothing."""
            return read_json(path) if Path(path).is_file() and Path(path).stat().st_mtime >= started_s else None

        from pipeline.artifacts import artifact

        report, ledger = artifact("report"), artifact("dp") / "ledger.json"
        verification, metrics = load(artifact("verification")), load(artifact("metrics"))
        privacy_path = artifact("privacy")
        privacy = written = load(privacy_path)
        numbers = headline(verification, metrics, privacy)
        if numbers:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            _retry(lambda: client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in numbers.items()]))
        if privacy is None and params is not None:  # the report did not run: what its config and verify say
            privacy = not_private_by_config(params, verification)
        name = client.get_run(run_id).info.run_name  # the start's, when verify did not run
        if verification:
            objective = read_json(ledger)["objective"] if ledger.is_file() else ""
            name = (f"{recipe_name(objective)} ε={bound_text(verification['epsilon_reported'], 2)} "
                    f"σ={verification['sigma']:.2f}")
        _name_and_label(client, run_id, name, privacy)
        if params is None and Path("params.yaml").is_file():
            params = yaml.safe_load(Path("params.yaml").read_text())
        if params:  # as the report shows it: a known noise key never leaves the machine
            from pipeline.report.render import params_yaml

            shown = params_yaml(params)
            _retry(lambda: client.log_text(run_id, shown, "params.yaml"))
        if written:  # the report ran in this run (it writes privacy.json after its folder)
            if report.is_dir():
                _retry(lambda: client.log_artifacts(run_id, str(report), "report"))
            _retry(lambda: client.log_artifact(run_id, str(privacy_path), "report"))
    elif params is not None:  # its stages may have logged what the config leaves outside ε (n under add_remove)
        _name_and_label(client, run_id, client.get_run(run_id).info.run_name, not_private_by_config(params, None))
    _retry(lambda: client.set_terminated(run_id, status="FINISHED" if ok else "FAILED"))


def _name_and_label(client, run_id: str, name: str, privacy: dict | None) -> None:
    """The parent's name, NOT PRIVATE before it, and its dpfm.private tags, when `privacy` (privacy.json's
    verdict, or not_private_by_config's) says the run is not private."""
    if privacy and not privacy["private"] and not name.startswith("NOT PRIVATE"):
        name = "NOT PRIVATE " + name
    _retry(lambda: client.set_tag(run_id, "mlflow.runName", name))
    if privacy:
        _retry(lambda: client.set_tag(run_id, "dpfm.private", str(privacy["private"]).lower()))
        if not privacy["private"]:
            _retry(lambda: client.set_tag(run_id, "dpfm.not_private", "; ".join(privacy["not_private"])))
