"""The one DP step (`engine.dp_step`) for every objective, at 1 and at 2 ranks (gloo on CPU):

- 2 ranks give the 1-rank update (each example enters the sum once; compared without noise, which
  would otherwise drown the difference);
- the noise added has std σ·K·C / divisor, and the noiseless part is bounded as accounted
  (per example: one example moves it by ≤ C; per batch: the clipped total has norm ≤ C);
- under bf16 autocast no clipped contribution exceeds C, and under fp16 no finite example is dropped;
- what the clipper cannot bound (tied weights, unknown layers, BatchNorm) is refused before step 1.

Each check is also run against the engine with one bug switched on (`BUGS`), to show it catches it.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.multiprocessing import ProcessRaisedException
from broken_engine import bug
from ranks import on_two_ranks

from pipeline.distributed import World, gather_with_grad
from pipeline.models import ModelConfig, build_model
from pipeline.objectives import OBJECTIVES
from pipeline.privacy import clipping
from pipeline.privacy.clipping import BookKeepingClipper, UnboundableModel, VmapClipper
from pipeline.privacy.engine import StepRefused, dp_step, make_clipper, micro_batches, pieces, rank_share
from pipeline.privacy.noise import gaussian, step_noise
from pipeline.train import NOISE, step_generator
from pipeline.privacy.plan import Plan
from pipeline.privacy.sampling import FixedBatch, PoissonSampler

N, Q, C, SIGMA, KEY = 40, 0.3, 0.05, 1.3, 11
CFG = {"size": "micro", "vocab_size": 50, "max_len": 8}


def FixedSampler(indices):
    """Every step draws the same batch: the examples `indices` of range(N)."""
    return FixedBatch(np.asarray(indices, dtype=np.int64), N)


def data():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N, 3, 16, 16, generator=g), torch.randint(4, 50, (N, 8), generator=g),
            torch.rand(N, 16, generator=g))


def fetcher(name, dtype=torch.float32):
    imgs, tokens, noise = data()

    def fetch(step, indices, positions):
        rows = indices[positions]
        return (imgs[rows].to(dtype), noise[rows]) if ModelConfig.of(CFG).reads_masks(name) else (imgs[rows].to(dtype), tokens[rows])
    return fetch


def plan_for(name, sigma=SIGMA):
    mode = OBJECTIVES[name].clipping
    return Plan.unaccounted(name, mode, sigma, C, n=N, sample_rate=Q, steps=100)


def model_for(name):
    torch.manual_seed(1)
    return build_model(name, CFG)


def clipper_for(name, model, world, precision=None):
    mode = OBJECTIVES[name].clipping
    autocast = (lambda: torch.autocast("cpu", dtype=precision)) if precision else contextlib.nullcontext
    return make_clipper(mode, model, C, autocast=autocast, loss_scale=2.0 ** 12 if precision == torch.float16 else 1.0,
                        gather=gather_with_grad(world) if mode == "per_batch" else None)


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


# ---- running the step at 1 and 2 ranks -----------------------------------------------------------

def train(name, world, steps=3, bug_name=None):
    """`steps` SGD steps of the real dp_step without noise; the flat parameters after them."""
    model = model_for(name)
    clipper = clipper_for(name, model, world)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    sampler = engine_sampler()
    with bug(bug_name):
        for step in range(steps):
            dp_step(step, sampler=sampler, fetch=fetcher(name), clipper=clipper, plan=plan_for(name, 0.0), key=KEY,
                    world=world, physical_batch_size=4)
            optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def engine_sampler():
    from pipeline.privacy.sampling import PoissonSampler

    return PoissonSampler(N, Q, KEY)


def noise_and_signal(name, world, bug_name=None):
    """(noise, noiseless update, largest change one example makes to the noiseless update), all
    multiplied back by the divisor, from three runs of the real step on one fixed batch."""
    indices = np.arange(0, N, 3)
    with bug(bug_name):
        noisy, clean = run_once(name, world, indices, SIGMA), run_once(name, world, indices, 0.0)
        without = [run_once(name, world, np.delete(indices, i), 0.0) for i in (0, 5)]
    divisor = plan_for(name).denominator
    return (noisy - clean) * divisor, clean * divisor, max(float((clean - w).norm()) * divisor for w in without)


def run_once(name, world, indices, sigma, precision=None, step=0):
    model = model_for(name)
    dp_step(step, sampler=FixedSampler(indices), fetch=fetcher(name), clipper=clipper_for(name, model, world, precision),
            plan=plan_for(name, sigma), key=KEY, world=world, physical_batch_size=4)
    return grads(model)


def _train(name, bug_name, world):
    return train(name, world, bug_name=bug_name)


def _noise_and_signal(name, bug_name, world):
    return noise_and_signal(name, world, bug_name)


def noise_at(name, step, bug_name, world, history=(), key=KEY):
    """The noise of step `step` on a fixed batch (the noisy update less the noiseless one), after
    running the steps in `history` on the same model first, as a resumed run would not."""
    indices, model = np.arange(0, N, 3), model_for(name)
    clipper = clipper_for(name, model, world)

    def release(sigma, s):
        dp_step(s, sampler=FixedSampler(indices), fetch=fetcher(name), clipper=clipper, plan=plan_for(name, sigma),
                key=key, world=world, physical_batch_size=4)
        return grads(model)

    with bug(bug_name):
        for earlier in history:
            release(SIGMA, earlier)
        return release(SIGMA, step) - release(0.0, step)


def _noise_on_every_rank(name, bug_name, world):
    import torch.distributed as dist

    mine = noise_at(name, 2, bug_name, world)
    every = [torch.empty_like(mine) for _ in range(world.size)]
    dist.all_gather(every, mine)
    return every


def relative(a, b):
    return float((a - b).norm() / b.norm())


# ---- the tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_two_ranks_give_the_one_rank_update(tmp_path, name):
    one = train(name, World())
    two = on_two_ranks(tmp_path, _train, name, None)
    start = torch.cat([p.detach().flatten() for p in model_for(name).parameters()])
    assert relative(two - start, one - start) <= 1e-4


NONFINITE = [2, 9, 21, 30]  # examples whose image is NaN: each rank's share of the step holds some


def dropped_count(name, world):
    """(the step's count of dropped examples, per batch: batches, on this rank; the update finite) for a
    batch of 18 examples, NONFINITE among them."""
    fetch = fetcher(name)

    def with_nans(step, indices, positions):
        imgs, other = fetch(step, indices, positions)
        broken = torch.from_numpy(np.isin(indices[positions], NONFINITE))
        return imgs.masked_fill(broken[:, None, None, None], float("nan")), other
    model = model_for(name)
    result = dp_step(0, sampler=FixedSampler(sorted({*range(0, 32, 2), *NONFINITE})), fetch=with_nans,
                     clipper=clipper_for(name, model, world), plan=plan_for(name, 0.0), key=KEY, world=world,
                     physical_batch_size=4)
    return result.nonfinite, bool(torch.isfinite(grads(model)).all())


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_the_dropped_count_is_the_whole_steps_on_two_ranks(tmp_path, name):
    """The count the owner's record keeps (and dp.log_private_stats logs) is of the step, not rank 0's part;
    a per-batch step drops its one batch. The update stays finite either way."""
    expected = 1 if OBJECTIVES[name].clipping == "per_batch" else len(NONFINITE)
    assert dropped_count(name, World()) == (expected, True)
    assert on_two_ranks(tmp_path, dropped_count, name) == (expected, True)


@pytest.mark.parametrize("name, bug_name", [("mae", "whole batch per rank"), ("caption", "whole batch per rank"),
                                            ("clip", "local negatives only")])
def test_two_rank_equality_catches_a_broken_split(tmp_path, name, bug_name):
    one = train(name, World())
    two = on_two_ranks(tmp_path, _train, name, bug_name)
    start = torch.cat([p.detach().flatten() for p in model_for(name).parameters()])
    assert relative(two - start, one - start) > 1e-3


# The sensitivity of each clipping, in units of C, as the analysis gives it (docs/privacy.md), not read
# from the code's table (objectives.SENSITIVITY), which a test comparing against could not catch.
SENSITIVITY_IN_C = {"per_sample": 1, "per_batch": 2}


def check_noise_and_signal(name, noise, clean, one_example):
    """The accounted mechanism: noise std σ·K·C (within 5%), and the noiseless sum moved by at most
    C by one example (per example) or bounded by C as a whole (per batch)."""
    problems = []
    std, want = float(noise.std()), SIGMA * SENSITIVITY_IN_C[OBJECTIVES[name].clipping] * C
    if abs(std / want - 1) > 0.05:
        problems.append(f"noise std {std:.4g}, accounted {want:.4g}")
    if OBJECTIVES[name].clipping == "per_batch" and float(clean.norm()) > C * (1 + 1e-5):
        problems.append(f"clipped batch gradient has norm {float(clean.norm()):.4g} > C={C}")
    if one_example > C * (1 + 1e-5):
        problems.append(f"one example moves the sum by {one_example:.4g} > C={C}")
    return problems


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_noise_and_sensitivity_are_as_accounted_on_two_ranks(tmp_path, name):
    assert check_noise_and_signal(name, *noise_and_signal(name, World())) == []
    assert check_noise_and_signal(name, *on_two_ranks(tmp_path, _noise_and_signal, name, None)) == []


def noise_problems(name, tmp_path, bug_name=None) -> list[str]:
    """Step 2's noise depends on (key, step) alone: the same fresh, after other steps (a resume
    replays none of them), and on each of two ranks (so it is added once, not twice)."""
    fresh = noise_at(name, 2, bug_name, World())
    others = [("after steps 0 and 1", noise_at(name, 2, bug_name, World(), history=(0, 1)))]
    others += [(f"on rank {r} of 2", noise) for r, noise in
               enumerate(on_two_ranks(tmp_path, _noise_on_every_rank, name, bug_name))]
    return [f"{label} differs by {relative(other, fresh):.2g}" for label, other in others
            if relative(other, fresh) > 1e-4]


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_the_noise_depends_on_key_and_step_alone(tmp_path, name):
    assert noise_problems(name, tmp_path) == []
    fresh = noise_at(name, 2, None, World())
    assert fresh.abs().sum() > 0 and relative(noise_at(name, 3, None, World()), fresh) > 0.5
    # and on the key: noise that ignored the secret key would be anyone's to subtract
    assert relative(noise_at(name, 2, None, World(), key=KEY + 1), fresh) > 0.5


def test_the_cpu_noise_holds_every_bit_of_its_key_and_step():
    """torch's CPU generator keeps the low 32 bits of its seed, so a step's noise seeded through it is
    one of 2^32 vectors: a search over them subtracts it from one released update, and two steps of a
    long run draw the same. Two steps of one key whose 63-bit seeds share their low 32 bits (found by a
    birthday search) draw different noise; through torch's generator, as the noise once was, the same."""
    key, seen = 0x2B7E151628AED2A6, {}
    for step in range(1 << 18):
        low = step_generator(key, step, NOISE).initial_seed() & 0xFFFFFFFF
        if low in seen:
            break
        seen[low] = step
    pair, shape, cpu = (seen[low], step), torch.Size([256]), torch.device("cpu")
    drawn = [gaussian(shape, step_noise(key, s, "cpu"), cpu) for s in pair]
    assert not torch.equal(*drawn)
    assert torch.equal(drawn[0], gaussian(shape, step_noise(key, pair[0], "cpu"), cpu))  # still (key, step) alone
    through_torch = [gaussian(shape, step_generator(key, s, NOISE), cpu) for s in pair]
    assert torch.equal(*through_torch)


