"""DP training itself: dp-train, the curve's points and evaluate's extra seeds all train through here.

One logical step is `privacy.engine.dp_step` (sample, charge the ledger, clip, sum over micro-batches
and torchrun ranks, add noise once, divide): this module plans the mechanism (plan.py), charges the
examples' budget before the first step (budget.py), builds the model and clipper from the
objective's table entry, streams the sampled examples, and runs the shared loop. `train_point` is
one point of the privacy-utility curve: the recipe at an ε, verified like dp-train's own run.

Nothing per example is held in memory: the sampler draws step t's ids from the key, and loader
worker processes read, decode and resize just this rank's share of them, several steps ahead (the
schedule is a function of the key, so it is known in advance). Peak memory is flat in n.

Only public-data figures are logged: the loss on the held-out eval split (post-processing of the private
model). Realised batch sizes and the non-finite count are owner-only (owner.py); no rate (it tracks them).
"""

from __future__ import annotations

import math
import os
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

from pipeline import checkpoints, stages
from pipeline.config import ParamsError
from pipeline.data import labelled_sets
from pipeline.data.loader import BatchLoader
from pipeline.data.shards import ShardDataset
from pipeline.data.tokenizer import Tokenizer, public_captions
from pipeline.distributed import (broadcast_int, fingerprint, gather_with_grad, init_world, same_on_every_rank,
                                  spread_over_ranks)
from pipeline.errors import InputError, PrivateDataError, RanksDisagree, VerificationFailed
from pipeline.io import DISK_FULL, read_json
from pipeline.locking import training_lock
from pipeline.models import ModelConfig, build_model, model_params_read
from pipeline.objectives import objective
from pipeline.privacy import accounting, budget, owner, release
from pipeline.privacy.clipping import view_rows
from pipeline.privacy.engine import StepRefused, dp_step, make_clipper, micro_batches, pieces
from pipeline.privacy.ledger import Ledger, LedgerError
from pipeline.privacy.params_check import check_dp_params, nonprivate_params
from pipeline.privacy.plan import agreed_plan, checked_plan, secret_key
from pipeline.privacy.sampling import PoissonSampler
from pipeline.privacy.run_checks import verify, with_batch_sizes
from pipeline.artifacts import artifact
from pipeline.train import (MASKS, STATE_ROOT, Checkpointer, Schedule, TrainState, WeightAverage, autocast, freeze,
                            log_earlier, loss_scale, make_optimizer, run_loop, state_dir, step_generator)

HELDOUT_EXAMPLES = 256  # the held-out loss's fixed sample of the eval split


def split_loader(split: str, mcfg: ModelConfig, tokenizer: Tokenizer | None, workers: int = 0,
                 device: str = "cpu") -> BatchLoader:
    """Model inputs (images at the model's size; caption tokens for caption/clip) of one split, by index."""
    return BatchLoader(ShardDataset(artifact("shards") / split), mcfg.img_size, tokenizer=tokenizer,
                       max_len=mcfg.max_len if tokenizer else None, workers=workers, device=device)


def out_of_memory(e: BaseException) -> bool:
    """A GPU's allocator raises OutOfMemoryError; the CPU's a RuntimeError that says so."""
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e)


def kept_for_owner(step: int, e: Exception) -> PrivateDataError:
    """The line `dpfm` prints for a failure inside the DP step. Its message and traceback can name
    private facts: an allocator's request or a tensor's shape follows the micro-batch, whose last one
    in each bucket holds what is left of the realised batch. They go to the owner's log with the step
    (which step failed first tells when an example was sampled); the line names neither."""
    where = owner.note("dp-train", f"step {step}: " + "".join(traceback.format_exception(e)))
    if out_of_memory(e):
        return PrivateDataError(f"out of memory in the DP step (lower dp.physical_batch_size); the allocator's "
                                f"message names sizes that follow the realised batch size, so it is kept for the "
                                f"data owner only: {where}")
    return PrivateDataError(f"the DP step failed ({type(e).__name__}); its message and traceback can name sizes that "
                            f"follow the realised batch size, so they are kept for the data owner only: {where}")


