"""The one-run audit: its lower bound is valid (an exactly ε-DP mechanism exceeds it at most 5% of the
time), a correct engine passes it, and engines broken in clipping or noise are flagged; its settings are
refused at their bounds, its p-value keeps its 2mδ term and its canaries are in with probability ½."""

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
    for r, level in [(10, 0.05), (200, 0.05), (1000, 0.01), (20000, 0.05)]:  # the last: ε_lower ≈ 8.8
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


# ---- settings, p-value terms, guesses and the CLI's defaults (from a mutation audit) -----------------------

@pytest.mark.parametrize("change, message", [
    ({"steps": 0}, "steps=0 must be ≥ 1"),
    ({"expected_batch_size": 0}, "expected_batch_size=0 must be ≥ 1"),
    ({"physical_batch_size": 0}, "physical_batch_size=0 must be ≥ 1"),
    ({"noise_scale": 0.0}, "noise_scale=0.0 must be > 0"),
    ({"lr": 0.0}, "lr=0.0 must be > 0"),
    ({"confidence": 0.3}, r"confidence=0.3 must be in \[0.5, 1\)"),
    ({"delta": 0.0}, r"delta=0.0 must be in \(0, 1\)"),
])
def test_audit_settings_refuse_each_value_out_of_range(change, message):
    with pytest.raises(ValueError, match="audit settings are invalid: " + message):
        A.AuditConfig(**change).check()


def test_audit_settings_accept_their_bounds_and_name_every_problem_at_once():
    A.AuditConfig(canaries=2, steps=1, canary_gradient_norm=1.0, confidence=0.5).check()
    with pytest.raises(ValueError, match="canaries=1 must be ≥ 2; steps=0 must be ≥ 1"):
        A.AuditConfig(canaries=1, steps=0).check()


def test_p_value_has_the_two_m_delta_term_of_steinke_et_al():
    """ε = 0, m = r = v: β = 2^-v; α = max_i P[v-i ≤ Bin(r, ½) < v]/i. By hand:
    v = 1: 0.5 + 0.5·δ·2; v = 2: 0.25 + max(0.5/1, 0.75/2)·δ·4."""
    assert A.p_value(1, 1, 1, 0.0, 0.1) == pytest.approx(0.6)
    assert A.p_value(2, 2, 2, 0.0, 0.1) == pytest.approx(0.45)
    with pytest.raises(ValueError, match="canaries"):
        A.p_value(3, 4, 2, 1.0, 0.0)  # more guesses than canaries


def test_scores_at_chance_report_no_guess_count():
    """Equal scores, every other canary in: no guess count beats chance, so none is reported."""
    included = np.arange(100) % 2 == 0
    found = A.audit_scores(np.zeros(100), included, 1e-5, 0.95)
    assert found["epsilon_lower"] == 0.0
    assert (found["guesses"], found["correct"], found["k_in"], found["k_out"]) == (0, 0, 0, 0)


def test_guess_menu_for_100_canaries():
    assert A.guess_menu(100) == [(1, 0), (2, 0), (5, 0), (5, 5), (10, 0), (10, 10), (20, 0), (25, 25), (50, 0),
                                 (50, 50)]


def test_perfect_separation_is_best_used_by_guessing_both_ends():
    """Scores that separate in from out perfectly: the widest two-sided guess (50 in, 50 out) is all correct."""
    scores = np.arange(100.0)
    found = A.audit_scores(scores, scores >= 50, 0.0, 0.95)
    assert (found["k_in"], found["k_out"], found["guesses"], found["correct"]) == (50, 50, 100, 100)


def test_sample_rate_is_fixed_by_the_expected_count_and_too_large_a_batch_is_refused():
    """1797 digits + m/2 expected canaries: with m = 10, q = B / 1802."""
    r = A.run_audit(A.AuditConfig(canaries=10, steps=1, expected_batch_size=10, physical_batch_size=16), progress=False)
    assert r["sample_rate"] == pytest.approx(10 / 1802)
    assert r["n"] == 1797 + r["included"]
    with pytest.raises(ValueError, match="expected_batch_size=2000 exceeds the 1802 expected examples"):
        A.run_audit(A.AuditConfig(canaries=10, steps=1, expected_batch_size=2000), progress=False)


def test_dpfm_audit_one_run_defaults_and_named_faults(monkeypatch, capsys):
    seen = []

    def fake(cfg):
        seen.append(cfg)
        return {"included": 1, "sample_rate": 0.1, "sigma": 1.0, "epsilon_claimed": 2.0, "epsilon_lower": 0.0,
                "guesses": 0, "correct": 0, "k_in": 0, "k_out": 0, "verdict": "consistent", "seconds": 0.0}

    monkeypatch.setattr(A, "run_audit", fake)
    assert cli.main(["audit", "--one-run"]) == 0
    cfg = seen[-1]
    assert (cfg.canaries, cfg.steps, cfg.expected_batch_size, cfg.epsilon, cfg.delta, cfg.confidence, cfg.seed) == \
        (5000, 300, 512, 2.0, 1e-5, 0.95, 0)
    assert (cfg.clipping, cfg.clipping_enabled, cfg.noise_scale, cfg.canary_gradient_norm, cfg.clip_norm) == \
        ("bookkeeping", True, 1.0, 10.0, 1.0)
    assert "faults injected" not in capsys.readouterr().out
    assert cli.main(["audit", "--one-run", "--noise-scale", "0.5", "--no-clipping"]) == 0
    assert seen[-1].noise_scale == 0.5 and seen[-1].clipping_enabled is False
    assert "faults injected: clipping disabled, noise ×0.5" in capsys.readouterr().out


def test_dpfm_audit_one_run_bad_settings_exit_2_naming_them(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["audit", "--one-run", "--canaries", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "canaries=1 must be ≥ 2" in err and "Traceback" not in err


def test_each_canary_is_included_with_probability_one_half():
    """The p-value assumes in/out with probability ½ each: of 4000 canaries, 2000 ± 4 sd (sd ≈ 32) are in."""
    r = A.run_audit(A.AuditConfig(canaries=4000, steps=1, expected_batch_size=10), progress=False)
    assert abs(r["included"] - 2000) < 130
