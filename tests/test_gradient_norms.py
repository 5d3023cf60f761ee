"""benchmarks/gradient_norms.py: per-example norms, whole and the encoder's part, as autograd gives them."""

import pytest
import torch

from benchmarks.gradient_norms import PARTS, ClippedMean, per_example_grads, squared_norms
from micro_batches import micro_model_and_batch
from pipeline.models import build_model


@pytest.mark.parametrize("name", ["mae", "caption"])
def test_squared_norms_are_each_examples_own(name):
    model, batch = micro_model_and_batch(name, 4)
    whole, encoder = squared_norms(per_example_grads(model, batch))
    params = dict(model.named_parameters())
    for i in range(4):
        grads = dict(zip(params, torch.autograd.grad(model(*(x[i:i + 1] for x in batch)).sum(), list(params.values()))))
        assert whole[i].item() == pytest.approx(sum(g.pow(2).sum().item() for g in grads.values()), rel=1e-4)
        want = sum(g.pow(2).sum().item() for n, g in grads.items() if n.startswith("encoder."))
        assert encoder[i].item() == pytest.approx(want, rel=1e-4)
        assert 0 < encoder[i].item() < whole[i].item()


def test_the_clipped_means_norm_is_the_mean_of_the_cross_products_of_clipped_examples():
    """‖E clip(g)‖² estimated from the pairs i != j only: no ‖c_i‖² term, whose mean is not ‖E c‖²."""
    torch.manual_seed(0)
    grads = {"encoder.w": torch.randn(6, 3, 2), "decoder.b": torch.randn(6, 4)}
    whole_sq, _ = squared_norms(grads)
    est = ClippedMean(clip_norm=1.5)
    est.add({k: v[:4] for k, v in grads.items()}, whole_sq[:4])  # in two chunks, as measure() feeds it
    est.add({k: v[4:] for k, v in grads.items()}, whole_sq[4:])
    factor = (1.5 / whole_sq.sqrt()).clamp(max=1.0)
    flat = {k: (v * factor.view(-1, *[1] * (v.dim() - 1))).flatten(1) for k, v in grads.items()}
    for part, names in (("whole", ["encoder.w", "decoder.b"]), ("encoder", ["encoder.w"])):
        # In float64, as the estimator sums: the mean of the pairs cancels to ~1e-3 of its terms, so
        # float32 dot products (whose rounding depends on the CPU's vector width) miss it by ~1e-4.
        c = torch.cat([flat[k] for k in names], dim=1).double()
        pairs = [float(c[i] @ c[j]) for i in range(6) for j in range(6) if i != j]
        assert est.squared_norm(PARTS[part]) == pytest.approx(sum(pairs) / len(pairs), rel=1e-5)
        assert est.parameters(PARTS[part]) == c.shape[1]
    # every example the same unclipped gradient: the estimate is its squared norm, not less
    same = ClippedMean(clip_norm=10.0)
    g = {"encoder.w": torch.full((5, 2), 0.5)}
    same.add(g, squared_norms(g)[0])
    assert same.squared_norm(PARTS["whole"]) == pytest.approx(0.5)


def test_the_encoders_kinds_of_parameter_split_it_without_overlap():
    names = [n for n, _ in build_model("mae", {"size": "micro"}).named_parameters()]
    kinds = [k for k in PARTS if k.startswith("encoder ")]
    for name in names:
        owners = [k for k in kinds if PARTS[k](name)]
        assert len(owners) == (1 if PARTS["encoder"](name) else 0), (name, owners)
    assert all(any(PARTS[k](n) for n in names) for k in kinds)


def test_the_encoders_depth_parts_split_it_without_overlap():
    from benchmarks.gradient_norms import depth_parts
    from pipeline.models import ModelConfig, build_model

    names = [n for n, _ in build_model("mae", ModelConfig.of({"size": "pico"})).named_parameters()]
    parts = depth_parts(names)
    assert [k for k in parts if "block" in k] == [f"encoder block {b}" for b in range(4)]
    for name in names:
        owners = [k for k, accepts in parts.items() if accepts(name)]
        assert len(owners) == (1 if PARTS["encoder"](name) else 0), (name, owners)
    assert all(any(accepts(n) for n in names) for accepts in parts.values())


def test_a_decoder_from_a_trained_model_leaves_the_encoder_at_its_warm_start(tmp_path):
    from benchmarks.gradient_norms import with_decoder_from

    cfg = {"size": "micro", "vocab_size": 50, "max_len": 10}
    torch.manual_seed(0)
    warm, trained = build_model("caption", cfg), build_model("caption", cfg)
    encoder_before = {k: v.clone() for k, v in warm.encoder.state_dict().items()}
    torch.save({"model": trained.state_dict(), "step": 3}, tmp_path / "checkpoint.pt")  # a state directory's form
    with_decoder_from(warm, str(tmp_path / "checkpoint.pt"))
    for k, v in warm.state_dict().items():
        expected = encoder_before[k[len("encoder."):]] if k.startswith("encoder.") else trained.state_dict()[k]
        assert torch.equal(v, expected), k
    torch.save({"model": build_model("caption", {**cfg, "vocab_size": 60}).state_dict()}, tmp_path / "other.pt")
    with pytest.raises(SystemExit, match="not a trained"):
        with_decoder_from(warm, str(tmp_path / "other.pt"))
