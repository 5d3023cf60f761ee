"""The model registry (pipeline/tracking.py: log_dp_model, tag_dp_models): what a registered DP encoder's
version says of its privacy from its first moment, and what later runs on the same examples add to it."""

import os
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


LOAD_REGISTERED = """
import importlib.util
import sys

import mlflow.pytorch
import numpy as np
import torch

# Without dpfm's installed package: the classes must come from the code the version carries.
sys.meta_path = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
assert importlib.util.find_spec("pipeline") is None
encoder = mlflow.pytorch.load_model(sys.argv[1])
with torch.no_grad():
    np.save(sys.argv[3], encoder(torch.from_numpy(np.load(sys.argv[2]))).numpy())
"""


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_a_registered_version_loads_where_dpfm_is_not_installed_and_gives_the_checkpoints_features(
        local_mlflow, tmp_path, objective):
    """A team that loads `models:/dpfm-<objective>/1` in a fresh environment gets the verified encoder: the same
    features as the checkpoint's, on a batch of another size than the signature's example."""
    import subprocess
    import sys

    import numpy as np
    import torch

    cfg = ModelConfig.of({"size": "micro", "img_size": 16}).to_dict()
    torch.manual_seed(3)
    checkpoints.save("c.pt", build_model(objective, cfg), objective=objective, model_cfg=cfg, steps=1, private=True,
                     config={})
    with tracking.stage_run(STAGE, {"run": {"seed": 0}}, "dpfm") as run:
        run.log_dp_model("c.pt", 2.0, 1e-5)
    images = torch.randn(5, 3, 16, 16)
    np.save("images.npy", images.numpy())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"MLFLOW_TRACKING_URI": tracking.tracking_uri()}
    loaded = subprocess.run([sys.executable, "-c", LOAD_REGISTERED, f"models:/dpfm-{objective}/1",
                             str(tmp_path / "images.npy"), str(tmp_path / "features.npy")],
                            cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    with torch.no_grad():
        expected = checkpoints.load("c.pt").build_encoder().eval()(images).numpy()
    np.testing.assert_array_equal(np.load(tmp_path / "features.npy"), expected)


def registered(client, name: str, run_id: str, tags: dict) -> str:
    """A version of `name` created straight in the registry (no model to log: only its tags matter here)."""
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        client.create_registered_model(name)
    return client.create_model_version(name, f"runs:/{run_id}/dp_encoder", run_id=run_id, tags=tags).version


def test_every_version_on_the_budget_of_every_dpfm_model_is_tagged_and_no_version_of_another_budget(local_mlflow):
    """A later composition on the budget tags every version charged to it, older ones and those of other
    objectives included (tagging only the newest left an older version claiming a smaller ε); versions
    on another budget, or on none, are not this composition's and keep their tags, even when called
    with no budget at all."""
    import mlflow

    client = mlflow.tracking.MlflowClient()
    with tracking.stage_run(STAGE, {"run": {"seed": 0}}, "dpfm") as run:
        ours = [("dpfm-mae", registered(client, "dpfm-mae", run.run_id, {"budget": "b1", "epsilon": "1.0"})),
                ("dpfm-mae", registered(client, "dpfm-mae", run.run_id, {"budget": "b1", "epsilon": "1.0"})),
                ("dpfm-clip", registered(client, "dpfm-clip", run.run_id, {"budget": "b1", "epsilon": "1.0"}))]
        others = [("dpfm-mae", registered(client, "dpfm-mae", run.run_id, {"budget": "b2", "epsilon": "1.0"})),
                  ("dpfm-mae", registered(client, "dpfm-mae", run.run_id, {"epsilon": "1.0"}))]
        assert run.tag_dp_models({"epsilon": "3.0", "dp_runs_on_data": "2"}, "b1") == 3
        assert run.tag_dp_models({"epsilon": "4.0", "dp_runs_on_data": "3"}) == 0  # no budget, no parent: none
    for name, version in ours:
        tags = client.get_model_version(name, version).tags
        assert (tags["epsilon"], tags["dp_runs_on_data"]) == ("3.0", "2"), (name, version, tags)
    for name, version in others:
        tags = client.get_model_version(name, version).tags
        assert tags["epsilon"] == "1.0" and "dp_runs_on_data" not in tags, (name, version, tags)


def test_versions_registered_under_this_pipelines_parent_are_tagged_and_another_pipelines_are_not(local_mlflow,
                                                                                                   monkeypatch):
    """Without a budget id, the versions this pipeline registered (their runs nested under its parent) are
    its composition's; a version another pipeline registered is not, and keeps what it says."""
    import mlflow

    client = mlflow.tracking.MlflowClient()
    versions, parents = {}, {}
    for pipeline in ("this", "another"):
        parents[pipeline] = tracking.start_parent("dpfm")
        monkeypatch.setenv(tracking.PARENT_ENV, parents[pipeline])
        with tracking.stage_run(STAGE, {"run": {"seed": 0}}, "dpfm") as run:
            versions[pipeline] = registered(client, "dpfm-mae", run.run_id, {"epsilon": "1.0"})
    monkeypatch.setenv(tracking.PARENT_ENV, parents["this"])
    with tracking.stage_run(STAGE, {"run": {"seed": 0}}, "dpfm") as run:
        assert run.tag_dp_models({"epsilon": "3.0"}) == 1
    assert client.get_model_version("dpfm-mae", versions["this"]).tags["epsilon"] == "3.0"
    assert client.get_model_version("dpfm-mae", versions["another"]).tags["epsilon"] == "1.0"


def test_a_not_private_version_stays_so_and_a_composed_epsilon_never_falls_nor_leaves_its_delta(local_mlflow):
    """A later run that finds nothing outside DP does not make a NOT PRIVATE version private again; and a
    version already stating a larger composed ε (at its δ) keeps both: a smaller ε at another δ would
    understate what its examples spent."""
    import mlflow

    client = mlflow.tracking.MlflowClient()
    with tracking.stage_run(STAGE, {"run": {"seed": 0}}, "dpfm") as run:
        public = registered(client, "dpfm-mae", run.run_id, {"budget": "b1", "private": "false", "epsilon": "inf"})
        larger = registered(client, "dpfm-mae", run.run_id, {"budget": "b1", "private": "true", "epsilon": "5.0",
                                                              "delta_composed": "1.00e-06"})
        assert run.tag_dp_models({"private": "true", "epsilon": "3.0", "delta_composed": "2.00e-06"}, "b1") == 1
    kept = client.get_model_version("dpfm-mae", public).tags
    assert (kept["private"], kept["epsilon"]) == ("false", "inf"), kept
    held = client.get_model_version("dpfm-mae", larger).tags
    assert (held["private"], held["epsilon"], held["delta_composed"]) == ("true", "5.0", "1.00e-06"), held


def test_a_version_is_never_seen_without_its_privacy_tags_whatever_fails_after_it_is_created(local_mlflow,
                                                                                              monkeypatch):
    """A version registered first and tagged after: a failure (or a kill) between the two left a published
    version with no ε and no NOT PRIVATE mark. It is created with its tags in one write, so no later tag
    write can leave it bare: any version the registry shows states its verdict and its ε."""
    import mlflow

    def connection_reset(*a, **k):
        raise RuntimeError("connection reset")

    monkeypatch.setattr(mlflow.tracking.MlflowClient, "set_model_version_tag", connection_reset)
    with tracking.stage_run(STAGE, {"run": {"seed": 0}}, "dpfm") as run:
        run.log_dp_model(saved("c.pt"), 2.0, 1e-5, private=False)
    [v] = mlflow.tracking.MlflowClient().search_model_versions("name='dpfm-mae'")
    assert (v.tags["private"], v.tags["epsilon"], v.tags["epsilon_run"]) == ("false", "inf", bound_text(2.0, 4))
