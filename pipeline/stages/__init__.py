"""The stage table: the single source of truth for the Snakemake rules, dvc.yaml and the CLI.

Each stage is run as `dpfm <name>`; it reads only its `sections` of params.yaml and its `inputs`,
and writes its `outputs` (`metrics` are small JSON files). Inputs and outputs are artifact names;
pipeline/artifacts.py gives each its path, once, and stages ask for them (`ctx.stage.input("dp")`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipeline.artifacts import ARTIFACTS, artifact


@dataclass(frozen=True)
class Resources:
    threads: int = 1
    mem_mb: int = 2000
    gpu: int = 0          # GPUs a training stage asks for on a cluster (0 on the CPU default)
    runtime: int = 60     # minutes, for cluster executors


PRIVATE_ARTIFACT = "shards"  # holds the private examples (beside the public eval split)
# What DVC versions in its place: dvc.lock, which git tracks, would hold DVC's plain md5 of the private
# shards and their size in bytes, statistics of them (a guess of one example could be tested against
# the md5). DVC sees their keyed digest, which changes whenever they do, and never caches or pushes them.
PRIVATE_ARTIFACT_FOR_DVC = "shards_digest"


@dataclass(frozen=True)
class Stage:
    name: str
    summary: str
    sections: tuple[str, ...]
    inputs: tuple[str, ...] = ()      # artifact names (ARTIFACTS)
    outputs: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()     # JSON outputs shown by `dvc metrics show`
    resources: Resources = field(default_factory=Resources)

    @property
    def command(self) -> str:
        return f"dpfm {self.name}"

    @property
    def module(self) -> str:
        """The module whose `run(params, ctx)` implements the stage (`runner` imports it)."""
        return f"pipeline.stages.{self.name.replace('-', '_')}"

    def input(self, name: str) -> Path:
        """The path of artifact `name`, which the stage must list as an input: what it reads is what
        Snakemake and DVC know it depends on."""
        if name not in self.inputs:
            raise KeyError(f"stage {self.name} reads {name!r}, which the stage table does not list as its input")
        return artifact(name)

    def output(self, name: str) -> Path:
        if name not in self.outputs + self.metrics:
            raise KeyError(f"stage {self.name} writes {name!r}, which the stage table does not list as its output")
        return artifact(name)

    @property
    def all_outputs(self) -> tuple[str, ...]:
        """Output paths, directories ending with "/"."""
        return tuple(ARTIFACTS[n] for n in self.outputs + self.metrics)

    @property
    def input_paths(self) -> list[str]:
        return [ARTIFACTS[n].rstrip("/") for n in self.inputs]

    @property
    def touches_private_data(self) -> bool:
        """Reads or writes the private shards: then its timing and resource use are statistics of them,
        kept out of MLflow (no system metrics) and out of logs/ (Snakemake's benchmark goes to the owner
        zone)."""
        return PRIVATE_ARTIFACT in self.inputs + self.outputs

    @property
    def dir_outputs(self) -> list[str]:
        return [p.rstrip("/") for p in self.all_outputs if p.endswith("/")]

    @property
    def file_outputs(self) -> list[str]:
        return [p for p in self.all_outputs if not p.endswith("/")]


STAGES: tuple[Stage, ...] = (
    Stage("shards", "write private-train and held-out eval webdataset shards with an index",
          # 2 threads: a labelled set's writer processes (shards.workers 0), as the synthetic stage's
          ("run", "shards"), outputs=("shards", "shards_digest"), resources=Resources(threads=2, mem_mb=2000)),
    Stage("synthetic", "render Shaders21k-style procedural images into shards",
          ("run", "synthetic"), outputs=("synthetic",), resources=Resources(threads=2, mem_mb=4000)),
    Stage("tokenizer", "train SentencePiece on public text (never the private captions)",
          ("run", "tokenizer"), outputs=("tokenizer",), resources=Resources(threads=1, mem_mb=2000)),
    Stage("pretrain", "non-private MAE pretraining on the synthetic images",
          ("run", "model", "pretrain"), inputs=("synthetic",), outputs=("pretrain",),
          resources=Resources(threads=2, mem_mb=8000, gpu=1, runtime=720)),
    Stage("dp-train", "DP-SGD on the private shards, warm-started from the pretrained encoder",
          ("run", "model", "dp", "privacy"), inputs=("shards", "pretrain", "tokenizer"), outputs=("dp",),
          resources=Resources(threads=2, mem_mb=8000, gpu=1, runtime=2880)),
    Stage("verify", "recompute ε from the ledger with independent accountants and check the run",
          ("run", "dp", "privacy", "verify"), inputs=("dp",), metrics=("verification",),
          resources=Resources(threads=1, mem_mb=2000)),
    # After dp-train, though it reads none of its outputs: its point at dp-train's ε is dp-train's run,
    # which it then resumes finished, rather than train it on its one GPU beside dp-train (on one state).
    Stage("curve", "privacy-utility curve: the recipe retrained at each ε of curve.epsilons, linear-probed",
          ("run", "model", "dp", "privacy", "verify", "evaluate", "curve"),
          inputs=("shards", "pretrain", "tokenizer", "dp"), metrics=("curve",),
          resources=Resources(threads=2, mem_mb=8000, gpu=1, runtime=2880)),
    Stage("evaluate", "linear probe, few-shot and zero-shot of the DP encoder beside its baselines",
          ("run", "model", "dp", "privacy", "verify", "evaluate"),
          inputs=("shards", "tokenizer", "pretrain", "dp", "verification", "curve"), metrics=("metrics",),
          # A GPU as the curve: it embeds the eval sets with every encoder, and with evaluate.seeds > 1 it
          # trains the DP recipe again at each other seed.
          resources=Resources(threads=2, mem_mb=8000, gpu=1, runtime=2880)),
    # The report shows every params section of the run (all are upstream of it: no extra re-runs).
    Stage("report", "HTML and Markdown report with plots",
          ("run", "shards", "synthetic", "tokenizer", "model", "pretrain", "dp", "privacy", "verify", "curve",
           "evaluate", "report"),
          inputs=("shards", "synthetic", "pretrain", "dp", "verification", "curve", "metrics"), outputs=("report",),
          metrics=("privacy",),  # the run's final verdict: after the curve and the seeds, which verify precedes
          resources=Resources(threads=1, mem_mb=2000)),
)

STAGE_BY_NAME = {s.name: s for s in STAGES}

# Keys that only name or schedule a run (the MLflow experiment, CPU threads, the device, how the
# shard scan is spread over processes): changing them re-runs nothing, since neither Snakemake nor
# DVC tracks them and no resumable state is keyed by them (a re-run of dp-train would spend privacy
# budget again on the same model). shards.scan_groups gives the same index for any value too, but
# for a web source it is the number of scan jobs the shards rule gathers, so under Snakemake a
# change re-runs shards and what follows (rules/scan.smk); DVC re-runs nothing. A section with
# such keys lists its others in TRACKED (a test checks both against the schema).
UNTRACKED = {"run": ("experiment", "threads", "device"), "shards": ("workers", "scan_groups")}
TRACKED = {"run": ("seed",),
           "shards": ("source", "urls", "path", "limit", "private_limit", "image_size", "eval_fraction", "samples_per_shard",
                      "cache_dir", "download")}
# Keys of how a stage computes, not what it makes (decoding processes, the micro-batch, compilation,
# checkpoint cadence): a change re-runs nothing under Snakemake or DVC, so a GPU job finished under one
# value is not queued again for another (pretrain would train from scratch; dp-train, the curve and
# evaluate's seeds would resume finished after days in the queue). Unlike UNTRACKED they keep their
# place in the resumable state's key (train.state_dir; dp-train's leaves them out itself, with
# dp.eval_every: privacy/training.HOW_IT_RUNS): moving them would orphan the runs keyed with them.
HOW_IT_RUNS = {"dp": ("physical_batch_size", "data_workers", "checkpoint_every", "compile", "compile_backend"),
               "pretrain": ("data_workers", "checkpoint_every"), "synthetic": ("workers",)}

# Sources whose shards are scanned where they live: Snakemake splits their scan into
# shards.scan_groups `dpfm scan-shards` jobs before the shards stage (rules/scan.smk). `download`
# writes its shards inside the stage, so it scans them there too; a labelled set needs no scan.
SCAN_GROUP_SOURCES = ("urls", "img2dataset")


def tracked(params: dict, sections) -> dict:
    """The params a stage's results depend on: its sections less the naming, scheduling and how-it-runs keys."""
    return {s: {k: v for k, v in params[s].items() if k not in UNTRACKED.get(s, ()) + HOW_IT_RUNS.get(s, ())}
            for s in sections}


