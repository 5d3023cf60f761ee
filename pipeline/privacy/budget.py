"""The privacy budget: every DP training run on the private examples, composed.

Each DP training (dp-train, every DP point of the curve, evaluate's extra seeds) appends its
mechanism (σ, q, planned steps, δ) to `data/budget/runs.jsonl` before its first step, with the
identity of the examples it trains on and its own identity: its state directory (a digest of the
params and inputs) and a fingerprint of its secret key. A resumed run is the same entry; a re-run with
other params is a new one, and so is the same run started again without its state (a lost or deleted
`.dpfm/`): its new key draws new batches and new noise, a second release. Planned steps are charged,
not applied ones: a run may go on to its plan at any later resume.

The examples' identity is a digest of the multiset of their content digests (index `content_hash`:
image and caption bytes), so re-sharding, rescanning or reordering the same examples keeps it. Runs
on *overlapping* sets (a subsample, a rescan that lost a shard, a new download sharing images) must
compose too: each set also leaves a sketch, a 2²⁴-bit map of its examples' digests, and a run is
composed with every recorded run whose set shares a bit with its own. Two disjoint sets can share
a bit by chance (more likely the larger they are), which only charges more than needed; a set
that truly overlaps always does, so composition is never undercounted.

The budget lives with the data (`data/budget/`, beside the shards; `make push` versions it with
DVC, `make clean` keeps it): it is the data owner's record and lives where the shards live. Only the
composed ε computed from it is published.

A digest of private data is published only keyed (`public_name`): the examples' identity, and the
name of a run (a digest of its inputs, the private index among them), go into the published ledger,
verify's composition and MLflow. Unkeyed, anyone who knew all examples but one could test guesses
of the last against them. The key (`data/budget/names.key`, owner-only) lives with the budget, as
secret as the shards beside it.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import math
import os
import secrets
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow.compute as pc

from pipeline.data.index import INDEX_NAME, ROW_GROUP_ROWS, open_index
from pipeline.data.splitmix import GOLDEN, MASK64, mix64_np
from pipeline.errors import BudgetCorrupt, BudgetNotHere, InputError
from pipeline.io import append_durably, atomic_path, drop_torn_tail
from pipeline.objectives import objective
from pipeline.privacy import owner
from pipeline.privacy.accountant_backends import composed_epsilon as composed_pld_epsilon
from pipeline.privacy.noise_edge import SHARE_OF_DELTA, UNRECORDED_EDGE, largest_move, noise_edge_floor
from pipeline.privacy.plan import Plan

BUDGET_DIR = Path("data/budget")
# Every charge this checkout made or merged, kept where DVC never writes: `dvc checkout`, `dvc exp apply`
# or `git checkout data/budget.dvc` put back an older runs.jsonl without a prompt (its version is in the
# cache once pushed), and the runs charged since would drop out of every later composition.
CHARGES = owner.OWNER_DIR / "budget-charges.jsonl"
SKETCH_BITS = 24  # 2 MiB per set: disjoint sets of n₁ and n₂ examples share a bit with chance ≈ n₁n₂/2²⁴


def _check_here() -> None:
    """Refuse to start a budget, or compose one, where `make push` recorded one that is absent (a fresh
    clone, a `dvc exp` workspace, before `make restore`): an empty budget would forget every run the
    pushed one holds, under a new owner's key, and the ε published would leave them out."""
    pointer = BUDGET_DIR.with_suffix(".dvc")
    if any((BUDGET_DIR / f).exists() for f in ("names.key", "runs.jsonl")):
        owner.seal(BUDGET_DIR)  # as secret as the shards: checked out by DVC (`make restore`) it was 0644
        _mark_started()  # a budget from before the mark existed gets its mark at its next use
        if pointer.exists():
            _merge_recorded(pointer)
        _merge_lines(_charges_kept, "charged or merged here, were missing: an older version of the budget was "
                                      "checked out over it (`dvc checkout`, `dvc exp apply`); they are", kept=True)
        return
    if pointer.exists():
        raise BudgetNotHere(f"{pointer} records a privacy budget that is not in {BUDGET_DIR}/: run `dvc pull "
                            f"{pointer}` (or `make restore`) first, so that this run composes with the runs it holds")
    # Never pushed, then deleted (`rm -rf data`): a DP run's ledger left here says a budget charged it, and a
    # new one would publish ε without it (and register the same examples as private again). `git clean -X`
    # deletes those records too (data/, .dpfm/ and models/ are all ignored): the mark outside the project stays.
    left = [*Path(".dpfm/state").glob("dp-train-*/ledger.jsonl"), Path("models/dp/ledger.json"), CHARGES,
            started_mark()]
    charged = sorted(str(p) for p in left if p.is_file())
    if charged:
        raise BudgetNotHere(f"{BUDGET_DIR}/ is gone but DP runs it charged left their records ({', '.join(charged[:3])}"
                            f"{', ...' if len(charged) > 3 else ''}): restore {BUDGET_DIR}/ from a backup; only if "
                            f"nothing those runs trained was ever released, delete .dpfm/state/dp-train-*, models/dp, "
                            f"{CHARGES} and {started_mark()} to start a new budget")


