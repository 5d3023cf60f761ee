"""Finished models on disk (pretrain's warm start, dp-train's model and its non-private twin): one
`save`, one `load`, one set of metadata. Resumable training state is train.py's Checkpointer."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.errors import InputError
from pipeline.io import atomic_path
from pipeline.privacy.release import public_params

# What earlier versions called the update count (dp-train, pretrain): read so their models still load.
LEGACY_STEP_KEYS = ("optimizer_steps", "step")
# The model settings that shape a warm start's tensors: the encoder's, and the MAE decoder's.
ENCODER_SETTINGS = ("size", "img_size", "patch_size", "in_chans")
DECODER_SETTINGS = ("decoder_width", "decoder_depth", "decoder_heads")


class CheckpointError(InputError, ValueError):
    """A file that is missing, or was not written by `save`."""


@dataclass(frozen=True)
class Checkpoint:
    objective: str      # mae | caption | clip: which model `model` is the state of
    model_cfg: dict     # ModelConfig.to_dict(): builds the model again
    model: dict         # the whole model's state dict
    encoder: dict       # the encoder's state dict (what evaluation and warm starts read)
    steps: int          # optimizer updates applied; dp-train's is the optimizer's own count, which verify checks
    private: bool       # trained with DP under a secret noise key: only such a model is registered as DP
    config: dict = field(default_factory=dict)  # the params sections it was trained with

    def build_encoder(self) -> torch.nn.Module:
        from pipeline.models import build_encoder

        encoder = build_encoder(self.model_cfg)
        encoder.load_state_dict(self.encoder)
        return encoder

    def build_model(self) -> torch.nn.Module:
        from pipeline.models import build_model

        model = build_model(self.objective, self.model_cfg)
        model.load_state_dict(self.model)
        return model

    # -- as a warm start: the whole MAE, its decoder too (ViP); another objective's encoder alone, its
    # text tower starting from random weights
    def _part(self, model: torch.nn.Module, objective: str) -> tuple[torch.nn.Module, dict, tuple[str, ...]]:
        if objective == self.objective:
            return model, self.model, ENCODER_SETTINGS + DECODER_SETTINGS
        return model.encoder, self.encoder, ENCODER_SETTINGS

    def load_into(self, model: torch.nn.Module, objective: str) -> None:
        module, state, _ = self._part(model, objective)
        module.load_state_dict(state)

    def check_fits(self, model: torch.nn.Module, objective: str, model_cfg: dict) -> None:
        """Refuse (ValueError) a model, built on any device (meta too), whose tensors this warm start
        cannot fill, naming the model settings that differ: a model section edited after pretrain ran."""
        module, state, settings = self._part(model, objective)
        # Settings too: another img_size keeps every tensor's shape (the positions are rebuilt, not
        # saved) but puts the patches on another grid than the one pretrained.
        differ = [f"model.{k}: {self.model_cfg[k]!r} there, {model_cfg[k]!r} here" for k in settings
                  if k in self.model_cfg and self.model_cfg[k] != model_cfg[k]]
        if not differ and ({k: tuple(v.shape) for k, v in module.state_dict().items()}
                           == {k: tuple(v.shape) for k, v in state.items()}):
            broken = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
            if broken:  # every example's gradient would be non-finite and dropped: a charged run that learns nothing
                raise ValueError(f"dp.init=pretrain: the synthetic warm start holds non-finite weights ({broken[0]}"
                                 f"{f' and {len(broken) - 1} more' if len(broken) > 1 else ''}): pretrain diverged; "
                                 "run it again with a lower pretrain.lr")
            return
        raise ValueError(f"dp.init=pretrain: the synthetic warm start was pretrained with other model settings "
                         f"({'; '.join(differ) or 'other tensor shapes'}): run pretrain again (snakemake does) or "
                         "set them back")


def save(path: str | Path, model: torch.nn.Module, *, objective: str, model_cfg: dict, steps: int, private: bool,
         config: dict) -> None:
    """Write atomically: a reader finds the previous file or this one, never half of one. The file is
    published (a DVC output), so `config` goes in as release.public_params shows it."""
    record = {"objective": objective, "model_cfg": model_cfg, "model": model.state_dict(),
              "encoder": model.encoder.state_dict(), "steps": int(steps), "private": bool(private),
              "config": public_params(config)}
    # Through a file object: torch.save(path) reports a full disk as an obscure RuntimeError.
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(record, f)


def weights_digest(path: str | Path) -> str:
    """What a finished model is, not when or how it was written: its objective, its config and every
    tensor of its state, in name order (the saved config, step count and file time left out)."""
    import hashlib
    import json

    ckpt = load(path)
    h = hashlib.sha256(json.dumps([ckpt.objective, ckpt.model_cfg], sort_keys=True).encode())
    for name, tensor in sorted((ckpt.model or ckpt.encoder).items()):
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def load(path: str | Path) -> Checkpoint:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=False)
    except (pickle.UnpicklingError, EOFError, RuntimeError, OSError) as e:  # truncated, or not a checkpoint at all
        raise CheckpointError(f"{path} cannot be read as a dpfm checkpoint ({type(e).__name__}: {e}): "
                              "write it again with the stage that made it") from None
    steps = next((raw[k] for k in ("steps", *LEGACY_STEP_KEYS) if isinstance(raw, dict) and k in raw), None)
    missing = [k for k in ("objective", "model_cfg", "encoder") if not isinstance(raw, dict) or k not in raw]
    if missing or steps is None:
        raise CheckpointError(f"{path} has no {', '.join(missing) or 'step count'}: it was not written by a dpfm stage")
    return Checkpoint(raw["objective"], raw["model_cfg"], raw.get("model", {}), raw["encoder"], steps,
                      bool(raw.get("private", False)), raw.get("config", {}))