class StreamedBatches:
    """`fetch` for dp_step: the inputs of the micro-batches this rank computes, decoded ahead.

    The first call starts the stream at its step (after a resume, the checkpoint's); from there the
    loader decodes, in dp_step's order, exactly the examples dp_step will ask for: those of
    `engine.micro_batches` over each step's sample. A request out of that order is a bug, not a
    reason to read something else. A per-batch part (a rank's whole share) is decoded in pieces of the
    physical size, joined here: the workers hold workers × prefetch × physical images whatever B is."""

    def __init__(self, loader: BatchLoader, sampler: PoissonSampler, mode: str, physical_batch_size: int, world,
                 steps: int):
        self.loader, self.sampler, self.mode, self.world = loader, sampler, mode, world
        self.physical, self.steps, self._stream = physical_batch_size, steps, None

    def _plan(self, start: int):
        for step in range(start, self.steps):
            indices = self.sampler.batch(step)
            for positions in micro_batches(indices, self.sampler, self.mode, self.physical, self.world):
                for piece in pieces(positions, self.physical):
                    yield indices[piece]

    def __call__(self, step: int, indices: np.ndarray, positions: np.ndarray) -> tuple[torch.Tensor, ...]:
        if self._stream is None:
            self._stream = self.loader(self._plan(step))
        with owner.failures_kept("dp-train", "reading the sampled private examples", when=f"step {step}"):
            decoded = [next(self._stream) for _ in pieces(positions, self.physical)]
        ids, inputs = decoded[0] if len(decoded) == 1 else (
            np.concatenate([i for i, _ in decoded]), tuple(map(torch.cat, zip(*(x for _, x in decoded)))))
        if not np.array_equal(ids, indices[positions]):
            raise RuntimeError(f"step {step}: the loader decoded other examples than the step sampled")
        return inputs

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()  # stops the decoding workers
        self.loader.dataset.close()


def check_labelled_captions(tokenizer: Tokenizer, max_len: int, source: str) -> None:
    """Warn (CaptionsTruncated) if max_len cuts any caption the labelled set `source` writes.

    The loader cuts private captions silently, as counting the cut ones would release a statistic
    of the private data; a labelled set's captions come from public templates, so they can be checked."""
    tokenizer.encode(labelled_sets.get(source).captions(), max_len, public=True)


def setup(params: dict, device: str) -> "Trainer":
    """Everything one DP training needs, planned and checked before any image is decoded."""
    dp = params["dp"]
    world = init_world(device)
    tokenizer = Tokenizer(artifact("tokenizer")) if objective(dp["objective"]).tokens else None
    mcfg = ModelConfig.from_params(params["model"], dp["objective"], tokenizer.vocab_size if tokenizer else None)
    shards = artifact("shards")
    n = len(ShardDataset(shards / "private", check_versions=True))  # a shard rewritten since: stop before any charge
    stats = read_json(shards / "stats.json")
    stats_n = stats["private"]["usable"]
    if n != stats_n:
        raise InputError(f"{shards}/private index has {n} usable examples but stats.json says {stats_n}: "
                         "re-run the shards stage")
    model = check_dp_params(params, mcfg)
    if dp["init"] == "pretrain":  # its tensors fit (a model section edited after pretrain ran by hand)
        try:
            checkpoints.load(artifact("pretrain") / "checkpoint.pt").check_fits(model, dp["objective"], mcfg.to_dict())
        except checkpoints.CheckpointError:
            raise  # a missing or unreadable file, named as such: not a params problem
        except ValueError as e:
            raise ParamsError([str(e)], source="dp params") from None
    if getattr(model, "per_sample", False):  # clip-public: enough public captions for its negatives
        public_negative_tokens(tokenizer, mcfg)
    if dp["nonprivate_baseline"]:
        release.check_nonprivate(params["privacy"], stats.get("source"), "dp.nonprivate_baseline")
    plan = checked_plan(dp, n, params["privacy"]["adjacency"])  # before any image is decoded or state written
    if tokenizer and stats.get("source") in labelled_sets.SETS:
        check_labelled_captions(tokenizer, mcfg.max_len, stats["source"])
    held = split_loader("eval", mcfg, tokenizer)
    with owner.failures_kept("dp-train", "reading the held-out split carved out of the private data") \
            if stats.get("eval_from_private") else nullcontext():
        held_inputs = held.load(np.arange(min(HELDOUT_EXAMPLES, len(held.dataset)))) if len(held.dataset) else None
    return Trainer(params, mcfg, tokenizer, held_inputs, plan, world, device, stats.get("source"))


