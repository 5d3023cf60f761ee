"""The accounting CLI (pipeline/privacy/tools/accounting_cli.py): ε, calibration, bad combinations
named, delta = 1/n with a warning, and its commands on a foreign parser."""

import argparse
import json

import pytest

from pipeline.privacy import accounting as acc
from pipeline.privacy.tools.accounting_cli import add_accounting_commands, main


def test_cli_epsilon_text(capsys):
    rc = main(["epsilon", "--sigma", "1.0", "--steps", "1000", "--batch-size", "100",
               "--n", "10000", "--delta", "1e-5", "--adjacency", "add_remove"])
    assert rc == 0
    out = capsys.readouterr().out
    expected = acc.epsilon(1.0, 0.01, 1000, 1e-5)
    assert f"epsilon[pld] = {acc.bound_text(expected, 4)}" in out  # the bound, rounded up
    assert float(out.split("epsilon[pld] = ")[1].split()[0]) >= expected


def test_cli_epsilon_json_all(capsys):
    rc = main(["epsilon", "--sigma", "1.0", "--steps", "1000", "--sample-rate", "0.01",
               "--n", "100000", "--delta", "1/2n", "--accountant", "all", "--adjacency", "add_remove", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["delta"] == pytest.approx(5e-6)
    assert set(data["epsilon"]) == {"pld", "rdp", "prv"}
    for name, value in data["epsilon"].items():
        assert value == pytest.approx(acc.epsilon(1.0, 0.01, 1000, 5e-6, accountant=name), rel=1e-9)


def test_cli_calibrate(capsys):
    argv = ["calibrate", "--epsilon", "2", "--steps", "500", "--sample-rate", "0.01",
            "--delta", "1e-5", "--accountant", "rdp", "--adjacency", "add_remove"]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    sigma = data["sigma"]["rdp"]
    assert sigma == pytest.approx(acc.calibrate_sigma(2.0, 0.01, 500, 1e-5, accountant="rdp"))
    assert 0.995 * 2 <= data["epsilon"]["rdp"] <= 2
    assert main(argv) == 0
    out = capsys.readouterr().out
    printed = float(out.split("sigma[rdp] = ")[1].split()[0])
    # Printed sigma is rounded up, so it never exceeds the target.
    assert sigma <= printed <= sigma + 1e-6
    assert acc.epsilon(printed, 0.01, 500, 1e-5, accountant="rdp") <= 2


@pytest.mark.parametrize(
    "argv,message",
    [
        (["epsilon", "--sigma", "1", "--steps", "10", "--batch-size", "10", "--delta", "1e-5"],
         "--batch-size needs --n"),
        (["epsilon", "--sigma", "1", "--steps", "10", "--sample-rate", "0.1", "--delta", "1/2n"],
         "needs --n"),
        (["epsilon", "--sigma", "1", "--steps", "10", "--delta", "1e-5"],
         "--sample-rate or --batch-size"),
        (["epsilon", "--sigma", "1", "--steps", "10", "--sample-rate", "0.1",
          "--batch-size", "10", "--n", "100", "--delta", "1e-5"], "not allowed with"),
        (["epsilon", "--sigma", "-1", "--steps", "10", "--sample-rate", "0.1",
          "--delta", "1e-5"], "sigma"),
        (["calibrate", "--epsilon", "1", "--steps", "0", "--sample-rate", "0.1",
          "--delta", "1e-5"], "steps=0"),
    ],
)
def test_cli_bad_combinations(argv, message, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_accepts_delta_1_over_n_with_a_warning_and_matches_dp_accounting(capsys):
    """DP-Cap's published configuration (δ = 1/n) can be reproduced; training keeps δ < 1/n."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    argv = ["epsilon", "--sigma", "0.728", "--steps", "5708", "--batch-size", "1310720", "--n", "233804767",
            "--delta", "1/n", "--adjacency", "add_remove", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "delta=4.27707e-09 >= 1/n" in out.err and "dp-train requires delta < 1/n" in out.err
    got = json.loads(out.out)["epsilon"]["pld"]
    q = 1310720 / 233804767
    ref = pld.from_gaussian_mechanism(0.728, sampling_prob=q, value_discretization_interval=1e-4,
                                      pessimistic_estimate=True).self_compose(5708).get_epsilon_for_delta(1 / 233804767)
    assert ref <= got <= ref * (1 + 1e-3)  # an upper bound, within the 0.1% refinement tolerance
    with pytest.raises(ValueError, match="1/n"):
        acc.check_delta(1 / 233804767, 233804767)  # what dp-train applies


def test_cli_registers_on_foreign_parser(capsys):
    parser = argparse.ArgumentParser(prog="dpfm")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train")  # the pipeline's own commands live alongside
    add_accounting_commands(sub)
    args = parser.parse_args(["epsilon", "--sigma", "1", "--steps", "100",
                              "--sample-rate", "0.01", "--delta", "1e-5", "--adjacency", "add_remove", "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["epsilon"]["pld"] == pytest.approx(
        acc.epsilon(1.0, 0.01, 100, 1e-5)
    )
