"""Nothing published holds a statistic of the private data (privacy/owner.py).

The whole DAG runs under Snakemake on a web source with bad samples (so there are exclusions to
count), once per objective, and each objective's dp-train, curve and evaluate again on two ranks
(torchrun; verify and the report by Snakemake). Afterwards every published artifact is scanned:
every file the project holds outside the owner's zone and the data (results/ and models/, the DVC outputs `make push`
uploads; logs/; whatever a stage writes elsewhere), data/shards/stats.json, what Snakemake printed,
and everything in MLflow (params, metrics, tags, artifacts, the registry). The
needles are the values the owner-only zone (`.dpfm/owner/`) holds for each run: the realised batch
sizes, the batch-size test's p-values, the exclusion counts by reason; and the names under which
they used to leak (`batch_sizes`, `nonfinite_examples`, `excluded`, `steps_per_s` of a private run).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from pipeline.data.shards import encode_png
from shard_data import picture, write_set
from snakemake_project import set_params
from stage_runs import torchrun
from test_e2e import dvc_project, snakemake

OBJECTIVES = ("mae", "caption", "clip")
REASONS = ("corrupt_image", "missing_caption", "missing_image")
# The keys these statistics were published under (a key followed by its value), and the reasons
# themselves; a check named batch_sizes_binomial or a sentence saying where the exclusions are kept
# is no leak.
LEAKY_KEYS = re.compile(r"\b(batch_sizes|nonfinite_examples|batch_size_p_values|p_mean|p_dispersion|excluded)\b"
                        r"[\"']?\s*[:=]")
PUBLIC_STAGES = ("synthetic", "tokenizer", "pretrain")  # they read no private data
LEAKY_WORDS = (*REASONS, *(r.replace("_", " ") for r in REASONS))
TEXT_SUFFIXES = {".json", ".md", ".html", ".txt", ".yaml", ".log", ".tsv", ".jsonl", ".csv", ".svg", ""}


def leaky_names(text: str) -> list[str]:
    return [m.group(1) for m in LEAKY_KEYS.finditer(text)] + [w for w in LEAKY_WORDS if w in text]


def web_source(root: Path) -> str:
    """60 good samples in 4 shards, and a fifth shard with 3 corrupt images, 2 images without a
    caption and 1 caption without an image."""
    write_set(root, n=60, per_shard=15, prefix="w")
    rng = np.random.default_rng(1)
    # Each corrupt image beside its caption: a sample's members are consecutive in a webdataset tar.
    members = [m for i in range(3) for m in ((f"bad{i}.png", b"not a png"), (f"bad{i}.txt", b"a caption"))]
    members += [(f"bare{i}.png", encode_png(picture(rng))) for i in range(2)] + [("lonely.txt", b"no image")]
    with tarfile.open(root / "w-000004.tar", "w") as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return str(root / "w-{000000..000004}.tar")


# What the walk of the project leaves out: the owner's zone, the private data with its budget, and the
# tools' own state (Snakemake's copy of what it printed is "snakemake output"; DVC's cache holds the
# outputs' bytes, scanned where they are).
UNPUBLISHED = {".dpfm", "data", ".snakemake", ".git", ".dvc"}


def published_texts(work: Path, printed: str) -> dict[str, str]:
    """Every published file's text, by path (every file the project holds outside UNPUBLISHED, whichever
    stage wrote it); of a checkpoint, the params it keeps beside the weights."""
    from pipeline import checkpoints

    texts = {"snakemake output": printed}
    for f in work.rglob("*"):
        if not f.is_file() or f.relative_to(work).parts[0] in UNPUBLISHED:
            continue
        if f.suffix in TEXT_SUFFIXES:
            texts[str(f.relative_to(work))] = f.read_text(errors="replace")
        elif f.suffix == ".pt":
            texts[str(f.relative_to(work))] = json.dumps(checkpoints.load(f).config, default=str)
    assert {"results", "models", "logs", "mlartifacts"} <= {Path(k).parts[0] for k in texts}, sorted(texts)[:20]
    texts["data/shards/stats.json"] = (work / "data/shards/stats.json").read_text()
    # Git tracks dvc.lock (docs/pipeline.md: commit it with the run), and data/budget.dvc once pushed.
    for f in ("dvc.lock", "data/budget.dvc"):
        if (work / f).exists():
            texts[f] = (work / f).read_text()
    assert "dvc.lock" in texts, "the project is a DVC repository: the run must write dvc.lock"
    return texts


def mlflow_texts(work: Path) -> tuple[dict[str, str], list]:
    """MLflow's params, metric names and values, tags and registry tags, as text per run; and the runs."""
    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("dpfm").experiment_id], max_results=1000)
    texts = {}
    for r in runs:
        history = {k: [m.value for m in client.get_metric_history(r.info.run_id, k)] for k in r.data.metrics}
        texts[f"mlflow run {r.info.run_name}"] = json.dumps({"params": r.data.params, "metrics": history,
                                                            "tags": r.data.tags}, default=str)
    for model in client.search_registered_models():
        for v in client.search_model_versions(f"name='{model.name}'"):
            texts[f"registry {model.name} v{v.version}"] = json.dumps(v.tags)
    return texts, runs


