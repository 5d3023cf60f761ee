"""The privacy budget: runs on the same examples compose whatever their sharding or order, runs on
overlapping sets compose, a resumed run is charged once, and the record survives `make clean`."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
from shard_data import write_set

from pipeline.data.shards import ShardWriter, encode_png
from pipeline.objectives import OBJECTIVES
from pipeline.privacy import accounting, budget
from pipeline.privacy.noise_edge import largest_move, noise_edge_floor
from pipeline.privacy.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
SIGMA, Q, STEPS, DELTA = 0.9, 0.01, 300, 1e-6


def plan(steps=STEPS, sigma=SIGMA, objective="mae"):
    """The objective's own clipping (Dp-CLIP's per batch, K = 2): σ is relative to K·C, as accounted."""
    return Plan(objective=objective, clipping=OBJECTIVES[objective].clipping, n=10_000, sample_rate=Q, sigma=sigma, clip_norm=1.0,
                steps=steps, delta=DELTA, accountant="pld", adjacency="add_remove", target_epsilon=8.0, epsilon=8.0)


def examples(n, seed=0, start=0):
    rng = np.random.default_rng(seed)
    return [(f"x{i:05d}", encode_png(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)), f"caption {i}", {})
            for i in range(start, start + n)]


def shard(directory, samples, per_shard=7, keys=None):
    with ShardWriter(directory, prefix="p", samples_per_shard=per_shard) as w:
        for i, (key, image, caption, meta) in enumerate(samples):
            w.write(keys[i] if keys else key, image, caption, meta)
    return budget.examples_identity(directory)


def charge(identity, sketch, run, key=7, **kw):
    budget.record(identity, sketch, run, plan(**kw), key)


def test_the_same_examples_keep_their_identity_whatever_the_sharding_order_or_keys(in_tmp):
    samples = examples(40)
    base, sketch = shard(in_tmp / "a", samples, per_shard=7)
    assert shard(in_tmp / "b", samples, per_shard=500)[0] == base                   # re-sharded
    assert shard(in_tmp / "c", samples[::-1], per_shard=3)[0] == base                # reordered
    assert shard(in_tmp / "d", samples, keys=[f"k{i}" for i in range(40)])[0] == base  # renamed
    assert shard(in_tmp / "e", samples[:-1])[0] != base                              # one example fewer
    changed = samples[:-1] + [(samples[-1][0], samples[-1][1], "another caption", {})]
    assert shard(in_tmp / "f", changed)[0] != base                                   # one caption changed
    assert np.array_equal(shard(in_tmp / "g", samples[::-1])[1], sketch)


def test_the_budgets_size_does_not_depend_on_the_examples(in_tmp, monkeypatch):
    """git tracks data/budget.dvc, which records the budget's size in bytes: measured, a run charged
    to 5 examples, to 300, and to those 300 with one replaced leaves budgets of one size."""
    sizes = []
    for name, samples in (("few", examples(5)), ("many", examples(300)),
                          ("neighbour", examples(299) + examples(1, seed=9, start=299))):
        project = in_tmp / name
        project.mkdir()
        monkeypatch.chdir(project)
        identity, sketch = shard(project / "shards", samples)
        charge(identity, sketch, "run")
        sizes.append(sum(f.stat().st_size for f in Path("data/budget").rglob("*") if f.is_file()))
    assert len(set(sizes)) == 1, sizes


def test_a_rescan_of_the_same_shards_has_the_writers_identity(in_tmp):
    """The shards stage scans web shards (index.build_index) and writes labelled sets (ShardWriter):
    both must name the same examples the same way."""
    from pipeline.data.index import build_index

    write_set(in_tmp / "ext", n=30, per_shard=10)
    written = budget.examples_identity(in_tmp / "ext")[0]
    build_index([str(p) for p in sorted((in_tmp / "ext").glob("*.tar"))], in_tmp / "scanned", eval_fraction=0.0,
                seed=0, cache_dir=in_tmp / "cache", workers=1, check_size=8)
    assert budget.examples_identity(in_tmp / "scanned/private")[0] == written


def test_the_identity_is_keyed_by_the_owner_and_a_run_charged_before_keys_still_composes(in_tmp):
    """The identity is published (the ledger, verify, MLflow): unkeyed, anyone knowing all examples but
    one could test guesses of the last against it. Keyed with the owner's key, it is the same for the
    same examples, another under another key; records made under the old unkeyed identity compose
    through their sketches."""
    samples = examples(30)
    identity, sketch = shard(in_tmp / "a", samples)
    key = budget.BUDGET_DIR / "names.key"
    assert key.stat().st_mode & 0o077 == 0 and len(key.read_text().strip()) == 64
    assert shard(in_tmp / "b", samples, per_shard=4)[0] == identity
    owners = key.read_bytes()
    key.unlink()  # another owner's key (a new budget here: its mark too)
    budget.started_mark().unlink()
    assert budget.examples_identity(in_tmp / "a")[0] != identity
    key.write_bytes(owners)
    assert budget.examples_identity(in_tmp / "a")[0] == identity
    budget.record("0123456789abcdef", sketch, "before-keys", plan(), key=1)  # the identity an old version wrote
    charge(identity, sketch, "after")
    assert [e["run"] for e in budget.runs(identity)] == ["before-keys", "after"]


def test_every_character_of_a_public_name_depends_on_the_owners_key(in_tmp):
    """A name keyed in part only (half of it a plain digest of the private data) is the same under every
    key where it is not keyed, and differs under another key all the same: measured over 32 keys, each
    of its 16 characters takes many values, as a uniform hex digit does (about 13 of 16)."""
    import secrets

    key = budget.BUDGET_DIR / "names.key"
    budget.public_name("make the budget")
    names = []
    for _ in range(32):
        key.write_text(secrets.token_hex(32))
        names.append(budget.public_name("a digest of the private data"))
    assert all(len(name) == 16 for name in names)
    assert min(len({name[i] for name in names}) for i in range(16)) >= 6, names


def test_runs_on_the_same_examples_compose_and_a_resume_is_charged_once(in_tmp):
    samples = examples(40)
    a = shard(in_tmp / "a", samples, per_shard=7)
    charge(*a, "run-a")
    charge(*a, "run-a")  # a resume: the same run, charged once
    b = shard(in_tmp / "b", samples, per_shard=500)  # the same examples, re-sharded
    charge(*b, "run-b")
    runs = budget.runs(b[0])
    assert [e["run"] for e in runs] == ["run-a", "run-b"]
    assert "7" not in {e["key"] for e in runs}  # a fingerprint, not the key
    composed = budget.composed_epsilon(runs, DELTA)
    # The same mechanism twice is the mechanism run for twice the steps.
    assert composed == pytest.approx(accounting.epsilon(SIGMA, Q, 2 * STEPS, DELTA), rel=5e-3)
    assert composed > accounting.epsilon(SIGMA, Q, STEPS, DELTA) * 1.2


def test_the_budget_names_a_key_by_a_fingerprint_that_is_slow_to_try_and_old_runs_resume_charged_once(in_tmp):
    """The budget travels to the owner's DVC remote. Its fingerprint of a run's 63-bit key was a SHA-256,
    which whoever reads the budget could invert by trying every key (about 1e10 a second on a GPU).
    It is scrypt's now; a run charged under the old fingerprint resumes without a second charge."""
    import hashlib

    d = shard(in_tmp / "d", examples(20))
    old, new = hashlib.sha256(b"dpfm budget key 11").hexdigest()[:16], budget.key_fingerprint(11)
    assert new == hashlib.scrypt(b"11", salt=b"dpfm budget key", n=1 << 14, r=8, p=1, dklen=16).hex() != old
    charge(*d, "old", key=11)
    path = budget.BUDGET_DIR / "runs.jsonl"
    path.write_text(path.read_text().replace(new, old))  # as the version before wrote it (keeping no charges)
    budget.CHARGES.unlink()
    charge(*d, "old", key=11)  # its resume
    charge(*d, "old", key=12)  # started again without its state: a new key
    assert [e["key"] for e in budget.runs(d[0])] == [old, budget.key_fingerprint(12)]


