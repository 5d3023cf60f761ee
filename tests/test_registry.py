"""The model registry (pipeline/tracking.py: log_dp_model, tag_dp_models): what a registered DP encoder's
version says of its privacy from its first moment, and what later runs on the same examples add to it."""

import types

import pytest

from pipeline import checkpoints, tracking
from pipeline.models import ModelConfig, build_model
from pipeline.privacy.accounting import bound_text

STAGE = types.SimpleNamespace(name="verify", input_paths=[], touches_private_data=False)


def saved(path, private=True):
    cfg = ModelConfig.of({"size": "micro"}).to_dict()
    checkpoints.save(path, build_model("mae", cfg), objective="mae", model_cfg=cfg, steps=1, private=private, config={})
    return path


def test_a_version_states_its_own_and_its_composed_bounds_and_its_verdict_from_the_start(local_mlflow):
    """Before any tag_dp_models: a version registered with private=False reads NOT PRIVATE with composed
    ε = ∞; δ is the run's own and delta_composed the composition's, each where it belongs."""
    import mlflow

    ckpt = saved("c.pt")
    eps, delta, eps_composed, delta_composed = 2.0, 1e-5, 3.5, 2e-7
    with tracking.stage_run(STAGE, {"run": {"seed": 0}}, "dpfm") as run:
        run.log_dp_model(ckpt, eps, delta, eps_composed, delta_composed, private=False)
        run.log_dp_model(ckpt, eps, delta, eps_composed, delta_composed, private=True)
    versions = mlflow.tracking.MlflowClient().search_model_versions("name='dpfm-mae'")
    public, private = sorted(versions, key=lambda v: int(v.version))
    assert (public.tags["private"], public.tags["epsilon"]) == ("false", "inf")
    assert (private.tags["private"], private.tags["epsilon"]) == ("true", bound_text(eps_composed, 4))
    for v in (public, private):
        assert v.tags["epsilon_run"] == bound_text(eps, 4)
        assert v.tags["delta"] == bound_text(delta, 3, exponent=True)
        assert v.tags["delta_composed"] == bound_text(delta_composed, 3, exponent=True)


def test_a_model_trained_without_dp_is_never_registered_and_a_versions_own_reasons_are_kept(local_mlflow):
    """A checkpoint saved private=False (a twin trained without DP) is refused, nothing registered; a version
    already NOT PRIVATE for a reason of its own keeps it beside the reasons a later run adds."""
    import mlflow

    client = mlflow.tracking.MlflowClient()
    with tracking.stage_run(STAGE, {"run": {"seed": 0}}, "dpfm") as run:
        with pytest.raises(ValueError, match="is not private: it is never registered as a DP model"):
            run.log_dp_model(saved("twin.pt", private=False), 2.0, 1e-5)
        assert client.search_model_versions() == []
        run.log_dp_model(saved("c.pt"), 2.0, 1e-5, budget="b1")
        [v] = client.search_model_versions("name='dpfm-mae'")
        client.set_model_version_tag("dpfm-mae", v.version, "private", "false")
        client.set_model_version_tag("dpfm-mae", v.version, "not_private", "its own reason")
        assert run.tag_dp_models({"private": "false", "epsilon": "inf", "not_private": "a later reason"}, "b1") == 1
    [v] = client.search_model_versions("name='dpfm-mae'")
    assert set(v.tags["not_private"].split("; ")) == {"its own reason", "a later reason"}
    assert (v.tags["private"], v.tags["epsilon"]) == ("false", "inf")
