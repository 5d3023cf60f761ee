"""pipeline/io.py: a durable append writes all of its text or names the full disk; a directory written
atomically leaves no copy behind, whatever an earlier run left or this one raised; a rewrite moves the
file's stamp; a temporary lies where the next start's clean-up finds it, and that clean-up spares others'."""

from __future__ import annotations

import errno
import os

import pytest

from pipeline import io as pio


def test_a_durable_append_writes_all_of_its_text_when_the_kernel_takes_it_in_pieces(tmp_path, monkeypatch):
    """os.write may write fewer bytes than asked (a signal, a nearly full disk): the rest must follow."""
    path = tmp_path / "runs.jsonl"
    real_write = os.write
    monkeypatch.setattr(pio.os, "write", lambda fd, data: real_write(fd, data[:3]))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        pio.append_durably(fd, '{"run": "A"}\n', path)
    finally:
        os.close(fd)
    assert path.read_text() == '{"run": "A"}\n'


def test_a_full_disk_inside_a_durable_append_names_the_file_and_keeps_its_errno(tmp_path, monkeypatch):
    path = tmp_path / "runs.jsonl"

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pio.os, "write", full)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        with pytest.raises(OSError) as caught:
            pio.append_durably(fd, "line\n", path)
    finally:
        os.close(fd)
    assert caught.value.errno == errno.ENOSPC
    assert f"while appending to {path}" in str(caught.value) and caught.value.filename == str(path)


def test_an_old_copy_left_beside_a_live_output_does_not_stop_the_next_write(tmp_path):
    """Killed after its second rename but before the old copy was removed, a writer leaves both the new
    output and `.<name>.old`: the next write must still succeed, and leave no `.old` behind."""
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards/private.tar").write_text("v2")
    (tmp_path / ".shards.old").mkdir()
    (tmp_path / ".shards.old/private.tar").write_text("v1")
    with pio.atomic_dir(tmp_path / "shards") as out:
        (out / "private.tar").write_text("v3")
    assert (tmp_path / "shards/private.tar").read_text() == "v3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]


def test_a_failed_directory_write_leaves_no_temporary_copy_and_the_old_output_in_place(tmp_path):
    """Only kill -9 skips atomic_dir's clean-up: a write that raises removes its half-written copy at once
    (of the private shards, a whole copy of private data that no later write may come to reclaim)."""
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards/private.tar").write_text("v1")
    with pytest.raises(RuntimeError):
        with pio.atomic_dir(tmp_path / "shards") as out:
            (out / "private.tar").write_text("half")
            raise RuntimeError("the stage failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]
    assert (tmp_path / "shards/private.tar").read_text() == "v1"


def test_a_file_rewritten_atomically_at_its_size_and_mtime_gets_a_new_stamp(tmp_path):
    """The stamp includes the inode, so an atomic rewrite (a rename: a new inode) shows even when the
    size and mtime are the same as before."""
    path = tmp_path / "s-000000.tar"
    path.write_bytes(b"a" * 100)
    before = pio.file_stamp(path)
    with pio.atomic_path(path) as tmp:
        tmp.write_bytes(b"b" * 100)
        os.utime(tmp, ns=(before[1], before[1]))
    after = pio.file_stamp(path)
    assert after[:2] == before[:2] and after != before


def test_a_files_temporary_lies_beside_it_where_the_stale_temp_clean_up_finds_it(tmp_path):
    """Beside the file: the rename stays on one file system (atomic), and what kill -9 leaves is what
    remove_stale_temps(directory, name) reclaims at the next start."""
    path = tmp_path / "checkpoint.pt"
    with pio.atomic_path(path) as tmp:
        tmp.write_bytes(b"x")
        assert list(tmp_path.glob(".checkpoint.pt.*.tmp")) == [tmp]
    assert path.read_bytes() == b"x"


def test_the_stale_temp_clean_up_of_one_output_spares_another_outputs_whose_name_extends_it(tmp_path):
    """Another writer's temporary (`shards-eval` beside `shards`) is live work, not a stale copy of `shards`."""
    other = tmp_path / ".shards-eval.x1y2z3.tmp"
    other.mkdir()
    with pio.atomic_dir(tmp_path / "shards") as out:
        (out / "private.tar").write_text("whole")
    assert other.exists()