def test_a_run_started_again_with_a_new_key_is_charged_again(in_tmp):
    """The run's name is a digest of its params and inputs; its secret key lives in its state
    directory. Started again without that directory (a deleted `.dpfm/`), the same run draws a new key,
    so new batches and new noise: a second release of the same examples, charged as one."""
    d = shard(in_tmp / "d", examples(20))
    charge(*d, "run", key=11)
    charge(*d, "run", key=11)  # resumed with its key: the same draws
    charge(*d, "run", key=12)  # its state lost: a new key
    runs = budget.runs(d[0])
    assert [e["run"] for e in runs] == ["run", "run"]
    assert budget.composed_epsilon(runs, DELTA) == pytest.approx(accounting.epsilon(SIGMA, Q, 2 * STEPS, DELTA),
                                                                rel=5e-3)


def test_runs_on_overlapping_sets_compose_and_disjoint_ones_do_not(in_tmp):
    full = shard(in_tmp / "full", examples(60))
    subset = shard(in_tmp / "subset", examples(60)[10:25])
    other = shard(in_tmp / "other", examples(30, seed=1, start=100))  # disjoint from both
    charge(*full, "on-full")
    charge(*subset, "on-subset")
    charge(*other, "on-other")
    assert [e["run"] for e in budget.runs(full[0])] == ["on-full", "on-subset"]
    assert [e["run"] for e in budget.runs(subset[0])] == ["on-full", "on-subset"]
    assert [e["run"] for e in budget.runs(other[0])] == ["on-other"]
    # A set whose sketch was lost counts as overlapping: never fewer runs than there were.
    (budget.BUDGET_DIR / "sets" / f"{other[0]}.npz").unlink()
    assert len(budget.runs(full[0])) == 3


def test_the_published_composition_does_not_depend_on_which_examples_the_sets_share(in_tmp, monkeypatch):
    """Which sets share an example is a fact about the private data. Measured: an earlier run on a set
    that shares one example with this run's, and one on that set with the example replaced, publish
    the same composition (every run charged to the budget); the owner's, over the runs that share
    examples, tells the two apart."""
    mine = examples(40)
    others = examples(20, seed=5, start=200)
    published, owners = [], []
    for name, earlier in (("shares", others + mine[:1]), ("replaced", others + examples(1, seed=9, start=300))):
        project = in_tmp / name
        project.mkdir()
        monkeypatch.chdir(project)
        charge(*shard(project / "earlier", earlier), "earlier")
        identity, sketch = shard(project / "mine", mine)
        charge(identity, sketch, "mine")
        ledger = {**plan().header(), "run": "mine", "data_identity": identity}
        # Each project has its own owner's key, so its own (keyed) data identity: the rest is compared.
        published.append({k: v for k, v in budget.composition(ledger, DELTA).items() if k != "data_identity"})
        owners.append(budget.overlap_composition(ledger, DELTA))
    assert published[0] == published[1] and published[0]["runs"] == 2
    assert [o["runs"] for o in owners] == [2, 1]


def test_a_release_outside_dp_makes_every_later_composition_infinite_whatever_its_flags(in_tmp):
    """A model trained without DP on the examples (a non-private twin, the curve's ε = ∞ point), a count
    published as it is, a known noise key: released once, it stays released. A later run whose own
    params are clean still composes to ∞ and is NOT PRIVATE, while the DP runs' own composition is kept
    beside it; the owner's composition counts it only where its set shares examples."""
    from pipeline.privacy import release
    from pipeline.config import load_params

    identity, sketch = shard(in_tmp / "d", examples(30))
    charge(identity, sketch, "with-twin")
    ledger = {**plan().header(), "run": "later", "data_identity": identity}
    clean = budget.composition(ledger, DELTA)
    budget.record_outside_dp(identity, sketch, "with-twin-nonprivate", "a training without DP on them")
    budget.record_outside_dp(identity, sketch, "with-twin-nonprivate", "a training without DP on them")  # a resume
    budget.record_outside_dp(identity, sketch, "with-twin-nonprivate", "a count of them published as it is")
    charge(identity, sketch, "later")
    later = budget.composition(ledger, DELTA)
    assert later["epsilon"] == float("inf") and sorted(later["outside_dp"]) == [  # each release the run made, once
        "a count of them published as it is", "a training without DP on them"]
    assert later["runs"] == 2 and later["epsilon_dp_runs"] == clean["epsilon"] < float("inf")  # the DP runs alone
    params = load_params(Path(__file__).parents[1] / "params.yaml")
    params["curve"]["epsilons"], params["privacy"]["testing"], params["dp"]["noise_seed"] = [8.0], False, None
    assert release.not_private_reasons(params, {}) == []  # its own flags are clean
    [reason] = release.not_private_reasons(params, {}, later)
    assert "without DP" in reason and "∞" in reason
    # a set that shares no example with the released one: the owner's figure stays finite
    other, other_sketch = shard(in_tmp / "o", examples(30, seed=3, start=500))
    charge(other, other_sketch, "elsewhere")
    mine = {**plan().header(), "run": "elsewhere", "data_identity": other}
    assert budget.overlap_composition(mine, DELTA)["epsilon"] < float("inf")
    assert budget.composition(mine, DELTA)["epsilon"] == float("inf")


def test_runs_of_every_objective_on_the_examples_compose(in_tmp):
    """A DP-MAE run and a Dp-CLIP run (per batch, K = 2) on the same examples each released something
    of them: the composition counts both, whatever their objectives, to more than either alone."""
    identity, sketch = shard(in_tmp / "a", examples(40))
    charge(identity, sketch, "mae-run", objective="mae")
    charge(identity, sketch, "clip-run", key=8, objective="clip")
    composed = budget.composition({**plan().header(), "run": "mae-run", "data_identity": identity}, DELTA)
    assert composed["runs"] == 2 and sorted(r["objective"] for r in composed["by_run"]) == ["clip", "mae"]
    assert composed["epsilon"] == pytest.approx(accounting.epsilon(SIGMA, Q, 2 * STEPS, DELTA), rel=5e-3)