@pytest.mark.parametrize("name, bug_name", [("mae", "noise per rank"), ("caption", "noise from the global stream"),
                                            ("clip", "noise per rank"), ("clip", "noise from the global stream")])
def test_the_noise_check_catches_noise_that_depends_on_more(tmp_path, name, bug_name):
    if bug_name == "noise per rank":  # the engine's own check (check_same_update) stops both ranks first
        with pytest.raises(ProcessRaisedException, match="the ranks drew different noise for one step"):
            noise_problems(name, tmp_path, bug_name)
        return
    assert noise_problems(name, tmp_path, bug_name) != []


@pytest.mark.parametrize("name, bug_name", [("mae", "noise / W"), ("caption", "noise x0.7"), ("clip", "noise / W"),
                                            ("clip", "noise x0.7"), ("mae", "clip bound 2C"), ("clip", "clip bound 2C")])
def test_noise_and_sensitivity_check_catches_broken_steps(tmp_path, name, bug_name):
    assert check_noise_and_signal(name, *on_two_ranks(tmp_path, _noise_and_signal, name, bug_name)) != []


# ---- the noise is drawn finer than fp32 -------------------------------------------------------------

def drawn_noise(name, bug_name, world):
    """The step's noise in units of its std, read off the release of a model held in fp64 (noisy
    less noiseless), so nothing rounds it to fp32 on the way out."""
    indices, plan = np.arange(0, N, 3), plan_for(name)

    def release(sigma):
        model = model_for(name).double()
        dp_step(0, sampler=FixedSampler(indices), fetch=fetcher(name, torch.float64),
                clipper=clipper_for(name, model, world), plan=plan_for(name, sigma), key=KEY, world=world,
                physical_batch_size=4)
        return grads(model)

    with bug(bug_name):
        return (release(SIGMA) - release(0.0)) * plan.denominator / plan.noise_std


