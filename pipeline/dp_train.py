"""The `dp-train` stage: DP-SGD on the private shards (ViP's MAE, DP-Cap's captioner or Dp-CLIP).

Privacy-relevant randomness (who is sampled, the noise) comes from a secret key kept in the stage's
state directory, never in params or MLflow. Only public-data figures are logged: the loss on the
held-out eval split, which is post-processing of the (private) model.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

from pipeline.data.sampling import PoissonSampler
from pipeline.data.shards import ShardDataset
from pipeline.data.tokenizer import PAD_ID, Tokenizer
from pipeline.data.transforms import to_tensor
from pipeline.io import atomic_dir, read_json, write_json
from pipeline.modelcfg import model_config
from pipeline.models import build_model
from pipeline.privacy import accounting
from pipeline.privacy.engine import SENSITIVITY, make_clipper, noisy_update
from pipeline.privacy.ledger import Ledger
from pipeline.train import Checkpointer, make_optimizer, run_loop, state_dir

SHARDS, PRETRAIN, TOKENIZER, OUT_DIR = "data/shards", "models/pretrain", "models/tokenizer", "models/dp"


def load_split(split: str, objective: str, tokenizer: Tokenizer | None, max_len: int):
    """Images (and caption tokens for caption/clip) of one split, as the model's inputs."""
    ds = ShardDataset(f"{SHARDS}/{split}")
    images = to_tensor(ds.load_images())
    if objective == "mae":
        return ds, (images,)
    tokens = tokenizer.encode([ds.caption(i) for i in range(len(ds))], max_len)
    return ds, (images, tokens)


def secret_key(directory, noise_seed: int | None) -> int:
    """The run's secret randomness key: created once, reused on resume, never logged."""
    if noise_seed is not None:
        return noise_seed
    path = directory / "secret.key"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(str(secrets.randbits(63)))
        path.chmod(0o600)
    return int(path.read_text())


def plan_mechanism(dp: dict, n: int) -> dict:
    """q, δ, σ and the ε they give, checked for contradictions before any work."""
    q = dp["expected_batch_size"] / n
    if q > 1:
        raise ValueError(f"dp.expected_batch_size={dp['expected_batch_size']} exceeds the {n} usable private examples")
    delta = accounting.parse_delta(dp["delta"], n)
    accounting.check_delta(delta, n)
    sensitivity = SENSITIVITY["per_batch" if dp["objective"] == "clip" else "per_sample"]
    # σ is the noise multiplier relative to the sensitivity: noise std = σ · sensitivity · C.
    sigma = dp["sigma"] or accounting.calibrate_sigma(dp["epsilon"], q, dp["steps"], delta, accountant=dp["accountant"])
    eps = accounting.epsilon(sigma, q, dp["steps"], delta, accountant=dp["accountant"])
    if eps > dp["epsilon"]:
        raise ValueError(f"dp.sigma={sigma} gives ε={eps:.3f} after {dp['steps']} steps, above the target "
                         f"dp.epsilon={dp['epsilon']}: raise sigma or lower steps")
    return {"n": n, "sample_rate": q, "delta": delta, "sigma": sigma, "clip_norm": dp["clip_norm"],
            "sensitivity": sensitivity, "noise_std": sigma * sensitivity * dp["clip_norm"],
            "sampler": PoissonSampler.name, "objective": dp["objective"], "planned_steps": dp["steps"],
            "target_epsilon": dp["epsilon"], "accountant": dp["accountant"], "epsilon_planned": eps}