def test_a_lone_run_composes_to_its_own_epsilon(in_tmp):
    charge(*shard(in_tmp / "d", examples(10)), "r")
    identity = budget.examples_identity(in_tmp / "d")[0]
    assert budget.composed_epsilon(budget.runs(identity), DELTA) == accounting.epsilon(SIGMA, Q, STEPS, DELTA)


def test_different_mechanisms_compose_between_their_parts(in_tmp):
    small, big = entry("a", plan(sigma=2.0)), entry("b", plan(sigma=0.8))
    parts = [budget.composed_epsilon([e], DELTA) for e in [small, big]]
    both = budget.composed_epsilon([small, big], DELTA)
    assert max(parts) < both < sum(parts) * 1.01


@pytest.mark.parametrize("adjacency", ["replace-one", "replace", ""])
def test_a_composition_under_an_adjacency_no_accountant_knows_is_refused(adjacency):
    """Below it every name but replace_one reads as add/remove: a ledger header saying 'replace-one'
    composed σ 1, q 0.01, T 300 to add/remove's 1.07 where replace-one spends 1.50."""
    runs = [entry("a", plan(sigma=1.0))]
    assert budget.composed_epsilon(runs, DELTA, "replace_one") > 1.1 * budget.composed_epsilon(runs, DELTA)
    with pytest.raises(ValueError, match="adjacency must be one of"):
        budget.composed_epsilon(runs, DELTA, adjacency)


def test_a_composition_that_pld_cannot_resolve_falls_back_to_a_bound_not_to_round_off():
    """Measured against a stable composition. Two long runs at a small δ (σ 0.8, q 4.2e-4, 300,000 steps
    each, δ 1e-10, replace-one): dp_accounting's PLD values drift with the grid by FFT round-off
    (6.54, 6.58, 6.41, 6.40 at intervals 5e-4 to 6.25e-5), and the last two agree to 0.1% below the true
    ε. Composed stably (the same pessimistic one-step PLD, its T-fold power taken on an exponentially
    tilted FFT, so round-off stays relative to the mass that decides δ), ε is 6.4137 at interval
    6.25e-5 and 6.4128 at 3.125e-5: an upper bound, converged. The budget's own ladder, before it took
    one run's (noise floor, spread of the last three, the RDP safety net), returned 6.40297. A single
    run of the same mechanism falls back to the group-of-two RDP bound, and so must the composition."""
    from pipeline.privacy.accountant_backends import _rdp_parts_bound

    half = {"sigma": 0.8, "sample_rate": 4.2e-4, "steps": 300_000}
    with pytest.warns(RuntimeWarning, match="numerically unstable"):
        composed = budget.composed_epsilon([half, half], 1e-10, "replace_one")
    assert composed >= 6.4128
    assert composed == _rdp_parts_bound(((0.8, 4.2e-4, 300_000),) * 2, 1e-10, "replace_one")


def test_round_off_that_falls_into_agreement_on_another_cpu_is_not_reported(monkeypatch):
    """How the FFT's round-off falls depends on the CPU: on this one the ladder above stops at a noise
    floor, on another (CI's) the same composition passed. Here the values a CPU could give, each within
    the 3% drift measured above, fall so that two successive ones agree to 0.1%, below the true 6.4128:
    what is reported must still be a bound. T · 2⁻⁵² against δ decides it before any grid is tried."""
    from pipeline.privacy import accountant_backends as backends

    drifted = iter([9.338, 7.481, 6.729, 6.55, 6.45, 6.404, 6.4025])  # each step closer: no noise floor
    monkeypatch.setattr(backends, "_pld_parts_at", lambda *args: next(drifted))
    monkeypatch.setattr(backends, "_capped_by_rdp", lambda eps, *args: eps)
    half = {"sigma": 0.8, "sample_rate": 4.2e-4, "steps": 300_000}
    with pytest.warns(RuntimeWarning, match="numerically unstable"):
        composed = budget.composed_epsilon([half, half], 1e-10, "replace_one")
    assert composed >= 6.4128


def test_round_off_is_judged_on_the_steps_composed_not_on_each_runs(monkeypatch):
    """Two runs of 30,000 steps at δ = 1e-10: each alone is under the line T·2⁻⁵² = δ/10 (45,036 steps),
    the two composed are over it: the composition is the RDP bound, whatever a PLD would read there."""
    from pipeline.privacy import accountant_backends as backends

    monkeypatch.setattr(backends, "_pld_parts_at", lambda *args: 0.5)  # a PLD below every bound
    half = {"sigma": 0.8, "sample_rate": 4.2e-4, "steps": 30_000}
    with pytest.warns(RuntimeWarning, match="numerically unstable"):
        composed = budget.composed_epsilon([half, half], 1e-10, "replace_one")
    assert composed == backends._rdp_parts_bound(((0.8, 4.2e-4, 30_000),) * 2, 1e-10, "replace_one") > 0.5


def test_a_ladder_stopped_at_its_noise_floor_reports_the_largest_of_its_last_three_values(monkeypatch):
    """Refining the grid, ε moved by 0.03, 0.02, 0.006 and then 0.011 (more than before: round-off, not
    convergence). The last three agree to 1%, and what is reported bounds each of them."""
    from pipeline.privacy import accountant_backends as backends

    ladder = iter([2.0, 2.03, 2.01, 2.016, 2.005])
    monkeypatch.setattr(backends, "_pld_parts_at", lambda *args: next(ladder))
    monkeypatch.setattr(backends, "_capped_by_rdp", lambda eps, *args: eps)
    assert backends.composed_epsilon([(1.0, 0.01, 300)], 1e-5) == 2.016


def test_a_pld_above_the_rdp_bound_is_replaced_by_it(monkeypatch):
    """The exact PLD ε never exceeds RDP's: a PLD value above it, even by a fifth, is a numerical failure,
    and the (always valid, here tighter) RDP bound is reported, said."""
    from pipeline.privacy import accountant_backends as backends

    parts = ((1.0, 0.01, 300),)
    rdp = backends._rdp_parts_bound(parts, 1e-5)
    monkeypatch.setattr(backends, "_pld_parts_at", lambda *args: 1.2 * rdp)
    with pytest.warns(RuntimeWarning, match="exceeds the RDP bound"):
        assert backends.composed_epsilon(parts, 1e-5) == rdp


def test_a_one_step_release_counts_in_the_composition():
    """A release of one step (a full-batch query, q = 1) on the same examples: it composes like any run."""
    one = {"sigma": 2.0, "sample_rate": 1.0, "steps": 1}
    run = {"sigma": 1.0, "sample_rate": 0.01, "steps": 300}
    assert budget.composed_epsilon([one], 1e-5) == pytest.approx(accounting.epsilon(2.0, 1.0, 1, 1e-5), rel=1e-6)
    assert budget.composed_epsilon([run, one], 1e-5) > budget.composed_epsilon([run], 1e-5) + 0.5


