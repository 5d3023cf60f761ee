"""The one-run audit: its lower bound is valid (an exactly ε-DP mechanism exceeds it at most 5% of the
time), a correct engine passes it, and engines broken in clipping or noise are flagged."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

from pipeline import cli
from pipeline.privacy.tools import canary_audit as A
from pipeline.privacy.layer_rules import LinearRule

SMALL = A.AuditConfig(canaries=400, steps=40, expected_batch_size=256, epsilon=1.0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The audit's model is tiny: on a shared CPU, more threads only contend (as `dpfm audit` does)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the statistics ------------------------------------------------------------------------------

def test_all_correct_guesses_give_the_closed_form_bound():
    """δ = 0 and v = r: P[r correct] = p^r with p = e^ε/(1+e^ε), so ε_lower solves p^r = level."""
    for r, level in [(10, 0.05), (200, 0.05), (1000, 0.01)]:
        p = level ** (1 / r)
        assert A.epsilon_lower_bound(r, r, r, 0.0, level) == pytest.approx(math.log(p / (1 - p)), rel=1e-6)


def test_chance_level_guesses_give_no_bound():
    assert A.epsilon_lower_bound(1000, 500, 250, 1e-5, 0.05) == 0.0
    assert A.epsilon_lower_bound(1000, 0, 0, 1e-5, 0.05) == 0.0


def test_delta_weakens_the_bound():
    assert A.epsilon_lower_bound(1000, 500, 480, 1e-3, 0.05) < A.epsilon_lower_bound(1000, 500, 480, 0.0, 0.05)


def test_p_value_refuses_impossible_counts():
    with pytest.raises(ValueError, match="correct"):
        A.p_value(10, 5, 6, 1.0, 0.0)


def _coverage(eps, level, r=200):
    """Exact probability that an exactly ε-DP guesser (randomized response: each of r guesses right
    with probability e^ε/(1+e^ε)) gets a lower bound above its true ε."""
    p = 1 / (1 + math.exp(-eps))
    return sum(stats.binom.pmf(v, r, p) for v in range(r + 1) if A.epsilon_lower_bound(r, r, v, 0.0, level) > eps)


@pytest.mark.parametrize("eps", [0.25, 1.0, 2.0, 4.0])
def test_bound_is_valid_at_95_percent(eps):
    assert 0.01 < _coverage(eps, 0.05) <= 0.05


def test_coverage_check_catches_an_overconfident_bound():
    """The check above can fail: a bound taken at 50% 'confidence' exceeds the true ε far too often."""
    assert _coverage(2.0, 0.5) > 0.3


def test_guess_menu_is_fixed_in_advance_and_bonferroni_corrected():
    scores = np.arange(100.0)
    included = scores >= 50  # perfect separation
    found = A.audit_scores(scores, included, 0.0, 0.95)
    assert found["menu_size"] == len(A.guess_menu(100)) and found["level_per_guess_count"] == pytest.approx(0.05 / found["menu_size"])
    assert found["correct"] == found["guesses"] > 0
    # The best guess count is judged at the corrected level, so it is weaker than an uncorrected one.
    assert found["epsilon_lower"] < A.epsilon_lower_bound(100, found["guesses"], found["correct"], 0.0, 0.05)


# ---- the training run through the engine --------------------------------------------------------

def _expected_gap(result, clip_factor):
    """E[score | in] - E[score | out] and its standard deviation: each sampled step moves an included
    canary's coordinate by lr·C_eff/B, where C_eff is the norm the clipper let through."""
    s = result["settings"]
    lr_b = s["lr"] / s["expected_batch_size"]
    t, q, c_eff = s["steps"], result["sample_rate"], clip_factor * s["clip_norm"]
    sd_noise = lr_b * result["noise_std"] * math.sqrt(t)
    sd_in = math.sqrt(sd_noise ** 2 + (lr_b * c_eff) ** 2 * t * q * (1 - q))
    n_in, n_out = result["included"], s["canaries"] - result["included"]
    return lr_b * c_eff * q * t, math.sqrt(sd_in ** 2 / n_in + sd_noise ** 2 / n_out)