def run(params: dict, ctx) -> None:
    dp, seed, device = params["dp"], params["run"]["seed"], ctx.device
    objective = dp["objective"]
    tokenizer = Tokenizer(TOKENIZER) if objective != "mae" else None
    mcfg = model_config(params["model"], objective, tokenizer.vocab_size if tokenizer else None)
    private, train_inputs = load_split("private", objective, tokenizer, mcfg["max_len"])
    _, held_inputs = load_split("eval", objective, tokenizer, mcfg["max_len"])
    n = len(private)
    stats_n = read_json(f"{SHARDS}/stats.json")["private"]["usable"]
    if n != stats_n:
        raise ValueError(f"{SHARDS}/private index has {n} usable examples but stats.json says {stats_n}")
    mech = plan_mechanism(dp, n)

    torch.manual_seed(seed)
    model = build_model(objective, mcfg).to(device)
    if dp["init"] == "pretrain":
        model.encoder.load_state_dict(torch.load(f"{PRETRAIN}/checkpoint.pt", map_location="cpu")["encoder"])
    optimizer = make_optimizer(model, dp["optimizer"], dp["lr"], dp["weight_decay"])
    clipper = make_clipper(objective, model, dp["clip_norm"], dp["clipping"])
    work = state_dir("dp-train", params)
    key = secret_key(work, dp["noise_seed"])
    sampler = PoissonSampler(n, mech["sample_rate"], key)
    ledger = Ledger(work / "ledger.jsonl", mech)
    num_patches = (mcfg["img_size"] // mcfg["patch_size"]) ** 2
    held = tuple(x[:256] for x in held_inputs)
    held_noise = torch.rand(len(held[0]), num_patches, generator=torch.Generator().manual_seed(seed))
    # Counted by the optimizer's own hook, so `verify` can compare it with the ledger independently.
    counters = {"applied_updates": 0, "nonfinite": 0}
    optimizer.register_step_post_hook(lambda *_: counters.__setitem__("applied_updates", counters["applied_updates"] + 1))

    def model_inputs(inputs, idx, noise_gen):
        batch = tuple(x[idx] for x in inputs)
        if objective == "mae":  # the masking noise is part of the input so per-sample calls match
            batch = batch + (torch.rand(len(idx), num_patches, generator=noise_gen),)
        return tuple(x.to(device) for x in batch)

    def step_fn(step: int) -> dict:
        if step >= mech["planned_steps"]:  # budget guard: ε was only paid for planned_steps
            raise RuntimeError(f"refusing step {step}: ε was accounted for {mech['planned_steps']} steps")
        indices = sampler.batch(step)
        ledger.record_step(step, len(indices))  # charged before the update is applied
        gen = torch.Generator().manual_seed(key + step)  # secret: the noise and masks of this step
        clipper.reset()
        chunks = [indices] if clipper.mode == "per_batch" else sampler.split(indices, dp["physical_batch_size"])
        for chunk in chunks:
            if len(chunk):
                counters["nonfinite"] += clipper.accumulate(*model_inputs(train_inputs, torch.as_tensor(chunk), gen)).nonfinite
        # Divide by the expected batch size q·n, not the realised one (which would leak its size).
        denominator = 1.0 if clipper.mode == "per_batch" else mech["sample_rate"] * n
        optimizer.zero_grad(set_to_none=True)
        noisy_update(clipper, mech["noise_std"], denominator, gen)
        optimizer.step()
        metrics = {"batch_size": float(len(indices))}
        if step % dp["eval_every"] == 0 or step == mech["planned_steps"] - 1:
            metrics["heldout_loss"] = heldout_loss(model, held, held_noise, objective, device)
        return metrics

    history = run_loop(model=model, optimizer=optimizer, total_steps=dp["steps"], base_lr=dp["lr"],
                       warmup=dp["warmup_steps"], step_fn=step_fn, checkpointer=Checkpointer(work),
                       checkpoint_every=dp["checkpoint_every"], desc="dp-train", log_every=1,
                       extra_state=lambda: dict(counters), restore_extra=counters.update,
                       on_log=lambda s, m: ctx.tracker.log_metrics({k: v for k, v in m.items() if k != "batch_size"}, step=s))
    record = ledger.to_dict()
    record["nonfinite_examples"] = counters["nonfinite"]
    record["epsilon"] = accounting.epsilon(mech["sigma"], mech["sample_rate"], ledger.steps, mech["delta"],
                                           accountant=mech["accountant"])
    with atomic_dir(OUT_DIR) as out:
        torch.save({"objective": objective, "model_cfg": mcfg, "model": model.state_dict(),
                    "encoder": model.encoder.state_dict(), "optimizer_steps": counters["applied_updates"]},
                   out / "checkpoint.pt")
        write_json(out / "ledger.json", record)
        write_json(out / "history.json", history)
    ctx.tracker.log_metrics({"epsilon": record["epsilon"], "sigma": mech["sigma"], "steps": ledger.steps,
                             "sample_rate": mech["sample_rate"], "nonfinite_examples": record["nonfinite_examples"]})
    ctx.tracker.set_tags({"dpfm.epsilon": f"{record['epsilon']:.4f}", "dpfm.accountant": mech["accountant"]})
    print(f"dp-train: {ledger.steps} steps on n={n}, q={mech['sample_rate']:.4f}, σ={mech['sigma']:.4f}, "
          f"ε={record['epsilon']:.3f} (δ={mech['delta']:.2e}, {mech['accountant']})")


@torch.no_grad()
def heldout_loss(model, held, held_noise, objective, device) -> float:
    model.eval()
    inputs = tuple(x.to(device) for x in held)
    if objective == "mae":
        inputs = inputs + (held_noise.to(device),)
    loss = model(*inputs).mean().item()
    model.train()
    return loss