def test_a_run_whose_noise_stops_at_fp32s_edge_makes_the_composition_infinite(in_tmp):
    """A run charged before the budget recorded its noise's edge drew torch's fp32 normals, which stop at
    5.77 std: at this σ, q and T (an edge floor of 4.7·δ) no ε holds at δ for any run composed with it."""
    identity, sketch = shard(in_tmp / "d", examples(30))
    charge(identity, sketch, "earlier")
    ledger = {**plan().header(), "run": "later", "data_identity": identity}
    assert budget.composition(ledger, DELTA)["epsilon"] < float("inf")  # the edge it recorded: 12.1 std
    path = budget.BUDGET_DIR / "runs.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in e.items() if k != "noise_edge"}) + "\n" for e in lines))
    later = budget.composition(ledger, DELTA)
    assert later["epsilon"] == float("inf") and "stops short" in later["outside_dp"][0]
    assert later["epsilon_dp_runs"] < float("inf")


def entry(run, p):
    """A budget entry as `budget.record` writes it."""
    return {"run": run, "objective": p.objective, "sigma": p.sigma, "sample_rate": p.sample_rate, "steps": p.steps,
            "delta": p.delta, "n": p.n, "noise_edge": p.noise_edge}


def test_a_charge_is_kept_by_the_owner_before_the_budget_gets_it(in_tmp, monkeypatch):
    """Killed (or out of disk) between the two appends, the charge survives in the owner's copy, and the
    budget's next use adds it: the other order would leave a charge that an older budget checked out
    over this one drops from every composition."""
    identity, sketch = shard(in_tmp / "d", examples(10))
    real_append = budget.append_durably

    def budget_write_fails(fd, text, path):
        if Path(path).name == "runs.jsonl":
            raise OSError(28, "No space left on device")
        return real_append(fd, text, path)
    monkeypatch.setattr(budget, "append_durably", budget_write_fails)
    with pytest.raises(OSError):
        charge(identity, sketch, "cut-short")
    assert [json.loads(line)["run"] for line in budget.CHARGES.read_text().splitlines()] == ["cut-short"]
    monkeypatch.setattr(budget, "append_durably", real_append)
    ledger = {**plan().header(), "run": "next", "data_identity": identity}
    assert budget.composition(ledger, DELTA)["runs"] == 2  # cut-short, and the run asking
    assert [e["run"] for e in budget._entries()] == ["cut-short"]


def test_a_run_without_noise_voids_the_noise_edge_check_whatever_its_other_fields():
    """σ = 0 has no noise edge to bound: counted as certain to show an example, never as nothing."""
    p = plan()  # as the budget records a run (budget.record): its noise edge with it
    entry = {"objective": p.objective, "sigma": p.sigma, "sample_rate": p.sample_rate, "steps": p.steps,
             "adjacency": p.adjacency, "noise_edge": p.noise_edge}
    assert budget.edges_problem([entry], DELTA, "add_remove") is None
    assert budget.edges_problem([{**entry, "sigma": 0.0}], DELTA, "add_remove") is not None


def test_a_torn_last_line_is_ignored_and_the_next_run_is_charged(in_tmp):
    d = shard(in_tmp / "d", examples(10))
    charge(*d, "r")
    with open(budget.BUDGET_DIR / "runs.jsonl", "a") as f:  # a kill in the middle of a charge
        f.write('{"run": "half')
    assert [e["run"] for e in budget.runs(d[0])] == ["r"]
    charge(*d, "next")  # not glued onto the torn line, where it would be dropped too
    assert [e["run"] for e in budget.runs(d[0])] == ["r", "next"]


def test_a_line_lost_before_the_last_stops_every_reader_by_name(in_tmp):
    """Only a last line without its newline is a torn charge; a bad line before it is a charge lost (an
    edit, two writers on a file system without locks), and composing without it would undercount."""
    d = shard(in_tmp / "d", examples(10))
    charge(*d, "r")
    charge(*d, "s")
    path = budget.BUDGET_DIR / "runs.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0][:25] + "\n" + lines[1])
    for read in (lambda: budget.runs(d[0]), lambda: charge(*d, "t")):
        with pytest.raises(budget.BudgetCorrupt, match="runs.jsonl, line 1, is not a charge"):
            read()


def test_a_budget_that_was_pushed_but_is_not_here_is_refused_until_it_is_pulled(in_tmp):
    """A fresh clone has git's data/budget.dvc but not the budget: starting an empty one there would
    publish an ε that forgets every run the pushed budget holds."""
    d = shard(in_tmp / "d", examples(10))
    charge(*d, "before")
    pushed = in_tmp / "remote-copy"
    shutil.copytree(budget.BUDGET_DIR, pushed)  # what `make push` uploads
    shutil.rmtree(budget.BUDGET_DIR)
    budget.BUDGET_DIR.with_suffix(".dvc").write_text("outs:\n- path: budget\n")  # what git brings
    ledger = {**plan().header(), "run": "after", "data_identity": d[0]}
    for start in (lambda: shard(in_tmp / "e", examples(10)), lambda: charge(*d, "after"),
                  lambda: budget.composition(ledger, DELTA)):
        with pytest.raises(budget.BudgetNotHere, match=r"dvc pull data/budget.dvc"):
            start()
    assert not budget.BUDGET_DIR.exists()  # nothing started in its place
    shutil.copytree(pushed, budget.BUDGET_DIR)  # `dvc pull`
    charge(*d, "after")
    assert [e["run"] for e in budget.runs(d[0])] == ["before", "after"]
    assert budget.composition(ledger, DELTA)["runs"] == 2


def test_runs_on_a_labelled_set_a_package_ships_are_left_out_of_runs_on_other_data(in_tmp):
    """The default run trains its ε = ∞ point on digits: every later run in the checkout, on private data
    too, composed to ∞ with it. A run on other data reads nothing of public digits; a run on digits still
    composes with every run (its examples may be in a private set too)."""
    from pipeline.privacy import release

    digits, private = shard(in_tmp / "digits", examples(10)), shard(in_tmp / "private", examples(10, seed=1))
    public = release.public_set("digits")
    assert public == "digits" and release.public_set("webdataset") is None
    budget.record(*digits, "demo", plan(), 1, public_set=public)
    budget.record_outside_dp(*digits, "demo-twin", "a training without DP on them", public_set=public)
    charge(*private, "mine")
    mine = {**plan().header(), "run": "mine", "data_identity": private[0]}
    c = budget.composition(mine, DELTA)
    assert c["runs"] == 1 and c["outside_dp"] == [] and c["epsilon"] == pytest.approx(
        accounting.epsilon(SIGMA, Q, STEPS, DELTA, adjacency="add_remove"), rel=1e-6)
    demo = {**plan().header(), "run": "demo", "data_identity": digits[0], "public_set": "digits"}
    c = budget.composition(demo, DELTA)
    assert c["runs"] == 2 and c["epsilon"] == float("inf") and c["outside_dp"] == ["a training without DP on them"]