@pytest.fixture(scope="module")
def correct_run():
    return A.run_audit(SMALL, progress=False)


def test_correct_engine_is_consistent(correct_run):
    r = correct_run
    assert r["verdict"] == "consistent"
    assert r["epsilon_lower"] <= r["epsilon_claimed"] <= SMALL.epsilon
    assert r["epsilon_claimed"] >= 0.99 * SMALL.epsilon


def test_canary_gets_through_clipped_to_exactly_c(correct_run):
    """The canaries do reach the update, at norm C: the score gap matches lr·C·q·T/B, and it is
    nowhere near what the unclipped norm (10·C) would give."""
    gap, sd = _expected_gap(correct_run, 1.0)
    assert abs(correct_run["score_gap"] - gap) < 4 * sd
    assert correct_run["score_gap"] < _expected_gap(correct_run, SMALL.canary_gradient_norm)[0] / 3


def test_no_clipping_is_flagged():
    r = A.run_audit(replace(SMALL, clipping_enabled=False), progress=False)
    assert r["verdict"] == "flagged" and r["epsilon_lower"] > r["epsilon_claimed"]
    gap, sd = _expected_gap(r, SMALL.canary_gradient_norm)
    assert abs(r["score_gap"] - gap) < 4 * sd


def test_noise_ten_times_too_small_is_flagged():
    r = A.run_audit(replace(SMALL, noise_scale=0.1), progress=False)
    assert r["verdict"] == "flagged" and r["epsilon_lower"] > r["epsilon_claimed"]


def test_a_bug_in_the_clipper_code_is_flagged(monkeypatch):
    """Not a setting but a code bug: ghost norms of Linear layers under-estimated 10× (so a canary of
    norm 10·C passes unclipped). The audit sees it because canaries go through the real clipper."""
    real = LinearRule.ghost_sq_norm

    def broken(self, m, a, g):  # the ghost path, taken for every Linear, 10× short in norm
        return real(self, m, a, g) / 100

    monkeypatch.setattr(LinearRule, "ghost_sq_norm", broken)
    monkeypatch.setattr(LinearRule, "ghost_is_faster", lambda self, m, a, g: True)
    r = A.run_audit(SMALL, progress=False)
    assert r["verdict"] == "flagged" and r["epsilon_lower"] > r["epsilon_claimed"]


def test_vmap_clipper_is_audited_too():
    ok = A.run_audit(replace(SMALL, clipping="vmap"), progress=False)
    assert ok["verdict"] == "consistent"
    bad = A.run_audit(replace(SMALL, clipping="vmap", clipping_enabled=False),
                      progress=False)
    assert bad["verdict"] == "flagged"


@pytest.mark.parametrize("change, message", [
    ({"canaries": 1}, "canaries=1 must be ≥ 2"),
    ({"delta": 0.5}, "delta"),
    ({"canary_gradient_norm": 0.5}, "canary_gradient_norm=0.5"),
    ({"clipping": "ghost"}, "clipping='ghost' is not a per-sample clipping method"),
])
def test_bad_settings_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        A.run_audit(replace(SMALL, **change), progress=False)


def test_dpfm_audit_prints_verdict_writes_json_and_exits_nonzero_when_flagged(tmp_path, capsys):
    args = ["audit", "--one-run", "--canaries", "400", "--steps", "40", "--batch-size", "256", "--epsilon", "1"]
    assert cli.main(args + ["--json", str(tmp_path / "audit.json")]) == 0
    out = capsys.readouterr().out
    assert "ε claimed" in out and "ε lower" in out and "consistent" in out
    saved = json.loads((tmp_path / "audit.json").read_text())
    assert saved["verdict"] == "consistent" and saved["epsilon_lower"] <= saved["epsilon_claimed"]
    assert cli.main(args + ["--noise-scale", "0.1"]) == 1
    assert "FLAGGED" in capsys.readouterr().out