def owner_needles(work: Path) -> dict[str, list[str]]:
    """What the owner-only zone holds, as the strings a release of it would contain."""
    owner = work / ".dpfm/owner"
    needles = {"exclusions": [], "batch sizes": [], "p-values": []}
    shards = json.loads((owner / "shards.json").read_text())
    total = {}
    for split in ("private", "eval"):
        for reason, count in shards[split]["excluded"].items():
            total[reason] = total.get(reason, 0) + count
    assert set(REASONS) <= set(total), "the web source has each kind of bad sample: the owner file must count them"
    needles["exclusions"] = [json.dumps(total, sort_keys=True)[1:-1], f"{shards['private']['rows']} rows"]
    for f in (owner / "runs").glob("*.json"):
        record = json.loads(f.read_text())
        if "batch_sizes" in record:
            sizes = record["batch_sizes"]
            needles["batch sizes"] += [json.dumps(sizes), ", ".join(map(str, sizes)), json.dumps(sizes, indent=2)]
        for p in record.get("batch_size_p_values", {}).values():
            if 0 < p < 1:
                # Full precision and 4 decimals; fewer digits would match public numbers by chance
                # (an accuracy of 0.862 against a p-value of 0.86199...).
                needles["p-values"] += [repr(p), f"{p:.4f}"]
    assert needles["batch sizes"] and needles["p-values"], sorted(p.name for p in (owner / "runs").glob("*"))
    return needles


def holds(text: str, needle: str) -> bool:
    """`needle` in `text` as a whole number: 0.8620 is not in 0.86201, nor 12 in 123."""
    return re.search(rf"(?<![\d.]){re.escape(needle)}(?![\d])", text) is not None


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    """The DAG once per objective on one project: (project, {objective: published texts}, owner needles)."""
    work = dvc_project(tmp_path_factory.mktemp("zone"))  # a DVC repository: its dvc.lock is in git
    pattern = web_source(tmp_path_factory.mktemp("web"))
    set_params(work, {"shards": {"source": "urls", "urls": [pattern], "eval_fraction": 0, "workers": 1,
                                 "image_size": 16},
                      "dp": {"expected_batch_size": 24},
                      "curve": {"epsilons": [2]}})  # no ε = ∞ point: refused on a web source by default
    published, needles = {}, {}
    for obj in OBJECTIVES:
        set_params(work, {"dp": {"objective": obj}})
        printed = snakemake(work)
        published[obj] = published_texts(work, printed)
        # dp-train, the curve (its synthetic-init point) and evaluate again on two ranks (rank 1 prints and
        # logs too), Snakemake for verify before evaluate and for the report after. The trainings' states
        # are deleted first, or the finished runs would only be resumed: they train, and are charged, again.
        for state in (work / ".dpfm/state").glob("dp-train-*"):
            shutil.rmtree(state)
        charged = (work / "data/budget/runs.jsonl").read_text().count("\n")
        printed = on_two_ranks(work, "dp-train") + on_two_ranks(work, "curve", "curve.inits=[pretrain]")
        printed += snakemake(work, "verify") + on_two_ranks(work, "evaluate") + snakemake(work)
        published[f"{obj}-2ranks"] = published_texts(work, printed)
        assert (work / "data/budget/runs.jsonl").read_text().count("\n") == charged + 2  # dp-train, the curve's point
        for kind, values in owner_needles(work).items():
            needles.setdefault(kind, set()).update(values)
    return work, published, needles