def test_a_budget_behind_the_version_git_records_gains_its_runs_and_a_push_keeps_them(in_tmp):
    """Checkout B `git pull`ed A's data/budget.dvc but kept its own older budget: it composed without A's
    second run, and its `make push` recorded a budget without it. Measured with DVC itself: B's first use
    of the budget adds A's run and its set's sketch; a version not in the cache, or another owner's key,
    is refused."""
    dvc = [str(ROOT / ".venv/bin/dvc")]
    subprocess.run(dvc + ["init", "-q", "--no-scm"], check=True)
    d, e = shard(in_tmp / "d", examples(10)), shard(in_tmp / "e", examples(10, seed=1))
    charge(*d, "A1")
    behind = in_tmp / "b-budget"
    shutil.copytree(budget.BUDGET_DIR, behind)  # B's budget: A's first push
    charge(*e, "A2")
    subprocess.run(dvc + ["add", "-q", "data/budget"], check=True)  # A's push (dvc fetch brings it to B's cache)
    pointer = (in_tmp / "data/budget.dvc").read_text()
    shutil.rmtree(budget.BUDGET_DIR)
    shutil.copytree(behind, budget.BUDGET_DIR)
    budget.CHARGES.write_text((behind / "runs.jsonl").read_text())  # B's own copy of the charges: A1's
    ledger = {**plan().header(), "run": "B1", "data_identity": d[0]}
    assert budget.composition(ledger, DELTA)["runs"] == 3  # A1, A2 and B1 (counted though not yet charged)
    assert [json.loads(line)["run"] for line in budget.CHARGES.read_text().splitlines()] == ["A1", "A2"]  # kept here
    charge(*d, "B1")
    assert [e["run"] for e in budget._entries()] == ["A1", "A2", "B1"]
    assert [e["run"] for e in budget.runs(e[0])] == ["A2"]  # through A2's sketch, copied from the cache
    subprocess.run(dvc + ["add", "-q", "data/budget"], check=True)  # B's push
    assert len(budget._entries()) == 3 and (in_tmp / "data/budget.dvc").read_text() != pointer

    (in_tmp / "data/budget.dvc").write_text(pointer.replace(pointer.split("md5: ")[1][:32], "f" * 32))
    with pytest.raises(budget.BudgetNotHere, match=r"dvc fetch data/budget.dvc"):
        charge(*d, "B2")
    (in_tmp / "data/budget.dvc").write_text(pointer)
    (budget.BUDGET_DIR / "names.key").write_text("ab" * 32)
    with pytest.raises(budget.BudgetCorrupt, match="two owners' budgets"):
        budget.sync()


def test_the_owners_copy_of_the_charges_is_cut_and_read_only_under_the_budgets_lock(in_tmp, monkeypatch):
    """Every use of the budget cuts a torn last line off CHARGES and reads it. Done outside runs.jsonl's
    lock, as it was, a read that caught another process inside its append cut that charge, complete by
    then, from the owner's copy. Measured at each cut: a second open of runs.jsonl cannot take the lock."""
    import fcntl

    from pipeline import io

    cuts = []

    def cut(path):
        if Path(path).name == budget.CHARGES.name:
            with open(budget.BUDGET_DIR / "runs.jsonl") as other:
                try:
                    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    cuts.append("unlocked")
                except BlockingIOError:
                    cuts.append("locked")
        io.drop_torn_tail(path)

    monkeypatch.setattr(budget, "drop_torn_tail", cut)
    d = shard(in_tmp / "d", examples(10))
    budget.record(*d, "A", plan(objective="mae"), 1)
    budget.record(*d, "B", plan(objective="clip"), 2)
    budget.sync()
    assert budget.composition({**plan().header(), "run": "A", "data_identity": d[0]}, DELTA)["runs"] == 2
    assert len(cuts) >= 4 and set(cuts) == {"locked"}, cuts


def test_an_older_budget_checked_out_over_this_one_gets_the_runs_charged_since_back(in_tmp):
    """`dvc checkout` (after `git checkout data/budget.dvc`, or in `dvc exp apply`) puts the pushed, older
    budget back over the charges made since, without asking: measured with DVC itself. Every later
    composition left those runs out. The charges this checkout made, kept in the owner's zone where DVC
    never writes, are added back at the budget's next use."""
    dvc = [str(ROOT / ".venv/bin/dvc")]
    subprocess.run(dvc + ["init", "-q", "--no-scm"], check=True)
    d = shard(in_tmp / "d", examples(10))
    budget.record(*d, "A", plan(objective="mae"), 1)
    subprocess.run(dvc + ["add", "-q", "data/budget"], check=True)  # `make push`
    budget.record(*d, "B", plan(objective="caption"), 2)
    budget.record(*d, "C", plan(objective="clip"), 3)
    assert (budget.BUDGET_DIR / "runs.jsonl").read_text().count("\n") == 3
    subprocess.run(dvc + ["checkout", "-q", "-f", "data/budget.dvc"], check=True)
    assert (budget.BUDGET_DIR / "runs.jsonl").read_text().count("\n") == 1  # the older version, as DVC leaves it
    ledger = {**plan().header(), "run": "D", "data_identity": d[0]}
    composed = budget.composition(ledger, DELTA)
    assert composed["runs"] == 4 and [r["run"] for r in composed["by_run"]] == ["A", "B", "C", "D"]
    assert composed["epsilon"] == pytest.approx(accounting.epsilon(SIGMA, Q, 4 * STEPS, DELTA), rel=1e-3)
    assert [e["run"] for e in budget._entries()] == ["A", "B", "C"] and budget.CHARGES.stat().st_mode & 0o077 == 0
    assert budget.CHARGES.read_text().count("\n") == 3  # each charge kept once, however often it is put back
    # A kill between the two appends leaves the charge kept in the owner's zone alone: added at the next use.
    (budget.BUDGET_DIR / "runs.jsonl").write_text((budget.BUDGET_DIR / "runs.jsonl").read_text().split("\n", 1)[1])
    assert [e["run"] for e in budget._entries()] == ["B", "C", "A"]


def test_a_budget_deleted_before_it_was_ever_pushed_is_refused_while_runs_it_charged_are_here(in_tmp):
    """`rm -rf data` or `git clean -X` with no data/budget.dvc: a new key and an empty budget restarted the
    composition, so the same examples were trained and registered again as private at one run's ε."""
    d = shard(in_tmp / "d", examples(10))
    charge(*d, "before")
    state = Path(".dpfm/state/dp-train-0123/ledger.jsonl")
    state.parent.mkdir(parents=True)
    state.write_text("{}\n")  # the run's own ledger, kept in its state directory
    backup = in_tmp / "backup"
    shutil.copytree(budget.BUDGET_DIR, backup)
    shutil.rmtree(budget.BUDGET_DIR)
    ledger = {**plan().header(), "run": "after", "data_identity": d[0]}
    for start in (lambda: shard(in_tmp / "e", examples(10)), lambda: charge(*d, "after"),
                  lambda: budget.composition(ledger, DELTA)):
        with pytest.raises(budget.BudgetNotHere, match=r"data/budget/ is gone but DP runs it charged left"):
            start()
    assert not budget.BUDGET_DIR.exists()  # no new key in its place
    shutil.copytree(backup, budget.BUDGET_DIR)
    assert budget.composition(ledger, DELTA)["runs"] == 2
    # `git clean -X` deletes data/, .dpfm/ and models/ together (all git-ignored): every record of the runs
    # inside the project goes with the budget, and a new one started from nothing. The mark outside stays.
    Path("models/dp").mkdir(parents=True)
    Path("models/dp/ledger.json").write_text("{}")
    for ignored in ("data", ".dpfm", "models"):
        shutil.rmtree(ignored)
    assert budget.started_mark().is_file() and not budget.started_mark().is_relative_to(in_tmp)
    with pytest.raises(budget.BudgetNotHere, match=r"data/budget/ is gone but DP runs it charged left") as gone:
        charge(*shard(in_tmp / "d", examples(10)), "after")
    assert str(budget.started_mark()) in str(gone.value) and not budget.BUDGET_DIR.exists()
    budget.started_mark().unlink()  # the owner's word that nothing those runs trained was released
    charge(*d, "anew")
    assert [e["run"] for e in budget.runs(d[0])] == ["anew"] and budget.started_mark().is_file()


