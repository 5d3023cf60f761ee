"""Checkpoints (pipeline/checkpoints.py): what a save keeps (the private flag, the step count, the config
without its noise key), what a load of an earlier version's file finds, and a save cut short."""

from __future__ import annotations

import errno

import pytest
import torch

from pipeline import checkpoints


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(2, 2)
        self.head = torch.nn.Linear(2, 1)


def save(path, **kw):
    args = dict(objective="mae", model_cfg={"size": "micro"}, steps=7, private=True,
                config={"dp": {"noise_seed": 918273645, "lr": 0.1}})
    checkpoints.save(path, Tiny(), **{**args, **kw})


@pytest.mark.parametrize("private", [True, False])
def test_a_checkpoint_keeps_its_private_flag_and_steps(tmp_path, private):
    save(tmp_path / "c.pt", private=private, steps=7)
    got = checkpoints.load(tmp_path / "c.pt")
    assert (got.private, got.steps, got.objective) == (private, 7, "mae")


def test_a_saved_checkpoint_hides_its_noise_key(tmp_path):
    """The model is a DVC output that gets pushed: a noise key in its config would let anyone subtract the noise."""
    save(tmp_path / "c.pt")
    assert checkpoints.load(tmp_path / "c.pt").config["dp"] == {"noise_seed": "(set; hidden)", "lr": 0.1}
    assert b"918273645" not in (tmp_path / "c.pt").read_bytes()


@pytest.mark.parametrize("key", ["optimizer_steps", "step"])
def test_a_checkpoint_from_an_earlier_version_keeps_its_step_count_and_is_not_taken_for_a_dp_model(tmp_path, key):
    """Earlier versions wrote the update count under other keys (pretrain's `step`) and no private flag."""
    torch.save({"objective": "mae", "model_cfg": {}, "model": {}, "encoder": {}, key: 11}, tmp_path / "old.pt")
    old = checkpoints.load(tmp_path / "old.pt")
    assert (old.steps, old.private) == (11, False)


def test_a_checkpoint_without_a_step_count_is_refused(tmp_path):
    torch.save({"objective": "mae", "model_cfg": {}, "model": {}, "encoder": {}}, tmp_path / "c.pt")
    with pytest.raises(checkpoints.CheckpointError, match="has no step count: it was not written by a dpfm stage"):
        checkpoints.load(tmp_path / "c.pt")


def test_a_warm_starts_weights_digest_covers_the_weights_outside_its_encoder(tmp_path):
    """An MAE warm start is the whole model, its decoder too (Checkpoint._part): a change outside the encoder
    (here Tiny's head) is another input, so the digest that keys a DP run by its warm start must move."""
    model = Tiny()
    checkpoints.save(tmp_path / "a.pt", model, objective="mae", model_cfg={"size": "micro"}, steps=2, private=False,
                     config={})
    with torch.no_grad():
        model.head.weight[0, 0] += 1.0
    checkpoints.save(tmp_path / "b.pt", model, objective="mae", model_cfg={"size": "micro"}, steps=2, private=False,
                     config={})
    assert checkpoints.weights_digest(tmp_path / "a.pt") != checkpoints.weights_digest(tmp_path / "b.pt")


def test_a_save_cut_short_keeps_the_previous_file_whole(tmp_path, monkeypatch):
    """A disk that fills inside torch.save leaves the previous checkpoint under the final name, loadable,
    and no temporary file beside it."""
    path = tmp_path / "c.pt"
    save(path, steps=3)

    def half(obj, f, *args, **kw):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", half)
    with pytest.raises(OSError, match=f"while writing {path}"):
        save(path, steps=9)
    monkeypatch.undo()
    assert checkpoints.load(path).steps == 3 and [p.name for p in tmp_path.iterdir()] == ["c.pt"]