def on_two_ranks(work: Path, name: str, *overrides: str) -> str:
    """What `dpfm <name>` prints on two CPU ranks (torchrun), MLflow in the project as Snakemake has it."""
    saved = os.environ.pop("MLFLOW_TRACKING_URI", None)  # set by an in-process stage earlier: not the project's
    try:
        proc = torchrun(work, name, overrides)
    finally:
        if saved is not None:
            os.environ["MLFLOW_TRACKING_URI"] = saved
    return proc.stdout + proc.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("objective", [*OBJECTIVES, *(f"{obj}-2ranks" for obj in OBJECTIVES)])
def test_no_published_file_holds_a_private_statistic(pipeline_runs, objective):
    work, published, needles = pipeline_runs
    found = [(where, kind, needle) for where, text in published[objective].items()
             for kind, values in needles.items() for needle in values if holds(text, needle)]
    found += [(where, "name", name) for where, text in published[objective].items() for name in leaky_names(text)]
    assert not found, found[:10]


@pytest.mark.e2e
def test_mlflow_and_the_registry_hold_no_private_statistic(pipeline_runs):
    work, _, needles = pipeline_runs
    texts, runs = mlflow_texts(work)
    assert {r.data.tags.get("dpfm.stage") for r in runs} >= {"shards", "dp-train", "verify", "curve", "report"}
    found = [(where, kind, needle) for where, text in texts.items()
             for kind, values in needles.items() for needle in values if holds(text, needle)]
    found += [(where, "name", name) for where, text in texts.items() for name in leaky_names(text)]
    # A private training's rate tracks its realised batch sizes; the stages on public data (the
    # synthetic images, pretraining on them) may log theirs.
    found += [(r.info.run_name, "metric", k) for r in runs if r.data.tags.get("dpfm.stage") not in PUBLIC_STAGES
              for k in r.data.metrics if "steps_per_s" in k or "images_per_s" in k]
    assert not found, found[:10]


# Every metric a stage on private data may log, reviewed: the public n, the mechanism (ε, σ, q, T), the
# released model's held-out loss and lr, and the public eval set's accuracies. A metric of another name
# (a step's sampled count, its seconds, a count of excluded rows) fails the test below until reviewed.
ALLOWED_PRIVATE_STAGE_METRICS = re.compile(
    r"(private|eval)_usable|epsilon(_composed|_dp_runs|_(add_remove_)?(pld|rdp|prv)|_curve_(pld|rdp|prv))?"
    r"|sigma|steps|sample_rate|dp_runs_on_data"
    r"|(curve\.(pretrain|random)\.eps_[\w.]+\.seed_\d+\.|seed_\d+\.)?(nonprivate_)?(heldout_loss|lr)"
    r"|curve\.(pretrain|random)\.eps_[\w.]+\.linear_probe(_ci_lo|_ci_hi)?"
    r"|[\w-]+\.\w+\.(first_seed_)?(linear_probe|zero_shot)(_ci_lo|_ci_hi)?|[\w-]+\.\w+\.(seeds|fewshot_\w+_\d+shot)"
    r"|\w+_linear_probe_acc")


