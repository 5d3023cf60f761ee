"""The owner-only zone: statistics of the private data that the data owner needs and nobody else sees.

Everything else the pipeline writes is published (MLflow, the report, stdout and logs, the DVC
outputs in models/ and results/) and holds only DP or public values; the DVC remote also holds
data/budget/ (its sketches, the owner's key), so it stays the owner's (docs/privacy.md, "Two zones"). What is computed on the private
data without noise goes here instead, under `.dpfm/owner/` (files mode 0600, never logged, pushed
or reported): the shard scan's exclusions by reason, non-finite examples dropped in training, the
realised batch sizes and the sampler's goodness-of-fit test on them, Snakemake's benchmarks of the
stages on private data (their timing and bytes read follow the sampled examples), and the owner's logs
(`shards.log`: shards that could not be read or were damaged; `dp-train.log`: what a failed read in
training named), and the md5 of every input file a stage hashed (`file-digests.json`, tracking.input_tag).

`dp.log_private_stats: true` is the explicit opt-in to publish the non-finite count as well; the
report then says that it is not covered by ε, and the run is NOT PRIVATE as a whole (release.py).
tests/test_published_zone.py runs the pipeline and scans every published artifact for each of these
values.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from pipeline.errors import PrivateDataError
from pipeline.io import read_json, write_json

OWNER_DIR = Path(".dpfm/owner")


def path(name: str) -> Path:
    return OWNER_DIR / f"{name}.json"


def zone() -> Path:
    """The owner-only folder, made owner-only if it was not."""
    OWNER_DIR.mkdir(parents=True, exist_ok=True)
    OWNER_DIR.chmod(0o700)
    return OWNER_DIR


def seal(folder: Path = OWNER_DIR) -> None:
    """Everything in `folder` owner-only, whoever wrote it: Snakemake writes its benchmarks of the
    stages on private data in the zone (timing, bytes read) with its default permissions, and DVC checks
    the privacy budget out with the umask's. A link is left alone (DVC's cache behind it is sealed apart)."""
    if folder.is_dir():
        for p in [folder, *folder.rglob("*")]:
            if not p.is_symlink():
                p.chmod(0o700 if p.is_dir() else 0o600)


def write(name: str, record: dict) -> Path:
    """Keep `record` (a statistic of the private data) for the owner only; returns where it is."""
    zone()
    path(name).parent.mkdir(parents=True, exist_ok=True)
    write_json(path(name), record, mode=0o600)
    return path(name)


def run_record(run: str) -> str:
    """The name of a DP run's owner-only record: its realised batch sizes and non-finite count."""
    return f"runs/{run}"


def note(name: str, line: str) -> Path:
    """Append `line` to the owner's log `name`: what a stage would otherwise print about the private
    data (a shard it could not read, one it found damaged)."""
    zone()
    log = OWNER_DIR / f"{name}.log"
    with os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as f:
        f.write(line.rstrip("\n") + "\n")
    return log


@contextmanager
def failures_kept(log: str, what: str, when: str = ""):
    """A failure while `what` reads private examples, as PrivateDataError: its message names them (a key,
    their bytes), so it goes to the owner's log `log`, with `when` (a step: when an example was sampled);
    the line printed says where, and neither."""
    try:
        yield
    except Exception as e:
        where = note(log, f"{when + ': ' if when else ''}{what}: {type(e).__name__}: {e}")
        raise PrivateDataError(f"{what} failed ({type(e).__name__}); what failed names them, so it is kept for the "
                               f"data owner only: {where}") from None


def read(name: str) -> dict | None:
    return read_json(path(name)) if path(name).exists() else None
