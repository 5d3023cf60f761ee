"""benchmarks/dp_time_breakdown.py: each rule method's time counts once, for the outermost call."""

from __future__ import annotations

import benchmarks.dp_time_breakdown as breakdown
from pipeline.privacy.layer_rules import LayerRule


class Rule(LayerRule):
    """clipped_sum built from per_sample, as LayerRule's default is: its time is the clipped sum's."""

    def per_sample(self, m, a, g):
        breakdown.time.tick += 2
        return {}

    def ghost_sq_norm(self, m, a, g):
        breakdown.time.tick += 5
        return None

    def clipped_sum(self, m, a, g, factors):
        breakdown.time.tick += 1
        return self.per_sample(m, a, g)


class Clock:
    tick = 0

    def perf_counter(self):
        return self.tick


def test_nested_rule_calls_count_for_the_outer_phase_only(monkeypatch):
    monkeypatch.setattr(breakdown, "time", Clock())
    rule, clock = Rule(), breakdown.PhaseClock()
    clock.wrap([rule])
    rule.per_sample(None, None, None)  # not measuring: not counted
    with clock.measuring() as seconds:
        rule.per_sample(None, None, None)
        rule.ghost_sq_norm(None, None, None)
        rule.clipped_sum(None, None, None, None)
    assert seconds == {"per_sample": 2, "ghost_sq_norm": 5, "clipped_sum": 3}
    assert sum(seconds.values()) == breakdown.time.tick - 2  # every tick inside is counted, once