def _drawn_noise(name, bug_name, world):
    return drawn_noise(name, world=world, bug_name=bug_name)


def share_on_the_fp32_grid(z):
    """The share of values within a thousandth of an fp32 spacing of an fp32 number. fp32 normals
    (scaled and added in fp64) all are; a draw resolved finer is, by chance, about 0.2% of the time."""
    nearest = z.float()
    spacing = (torch.nextafter(nearest.abs(), torch.tensor(float("inf"))) - nearest.abs()).double()
    return float(((z - nearest.double()).abs() <= 1e-3 * spacing).double().mean())


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_the_noise_is_drawn_finer_than_fp32_on_one_and_two_ranks(tmp_path, name):
    """fp32 normals (Box-Muller on 24-bit uniforms) never pass 5.77 std: a released coordinate past
    that edge would show an example was in (docs/privacy.md, "Floating-point noise")."""
    one, two = drawn_noise(name, None, World()), on_two_ranks(tmp_path, _drawn_noise, name, None)
    assert share_on_the_fp32_grid(one) < 0.02 and share_on_the_fp32_grid(two) < 0.02
    assert abs(float(one.std()) - 1) < 0.05 and relative(two, one) < 1e-9  # the same draw on both


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_the_fp32_grid_check_catches_fp32_noise(tmp_path, name):
    assert share_on_the_fp32_grid(drawn_noise(name, "noise drawn in fp32", World())) > 0.98
    assert share_on_the_fp32_grid(on_two_ranks(tmp_path, _drawn_noise, name, "noise drawn in fp32")) > 0.98