def test_one_run_charged_by_two_processes_at_once_is_charged_once(in_tmp, monkeypatch):
    """Processes charge side by side (a run started twice): the check for a run and its line are one step.
    Each charge, once it has read the record, waits for the other to have read it too: without the
    lock both then append; with it the other is still waiting for the lock, and the wait times out."""
    import multiprocessing
    import threading

    d = shard(in_tmp / "d", examples(10))
    ctx = multiprocessing.get_context("fork")
    both_read, parse = ctx.Barrier(2), budget._parse

    def parse_then_meet(text, path):
        entries = parse(text, path)
        try:
            both_read.wait(timeout=3)
        except threading.BrokenBarrierError:
            pass
        return entries

    monkeypatch.setattr(budget, "_parse", parse_then_meet)
    charges = [ctx.Process(target=charge, args=(*d, "run")) for _ in range(2)]
    for c in charges:
        c.start()
    for c in charges:
        c.join(60)
    monkeypatch.setattr(budget, "_parse", parse)
    assert [c.exitcode for c in charges] == [0, 0]
    assert [e["run"] for e in budget.runs(d[0])] == ["run"]


def test_an_index_without_content_digests_is_refused_by_name(in_tmp):
    import pyarrow.parquet as pq

    shard(in_tmp / "d", examples(5))
    table = pq.read_table(in_tmp / "d/index.parquet")
    pq.write_table(table.drop(["content_hash"]), in_tmp / "d/index.parquet")
    with pytest.raises(budget.IdentityError, match="re-run the shards stage"):
        budget.examples_identity(in_tmp / "d")


def test_make_clean_keeps_the_budget_and_the_charges_that_bring_back_runs_an_older_budget_lacks(in_tmp):
    """`make clean` deleted all of .dpfm/, the owner's copy of the charges with it: an older budget put back
    after it (`dvc checkout`) then dropped every run charged since from each later composition."""
    dvc = [str(ROOT / ".venv/bin/dvc")]
    subprocess.run(dvc + ["init", "-q", "--no-scm"], check=True)
    shutil.copy(ROOT / "Makefile", in_tmp / "Makefile")
    d = shard(in_tmp / "d", examples(10))
    budget.record(*d, "A", plan(objective="mae"), 1)
    subprocess.run(dvc + ["add", "-q", "data/budget"], check=True)  # `make push`
    budget.record(*d, "B", plan(objective="caption"), 2)
    for path in ("data/shards/private", "data/synthetic", "models/dp", ".dpfm/state/dp-train-x", ".dpfm/owner/runs"):
        (in_tmp / path).mkdir(parents=True, exist_ok=True)
    subprocess.run(["make", "-s", "clean"], cwd=in_tmp, check=True)
    assert not any((in_tmp / p).exists() for p in ("data/shards", "data/synthetic", "models", ".dpfm/state",
                                                     ".dpfm/owner/runs"))
    assert sorted(p.name for p in (in_tmp / ".dpfm").rglob("*")) == ["budget-charges.jsonl", "owner"]
    assert [e["run"] for e in budget._entries()] == ["A", "B"]
    subprocess.run(dvc + ["checkout", "-q", "-f", "data/budget.dvc"], check=True)  # the older budget, over it
    assert (budget.BUDGET_DIR / "runs.jsonl").read_text().count("\n") == 1
    assert [e["run"] for e in budget._entries()] == ["A", "B"]


def test_runs_compose_at_the_smallest_delta_of_theirs(in_tmp):
    """A run on 10⁶ examples (δ = 5e-7) and a later one on 1,000 (δ = 5e-4): the later run's δ is
    500 times 1/n of the first set, so their composition is stated at 5e-7 (and tagged beside the
    first run's model), and its ε is what the two compose to there, not at the later run's δ."""
    from dataclasses import replace

    big = replace(plan(), n=1_000_000, delta=5e-7, sigma=1.0, sample_rate=0.0041, steps=2000)
    small = replace(plan(), n=1_000, delta=5e-4, sigma=1.0, sample_rate=0.064, steps=300)
    for run, p, seed in (("big", big, 0), ("small", small, 1)):
        budget.record(*shard(in_tmp / run, examples(20, seed=seed)), run, p, key=7)
    ledger = {**small.header(), "run": "small"}
    c = budget.composition(ledger, small.delta)
    assert c["delta"] == big.delta and c["runs"] == 2
    at_small_delta = budget.composed_epsilon([entry("big", big), entry("small", small)], small.delta, "add_remove")
    assert c["epsilon"] == pytest.approx(
        budget.composed_epsilon([entry("big", big), entry("small", small)], big.delta, "add_remove"))
    assert c["epsilon"] > at_small_delta + 1  # the pair it used to state: 9.7 at δ = 5e-4 beside δ = 5e-7


def test_a_charge_in_a_temporary_dvc_workspace_is_refused(in_tmp, monkeypatch):
    """`dvc exp run --temp` runs the stages in a copy of the project, with DVC_ROOT naming the project: the
    copy's budget, not a stage output, is deleted with it, and the run was never composed."""
    d = shard(in_tmp / "d", examples(10))
    for root in (in_tmp, in_tmp.parent):  # `dvc exp run` in the workspace (the project, or a folder of the repository)
        monkeypatch.setenv("DVC_ROOT", str(root))
        charge(*d, f"in {root}")
    monkeypatch.setenv("DVC_ROOT", str(in_tmp.parent))
    copy = in_tmp.parent / ".dvc/tmp/exps/tmpab12" / in_tmp.name  # where DVC puts a temporary workspace
    shutil.copytree(in_tmp, copy)
    monkeypatch.chdir(copy)
    with pytest.raises(budget.BudgetNotHere, match="without --temp or --queue"):
        charge(*d, "in a copy")
    assert len(budget._entries()) == 2