NOT_THE_PRIVATE_RUN = ("nonprivate_baseline", "nonprivate", "nonprivate_clipped", "log_private_stats")
# Keys of how a run is computed, not what it releases (the same batches, clip bound and noise): after an
# out-of-memory a smaller dp.physical_batch_size, as its message advises, must resume the run, not
# start another under a fresh key and charge the whole budget again.
HOW_IT_RUNS = (*stages.HOW_IT_RUNS["dp"], "eval_every")  # eval_every: the history's points, not the run


def work_dir(params: dict, trainer: "Trainer"):
    """The run's state directory: its identity for resume and for the privacy budget."""
    inputs = ([artifact("shards") / "private"] + ([artifact("pretrain")] if params["dp"]["init"] == "pretrain" else [])
              + ([artifact("tokenizer")] if trainer.tokenizer else []))
    # Keys that change what is reported beside the private run, not the run: toggling them must
    # resume it, not train (and charge) the same private model again.
    dp = {k: v for k, v in params["dp"].items() if k not in NOT_THE_PRIVATE_RUN}
    # The adjacency sets σ (calibrated to it): another adjacency is another mechanism, another run.
    dp["adjacency"] = params["privacy"]["adjacency"]
    def keyed(form: dict, model: dict) -> Path:  # what a DP training is (dp-train, the curve's points, the seeds)
        return state_dir("dp-train", {"run": params["run"], "model": model, "dp": form}, inputs,
                         name=budget.public_name)

    # Nor are the model keys its objective never reads; a run keyed with them, or with the keys of how it
    # runs, before they left the key, resumes under its old values.
    the_run = {k: v for k, v in dp.items() if k not in HOW_IT_RUNS}
    keys = [keyed(the_run, model_params_read(params["model"], dp["objective"])), keyed(the_run, params["model"]),
            keyed(dp, params["model"])]
    return next((p for p in keys if p.is_dir()), keys[0])


def one_process(work, world):
    """Held by the main rank around all a run does in its state directory (its charge, its key, its
    training), so that two processes on one run never interleave its ledger and checkpoints. The curve
    point that repeats dp-train is dp-train's own run, and Snakemake may start both at once (on SLURM,
    or with cores to spare): a single process waits for the holder and then resumes the run where it
    was left (finished: no step). Under torchrun the other ranks would wait in a collective, which
    times out, so there the second stops at once (StageBusy)."""
    if not world.is_main:
        return nullcontext()
    # Named by the run's path below the state root: <run>, or <run>-nonprivate for its ε = ∞ twin.
    return training_lock(work, "-".join(work.relative_to(STATE_ROOT).parts), wait=world.size == 1)


PER_NODE = {"dp": ("data_workers",)}  # may differ between nodes: each runs its own loader processes


def check_same_params(params: dict, world) -> None:
    """Every rank must train by the same dp and model params. One launched with others (a node reading
    its own params file) cuts its part of a step's sample by another rule (dp.physical_batch_size,
    mask_views: one example in two ranks' parts, or in none), clips above the C the noise is drawn for
    (clip_norm, encoder_clip_share), or sums another set of tensors (dp.frozen). Before anything is
    charged the ranks compare a digest of each key, and all stop naming those that differ."""
    keys = [(s, k) for s in ("dp", "model") for k in sorted(params[s]) if k not in PER_NODE.get(s, ())]
    digests = [fingerprint(params[s][k]) for s, k in keys]
    if not same_on_every_rank([len(keys)], world):  # another version of dpfm: other keys
        raise RanksDisagree("the ranks were launched with other params (other keys in dp or model): every rank "
                            "must run the same dpfm with the same params")
    differ = [f"{s}.{k}={params[s][k]}" for (s, k), spread in zip(keys, spread_over_ranks(digests, world)) if spread]
    if differ:
        raise RanksDisagree(f"the ranks were launched with other params (rank {world.rank}: {', '.join(differ)}): "
                            "every rank must read the same params")