# ---- precision: the privacy arithmetic is fp32 under autocast ----------------------------------------

def contributions(name, precision):
    """Each example's clipped contribution (one-example batches through the real step, no noise)."""
    return [float(run_once(name, World(), np.array([i]), 0.0, precision).norm()) * plan_for(name).denominator
            for i in range(0, N, 4)]


def autocast_everywhere(dtype):
    """BROKEN on purpose: the clipping arithmetic left under autocast, as it once was."""
    return lambda device: torch.autocast(device_type=device.type, dtype=dtype)


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_no_clipped_contribution_exceeds_c_under_bf16(name, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "C", 1e-3)  # every example clipped: its contribution is C
    assert max(contributions(name, torch.bfloat16)) <= 1e-3 * (1 + 1e-6)
    if name != "clip":  # the per-batch clip is a single scalar product: bf16 cannot hurt it measurably
        monkeypatch.setattr(clipping, "fp32_only", autocast_everywhere(torch.bfloat16))
        assert max(contributions(name, torch.bfloat16)) > 1e-3 * (1 + 1e-6)


@pytest.mark.parametrize("name", ["mae", "caption"])
def test_fp16_drops_no_finite_example(name, monkeypatch):
    model = model_for(name)
    clipper = clipper_for(name, model, World(), torch.float16)
    imgs, tokens, noise = data()
    batch = (imgs[:8] * 30, noise[:8]) if ModelConfig.of(CFG).reads_masks(name) else (imgs[:8] * 30, tokens[:8])
    clipper.reset()
    assert clipper.accumulate(*batch).nonfinite == 0
    monkeypatch.setattr(clipping, "fp32_only", autocast_everywhere(torch.float16))
    clipper.reset()
    assert clipper.accumulate(*batch).nonfinite > 0  # the Gram products overflow in fp16


# ---- what cannot be bounded is refused ---------------------------------------------------------------

class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.out = nn.Linear(6, 10, bias=False)
        self.out.weight = self.embed.weight  # weight tying, as in many language models

    def forward(self, ids):
        return self.out(self.embed(ids)).logsumexp(-1).mean(-1)