def params_digest(params: dict, name: str) -> str:
    """A digest of the params stage `name` was run with (those that re-run it): a later command can tell
    whether its output is from the params it has now."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(tracked(params, stage(name).sections), sort_keys=True).encode()).hexdigest()[:16]


def eval_files_tag(sets: list[dict]) -> str:
    """A digest of the names, sizes and modification times of the files under the eval sets' local paths
    (`path`, `train`, `test`), for Snakemake to compare as a param: the paths are params, the files under
    them not, so images replaced, relabelled or added under the same path left evaluate and the curve up
    to date with the accuracies of the old files. Names and sizes of public data only."""
    return _files_tag([Path(spec[key]) for spec in sets for key in ("path", "train", "test") if spec.get(key)],
                      sizes=True)


def source_files_tag(shards: dict) -> str:
    """The same for the shards stage, of the private source's local files: a (url, caption) table edited,
    shards img2dataset finished after a run, a shard rewritten in place under the same name left the
    shards, and the model, up to date with the old data. Names and modification times only: a size is
    a statistic of the examples. Remote shards are checked by their version tags when they are scanned."""
    from pipeline.data import remote, sources

    if shards["source"] in ("download", "img2dataset") and shards["path"] and remote.is_local(shards["path"]):
        roots = [Path(remote.local_path(shards["path"]))]
    elif shards["source"] == "urls":
        try:
            roots = [Path(remote.local_path(u)) for u in sources.expand_urls(shards["urls"]) if remote.is_local(u)]
        except ValueError:  # a bad pattern: the stage names it when it runs
            roots = []
    else:  # the labelled sets: public packages
        roots = []
    return _files_tag(roots, sizes=False)


def _files_tag(roots: list[Path], sizes: bool) -> str:
    import hashlib
    import os

    digest = hashlib.sha256()
    for root in roots:
        walked = os.walk(root) if root.is_dir() else [(root.parent, [], [root.name])]
        for folder, dirs, files in walked:
            dirs.sort()
            for name in sorted(files):
                try:
                    st = os.stat(Path(folder) / name)
                except FileNotFoundError:  # a missing path: the stage names it when it runs
                    continue
                digest.update(f"{Path(folder) / name}\0{st.st_size if sizes else ''}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def dvc_params(st: Stage) -> list[str]:
    """The stage's params as dvc.yaml lists them: whole sections, or a section's tracked keys."""
    from pipeline.config import load_schema

    def keys(s: str) -> list[str]:
        if s in TRACKED:
            return list(TRACKED[s])
        return [k for k in load_schema()["properties"][s]["properties"] if k not in HOW_IT_RUNS[s]]

    return [item for s in st.sections
            for item in ([f"{s}.{k}" for k in keys(s)] if s in TRACKED or s in HOW_IT_RUNS else [s])]


def stage(name: str) -> Stage:
    try:
        return STAGE_BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown stage {name!r}; stages: {', '.join(STAGE_BY_NAME)}") from None


def check_table() -> None:
    """Every artifact is known, and every input is produced by an earlier stage: the table is a DAG
    in listed order."""
    produced: set[str] = set()
    for s in STAGES:
        unknown = [a for a in s.inputs + s.outputs + s.metrics if a not in ARTIFACTS]
        if unknown:
            raise ValueError(f"stage {s.name}: {unknown} are not in ARTIFACTS")
        missing = [i for i in s.inputs if i not in produced]
        if missing:
            raise ValueError(f"stage {s.name}: inputs {missing} are not produced by an earlier stage")
        produced.update(s.outputs + s.metrics)
