"""The `evaluate` stage: the DP encoder beside its baselines on labelled eval sets.

Models: the DP model; the non-private counterpart (models/dp/nonprivate.pt, when dp-train made
one: local, never pushed); the synthetic-only encoder (Syn-ViP: the pretrain checkpoint); the raw pixels (no encoder:
the simplest baseline); a random-init encoder.
Protocols: linear probe (ViP), K-shot logistic regression over seeded class-balanced subsets,
K-shot full fine-tuning (when enabled), zero-shot with the text tower (captioner/CLIP).

Every linear-probe and zero-shot accuracy carries a 95% bootstrap interval over the test images,
and the DP model's linear probe is compared with each baseline's on the same images (paired). With
`evaluate.probe_refits` > 0 the linear probe's intervals also cover which images the probe is fit
on: it is refit on that many bootstrap resamples of probe-train, the same resamples for every model
(eval/probe.py `refit_correct`, eval/stats.py).

With `evaluate.seeds` k > 1 the trained rows have k training seeds (run.seed, +1, ...): dp-train's
model is seed run.seed, and the DP recipe (and its non-private twin, when dp-train made one) is
trained again at each other seed here, through the curve stage's `train_point`, so each extra DP
training is verified and charged to the data's budget like dp-train (the curve's run of the same
seed is the same run, charged once). Random init takes k seeds; the synthetic encoder and the
pixels are one fixed artifact each. Linear probe and zero-shot intervals then cover the seeds as
well (two-level bootstrap, eval/stats.py) and pair by seed; few-shot and fine-tuning stay on the
first seed's model.

Each eval set is public and held out: it is split into probe-train / probe-test, so no private
example is used here and the accuracies are post-processing of the DP model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pipeline import checkpoints
from pipeline.artifacts import ARTIFACTS
from pipeline.errors import VerificationFailed
from pipeline.objectives import recipe_name
from pipeline.privacy import release
from pipeline.privacy.accounting import bound_text
from pipeline.privacy.run_checks import check_made_for
from pipeline.eval.evalsets import EvalSet
from pipeline.eval.fewshot import fewshot_finetune, fewshot_logreg
from pipeline.eval.probe import features, probe_outcomes
from pipeline.eval.protocols import checked_eval_sets
from pipeline.eval.stats import accuracy_ci, chance, difference_ci, released
from pipeline.eval.zeroshot import ZERO_SHOT_OBJECTIVES, class_scores
from pipeline.io import read_json, write_json
from pipeline.models import ModelConfig, build_encoder, build_model



@dataclass
class Candidate:
    """One model under evaluation."""

    name: str          # dp | nonprivate | synthetic | random | pixels
    label: str         # for tables
    source: str
    encoder: torch.nn.Module | None             # None: the raw pixels are the features
    text_model: torch.nn.Module | None = None  # captioner / CLIP, for zero-shot
    objective: str | None = None
    max_len: int = 0                            # caption tokens the text tower takes
    seed_index: int = 0                         # k-th training seed of this row (evaluate.seeds)


def from_checkpoint(name: str, label: str, path: str, with_text: bool) -> Candidate:
    ckpt = checkpoints.load(path)
    if with_text and ckpt.objective in ZERO_SHOT_OBJECTIVES:
        model = ckpt.build_model()
        max_len = ModelConfig.of(ckpt.model_cfg).max_len
        return Candidate(name, label, path, model.encoder, model, ckpt.objective, max_len)
    return Candidate(name, label, path, ckpt.build_encoder(), None, ckpt.objective)


def load_candidates(st, baselines: list[str], seed: int, with_text: bool) -> list[Candidate]:
    """The DP model first, then the baselines that exist (non-private only when dp-train made it).
    `st`: the evaluate Stage, whose inputs name the checkpoints."""
    dp_path, twin_path = st.input("dp") / "checkpoint.pt", st.input("dp") / "nonprivate.pt"
    dp_ckpt = checkpoints.load(dp_path)
    objective, mcfg = dp_ckpt.objective, dp_ckpt.model_cfg
    recipe = recipe_name(objective)
    out = [from_checkpoint("dp", f"DP ({recipe})", str(dp_path), with_text)]
    if "nonprivate" in baselines and twin_path.exists():
        out.append(from_checkpoint("nonprivate", f"Not private ({recipe} without DP, ε = ∞)", str(twin_path), with_text))
    if "synthetic" in baselines:
        warm = st.input("pretrain") / "checkpoint.pt"
        encoder = build_encoder(mcfg)  # the DP model's config: the warm start's weights must fit it
        encoder.load_state_dict(checkpoints.load(warm).encoder)
        out.append(Candidate("synthetic", "Synthetic only (Syn-ViP)", str(warm), encoder))
    if "pixels" in baselines:  # the simplest baseline: a linear probe on the pixels themselves
        out.append(Candidate("pixels", "Raw pixels (no encoder)", "input images", None))
    if "random" in baselines:
        out.append(random_candidate(objective, mcfg, seed, with_text))
    return out


def random_candidate(objective: str, mcfg: dict, seed: int, with_text: bool, seed_index: int = 0) -> Candidate:
    torch.manual_seed(seed)
    if with_text and objective in ZERO_SHOT_OBJECTIVES:  # a random text tower too: zero-shot chance level
        model = build_model(objective, mcfg)
        return Candidate("random", "Random init", f"seed {seed}", model.encoder, model, objective,
                         ModelConfig.of(mcfg).max_len, seed_index)
    return Candidate("random", "Random init", f"seed {seed}", build_encoder(mcfg), seed_index=seed_index)


def seed_candidates(params: dict, ctx, first: list[Candidate], with_text: bool) -> list[Candidate]:
    """The trained rows at training seeds run.seed + 1 ... + evaluate.seeds - 1 (see the module
    docstring): the DP recipe, its non-private twin when `first` has one, and random init."""
    from pipeline.privacy.training import train_point  # dp-train's own training, verified and charged

    seed, names = params["run"]["seed"], {c.name: c for c in first}
    mcfg = checkpoints.load(ctx.stage.input("dp") / "checkpoint.pt").model_cfg
    out = []
    for k in range(1, params["evaluate"]["seeds"]):
        p = {**params, "run": {**params["run"], "seed": seed + k}}
        for name, epsilon in (("dp", params["dp"]["epsilon"]), ("nonprivate", math.inf)):
            if name in names:
                model, _, _ = train_point(p, ctx, params["dp"]["init"], epsilon, f"evaluate.seed_{seed + k}.")
                c = names[name]
                out.append(replace(c, source=f"{c.source}, training seed {seed + k}", encoder=model.encoder,
                                   text_model=model if c.text_model is not None else None, seed_index=k))
        if "random" in names:
            out.append(random_candidate(names["dp"].objective, mcfg, seed + k, with_text, seed_index=k))
    return out


def evaluate_set(es: EvalSet, candidates: list[Candidate], cfg: dict, seed: int, device: str, tokenize) -> dict:
    tr, te = es.split(cfg["probe_fraction"], seed)
    y_tr, y_te = es.labels[tr], es.labels[te]
    # Lazy views: every protocol reads its images batch by batch, so no part is ever held whole.
    images_tr, images_te = es.images.subset(tr), es.images.subset(te)
    few, ft = cfg["fewshot"], cfg["finetune"]
    results, correct, refits, zero = {}, {}, {}, {}
    zero_shot = cfg["zero_shot"] and es.named
    if cfg["zero_shot"] and not es.named:
        print(f"evaluate: {es.name}: no zero-shot: its integer labels have no names (give evaluate.sets[].classes); "
              f"prompts naming bare numbers would rank the classes by the numbers' text")
    for cand in tqdm(candidates, desc=f"evaluate {es.name}", unit="model"):
        x = features(cand.encoder, es.images, cfg, device, what=f"the {cand.name} model on {es.name}")
        outcomes, refit = probe_outcomes(x, es.labels, (tr, te), cfg, seed, device)
        correct.setdefault(cand.name, []).append(outcomes)
        if refit is not None:
            refits.setdefault(cand.name, []).append(refit)
        if zero_shot and cand.text_model is not None:
            scores = class_scores(cand.text_model, cand.objective, images_te, es.prompts(), tokenize(cand), device)
            zero.setdefault(cand.name, []).append(scores.argmax(axis=1) == y_te)
        if cand.seed_index > 0:  # another seed of a row: its probe and zero-shot outcomes join the row's
            continue
        r = {}
        if few["shots"]:
            r["fewshot_logreg"] = fewshot_logreg(x[tr], y_tr, x[te], y_te, few["shots"], few["repeats"],
                                                 cfg["probe_c"], seed)
        if ft["enabled"] and cand.encoder is not None:
            train_cfg = {k: ft[k] for k in ("epochs", "batch_size", "lr", "weight_decay")}
            r["fewshot_finetune"] = fewshot_finetune(cand.encoder, images_tr, y_tr, images_te, y_te,
                                                     len(es.classes), ft["shots"], ft["repeats"], train_cfg,
                                                     cfg["pool"], seed, device)
        results[cand.name] = r
    correct = {name: np.stack(rows) for name, rows in correct.items()}  # (seeds, test examples)
    refits = {name: np.stack(rows) for name, rows in refits.items()}    # (seeds, fits, test examples)
    for name, r in results.items():
        r.update(with_interval("linear_probe", correct[name], seed, refits.get(name)), seeds=len(correct[name]))
        if name in zero:
            r.update(with_interval("zero_shot", np.stack(zero[name]), seed))
        if r["seeds"] > 1:  # the row is a mean over its seeds; the first is the checkpoint a stage released
            first = with_interval("linear_probe", correct[name][:1], seed, None if name not in refits else refits[name][:1])
            r["first_seed"] = first | (with_interval("zero_shot", zero[name][0][None], seed) if name in zero else {})
        (lo, hi), seeds = r["linear_probe_ci"], r["seeds"]
        print(f"evaluate: {es.name}/{name:<10} linear probe {r['linear_probe']:.3f} (95% CI {lo:.3f}-{hi:.3f}"
              f"{f', {seeds} seeds' if seeds > 1 else ''})"
              + (f", zero-shot {r['zero_shot']:.3f}" if "zero_shot" in r else ""))
    # Paired on the same test images (and seeds): is the DP model's linear probe better than each baseline's?
    versus = {name: difference_ci(correct["dp"], c, seed, refits_a=refits.get("dp"), refits_b=refits.get(name))
              for name, c in correct.items() if name != "dp"}
    return {"classes": es.classes, "n_probe_train": int(len(tr)), "n_probe_test": int(len(te)),
            "chance": chance(y_te), "results": results, "dp_versus": versus if "dp" in correct else {}}


def with_interval(protocol: str, correct: np.ndarray, seed: int, refits: np.ndarray | None = None) -> dict:
    """The accuracy of per-example outcomes and its 95% bootstrap interval over the test images (and
    the probe's refits, when given)."""
    return {protocol: float(correct.mean()), f"{protocol}_ci": accuracy_ci(correct, seed, refits=refits)}


def mlflow_metrics(metrics: dict) -> dict:
    """Flat names: `<set>.<model>.<protocol>[_<k>shot]`, plus the primary set's headline per model."""
    flat = {}
    for set_name, s in metrics["sets"].items():
        for model, r in s["results"].items():
            first = {f"first_seed_{k}": v for k, v in r.get("first_seed", {}).items()}  # the released model's own
            for protocol, v in (r | first).items():
                if protocol == "first_seed":
                    continue
                if isinstance(v, dict):
                    flat.update({f"{set_name}.{model}.{protocol}_{k}shot": kv["mean"] for k, kv in v.items()})
                elif isinstance(v, list):  # a [lo, hi] interval
                    flat.update({f"{set_name}.{model}.{protocol}_lo": v[0], f"{set_name}.{model}.{protocol}_hi": v[1]})
                else:
                    flat[f"{set_name}.{model}.{protocol}"] = v
    primary = metrics["sets"][metrics["primary_set"]]["results"]
    # Beside the run's ε: the accuracy of the model that ε is for (over seeds, the first: the released one).
    flat.update({f"{model}_linear_probe_acc": released(r)["linear_probe"] for model, r in primary.items()})
    flat["epsilon"] = metrics["privacy"]["epsilon"]
    return flat


def known_not_private(params: dict, stats: Path, curve: Path, ver: dict) -> list[str]:
    """Why the run's outputs are not covered by its ε, as far as is known when evaluate ends: its params,
    the curve's points, the shards' stats and the budget as verify found it (the report's verdict is final)."""
    points = read_json(curve)["points"] if curve.exists() else []
    trained = {"epsilons": [float(p["epsilon"]) for p in points], "inits": [p["init"] for p in points]}
    return release.known_before_the_report(params | {"curve": trained}, stats, ver)


def run(params: dict, ctx) -> None:
    cfg, seed = params["evaluate"], params["run"]["seed"]
    st = ctx.stage
    verification, curve, out = st.input("verification"), st.input("curve"), st.output("metrics")
    dp_path = st.input("dp") / "checkpoint.pt"
    ver = read_json(verification)
    dp_ckpt = checkpoints.load(dp_path)
    dp_steps = dp_ckpt.steps
    if not ver["passed"] or ver["steps"] != dp_steps:
        raise VerificationFailed(f"{verification} does not vouch for {dp_path} (passed={ver['passed']}, "
                                 f"{ver['steps']} verified steps vs {dp_steps} applied): run `dpfm verify` first")
    check_made_for(ver.get("run"), verification, st.input("dp"), "dpfm verify")
    if curve.exists():  # published beside these accuracies: the curve of this run's recipe, not an earlier one's
        check_made_for(read_json(curve).get("run"), curve, st.input("dp"), "dpfm curve")
    candidates = load_candidates(st, cfg["baselines"], seed, with_text=cfg["zero_shot"])
    encoder = candidates[0].encoder  # the DP model's: its input size, its depth
    # Checked, and with extra seeds to train and charge every image decoded once, before them.
    eval_sets = [es for es, _ in checked_eval_sets(cfg["sets"], cfg, seed, encoder.img_size, len(encoder.blocks),
                                                   decode=cfg["seeds"] > 1)]
    candidates += seed_candidates(params, ctx, candidates, with_text=cfg["zero_shot"])
    not_private = known_not_private(params, st.input("shards") / "stats.json", curve, ver)
    tokenizer = None
    if any(c.text_model is not None for c in candidates):
        from pipeline.data.tokenizer import Tokenizer

        tokenizer = Tokenizer(st.input("tokenizer"))

    def tokenize(cand: Candidate):
        return lambda captions: tokenizer.encode(captions, cand.max_len, public=True)  # prompts: public text

    sets = {es.name: evaluate_set(es, candidates, cfg, seed, ctx.device, tokenize) for es in eval_sets}
    metrics = {
        "primary_set": cfg["sets"][0]["name"],
        "objective": candidates[0].objective,
        "models": {c.name: {"label": c.label, "source": c.source} for c in candidates if c.seed_index == 0},
        "model_order": [c.name for c in candidates if c.seed_index == 0],  # JSON keys get sorted; tables keep this order
        "protocol": {k: cfg[k] for k in ("pool", "last_k_blocks", "probe_fraction", "probe_solver", "probe_c",
                                         "probe_refits", "fewshot", "finetune", "zero_shot", "seeds")},
        # ε is dp-train's model's own. The DP row pools evaluate.seeds DP trainings, each charged to the
        # budget: what every run on the examples composes to is the report's (results/privacy/privacy.json).
        "privacy": {"run": ver["run"], "epsilon": ver["epsilon_reported"], "delta": ver["delta"],
                    "accountant": ver["accountant"],
                    "dp_trainings": cfg["seeds"], "epsilon_composed_in": ARTIFACTS["privacy"],
                    "not_private": not_private},
        "sets": sets,
        # The privacy-utility curve (stages/curve.py), kept with the accuracies it is read beside.
        "privacy_utility": read_json(curve) if curve.exists() else None,
    }
    write_json(out, metrics)
    ctx.tracker.log_metrics(mlflow_metrics(metrics))
    ctx.tracker.set_tags(release.not_private_tags(not_private))  # beside the ε this run logs
    # A test run's model (a known noise key) is saved not private: the report plots no DP point for it.
    ctx.tracker.set_tags({"dpfm.objective": metrics["objective"],
                          "dpfm.epsilon": bound_text(ver["epsilon_reported"], 4),
                          "dpfm.model_private": str(dp_ckpt.private).lower(), "dpfm.primary_set": metrics["primary_set"],
                          "dpfm.adjacency": ver.get("adjacency", "add_remove")})
    ctx.tracker.log_artifact(str(out))