def test_tied_weights_are_refused_and_would_break_the_bound(monkeypatch):
    with pytest.raises(UnboundableModel, match="tied to embed.weight, out.weight"):
        BookKeepingClipper(Tied(), 1.0)
    # What the refusal prevents: the clipper's per-example norm is not the true one.
    monkeypatch.setattr(clipping, "reject_unboundable", lambda *a, **k: None)
    torch.manual_seed(0)
    model, ids = Tied(), torch.randint(0, 10, (6, 4))
    ref = VmapClipper(model, 1e-4)  # exact for tied weights (functional_call)
    hooked = BookKeepingClipper(model, 1e-4)
    for c in (ref, hooked):
        c.reset()
    true_norms, hooked_norms = ref.accumulate(ids).norms, hooked.accumulate(ids).norms
    assert max(abs(a / b - 1) for a, b in zip(hooked_norms, true_norms)) > 1e-3


def test_unknown_layers_and_batchnorm_are_refused_by_name():
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 1))
    with pytest.raises(UnboundableModel, match=r"0\.weight belongs to Conv2d, which has no clipping rule"):
        BookKeepingClipper(conv, 1.0)
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    for make in (lambda: BookKeepingClipper(bn, 1.0), lambda: VmapClipper(bn, 1.0),
                 lambda: make_clipper("per_sample", bn, 1.0, "opacus-hooks"), lambda: make_clipper("per_batch", bn, 1.0)):
        with pytest.raises(UnboundableModel, match=r"1 \(BatchNorm1d\) keeps running statistics"):
            make()
    # Without parameters or running statistics it still normalises over the batch: one example moves the
    # others' gradients, so a per-example clipper refuses it; the per-batch clip bounds the batch anyway.
    bare = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False, track_running_stats=False), nn.Linear(4, 1))
    for make in (lambda: BookKeepingClipper(bare, 1.0), lambda: VmapClipper(bare, 1.0),
                 lambda: make_clipper("per_sample", bare, 1.0, "opacus-hooks")):
        with pytest.raises(UnboundableModel, match=r"1 \(BatchNorm1d\) normalises over the batch"):
            make()
    make_clipper("per_batch", bare, 1.0)


def test_every_model_is_accepted():
    for name in OBJECTIVES:
        make_clipper(OBJECTIVES[name].clipping, model_for(name), 1.0)  # raises if a model had a problem


def guarded_step(name, step, world):
    """What dp_step does with step `step` of a plan accounted for 2: its refusal, or that it stepped."""
    model = model_for(name)
    plan = Plan.unaccounted(name, OBJECTIVES[name].clipping, SIGMA, C, n=N, sample_rate=Q, steps=2)
    try:
        dp_step(step, sampler=engine_sampler(), fetch=fetcher(name), clipper=clipper_for(name, model, world),
                plan=plan, key=KEY, world=world)
    except StepRefused as e:
        return str(e)
    return "stepped"


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_budget_guard_refuses_a_step_beyond_the_accounted_ones(tmp_path, name):
    assert guarded_step(name, 1, World()) == "stepped"
    for refused in (guarded_step(name, 2, World()), on_two_ranks(tmp_path, guarded_step, name, 2)):
        assert refused == "refusing step 2: ε was accounted for 2 steps"


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_fixed_batch_is_cut_as_training_cuts_a_batch_expecting_as_many(world_size):
    """The step audit releases a FixedBatch of B examples; what it measures (the others' rounding by
    bucket) is training's only if its micro-batches are those of a Poisson step expecting B: the same
    B examples spread over k·B, drawn at rate 1/k."""
    size, physical, k = 1000, 7, 50  # B / P not a bucket multiple: halving the buckets moves the cuts
    for rank in range(world_size):
        world = World(rank=rank, size=world_size)
        audited = rank_share(np.arange(size), FixedBatch(np.arange(size), size), "per_example", physical, world)
        trained = rank_share(k * np.arange(size), PoissonSampler(k * size, 1 / k, key=0), "per_example", physical,
                             world)
        assert len(audited) > 1 and [m.tolist() for m in audited] == [m.tolist() for m in trained]


def noise_off_its_stream(name, world):
    """How far step 2's released noise is from step_noise(KEY, 2)'s draws · σ·K·C / divisor, relatively."""
    released = noise_at(name, 2, None, world)
    model, plan, generator = model_for(name), plan_for(name), step_noise(KEY, 2, "cpu")
    drawn = torch.cat([gaussian(p.shape, generator, torch.device("cpu")).flatten()
                       for p in model.parameters() if p.requires_grad])
    return relative(released.double(), drawn * plan.noise_std / plan.denominator)


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_the_noise_is_step_noise_of_key_and_step(tmp_path, name):
    """Only step_noise(key, t)'s stream is shown apart from the sampler's and the masks' (test_noise_std): noise
    drawn from another generator of (key, t), e.g. the Poisson sampler's, passes every test of test_engine."""
    assert noise_off_its_stream(name, World()) < 1e-4
    assert on_two_ranks(tmp_path, noise_off_its_stream, name) < 1e-4


