"""The owner-only zone (pipeline/privacy/owner.py): what it keeps is readable by its owner alone from its
first byte, whatever the umask and whoever wrote it, and a failure on private examples prints where the
owner finds it, never what it named."""

import os
import stat

import pytest

from pipeline.errors import PrivateDataError
from pipeline.privacy import owner


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path, follow_symlinks=False).st_mode)


@pytest.fixture
def open_umask(in_tmp):
    """A umask that would make every new file world-readable: only explicit modes keep the zone closed."""
    before = os.umask(0)
    yield in_tmp
    os.umask(before)


def test_records_and_logs_are_owner_only_under_any_umask(open_umask):
    owner.OWNER_DIR.mkdir(parents=True)
    owner.OWNER_DIR.chmod(0o755)  # made by another tool first
    record = owner.write(owner.run_record("r1"), {"batch_sizes": [3, 4]})
    log = owner.note("shards", "shard 7 could not be read")
    assert owner.read(owner.run_record("r1")) == {"batch_sizes": [3, 4]}
    assert mode(owner.OWNER_DIR) == 0o700 and mode(record) == 0o600 and mode(log) == 0o600
    assert owner.note("shards", "shard 9 too") == log and log.read_text().splitlines() == [
        "shard 7 could not be read", "shard 9 too"]
    # A record never written reads as None: verify names the missing record (run_checks.with_batch_sizes).
    assert owner.read(owner.run_record("never-trained")) is None


def test_seal_closes_what_other_tools_wrote_in_the_zone_and_leaves_links_alone(open_umask):
    bench = owner.OWNER_DIR / "benchmarks" / "dp-train.tsv"  # Snakemake's, with its default modes
    bench.parent.mkdir(parents=True)
    bench.write_text("s\t12.3\n")
    target = open_umask / "cache-object"
    target.write_text("x")
    target.chmod(0o444)
    (owner.OWNER_DIR / "link").symlink_to(target)
    owner.seal()
    assert mode(owner.OWNER_DIR) == mode(bench.parent) == 0o700 and mode(bench) == 0o600
    assert mode(target) == 0o444  # DVC's cache behind a link is sealed apart, not here


def test_a_failure_on_private_examples_prints_where_it_is_kept_and_never_what_it_named(in_tmp):
    with pytest.raises(PrivateDataError) as raised:
        with owner.failures_kept("dp-train", "decoding a sampled example", when="step 3"):
            raise ValueError("private-key-000042 is not a PNG")
    printed = str(raised.value)
    assert "private-key-000042" not in printed and "(ValueError)" in printed and ".dpfm/owner/dp-train.log" in printed
    assert (in_tmp / ".dpfm/owner/dp-train.log").read_text() == (
        "step 3: decoding a sampled example: ValueError: private-key-000042 is not a PNG\n")