def started_mark() -> Path:
    """Where this project's budget is marked as started, outside the project ($XDG_STATE_HOME, by default
    ~/.local/state): git-ignored together with every record of the runs it charged, the budget could be
    deleted with them, and a new one would start from nothing."""
    home = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local/state")
    project = str(Path.cwd().resolve())
    return home / "dpfm/budgets" / f"{hashlib.sha256(project.encode()).hexdigest()[:16]}.json"


def _mark_started() -> None:
    mark = started_mark()
    if mark.exists():
        return
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(mark) as tmp:
            tmp.write_text(json.dumps({"project": str(Path.cwd().resolve()), "budget": str(BUDGET_DIR)}) + "\n")
    except OSError as e:  # a read-only home: the records inside the project still guard it
        print(f"budget: could not mark the budget as started in {mark} ({e}): a `git clean -X` that deletes "
              f"{BUDGET_DIR}/ and the runs' records together would go unnoticed")


def _check_not_a_temporary_workspace() -> None:
    """`dvc exp run --temp` (or `--queue`) runs the stages in a copy of the project under the repository's
    .dvc/tmp/exps/, deleted after, with DVC_ROOT naming the repository: a charge made to the copy's
    budget, not a stage output, is lost with it, and the project's budget never composes that run."""
    root = os.environ.get("DVC_ROOT")
    if root and Path.cwd().resolve().is_relative_to(Path(root).resolve() / ".dvc"):
        raise BudgetNotHere(f"this DP run would charge the privacy budget of a temporary DVC workspace ({Path.cwd()}), "
                            f"which is deleted after the experiment, and {root}/{BUDGET_DIR} would never count it: "
                            "run `dvc exp run` without --temp or --queue")


def sync() -> None:
    """The check every use of the budget makes first, on its own (`dpfm budget-sync`, `make push` before
    `dvc add data/budget`, `make restore` after `dvc pull`); and DVC's cache sealed, which receives it."""
    _seal_dvc_cache()
    _check_here()


def _seal_dvc_cache() -> None:
    """DVC's cache keeps the budget's key, charges and sketches as objects of mode 0444 in folders of
    0755: anyone on the machine could read them. The project's own cache (.dvc/cache) is made
    owner-only; a cache configured elsewhere (`cache.dir`, one a team shares) is its owners' to keep
    closed, and is named."""
    from pipeline.dvc_cache import cache_dir

    if not Path(".dvc").is_dir():
        return
    cache = cache_dir()
    if cache == Path(".dvc") / "cache":
        cache.mkdir(mode=0o700, exist_ok=True)
        cache.chmod(0o700)
    elif not cache.exists() or cache.stat().st_mode & 0o077:
        print(f"budget: DVC's cache {cache} (cache.dir) receives {BUDGET_DIR}/ (the owner's key, the charges) at "
              "`dvc add` and `dvc pull`: keep it readable by the data owner only", file=sys.stderr)


