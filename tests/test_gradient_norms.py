"""benchmarks/gradient_norms.py: per-example norms, whole and the encoder's part, as autograd gives them."""

import pytest
import torch

from benchmarks.gradient_norms import squared_norms
from pipeline.models import build_model


@pytest.mark.parametrize("name", ["mae", "caption"])
def test_squared_norms_are_each_examples_own(name):
    torch.manual_seed(0)
    if name == "mae":
        model, batch = build_model("mae", {"size": "micro"}), (torch.randn(4, 3, 16, 16), torch.rand(4, 16))
    else:
        model = build_model("caption", {"size": "micro", "vocab_size": 50, "max_len": 10})
        batch = (torch.randn(4, 3, 16, 16), torch.randint(4, 50, (4, 10)))
    whole, encoder = squared_norms(model, batch)
    params = dict(model.named_parameters())
    for i in range(4):
        grads = dict(zip(params, torch.autograd.grad(model(*(x[i:i + 1] for x in batch)).sum(), list(params.values()))))
        assert whole[i].item() == pytest.approx(sum(g.pow(2).sum().item() for g in grads.values()), rel=1e-4)
        want = sum(g.pow(2).sum().item() for n, g in grads.items() if n.startswith("encoder."))
        assert encoder[i].item() == pytest.approx(want, rel=1e-4)
        assert 0 < encoder[i].item() < whole[i].item()