def check_same_data(plan, world) -> None:
    """Every rank draws each step's Poisson sample itself and computes the part of it assigned to it. A
    rank whose n or q differs, or whose indices name other examples (a node with a stale or partial
    copy of the shards, or one listing them in another order), would draw from another population, and
    one example could then be in two ranks' parts of one step: 2C against the accounted C. Before
    anything is charged the ranks compare n, q, T and a fingerprint of what their indices name (the
    shards' digest, the keys at 16 spread indices), and all stop where they differ."""
    if world.size == 1:
        return
    data = ShardDataset(artifact("shards") / "private")
    digest = Path(artifact("shards_digest"))
    spread = sorted({i * (len(data) - 1) // 15 for i in range(16)}) if len(data) else []
    named = [len(data), *(data.key(i) for i in spread), digest.read_text() if digest.exists() else None]
    if not same_on_every_rank([plan.n, plan.sample_rate, plan.steps, fingerprint(named)], world):
        raise RanksDisagree(f"the ranks see different private data (rank {world.rank}: n = {plan.n} in "
                            f"{artifact('shards')}): every node must see the same shards, on the file system the "
                            f"ranks share, or their samples would overlap")


def train_private(params: dict, trainer: "Trainer", ctx, metrics_as: str = ""):
    """One DP training, charged to the data's budget before its first step: (model, counters, ledger record).
    Its per-step metrics go to the stage's run under `metrics_as` (a stage that trains several names each)."""
    world = trainer.world
    work = work_dir(params, trainer)
    check_same_data(trainer.plan, world)
    check_same_params(params, world)
    with one_process(work, world):
        key = 0
        if world.is_main:
            work.mkdir(parents=True, exist_ok=True)
            work.chmod(0o700)  # its key, and its ledger of realised batch sizes: the owner's alone
            key = secret_key(work, params["dp"]["noise_seed"])
            # Charged to the examples' budget before the first step (composition across runs), once per key.
            data_id, sketch = budget.examples_identity(artifact("shards") / "private")
            public = release.public_set(trainer.source)
            budget.record(data_id, sketch, work.name, trainer.plan, key, public_set=public)
            record_outside_dp(params, work.name, data_id, sketch, public)
        key = broadcast_int(key, world)
        model, counters, history = trainer.train(key, work, ctx, private=True, metrics_as=metrics_as)
    record, plan = None, trainer.plan  # the ledger's, on a resume
    if world.is_main:
        record = trainer.ledger.public()
        record["data_identity"], record["run"] = data_id, work.name
        record.update({"public_set": public} if public else {})  # the runs it composes with (budget.composition)
        record["epsilon"] = accounting.epsilon(plan.sigma, plan.sample_rate, trainer.ledger.steps, plan.delta,
                                               accountant=plan.accountant, adjacency=plan.adjacency)
        record["history"] = history
        # Statistics of the private data, for the data owner and `verify` only (privacy/owner.py).
        owner.write(owner.run_record(work.name), {"batch_sizes": trainer.ledger.to_dict()["batch_sizes"],
                                                 "nonfinite_examples": counters["nonfinite"]})
    return model, counters, record


def record_outside_dp(params: dict, run: str, data_id: str, sketch, public_set: str | None, twin=False) -> None:
    """What this run releases without DP, charged before it is released: later runs on these examples compose
    to ∞ whatever their flags (budget.record_outside_dp). The ε = ∞ `twin` releases its set and held-out loss."""
    reasons = [(data_id, sketch, "a training without DP on them")] if twin else []
    if params["dp"]["noise_seed"] is not None and not twin:
        reasons.append((data_id, sketch, "a known noise key (dp.noise_seed)"))
    if params["dp"]["log_private_stats"] and not twin:
        reasons.append((data_id, sketch, "dp.log_private_stats published a count without noise"))
    if read_json(artifact("shards") / "stats.json").get("eval_from_private"):  # the held-out loss reads it
        reasons.append((*budget.examples_identity(artifact("shards") / "eval"),
                        "the eval split carved out of the source (shards.eval_fraction)"))
    for identity, bits, why in reasons:
        budget.record_outside_dp(identity, bits, run, why, public_set)


def train_nonprivate(params: dict, trainer: "Trainer", ctx, metrics_as: str = ""):
    """The recipe without noise (ε = ∞), and without clipping unless `dp.nonprivate_clipped`: for
    comparison only, never to be published. Noise does not limit it, so `dp.nonprivate` may give it a
    longer schedule of its own."""
    release.check_nonprivate(params["privacy"], trainer.source, "the ε = ∞ twin")
    p = nonprivate_params(params)
    twin = Trainer(p, trainer.mcfg, trainer.tokenizer, trainer.held, trainer.plan.without_noise(p["dp"]["steps"]),
                   trainer.world, trainer.device, trainer.source)
    work = work_dir(p, trainer) / ("nonprivate-clipped" if p["dp"]["nonprivate_clipped"] else "nonprivate")
    with one_process(work, trainer.world):
        if trainer.world.is_main:  # charged before its first step, as a DP run is
            record_outside_dp(params, f"{work.parent.name}-{work.name}",
                              *budget.examples_identity(artifact("shards") / "private"),
                              release.public_set(trainer.source), twin=True)
        return twin.train(params["run"]["seed"], work, ctx, private=False, metrics_as=metrics_as)[0]


@contextmanager
def compile_cache_in(directory):
    """Inductor's and Triton's caches in `directory` (owner-only) while a model compiles and runs there:
    a traced graph keeps its inputs' sizes (a Poisson-sized micro-batch's rows: a realised batch size),
    and Inductor's default cache is a world-readable /tmp directory kept across runs."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    names = {"TORCHINDUCTOR_CACHE_DIR": directory / "inductor", "TRITON_CACHE_DIR": directory / "triton"}
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({name: str(path) for name, path in names.items()})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def public_negative_tokens(tokenizer, mcfg) -> torch.Tensor:
    """clip-public's negatives, `model.public_negatives` public captions as token ids (K, max_len): every
    caption of the labelled sets (the captions of the domains dpfm ships, which an image must tell
    apart; from a corpus of mostly other domains' captions, a handful of them drawn in 256 left the
    classes nothing to be told apart by, and the features collapsed: −5.2 points at ε = 8), then the
    rest drawn from the filled templates by a fixed public seed: the same on every rank and run."""
    labelled, others = public_captions()
    count = mcfg.public_negatives
    if count > len(labelled) + len(others):
        raise ParamsError([f"model.public_negatives={count}, but the public caption corpus holds "
                           f"{len(labelled) + len(others)}"], source="model params")
    drawn = np.sort(np.random.default_rng(0).choice(len(others), max(0, count - len(labelled)), replace=False))
    texts = list(labelled[:count]) + [others[i] for i in drawn]
    return tokenizer.encode(texts, mcfg.max_len)  # any cut: public text, still a negative


def warm_start(model, objective_name: str) -> None:
    """Loads the synthetic warm start (the pretrain artifact) into a freshly built model."""
    checkpoints.load(artifact("pretrain") / "checkpoint.pt").load_into(model, objective_name)


class Trainer:
    """Builds the model and runs the DP (or, for the baseline, the plain) training loop."""

    def __init__(self, params, mcfg, tokenizer, held_inputs, plan, world, device, source):
        self.params, self.dp, self.mcfg, self.tokenizer = params, params["dp"], mcfg, tokenizer
        self.plan, self.world, self.device, self.source = plan, world, device, source
        self.num_patches = (mcfg.img_size // mcfg.patch_size) ** 2
        self.held = held_inputs  # None: no eval split, no held-out loss
        if held_inputs is not None:
            self.held_noise = torch.rand(len(held_inputs[0]), self.num_patches,
                                         generator=torch.Generator().manual_seed(params["run"]["seed"]))
        self.ledger = None

    def build(self):
        torch.manual_seed(self.params["run"]["seed"])
        model = build_model(self.dp["objective"], self.mcfg).to(self.device)
        if self.dp["init"] == "pretrain":
            warm_start(model, self.dp["objective"])
        if getattr(model, "per_sample", False):  # clip-public: scored against the public corpus's captions
            model.set_public_negatives(public_negative_tokens(self.tokenizer, self.mcfg))
        freeze(model, self.dp["frozen"])
        return model

    def train(self, key: int, work, ctx, private: bool, metrics_as: str = ""):
        """(model, counters, history) of the run whose state lives in `work`, resumed from it; the caller
        holds the run's lock (`one_process`)."""
        dp, plan, world, device = self.dp, self.plan, self.world, self.device
        obj = objective(dp["objective"])
        model = self.build()
        # A warm-started encoder moves at encoder_lr_scale × lr (its features are what the run is for).
        optimizer = make_optimizer(model, dp["optimizer"], dp["lr"], dp["weight_decay"],
                                   dp["encoder_lr_scale"] if dp["init"] == "pretrain" else 1.0)
        clips = private or dp["nonprivate_clipped"]  # a twin may clip without noise (which of the two costs)
        clipper = make_clipper(obj.clipping, model, dp["clip_norm"], dp["clipping"] if clips else "plain",
                               autocast=lambda: autocast(device, dp["precision"]), loss_scale=loss_scale(dp["precision"]),
                               gather=gather_with_grad(world) if obj.clipping == "per_batch" else None,
                               encoder_share=dp["encoder_clip_share"], views=dp["mask_views"], compiled=dp["compile"])
        if dp["compile"]:  # after the clipper's hooks, which the compiled call runs (same numbers)
            model.compile(backend=dp["compile_backend"])
        if not private and plan.sigma:
            raise ValueError("a non-private training takes its plan's without_noise()")
        ledger = Ledger(work / "ledger.jsonl", plan) if private and world.is_main else None
        if private:  # the mechanism the run began with (its ledger's), the main rank's on every rank
            self.ledger = ledger
            plan = self.plan = agreed_plan(ledger.plan if ledger else plan, world)
        sampler = PoissonSampler(plan.n, plan.sample_rate, key)
        # Counted by the optimizer's own hook, so `verify` can compare it with the ledger independently.
        state = TrainState(model, optimizer, counters={"applied_updates": 0, "nonfinite": 0})
        counters = state.counters
        optimizer.register_step_post_hook(lambda *_: counters.__setitem__("applied_updates", counters["applied_updates"] + 1))
        if hasattr(model, "after_optimizer_step"):  # a parameter's range (CLIP's scale): post-processing too
            optimizer.register_step_post_hook(lambda *_: model.after_optimizer_step())
        if dp["ema_decay"]:  # the average of the noisy iterates is released: post-processing, the same ε
            state.average = WeightAverage(model, dp["ema_decay"])
            optimizer.register_step_post_hook(lambda *_: state.average.update())
        masks, views = {}, dp["mask_views"]
        physical = max(1, dp["physical_batch_size"] // views)  # examples per micro-batch: its rows are what memory holds
        loader = split_loader("private", self.mcfg, self.tokenizer, dp["data_workers"], device)
        stream = StreamedBatches(loader, sampler, obj.clipping, physical, world, plan.steps)

        def fetch(step: int, indices: np.ndarray, positions: np.ndarray) -> tuple:
            batch, mine = stream(step, indices, positions), None
            if self.mcfg.reads_masks(obj.name):  # drawn per logical batch: the same masks however it is split
                if step not in masks:
                    masks.clear()
                    masks[step] = torch.rand(len(indices), views, self.num_patches,
                                             generator=step_generator(key, step, MASKS))
                mine = masks[step][positions]
            return tuple(x.to(device) for x in view_rows(batch, mine, views))

        def step_fn(step: int) -> dict:
            try:
                result = dp_step(step, sampler=sampler, fetch=fetch, clipper=clipper, plan=plan, key=key, world=world,
                                 physical_batch_size=physical, ledger=ledger)
            except (PrivateDataError, LedgerError, StepRefused, RanksDisagree):  # messages written to be published
                raise
            except Exception as e:  # but a full disk: the ledger's charge (io.append_durably names the file)
                if isinstance(e, OSError) and e.errno in DISK_FULL:
                    raise
                raise kept_for_owner(step, e) from None
            counters["nonfinite"] += result.nonfinite  # private: kept for the ledger, not logged
            optimizer.step()
            metrics = {}
            if self.held is not None and (step % dp["eval_every"] == 0 or step == plan.steps - 1):
                metrics["heldout_loss"] = self.heldout_loss(model)
            return metrics

        prefix = metrics_as + ("" if private else "nonprivate_")
        # On private data a step's time tracks its realised batch size: not timed, and its metrics carry
        # the stage's one timestamp (tracking.StageRun), not the time MLflow would give each step.
        try:
            with compile_cache_in(work / "compile-cache") if dp["compile"] else nullcontext():
                run_loop(state, Schedule(dp["steps"], dp["lr"], dp["warmup_steps"], dp["checkpoint_every"], log_every=1),
                         step_fn, Checkpointer(work, write=world.is_main), desc=f"dp-train{'' if private else ' (non-private)'}",
                         log=lambda s, m: ctx.tracker.log_metrics({prefix + k: v for k, v in m.items()}, step=s),
                         world=world, timed=False)
            log_earlier(state, ctx.tracker, ("heldout_loss", "lr"), prefix)
        finally:
            stream.close()
        if state.average is not None:
            state.average.copy_to(model)
        return model, counters, state.history

    @torch.no_grad()
    def heldout_loss(self, model) -> float:
        model.eval()
        inputs = tuple(x.to(self.device) for x in self.held)
        if self.mcfg.reads_masks(self.dp["objective"]):
            inputs = inputs + (self.held_noise.to(self.device),)
        loss = model(*inputs).mean().item()
        model.train()
        return loss


TRAIN_SECTIONS = ("run", "model", "dp", "privacy")  # dp-train's own (its state directory is keyed by run, model, dp)


def point_params(params: dict, init: str, epsilon: float) -> dict:
    """dp-train's params for one point: the recipe at `epsilon` from `init`. ε = ∞ keeps the
    recipe's own ε for planning (the sampling rate and steps), and trains without noise."""
    dp = {**params["dp"], "init": init}
    if math.isfinite(epsilon) and epsilon != dp["epsilon"]:  # dp-train's own ε keeps its σ (and identity)
        dp.update(epsilon=float(epsilon), sigma=None)
    return {**{s: params[s] for s in TRAIN_SECTIONS}, "dp": dp}


def check_point_plans(params: dict, n: int) -> None:
    """Plan each private curve point as dp-train will, before the first is charged (the curve, `dpfm validate`)."""
    for epsilon in filter(math.isfinite, params["curve"]["epsilons"]):
        checked_plan(point_params(params, "random", epsilon)["dp"], n, params["privacy"]["adjacency"],
                     what=f"the curve's point at ε = {epsilon} (dp params, curve.epsilons' ε)")


def train_point(params: dict, ctx, init: str, epsilon: float, metrics_as: str = ""):
    """(model, verified ε or None for ∞, whether this is the main process) of one point, its per-step
    metrics named `metrics_as` + metric."""
    p = point_params(params, init, epsilon)
    trainer = setup(p, ctx.device)
    is_main = trainer.world.is_main
    if not math.isfinite(epsilon):
        return train_nonprivate(p, trainer, ctx, metrics_as), None, is_main
    model, counters, record = train_private(p, trainer, ctx, metrics_as)
    if not is_main:
        return model, None, is_main
    record.pop("history")
    checked = verify(with_batch_sizes(record), counters["applied_updates"], p["dp"], params["verify"]["accountants"],
                     params["verify"]["batch_size_alpha"], params["privacy"]["adjacency"])
    if not checked["passed"]:
        failed = [c["name"] for c in checked["checks"] if not c["passed"]]
        raise VerificationFailed(f"curve point ε={epsilon} from {init}: privacy verification failed: {', '.join(failed)}")
    return model, checked["epsilon_reported"], is_main