def _merge_recorded(pointer: Path) -> None:
    """Add the runs that the budget version git records (another checkout's `make push`, brought by `git
    pull`) holds and this one lacks, with their sketches: composed without them, ε would leave them out,
    and the next push would record a budget without them. A budget only grows, so the union is the budget."""
    from pipeline import dvc_cache

    files = dvc_cache.recorded_files(pointer)
    if files is None:
        md5 = dvc_cache.recorded_md5(pointer)
        from pipeline.tracking import dvc_hash

        if md5 and dvc_hash(BUDGET_DIR) != md5:
            raise BudgetNotHere(f"{pointer} records a budget version that is not in this checkout's DVC cache: run "
                                f"`dvc fetch {pointer}` and start again; its runs are then added to {BUDGET_DIR}/ "
                                "(`dvc pull` would refuse to overwrite the charges made here)")
        return
    key = BUDGET_DIR / "names.key"
    if "names.key" in files and key.exists() and files["names.key"].read_bytes().strip() != key.read_bytes().strip():
        raise BudgetCorrupt(f"{key} is not the key of the budget {pointer} records: two owners' budgets cannot be "
                            "merged (their runs' names differ); restore one of them")
    if "runs.jsonl" not in files:
        return
    for rel, cached in files.items():  # sketches first: a run is composed through its set's sketch
        if rel.startswith("sets/") and not (BUDGET_DIR / rel).exists():
            with atomic_path(BUDGET_DIR / rel) as tmp:
                tmp.write_bytes(cached.read_bytes())
    _merge_lines(files["runs.jsonl"].read_text().splitlines, f"of the budget {pointer} records, charged elsewhere,")


def _merge_lines(read_lines: Callable[[], list[str]], whose: str, kept: bool = False) -> None:
    """Append to runs.jsonl each of the charges `read_lines()` gives that it lacks, and to the charges kept
    here unless they are `kept` there already. Read under runs.jsonl's lock, as CHARGES is written: a
    read outside it could cut the tail of a charge another process is appending (drop_torn_tail)."""
    with _locked_runs() as f:
        have = set(f.read().splitlines())
        missing = [line for line in read_lines() if line.strip() and line not in have]
        if missing:
            if not kept:
                _keep_charges(missing)
            append_durably(f.fileno(), "".join(line + "\n" for line in missing), BUDGET_DIR / "runs.jsonl")
            print(f"budget: {len(missing)} run(s) {whose} added to {BUDGET_DIR}/runs.jsonl")


def _keep_charges(lines: list[str]) -> None:
    """Append charges to CHARGES (owner-only, fsynced) before runs.jsonl gets them: a kill between the
    two leaves a charge kept here, added to the budget at its next use."""
    owner.zone()
    fd = os.open(CHARGES, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        drop_torn_tail(CHARGES)
        append_durably(fd, "".join(line + "\n" for line in lines), CHARGES)
    finally:
        os.close(fd)


def _charges_kept() -> list[str]:
    """The charges kept here; under runs.jsonl's lock (`_merge_lines`)."""
    if not CHARGES.exists():
        return []
    drop_torn_tail(CHARGES)
    return CHARGES.read_text().splitlines()


def _names_key() -> bytes:
    """The data owner's key for naming private data in public: made once, never replaced (a second
    process making one at the same moment takes the first's)."""
    path = BUDGET_DIR / "names.key"
    if not path.exists():
        _check_here()
        BUDGET_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".names.key.", dir=BUDGET_DIR)  # owner-only from its first byte
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)  # whole, and never over a key another process made first
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links
            if not path.exists():
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _mark_started()
    return bytes.fromhex(path.read_text().strip())


def public_name(digest: str) -> str:
    """A publishable name for `digest`, a digest of private data: keyed with the owner's key."""
    return hmac.new(_names_key(), digest.encode(), hashlib.sha256).hexdigest()[:16]


def registry_id() -> str:
    """This budget's publishable name: the registry's versions whose examples it charges carry it, so
    every later composition over it can tag them all (tracking.tag_dp_models)."""
    return public_name("dpfm budget")


