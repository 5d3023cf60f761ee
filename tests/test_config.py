import pytest
import yaml

from pipeline.cli import main
from pipeline.config import ParamsError, apply_overrides, load_params


def errors_for(*overrides):
    with pytest.raises(ParamsError) as e:
        load_params(overrides=list(overrides))
    return e.value.problems


def test_default_params_are_valid(in_tmp):
    params = load_params()
    assert params["dp"]["epsilon"] == 8.0


@pytest.mark.parametrize("override, expected", [
    ("dp.epsilon=eight", "dp.epsilon: 'eight' is not allowed (type); allowed: number > 0 and <= 100"),
    ("dp.epsilon=-1", "dp.epsilon: -1 is not allowed (exclusiveMinimum); allowed: number > 0 and <= 100"),
    ("dp.epsilon=1000", "dp.epsilon: 1000 is not allowed (maximum); allowed: number > 0 and <= 100"),
    ("dp.objective=simclr", "dp.objective: 'simclr' is not allowed (enum); allowed: one of mae, caption, clip"),
    ("dp.delta=1.5", "dp.delta: 1.5 is not allowed (oneOf); allowed: number > 0 and < 1 or one of 1/n, 1/2n"),
    ("pretrain.steps=1.5", "pretrain.steps: 1.5 is not allowed (type); allowed: integer >= 0"),
    ("verify.accountants=[pld]", "verify.accountants: ['pld'] is not allowed (minItems)"),
])
def test_each_violation_names_key_and_allowed_values(in_tmp, override, expected):
    problems = errors_for(override)
    assert len(problems) == 1
    assert problems[0].startswith(expected)


def test_unknown_key_lists_allowed_keys(in_tmp):
    (problem,) = errors_for("dp.epsilom=3")
    assert problem.startswith("unknown key dp.epsilom (allowed keys: accountant, checkpoint_every, clip_norm, clipping, delta,")


def test_unknown_section(in_tmp):
    params = yaml.safe_load(open("params.yaml"))
    params["optim"] = {"lr": 1}
    yaml.safe_dump(params, open("params.yaml", "w"))
    (problem,) = errors_for()
    assert problem.startswith("unknown key optim (allowed keys: dp, evaluate, model,")


def test_missing_key(in_tmp):
    params = yaml.safe_load(open("params.yaml"))
    del params["dp"]["clip_norm"]
    yaml.safe_dump(params, open("params.yaml", "w"))
    assert errors_for() == ["missing key dp.clip_norm"]


def test_overrides_parse_yaml_values():
    out = apply_overrides({"dp": {"epsilon": 8, "sigma": 1.0}}, ["dp.epsilon=3", "dp.sigma=null"])
    assert out == {"dp": {"epsilon": 3, "sigma": None}}


def test_bad_override_syntax():
    with pytest.raises(ParamsError, match="expected section.key=value"):
        apply_overrides({}, ["dp.epsilon"])


def test_cli_reports_errors_before_any_work(in_tmp, capsys):
    assert main(["shards", "--set", "shards.eval_fraction=2"]) == 2
    err = capsys.readouterr().err
    assert "shards.eval_fraction: 2 is not allowed (exclusiveMaximum); allowed: number > 0 and < 1" in err
    assert not (in_tmp / "data").exists()
    assert not (in_tmp / "mlflow.db").exists()