@pytest.mark.e2e
def test_every_metric_of_a_stage_on_private_data_is_one_reviewed(pipeline_runs):
    """Scanning for known leaks finds only the leaks someone thought of: a step's realised batch size
    logged as `sampled`, or its seconds, passed. Every metric name is matched against a reviewed list."""
    from pipeline.stages import STAGES

    work, _, _ = pipeline_runs
    _, runs = mlflow_texts(work)
    private = {st.name for st in STAGES if st.touches_private_data}
    names = {k for r in runs if r.data.tags.get("dpfm.stage") in private for k in r.data.metrics}
    assert {"epsilon", "sigma", "private_usable"} <= names, sorted(names)  # real runs, matched
    assert sorted(k for k in names if not ALLOWED_PRIVATE_STAGE_METRICS.fullmatch(k)) == [], sorted(names)


@pytest.mark.e2e
def test_no_stage_on_private_data_publishes_its_timing_or_a_plain_digest_of_the_shards(pipeline_runs):
    """Measured, not read off a flag. A private training's per-step metrics would time every step
    through MLflow's timestamps (a step's time tracks its realised batch size), and the metrics a stage
    logs after a training (its ε, a curve point's probe) would time the training; system metrics and
    Snakemake's benchmarks (wall time, bytes read) follow the sampled examples; a plain digest of the
    private shards lets anyone who knows all examples but one test guesses of the last."""
    import mlflow

    from pipeline.stages import STAGES
    from pipeline.tracking import dvc_hash

    work, published, _ = pipeline_runs
    client = mlflow.tracking.MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("dpfm").experiment_id], max_results=1000)
    private = {st.name for st in STAGES if st.touches_private_data}
    timed, per_step = [], 0
    for r in runs:
        if r.data.tags.get("dpfm.stage") not in private:
            continue
        timed += [(r.info.run_name, k) for k in r.data.metrics if k.startswith("system/")]
        stamps = set()  # every metric of the stage, every step: one time
        for k in r.data.metrics:
            history = client.get_metric_history(r.info.run_id, k)
            per_step += len({m.step for m in history}) >= 4  # a training's per-step metric
            stamps |= {m.timestamp for m in history}
        if len(stamps) > 1:
            timed.append((r.info.run_name, sorted(stamps)[:4]))
    assert per_step >= 3 and not timed, timed[:5]  # dp-train of each objective logs per step
    assert {p.stem for p in (work / "logs/benchmarks").rglob("*.tsv")}.isdisjoint(private | {"scan_shards"})
    assert not (work / "logs/benchmarks/scan_shards").exists()
    assert (work / ".dpfm/owner/benchmarks/dp-train.tsv").is_file()
    plain = dvc_hash(work / "data/shards")
    size = sum(f.stat().st_size for f in (work / "data/shards").rglob("*") if f.is_file())  # DVC's `size`
    texts, _ = mlflow_texts(work)
    everywhere = {**texts, **{f"{obj}: {k}": v for obj, files in published.items() for k, v in files.items()}}
    assert not [where for where, text in everywhere.items() if plain.removesuffix(".dir") in text]
    assert not [where for where, text in everywhere.items() if holds(text, str(size))], size


@pytest.mark.e2e
def test_the_owner_zone_is_owner_only_and_complete(pipeline_runs):
    work, _, needles = pipeline_runs
    owner = work / ".dpfm/owner"
    files = [f for f in owner.rglob("*") if f.is_file()]
    assert files and all(f.stat().st_mode & 0o077 == 0 for f in files)
    record = next(json.loads(f.read_text()) for f in (owner / "runs").glob("*.json") if "nonfinite_examples" in f.read_text())
    assert record["nonfinite_examples"] == 0 and all(isinstance(b, int) for b in record["batch_sizes"])
    assert np.mean(record["batch_sizes"]) > 0