class IdentityError(InputError, ValueError):
    """The index cannot say which examples it holds."""


def _salted(h: np.ndarray, salt: int) -> np.ndarray:
    return mix64_np(h ^ np.uint64((salt * GOLDEN) & MASK64))


def examples_identity(private_dir: str | Path) -> tuple[str, np.ndarray]:
    """(identity, sketch) of the usable examples of a shard directory, streamed from its index in
    row batches (memory flat in n): the identity adds two salted 64-bit mixes of every content digest
    (an order-free multiset digest), keyed for publishing; the sketch sets one bit per example."""
    path = Path(private_dir) / INDEX_NAME
    pf = open_index(path)
    if "content_hash" not in pf.schema_arrow.names:
        raise IdentityError(f"{path} predates content digests, which the privacy budget needs: re-run the shards stage")
    count, sums = 0, [np.uint64(0), np.uint64(0)]
    sketch = np.zeros(1 << SKETCH_BITS, dtype=bool)
    with np.errstate(over="ignore"):
        for batch in pf.iter_batches(batch_size=ROW_GROUP_ROWS, columns=["content_hash", "status"]):
            batch = batch.filter(pc.equal(batch.column("status"), "ok"))
            digests = batch.column("content_hash")
            if digests.null_count:
                # No count in the message: it reaches the stage's log, and a count of private rows is a release.
                raise IdentityError(f"{path}: usable rows without a content digest: re-run the shards stage")
            h = digests.to_numpy()
            count += len(h)
            sums = [sums[i] + _salted(h, i + 1).sum(dtype=np.uint64) for i in range(2)]
            sketch[_salted(h, 3) >> np.uint64(64 - SKETCH_BITS)] = True
    return public_name(f"examples {count}:{int(sums[0]):016x}:{int(sums[1]):016x}"), sketch


def _sketch_path(identity: str) -> Path:
    return BUDGET_DIR / "sets" / f"{identity}.npz"


def _save_sketch(identity: str, sketch: np.ndarray) -> None:
    if _sketch_path(identity).exists():
        return
    # Uncompressed: a compressed sketch's size would be a function of the examples' digests, and git
    # tracks data/budget.dvc, which records the budget's size in bytes (sketches of earlier versions,
    # compressed, still load).
    with atomic_path(_sketch_path(identity)) as tmp, open(tmp, "wb") as f:
        np.savez(f, bits=np.packbits(sketch))


def _load_sketch(identity: str) -> np.ndarray | None:
    path = _sketch_path(identity)
    if not path.exists():
        return None
    with np.load(path) as z:
        return z["bits"]


def key_fingerprint(key: int) -> str:
    """Which draw of batches and noise a run makes, without the key itself. The budget travels to the
    owner's DVC remote, and the key has 63 bits: a fast hash of it could be inverted offline by trying
    every key, so the fingerprint is scrypt's (16 MiB and about 0.1 s a try)."""
    return hashlib.scrypt(str(key).encode(), salt=b"dpfm budget key", n=1 << 14, r=8, p=1, dklen=16).hex()


def _sha256_key_fingerprint(key: int) -> str:
    """The fingerprint of runs charged until 2026-12-05: their resumes are matched by it, charged once."""
    return hashlib.sha256(f"dpfm budget key {key}".encode()).hexdigest()[:16]


def record(identity: str, sketch: np.ndarray, run: str, plan: Plan, key: int, public_set: str | None = None) -> None:
    """Charge run `run`'s planned mechanism, drawn with secret `key`, to the examples `identity`
    (once per run and key; fsynced before training). `public_set`: the labelled set a package ships that
    the examples are (release.public_set), whose runs no run on other data composes with."""
    _append(identity, sketch, {"run": run, "key": key_fingerprint(key), "set": identity, "objective": plan.objective,
                               "sigma": plan.sigma, "sample_rate": plan.sample_rate, "steps": plan.steps,
                               "delta": plan.delta, "n": plan.n, "adjacency": plan.adjacency,
                               "noise_edge": plan.noise_edge} | ({"public_set": public_set} if public_set else {}),
            same=("run", "key"), earlier=[{"key": _sha256_key_fingerprint(key)}])


