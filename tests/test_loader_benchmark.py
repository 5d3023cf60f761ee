"""benchmarks/loader.py's verdict reads the ratio of the loader's rate to the step's, not a rate."""

from benchmarks.loader import TARGET_RATIO, keeps_up


def row(ratio, streamed=1935.0):
    consumed = 1993.0
    return {"res": 224, "parallel": ratio * consumed, "single": 464.0, "consumed": consumed,
            "streamed": streamed, "ratio": ratio}


def test_the_target_is_missed_when_any_resolution_falls_short_of_the_ratio():
    # the H200's figures of 2026-11-27 (ViT-B): 1.8x and 2.0x, which a verdict on the fed rate called met
    assert not keeps_up([row(1.81, 9455.0), row(1.95)])
    assert not keeps_up([row(TARGET_RATIO + 1), row(TARGET_RATIO - 0.1)])
    assert keeps_up([row(TARGET_RATIO), row(TARGET_RATIO + 2)])


def test_the_benchmark_prints_missed_for_the_h200_figures(monkeypatch, capsys):
    """The whole report, its rates stubbed with the H200's ViT-B figures (the measuring is the
    benchmark's job, not a test's): the table, the verdict line and the JSON agree on the ratio."""
    import torch

    from benchmarks import loader

    rates = {(64, "parallel"): 22364.1, (64, "single"): 1136.1, (224, "parallel"): 3890.0, (224, "single"): 464.0}
    monkeypatch.setattr(loader, "make_shards", lambda tmp, count: None)
    monkeypatch.setattr(loader, "loader_rate",
                        lambda ds, res, workers, *a: rates[res, "parallel" if workers else "single"])
    monkeypatch.setattr(loader, "dp_stepper", lambda res, *a: res)
    monkeypatch.setattr(loader, "dp_step_rate", lambda step, *a: {64: 12326.13, 224: 1993.11}[step])
    monkeypatch.setattr(loader, "streamed_rate", lambda step, *a: {64: 9454.96, 224: 1935.25}[step])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    result = loader.main(["--quick", "--workers", "12"])
    out = capsys.readouterr().out
    verdict = next(line for line in out.splitlines() if line.startswith("target:"))
    assert "MISSED" in verdict and ": met" not in verdict
    assert result["targets_met"] is False and result["ratio_224"] == 1.95
    assert "1935.25 (97%)" in out
