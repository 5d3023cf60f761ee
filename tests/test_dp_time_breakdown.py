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


def test_per_layer_times_group_like_layers_with_their_shapes_and_multiply_adds(monkeypatch):
    import torch
    import torch.nn as nn

    monkeypatch.setattr(breakdown, "time", Clock())
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(4, 6), "norm": nn.LayerNorm(6)}) for _ in range(2))
    rule, clock = Rule(), breakdown.PhaseClock()
    clock.wrap([rule])
    a, g, h = torch.zeros(3, 5, 4), torch.zeros(3, 5, 6), torch.zeros(3, 5, 6)
    rounds = []
    for _ in range(3):
        with clock.measuring():
            for block in model.blocks:
                rule.ghost_sq_norm(block["fc"], a, g)       # 5 ticks each
                rule.clipped_sum(block["fc"], a, g, None)   # 1 + 2 ticks: the outer method's
                rule.per_sample(block["norm"], h, h)        # 2 ticks
        rounds.append(dict(clock.layers))
    rows = breakdown.layer_rows(model, rounds, clock.shapes)
    assert [r["layer"] for r in rows] == ["blocks.*.fc", "blocks.*.norm"]  # the slowest first
    fc, norm = rows
    assert fc["count"] == 2 and fc["route"] == "ghost" and (fc["tokens"], fc["d"], fc["p"]) == (5, 4, 6)
    assert fc["seconds"] == {"ghost_sq_norm": 10, "per_sample": 0, "clipped_sum": 6}
    assert fc["gram_macs"] == 2 * 3 * 5 * 5 * (4 + 6) and fc["gemm_macs"] == 2 * 3 * 5 * 4 * 6
    assert norm["route"] == "per-example" and norm["seconds"]["per_sample"] == 4 and "tokens" not in norm