def record_outside_dp(identity: str, sketch: np.ndarray, run: str, why: str, public_set: str | None = None) -> None:
    """Charge a release of the examples `identity` made without DP (a training without noise on them,
    a count of them published as it is, a noise key that is known): every composition that counts it
    is ε = ∞, in this run and in every later one, whatever their own flags (once per run and reason;
    fsynced before the release)."""
    _append(identity, sketch, {"run": run, "set": identity, "outside_dp": why}
            | ({"public_set": public_set} if public_set else {}), same=("run", "outside_dp"))


def _append(identity: str, sketch: np.ndarray, entry: dict, same: tuple[str, ...], earlier: list[dict] = ()) -> None:
    """Append `entry` to the budget unless an entry agrees on `same` with it, or with it as an earlier
    version wrote it (`entry` updated by one of `earlier`): a resume."""
    _check_not_a_temporary_workspace()
    _check_here()
    _save_sketch(identity, sketch)
    entry["recorded"] = int(time.time())  # whole seconds: a fixed width
    with _locked_runs() as f:  # the check and the append as one: a run started twice at once is charged once
        forms = [entry, *({**entry, **change} for change in earlier)]
        if any(all(e.get(k) == form[k] for k in same) for e in _parse(f.read(), BUDGET_DIR / "runs.jsonl") for form in forms):
            return  # a resume: the same batches and noise (an entry from before keys were recorded charges again)
        line = json.dumps(entry, sort_keys=True)
        _keep_charges([line])
        append_durably(f.fileno(), line + "\n", BUDGET_DIR / "runs.jsonl")