def test_the_budget_and_dvcs_copy_of_it_are_readable_by_the_owner_only(in_tmp, capsys):
    """The budget holds the owner's key and the sets' sketches. `dvc add` (make push) keeps them in DVC's
    cache as objects of mode 0444 in folders of 0755, and `dvc checkout` (make restore) writes them back
    0644: anyone on the machine could read the key. Measured with DVC: after `dpfm budget-sync` (make
    push and restore run it) the project's cache is closed to others and so is the checked-out budget;
    a cache configured elsewhere (cache.dir, a team's) is named, never changed."""
    dvc = [str(ROOT / ".venv/bin/dvc")]
    subprocess.run(dvc + ["init", "-q", "--no-scm"], check=True)
    d = shard(in_tmp / "d", examples(10))
    budget.record(*d, "A", plan(), 1)
    budget.public_name("a digest")  # the key
    held = [budget.BUDGET_DIR, *budget.BUDGET_DIR.rglob("*")]
    assert {p.name for p in held} >= {"names.key", "runs.jsonl", "sets"}

    def open_to_others(paths):
        return [str(p) for p in paths if p.stat().st_mode & 0o077]

    assert open_to_others([budget.BUDGET_DIR]) == []  # as made: a folder only the owner can enter
    budget.sync()  # `make push`: then `dvc add`
    subprocess.run(dvc + ["add", "-q", "data/budget"], check=True)
    cache = in_tmp / ".dvc/cache"
    objects = [p for p in cache.rglob("*") if p.is_file()]
    assert objects and all(p.stat().st_mode & 0o777 == 0o444 for p in objects)  # DVC's own modes...
    assert open_to_others([cache]) == []  # ...behind a folder only the owner can enter
    shutil.rmtree(budget.BUDGET_DIR)
    subprocess.run(dvc + ["checkout", "-q", "data/budget.dvc"], check=True)  # `make restore`
    assert open_to_others([budget.BUDGET_DIR / "names.key"])  # as DVC writes it
    budget.sync()
    assert open_to_others([budget.BUDGET_DIR, *budget.BUDGET_DIR.rglob("*")]) == []
    shared = in_tmp / "team-cache"
    shared.mkdir(mode=0o775)
    shared.chmod(0o775)
    (in_tmp / ".dvc/config").write_text(f"[cache]\n    dir = {shared}\n")
    budget.sync()
    assert f"DVC's cache {shared} (cache.dir) receives data/budget/" in capsys.readouterr().err
    assert shared.stat().st_mode & 0o777 == 0o775


def edge_giving(share, sigma, sample_rate, steps, move):
    """The noise edge at which one run's edge floor is `share`·δ (bisected on noise_edge_floor)."""
    lo, hi = 1.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if noise_edge_floor(sigma, sample_rate, steps, mid, move=move) > share * DELTA else (lo, mid)
    return hi


def edge_entry(edge, sigma=0.9, sample_rate=0.01, steps=300, adjacency="add_remove"):
    """A run as budget.record writes it, with the noise edge `edge`."""
    return {"run": "r", "objective": "mae", "sigma": sigma, "sample_rate": sample_rate, "steps": steps,
            "delta": DELTA, "adjacency": adjacency, "noise_edge": edge}


def test_a_noise_edge_giving_away_half_of_delta_voids_epsilon_at_delta():
    """The edge alone may give away at most a tenth of δ: a run whose edge shows an example with
    probability δ/2 leaves too little of δ for the ε stated at it."""
    half = edge_entry(edge_giving(0.5, 0.9, 0.01, 300, move=1.0))
    assert noise_edge_floor(0.9, 0.01, 300, half["noise_edge"], move=1.0) == pytest.approx(0.5 * DELTA, rel=1e-6)
    assert budget.edges_problem([half], DELTA, "add_remove") is not None
    assert budget.edges_problem([edge_entry(edge_giving(0.05, 0.9, 0.01, 300, move=1.0))], DELTA, "add_remove") is None


def test_a_charged_run_whose_edge_gives_away_half_of_delta_makes_the_composition_infinite(in_tmp):
    """Measured through the budget: a charged run whose noise edge shows an example with probability δ/2
    (at the composition's own δ) voids every ε at δ of the runs composed with it."""
    identity, sketch = shard(in_tmp / "d", examples(30))
    charge(identity, sketch, "earlier")
    ledger = {**plan().header(), "run": "later", "data_identity": identity}
    assert budget.composition(ledger, DELTA)["epsilon"] < float("inf")
    path = budget.BUDGET_DIR / "runs.jsonl"
    edge = edge_giving(0.5, 0.9, 0.01, 300, move=1.0)
    path.write_text("".join(json.dumps({**json.loads(line), "noise_edge": edge}) + "\n"
                            for line in path.read_text().splitlines()))
    budget.CHARGES.unlink()  # else the charge as recorded, its edge with it, is put back beside the edited one
    later = budget.composition(ledger, DELTA)
    assert later["runs"] == 2 and later["epsilon"] == float("inf") and "stops short" in later["outside_dp"][0]


def test_noise_edges_of_composed_runs_add_up():
    """Each of two runs' edges shows an example with probability 0.06·δ, under the tenth of δ allowed;
    composed, they show it with probability 0.12·δ, over it: the check is on the runs together."""
    e = edge_entry(edge_giving(0.06, 0.9, 0.01, 300, move=1.0))
    assert budget.edges_problem([e], DELTA, "add_remove") is None
    assert budget.edges_problem([e, {**e, "run": "s"}], DELTA, "add_remove") is not None


def test_a_runs_noise_edge_is_judged_under_its_own_adjacency():
    """A full-batch replace-one run (q = 1) moves x's coordinate 2C past its neighbour's edge: composed into a
    later add-remove run, its edge floor is still the one its own adjacency gives, not the later run's."""
    assert largest_move(1.0, "replace_one", 1.0) == 2 * largest_move(1.0, "add_remove", 1.0)
    edge = edge_giving(0.5, 0.5, 1.0, 1, move=2.0)  # a δ/2 floor as replace-one; far below δ/10 as add-remove
    assert noise_edge_floor(0.5, 1.0, 1, edge, move=1.0) < 0.01 * DELTA
    run = edge_entry(edge, sigma=0.5, sample_rate=1.0, steps=1, adjacency="replace_one")
    assert budget.edges_problem([run], DELTA, "add_remove") is not None


def test_a_set_whose_own_sketch_was_lost_composes_with_every_run(in_tmp):
    """Without its own sketch on record, which sets share its examples cannot be read: every run charged,
    on whatever set, is composed with it (never fewer runs than there were)."""
    mine, other = shard(in_tmp / "mine", examples(30)), shard(in_tmp / "other", examples(30, seed=1, start=100))
    charge(*mine, "mine")
    charge(*other, "other")
    assert [e["run"] for e in budget.runs(mine[0])] == ["mine"]
    (budget.BUDGET_DIR / "sets" / f"{mine[0]}.npz").unlink()
    assert [e["run"] for e in budget.runs(mine[0])] == ["mine", "other"]


def test_a_charged_replace_one_runs_edge_counts_in_a_later_add_remove_runs_composition(in_tmp):
    """Measured through the budget: a full-batch replace-one run whose edge floor is δ/2 under its own
    adjacency (far below δ/10 under add-remove) voids the composition of a later add-remove run."""
    identity, sketch = shard(in_tmp / "d", examples(30))
    edge = edge_giving(0.5, 0.5, 1.0, 1, move=2.0)
    full = dataclasses.replace(plan(), adjacency="replace_one", sample_rate=1.0, sigma=0.5, steps=1, noise_edge=edge)
    budget.record(identity, sketch, "full-batch", full, key=7)
    ledger = {**plan().header(), "run": "later", "data_identity": identity}
    assert ledger["adjacency"] == "add_remove"
    composed = budget.composition(ledger, DELTA)
    assert composed["epsilon"] == float("inf") and "stops short" in composed["outside_dp"][0]


