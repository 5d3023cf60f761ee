"""The per-dataset privacy budget: runs on one dataset compose, a resumed run is charged once."""

from __future__ import annotations

import pytest

from pipeline.privacy import accounting, budget

SIGMA, Q, STEPS, DELTA = 0.9, 0.01, 300, 1e-6


def entry(run, steps=STEPS, sigma=SIGMA):
    return {"run": run, "objective": "mae", "sigma": sigma, "sample_rate": Q, "planned_steps": steps, "delta": DELTA,
            "n": 10_000}


def test_two_runs_compose_to_one_run_of_both_lengths(in_tmp):
    budget.record("data1", "run-a", entry("run-a"))
    budget.record("data1", "run-a", entry("run-a"))  # a resume: the same run, charged once
    budget.record("data1", "run-b", entry("run-b"))
    budget.record("data2", "run-c", entry("run-c"))  # other data: not composed with data1
    runs = budget.runs("data1")
    assert [e["run"] for e in runs] == ["run-a", "run-b"]
    composed = budget.composed_epsilon(runs, DELTA)
    # The same mechanism twice is the mechanism run for twice the steps.
    assert composed == pytest.approx(accounting.epsilon(SIGMA, Q, 2 * STEPS, DELTA), rel=5e-3)
    assert composed > accounting.epsilon(SIGMA, Q, STEPS, DELTA) * 1.2


def test_a_lone_run_composes_to_its_own_epsilon(in_tmp):
    budget.record("d", "r", entry("r"))
    assert budget.composed_epsilon(budget.runs("d"), DELTA) == accounting.epsilon(SIGMA, Q, STEPS, DELTA)


def test_different_mechanisms_compose_between_their_parts(in_tmp):
    small, big = entry("a", sigma=2.0), entry("b", sigma=0.8)
    parts = [budget.composed_epsilon([e], DELTA) for e in budget_entries([small, big])]
    both = budget.composed_epsilon(budget_entries([small, big]), DELTA)
    assert max(parts) < both < sum(parts) * 1.01


def budget_entries(entries):
    return [{**e, "steps": e["planned_steps"]} for e in entries]


def test_a_torn_last_line_is_ignored(in_tmp):
    budget.record("d", "r", entry("r"))
    with open(budget.BUDGET_DIR / "d.jsonl", "a") as f:
        f.write('{"run": "half')
    assert [e["run"] for e in budget.runs("d")] == ["r"]
