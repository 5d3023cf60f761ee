"""A micro model of a per-example objective with a batch of its inputs, for tests of per-example gradients."""

import torch

from pipeline.models import build_model


def micro_model_and_batch(name: str, examples: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The mae (images, mask noise) or caption (images, tokens) micro model at 16 px, seeded."""
    torch.manual_seed(0)
    images = torch.randn(examples, 3, 16, 16)
    if name == "mae":
        return build_model("mae", {"size": "micro"}), (images, torch.rand(examples, 16))
    model = build_model("caption", {"size": "micro", "vocab_size": 50, "max_len": 10})
    return model, (images, torch.randint(4, 50, (examples, 10)))