def test_a_garbled_last_line_that_ends_in_a_newline_is_a_lost_charge_not_a_torn_one(in_tmp):
    """Only a last line without its newline is torn (a kill inside a charge). A complete last line that does
    not read was a charge (an edit, two writers without a lock): composing without it would undercount."""
    d = shard(in_tmp / "d", examples(10))
    charge(*d, "r")
    charge(*d, "s")
    path = budget.BUDGET_DIR / "runs.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][:25] + "\n")
    budget.CHARGES.unlink()  # no copy of it kept (a budget from before the owner kept one) to put it back
    for read in (lambda: budget.runs(d[0]), lambda: charge(*d, "t")):
        with pytest.raises(budget.BudgetCorrupt, match="runs.jsonl, line 2, is not a charge"):
            read()


def test_a_charge_being_appended_while_the_budget_is_read_is_not_a_lost_one(in_tmp, monkeypatch):
    """The budget is read (`_entries`) after its lock is released: another process may be inside its append,
    its line not yet whole. That line is not yet a charge (its run has not started), and stops no reader."""
    d = shard(in_tmp / "d", examples(10))
    charge(*d, "r")
    check = budget._check_here

    def check_then_another_appends():
        check()
        with open(budget.BUDGET_DIR / "runs.jsonl", "a") as f:
            f.write('{"run": "another", "se')

    monkeypatch.setattr(budget, "_check_here", check_then_another_appends)
    assert [e["run"] for e in budget.runs(d[0])] == ["r"]


def test_a_release_outside_dp_composes_to_infinity_beside_dp_runs(in_tmp):
    """composed_epsilon over a set's runs (`runs`) that include a release without DP is ∞, whatever the DP
    runs beside it compose to."""
    identity, sketch = shard(in_tmp / "d", examples(10))
    charge(identity, sketch, "dp")
    budget.record_outside_dp(identity, sketch, "twin", "a training without DP on them")
    assert budget.composed_epsilon(budget.runs(identity), DELTA) == float("inf")


def test_a_torn_line_in_the_owners_copy_of_the_charges_is_cut_not_added_to_the_budget(in_tmp):
    """A kill inside the append to the owner's copy (budget-charges.jsonl) leaves a line without its newline.
    Read as a charge at the next use, it was added to runs.jsonl, whose every reader then stopped."""
    d = shard(in_tmp / "d", examples(10))
    charge(*d, "r")
    with open(budget.CHARGES, "a") as f:
        f.write('{"run": "half')
    charge(*d, "s")
    assert [e["run"] for e in budget.runs(d[0])] == ["r", "s"]
    assert [json.loads(line)["run"] for line in budget.CHARGES.read_text().splitlines()] == ["r", "s"]


def test_runs_merged_from_the_recorded_budget_are_kept_whole_after_a_torn_charge(in_tmp):
    """A kill inside an append to the owner's copy of the charges left a line without its newline; the next
    use merges runs from the budget version git records into both. Glued onto the torn line, a merged
    charge was garbled in the owner's copy, and from there stopped every reader of the budget."""
    dvc = [str(ROOT / ".venv/bin/dvc")]
    subprocess.run(dvc + ["init", "-q", "--no-scm"], check=True)
    d, e = shard(in_tmp / "d", examples(10)), shard(in_tmp / "e", examples(10, seed=1))
    charge(*d, "A1")
    behind = in_tmp / "b-budget"
    shutil.copytree(budget.BUDGET_DIR, behind)
    charge(*e, "A2")
    subprocess.run(dvc + ["add", "-q", "data/budget"], check=True)  # A's push
    shutil.rmtree(budget.BUDGET_DIR)
    shutil.copytree(behind, budget.BUDGET_DIR)
    budget.CHARGES.write_text((behind / "runs.jsonl").read_text() + '{"run": "half')  # B's copy, torn
    ledger = {**plan().header(), "run": "B1", "data_identity": d[0]}
    assert budget.composition(ledger, DELTA)["runs"] == 3
    assert [json.loads(line)["run"] for line in budget.CHARGES.read_text().splitlines()] == ["A1", "A2"]
    assert [e["run"] for e in budget._entries()] == ["A1", "A2"]


def test_the_owners_copy_of_the_charges_alone_refuses_a_new_budget(in_tmp):
    """The mark outside the project may be absent (another $XDG_STATE_HOME, a home it could not be written
    to): a budget deleted while the owner's copy of its charges is here is refused all the same."""
    d = shard(in_tmp / "d", examples(10))
    charge(*d, "before")
    shutil.rmtree(budget.BUDGET_DIR)
    budget.started_mark().unlink()
    with pytest.raises(budget.BudgetNotHere, match=r"data/budget/ is gone but DP runs it charged left"):
        charge(*d, "after")
    assert not budget.BUDGET_DIR.exists()


def test_a_budget_started_before_the_mark_existed_is_marked_at_its_next_use(in_tmp):
    """A budget from before the mark outside the project: its next use marks it, so a `git clean -X` that
    deletes it with every record of its runs inside the project is refused, not restarted from nothing."""
    d = shard(in_tmp / "d", examples(10))
    charge(*d, "before")
    budget.started_mark().unlink()
    budget.sync()
    assert budget.started_mark().is_file()
    for ignored in ("data", ".dpfm"):
        shutil.rmtree(ignored)
    with pytest.raises(budget.BudgetNotHere, match=r"data/budget/ is gone but DP runs it charged left"):
        charge(*shard(in_tmp / "d2", examples(10)), "after")


def test_the_ladder_never_builds_a_one_step_pld_past_its_grid_cap(monkeypatch):
    """Memory: each halving of the interval doubles the one-step PLD's points (and its FFT); a ladder still
    converging when the next halving would pass _PLD_MAX_GRID points stops there. Simulated: the grid starts
    at a quarter of the cap and ε keeps moving by half its last change, above PLD_REL_TOL."""
    from pipeline.privacy import accountant_backends as backends

    size = {}

    def grid(noise, q, interval, adjacency="add_remove"):
        return round(backends._PLD_MAX_GRID / 4 * backends.PLD_START_INTERVAL / interval)

    def at(parts, delta, interval, adjacency="add_remove"):
        size[interval] = grid(1.0, 0.01, interval)
        return 1.8 + 0.2 * interval / backends.PLD_START_INTERVAL

    monkeypatch.setattr(backends, "_pld_parts_at", at)
    monkeypatch.setattr(backends, "_pld_grid_size", grid)
    monkeypatch.setattr(backends, "_capped_by_rdp", lambda eps, *args: eps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        backends.composed_epsilon([(1.0, 0.01, 300)], 1e-5)
    assert len(size) >= 3 and max(size.values()) <= backends._PLD_MAX_GRID