def sum_dtype_of_one_part_per_rank(name, world):
    """The dtype of the summed clipped gradients after a step in which each rank has one micro-batch."""
    model = model_for(name)
    clipper = clipper_for(name, model, world)
    dp_step(0, sampler=FixedSampler(np.arange(0, N, 5)), fetch=fetcher(name), clipper=clipper, plan=plan_for(name, 0.0),
            key=KEY, world=world, physical_batch_size=N)
    return next(iter(clipper.sum.values())).dtype


@pytest.mark.parametrize("name", [n for n, o in OBJECTIVES.items() if o.clipping == "per_sample"])
def test_a_sum_over_two_ranks_is_fp64_even_with_one_micro_batch_each(tmp_path, name):
    """Two ranks' partial sums add up like two micro-batches': in fp64 (clipping.SUM_DTYPE), or the
    others' rounding moves with one example beyond what the step audit measured. One micro-batch per rank
    is the case a count of this rank's parts alone (one: no sum to round) gets wrong."""
    assert on_two_ranks(tmp_path, sum_dtype_of_one_part_per_rank, name) == torch.float64


def test_every_rank_joins_a_per_batch_step_of_one_example_and_none_joins_an_empty_one():
    """A per-batch rank with nothing of the batch must still join its part's gathers (or the other rank
    waits forever); an empty batch gives no part to any rank."""
    sampler = PoissonSampler(N, 0.3, KEY)
    for size in (1, 2, 3):
        for rank in (0, 1):
            parts = list(micro_batches(np.arange(size), sampler, "per_batch", 4, World(rank, 2)))
            assert len(parts) == 1 and sorted(parts[0].tolist()) == list(range(size))[rank::2]
    for rank in (0, 1):
        assert list(micro_batches(np.arange(0), sampler, "per_batch", 4, World(rank, 2))) == []


def per_batch_update(name, world, clip=1e6):
    """A per-batch step's noiseless update with clip bound `clip`, on the batch of every third example."""
    model, mode = model_for(name), OBJECTIVES[name].clipping
    clipper = make_clipper(mode, model, clip, gather=gather_with_grad(world))
    plan = Plan.unaccounted(name, mode, 0.0, clip, n=N, sample_rate=Q, steps=1)
    dp_step(0, sampler=FixedSampler(np.arange(0, N, 3)), fetch=fetcher(name), clipper=clipper, plan=plan, key=KEY,
            world=world, physical_batch_size=4)
    return grads(model)


@pytest.mark.parametrize("name", [n for n, o in OBJECTIVES.items() if o.clipping == "per_batch"])
def test_an_unclipped_per_batch_update_is_the_batch_mean_gradient(tmp_path, name):
    """The per-batch release is the clipped batch *mean*: the clip alone cannot show it (a clipped sum and a
    clipped mean are both C·S/‖S‖), so with C out of reach the update must be ∇ of the mean loss."""
    indices = np.arange(0, N, 3)
    model = model_for(name)
    losses = model(*fetcher(name)(0, indices, np.arange(len(indices))))
    mean = torch.autograd.grad(losses.sum() / len(indices), [p for p in model.parameters() if p.requires_grad],
                               allow_unused=True)
    want = torch.cat([g.flatten() for g in mean if g is not None])
    assert float(want.norm()) < 1e6
    assert relative(per_batch_update(name, World()), want) < 1e-4
    assert relative(on_two_ranks(tmp_path, per_batch_update, name), want) < 1e-4


def test_pieces_cover_a_part_in_order_and_an_empty_part_is_one_empty_piece():
    """The streaming loader decodes a per-batch part piece by piece and checks the ids: a piece lost past the
    physical size, or no piece for an empty part (a rank with none of a small batch), breaks the step."""
    for size in (1, 3, 4, 16):
        for n in range(0, 3 * size + 2):
            got = pieces(np.arange(10, 10 + n), size)
            assert all(0 < len(p) <= size for p in got) if n else [len(p) for p in got] == [0]
            assert np.concatenate(got).tolist() == list(range(10, 10 + n))
