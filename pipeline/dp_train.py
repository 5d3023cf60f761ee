"""The `dp-train` stage: DP-SGD on the private shards (ViP's MAE, DP-Cap's captioner or Dp-CLIP).

One logical step: a Poisson batch (secret sampler), recorded in the ledger before anything else;
per-sample clipped gradients summed over physical micro-batches and over torchrun ranks; Gaussian
noise N(0, (σ·K·C)²) added once; divided by the expected batch size q·n; one optimizer update.

Privacy-relevant randomness (who is sampled, the noise, the MAE masks) comes from a secret key kept
in the stage's state directory, never in params or MLflow. Only public-data figures are logged: the
loss on the held-out eval split, which is post-processing of the (private) model.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

from pipeline.config import ParamsError
from pipeline.data.sampling import PoissonSampler
from pipeline.data.shards import ShardDataset
from pipeline.data.tokenizer import Tokenizer
from pipeline.data.transforms import to_tensor
from pipeline.distributed import all_reduce_sum, barrier, broadcast_int, init_world
from pipeline.io import atomic_dir, read_json, write_json
from pipeline.modelcfg import model_config
from pipeline.models import build_model
from pipeline.privacy import accounting
from pipeline.privacy.clipping import PlainSum
from pipeline.privacy.engine import SENSITIVITY, make_clipper, noisy_update
from pipeline.privacy.ledger import Ledger
from pipeline.train import Checkpointer, autocast, make_optimizer, run_loop, state_dir

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


def step_generator(key: int, step: int, stream: int) -> torch.Generator:
    """Independent generators per (key, step, stream): the same on every rank and on every re-run."""
    seed = int(np.random.SeedSequence([key, step, stream]).generate_state(1, np.uint64)[0] >> np.uint64(1))
    return torch.Generator().manual_seed(seed)


MASKS, NOISE = 1, 2


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


class LossScaler:
    """Dynamic fp16 loss scale: halve when an example overflowed (it was dropped), grow when stable."""

    def __init__(self, enabled: bool, scale: float = 2.0 ** 12, growth_interval: int = 100):
        self.enabled, self.scale, self.interval, self.good = enabled, scale if enabled else 1.0, growth_interval, 0

    def update(self, nonfinite: int) -> None:
        if not self.enabled:
            return
        self.good = 0 if nonfinite else self.good + 1
        if nonfinite:
            self.scale = max(1.0, self.scale / 2)
        elif self.good % self.interval == 0:
            self.scale *= 2


def precision_context(device: str, precision: str):
    if precision == "fp16":
        return torch.autocast(device_type=device, dtype=torch.float16)
    return autocast(device, precision)


def run(params: dict, ctx) -> None:
    dp, seed, device = params["dp"], params["run"]["seed"], ctx.device
    world = init_world(device)
    objective = dp["objective"]
    tokenizer = Tokenizer(TOKENIZER) if objective != "mae" else None
    mcfg = model_config(params["model"], objective, tokenizer.vocab_size if tokenizer else None)
    n = len(ShardDataset(f"{SHARDS}/private"))
    stats_n = read_json(f"{SHARDS}/stats.json")["private"]["usable"]
    if n != stats_n:
        raise ValueError(f"{SHARDS}/private index has {n} usable examples but stats.json says {stats_n}")
    try:  # contradictions in the params stop the run here, before any image is decoded or state written
        mech = plan_mechanism(dp, n)
    except ValueError as e:
        raise ParamsError([str(e)], source=f"dp params (n={n} usable private examples)") from None
    _, train_inputs = load_split("private", objective, tokenizer, mcfg["max_len"])
    _, held_inputs = load_split("eval", objective, tokenizer, mcfg["max_len"])
    inputs = [f"{SHARDS}/private"] + ([PRETRAIN] if dp["init"] == "pretrain" else []) + ([TOKENIZER] if tokenizer else [])
    work = state_dir("dp-train", params, inputs)
    key = broadcast_int(secret_key(work, dp["noise_seed"]) if world.is_main else 0, world)
    trainer = Trainer(params, mcfg, train_inputs, held_inputs, mech, world, device)

    model, counters, history = trainer.train(key, work, ctx, private=True)
    if world.is_main:
        ledger = trainer.ledger
        record = ledger.to_dict()
        record["nonfinite_examples"] = counters["nonfinite"]
        record["epsilon"] = accounting.epsilon(mech["sigma"], mech["sample_rate"], ledger.steps, mech["delta"],
                                               accountant=mech["accountant"])
    baseline = None
    if dp["nonprivate_baseline"]:  # same recipe without clipping or noise, for the evaluation table
        baseline, _, _ = trainer.train(seed, work / "nonprivate", ctx, private=False)
    if not world.is_main:
        barrier(world)
        return
    with atomic_dir(OUT_DIR) as out:
        save_checkpoint(out / "checkpoint.pt", objective, mcfg, model, counters["applied_updates"])
        if baseline is not None:
            save_checkpoint(out / "nonprivate.pt", objective, mcfg, baseline, dp["steps"])
        write_json(out / "ledger.json", record)
        write_json(out / "history.json", history)
    barrier(world)
    ctx.tracker.log_metrics({"epsilon": record["epsilon"], "sigma": mech["sigma"], "steps": ledger.steps,
                             "sample_rate": mech["sample_rate"]})
    ctx.tracker.set_tags({"dpfm.epsilon": f"{record['epsilon']:.4f}", "dpfm.accountant": mech["accountant"]})
    print(f"dp-train: {ledger.steps} steps on n={n}, q={mech['sample_rate']:.4f}, σ={mech['sigma']:.4f}, "
          f"ε={record['epsilon']:.3f} (δ={mech['delta']:.2e}, {mech['accountant']}), "
          f"{record['nonfinite_examples']} non-finite examples dropped")


def save_checkpoint(path, objective, mcfg, model, optimizer_steps) -> None:
    torch.save({"objective": objective, "model_cfg": mcfg, "model": model.state_dict(),
                "encoder": model.encoder.state_dict(), "optimizer_steps": optimizer_steps}, path)


class Trainer:
    """Builds the model and runs the DP (or, for the baseline, the plain) training loop."""

    def __init__(self, params, mcfg, train_inputs, held_inputs, mech, world, device):
        self.params, self.dp, self.mcfg = params, params["dp"], mcfg
        self.train_inputs, self.mech, self.world, self.device = train_inputs, mech, world, device
        self.num_patches = (mcfg["img_size"] // mcfg["patch_size"]) ** 2
        self.held = tuple(x[:256] for x in held_inputs)
        self.held_noise = torch.rand(len(self.held[0]), self.num_patches,
                                     generator=torch.Generator().manual_seed(params["run"]["seed"]))
        self.ledger = None

    def build(self):
        torch.manual_seed(self.params["run"]["seed"])
        model = build_model(self.dp["objective"], self.mcfg).to(self.device)
        if self.dp["init"] == "pretrain":
            state = torch.load(f"{PRETRAIN}/checkpoint.pt", map_location="cpu", weights_only=False)["encoder"]
            model.encoder.load_state_dict(state)
        return model

    def train(self, key: int, work, ctx, private: bool):
        dp, mech, world, objective = self.dp, self.mech, self.world, self.dp["objective"]
        n = mech["n"]
        model = self.build()
        optimizer = make_optimizer(model, dp["optimizer"], dp["lr"], dp["weight_decay"])
        clipper = make_clipper(objective, model, dp["clip_norm"], dp["clipping"]) if private else PlainSum(model)
        scaler = LossScaler(dp["precision"] == "fp16")
        if scaler.enabled and not hasattr(clipper, "loss_scale"):
            raise ValueError(f"dp.precision=fp16 needs dp.clipping=bookkeeping (got {dp['clipping']})")
        sampler = PoissonSampler(n, mech["sample_rate"], key)
        ledger = Ledger(work / "ledger.jsonl", mech) if private and world.is_main else None
        if private:
            self.ledger = ledger
        # Counted by the optimizer's own hook, so `verify` can compare it with the ledger independently.
        counters = {"applied_updates": 0, "nonfinite": 0}
        optimizer.register_step_post_hook(lambda *_: counters.__setitem__("applied_updates", counters["applied_updates"] + 1))
        noise_std = mech["noise_std"] if private else 0.0
        denominator = 1.0 if clipper.mode == "per_batch" else mech["sample_rate"] * n

        def step_fn(step: int) -> dict:
            if step >= mech["planned_steps"]:  # budget guard: ε was paid for planned_steps, no more
                raise RuntimeError(f"refusing step {step}: ε was accounted for {mech['planned_steps']} steps")
            indices = sampler.batch(step)
            if ledger is not None:
                ledger.record_step(step, len(indices))  # charged before the update is applied
            # MAE masks for the whole logical batch, so they do not depend on how it is split.
            masks = torch.rand(len(indices), self.num_patches, generator=step_generator(key, step, MASKS))
            positions = np.arange(len(indices))
            chunks = [positions] if clipper.mode == "per_batch" else \
                sampler.split(positions, dp["physical_batch_size"], world.rank, world.size)
            clipper.reset()
            if scaler.enabled:
                clipper.loss_scale = scaler.scale
            nonfinite = 0
            for pos in chunks:
                if len(pos):
                    batch = tuple(x[indices[pos]] for x in self.train_inputs)
                    if objective == "mae":  # the masking noise is an input, so per-sample calls match
                        batch = batch + (masks[pos],)
                    with precision_context(self.device, dp["precision"]):
                        nonfinite += clipper.accumulate(*(x.to(self.device) for x in batch)).nonfinite
            all_reduce_sum(clipper.sum, world)
            counters["nonfinite"] += nonfinite
            scaler.update(nonfinite)
            # Divide by the expected batch size q·n, not the realised one (whose size is private).
            optimizer.zero_grad(set_to_none=True)
            noisy_update(clipper, noise_std, denominator, step_generator(key, step, NOISE))
            optimizer.step()
            # Only public figures leave this loop: realised batch sizes and non-finite counts depend on
            # private data and the secret sampler, so they stay in the ledger (an audit record).
            metrics = {}
            if step % dp["eval_every"] == 0 or step == mech["planned_steps"] - 1:
                metrics["heldout_loss"] = self.heldout_loss(model)
            return metrics

        prefix = "" if private else "nonprivate_"
        history = run_loop(model=model, optimizer=optimizer, total_steps=dp["steps"], base_lr=dp["lr"],
                           warmup=dp["warmup_steps"], step_fn=step_fn,
                           checkpointer=Checkpointer(work, write=world.is_main),
                           checkpoint_every=dp["checkpoint_every"], desc=f"dp-train{'' if private else ' (non-private)'}",
                           log_every=1, extra_state=lambda: dict(counters), restore_extra=counters.update,
                           on_log=lambda s, m: ctx.tracker.log_metrics({prefix + k: v for k, v in m.items()}, step=s),
                           world=world)
        return model, counters, history

    @torch.no_grad()
    def heldout_loss(self, model) -> float:
        model.eval()
        inputs = tuple(x.to(self.device) for x in self.held)
        if self.dp["objective"] == "mae":
            inputs = inputs + (self.held_noise.to(self.device),)
        loss = model(*inputs).mean().item()
        model.train()
        return loss