@contextmanager
def _locked_runs():
    """runs.jsonl open to read from its start and append, held under an exclusive lock."""
    BUDGET_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(BUDGET_DIR / "runs.jsonl", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: a race can then only charge a run twice, never miss it
            pass
        drop_torn_tail(BUDGET_DIR / "runs.jsonl")  # a charge cut by a kill: its run had not started
        f.seek(0)
        yield f


def _entries() -> list[dict]:
    """Every charged run."""
    _check_here()
    path = BUDGET_DIR / "runs.jsonl"
    return _parse(path.read_text(), path) if path.exists() else []


def _parse(text: str, path: Path) -> list[dict]:
    """The entries of runs.jsonl. A last line without its newline was torn by a kill inside a charge
    (its run had not started) and is dropped; any other line that does not read is a charge lost
    (an edit, two writers without a lock) and stops every reader rather than leave a run uncomposed."""
    lines = text.split("\n")
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # no newline after it: torn
                continue
            raise BudgetCorrupt(f"{path}, line {number}, is not a charge: the budget cannot say what was spent; "
                                "restore it from its DVC remote (`dvc pull`) or mend the line") from None
    return out


def runs(identity: str) -> list[dict]:
    """The entries (DP runs, and releases outside DP) that touched any example of set `identity`: on the
    same set, or on a set whose sketch shares a bit with its sketch (a set without a sketch on record
    counts as overlapping)."""
    mine = _load_sketch(identity)
    overlaps: dict[str, bool] = {identity: True}
    out = []
    for entry in _entries():
        other = entry["set"]
        if other not in overlaps:
            theirs = _load_sketch(other)
            overlaps[other] = mine is None or theirs is None or bool(np.any(mine & theirs))
        if overlaps[other]:
            out.append(entry)
    return out


def composed_epsilon(entries: list[dict], delta: float, adjacency: str = "add_remove") -> float:
    """ε at δ of the runs' mechanisms applied one after another to the same data, for `adjacency`
    neighbours: the PLD composition of their Poisson-subsampled Gaussians (σ relative to the
    sensitivity), refined, guarded and bounded as one run's is (accountant_backends._pld_ladder); ∞
    when any entry released the examples without DP."""
    if any("outside_dp" in e for e in entries):
        return math.inf
    return composed_pld_epsilon([(e["sigma"], e["sample_rate"], e["steps"]) for e in entries], delta, adjacency)


def edges_problem(entries: list[dict], delta: float, adjacency: str) -> str | None:
    """Why the composed runs' noise edges void every ε at δ (privacy/noise_edge.py), or None. Each run's
    edge shows an informed adversary an example was in with probability noise_edge_floor, and over
    runs these add up; a run charged before the budget recorded its edge drew torch's fp32 normals."""
    def run_floor(e: dict) -> float:
        move = largest_move(objective(e["objective"]).sensitivity, e.get("adjacency", adjacency), e["sample_rate"])
        return noise_edge_floor(e["sigma"], e["sample_rate"], e["steps"], e.get("noise_edge", UNRECORDED_EDGE), move=move)

    floor = sum(run_floor(e) if e["sigma"] > 0 else 1.0 for e in entries)
    if floor <= SHARE_OF_DELTA * delta:
        return None
    return (f"noise that stops short of a Gaussian's tail: its edges show that an example was in with probability "
            f"{floor:.2g}, above δ/10 = {SHARE_OF_DELTA * delta:.2g}")


def composition(ledger: dict, delta: float) -> dict:
    """The published composition: ε of every DP run charged to this budget, on whatever examples,
    composed; this run is counted even if the budget record was lost. Only the runs on sets that
    share examples with this one would be tighter (`overlap_composition`), but which sets share an
    example is a fact about the private data: replacing the one shared example could drop a run.
    `ledger` is the published ledger: its plan, run and data identity.

    Runs on a labelled set a package ships (digits, Fashion-MNIST: public, each anyone's to compute on)
    read nothing of other data: a run on other data leaves them out, which its `public_set` (absent)
    says publicly. So the default run's ε = ∞ point on digits leaves a later run on private data DP. A
    run on a public set composes with every run (the same examples may be in a private set too)."""
    entries = _entries()
    if not ledger.get("public_set"):
        entries = [e for e in entries if not e.get("public_set")]
    return _composed(ledger, entries, delta)


def overlap_composition(ledger: dict, delta: float) -> dict:
    """The owner's composition: ε of the runs charged to examples this run trained on (`runs`)."""
    entries = runs(ledger["data_identity"]) if "data_identity" in ledger else []
    return _composed(ledger, entries, delta)


def keep_overlap_composition(ledger: dict, delta: float) -> Path:
    """Write the owner's composition to their zone; returns where. Only `dpfm owner-composition` does:
    how long it takes follows which sets share examples (the runs it composes), so no stage, whose
    wall time is published, computes it."""
    return owner.write("composition", overlap_composition(ledger, delta))


def _composed(ledger: dict, entries: list[dict], delta: float) -> dict:
    """`epsilon`: ε = ∞ once any entry released the examples without DP; `epsilon_dp_runs`: the DP runs',
    both at `delta`: the smallest δ of this run and the runs composed. Each run's δ is below 1/n of its
    own set, so only the smallest is below 1/n of every set composed (a run on a smaller set has a
    larger δ), and an ε stated beside a run's own δ must hold at it."""
    plan = Plan.from_header(ledger)
    outside = sorted({e["outside_dp"] for e in entries if "outside_dp" in e})
    entries = [e for e in entries if "outside_dp" not in e]
    if not any(e["run"] == ledger.get("run") for e in entries):
        entries.append({"run": ledger.get("run"), "objective": plan.objective, "sigma": plan.sigma,
                        "sample_rate": plan.sample_rate, "steps": plan.steps, "noise_edge": plan.noise_edge})
    delta = min([delta, *(e["delta"] for e in entries if "delta" in e)])
    edges = edges_problem(entries, delta, plan.adjacency)
    outside += [edges] if edges else []
    dp_runs = composed_epsilon(entries, delta, plan.adjacency)
    return {"epsilon": math.inf if outside else dp_runs, "epsilon_dp_runs": dp_runs, "delta": delta,
            "outside_dp": outside, "runs": len(entries), "adjacency": plan.adjacency,
            "data_identity": ledger.get("data_identity"),
            "by_run": [{k: e[k] for k in ("run", "objective", "sigma", "sample_rate", "steps")} for e in entries]}
