"""The report: content, self-containment, the privacy-utility points from MLflow, and a real render
in headless Chromium (no console errors; the screenshot shows the accuracy table)."""

import json
import math
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from matplotlib.axes import Axes
from PIL import Image

from pipeline.report import accuracy as report_accuracy, content, curves as report_curves, plots
from pipeline.report import privacy as report_privacy, render as report_render
from pipeline.stages import report, stage
from pipeline.report.render import TABLE_HEAD_COLOR
from pipeline.io import read_json, write_json
from pipeline.privacy.plan import Plan
from pipeline.errors import VerificationFailed
from pipeline.privacy import accounting
from pipeline.privacy.accounting import bound_text
from recording import RecordingTracker

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def history(key, steps):
    return {"step": list(steps), "metrics": [{key: 3.0 / (1 + s)} for s in steps]}


def check(name, passed=True):
    return {"name": name, "passed": passed, "detail": f"{name} detail"}


def metrics_json():
    few = {"1": {"mean": 0.3, "std": 0.05, "runs": [0.25, 0.35]},
           "10": {"mean": 0.7, "std": 0.01, "runs": [0.69, 0.71]}}
    results = {"dp": {"linear_probe": 0.822, "linear_probe_ci": [0.774, 0.867], "fewshot_logreg": few,
                      "zero_shot": 0.41, "zero_shot_ci": [0.352, 0.47]},
               "nonprivate": {"linear_probe": 0.9, "linear_probe_ci": [0.863, 0.933], "fewshot_logreg": few,
                              "zero_shot": 0.6, "zero_shot_ci": [0.541, 0.659]},
               "synthetic": {"linear_probe": 0.804, "linear_probe_ci": [0.756, 0.852], "fewshot_logreg": few},
               "pixels": {"linear_probe": 0.85, "linear_probe_ci": [0.807, 0.889], "fewshot_logreg": few},
               "random": {"linear_probe": 0.5, "linear_probe_ci": [0.441, 0.559], "fewshot_logreg": few,
                          "zero_shot": 0.1, "zero_shot_ci": [0.067, 0.137]}}
    versus = {"nonprivate": {"diff": -0.078, "ci": [-0.111, -0.044]},
              "synthetic": {"diff": 0.018, "ci": [-0.011, 0.048]},
              "pixels": {"diff": -0.028, "ci": [-0.07, 0.015]},
              "random": {"diff": 0.322, "ci": [0.27, 0.374]}}
    labels = {"dp": "DP (DP-Cap)", "nonprivate": "Not private (DP-Cap without DP, ε = ∞)",
              "synthetic": "Synthetic only (Syn-ViP)", "pixels": "Raw pixels (no encoder)", "random": "Random init"}
    return {"primary_set": "digits", "objective": "caption", "model_order": list(labels),
            "models": {k: {"label": v, "source": "x"} for k, v in labels.items()},
            "protocol": {"pool": "cls", "last_k_blocks": 1, "probe_fraction": 0.5, "probe_solver": "logreg",
                         "probe_c": 1.0, "fewshot": {"shots": [1, 10], "repeats": 2},
                         "finetune": {"enabled": False, "repeats": 1}, "zero_shot": True},
            "privacy": {"run": "this", "epsilon": 7.99, "delta": 4e-4, "accountant": "pld"},
            "sets": {"digits": {"classes": [str(i) for i in range(10)], "n_probe_train": 269, "n_probe_test": 270,
                                "chance": 0.102, "results": results, "dp_versus": versus}}}


OWNER_BATCH_SIZES = [131, 137, 139] * 13 + [149]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A finished run's report inputs, and an empty MLflow store."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    write_json("results/privacy/verification.json", {
        "passed": True, "checks": [check("sampler_is_poisson"), check("epsilon_within_target")], "run": "this",
        "epsilon": {"pld": 7.99, "rdp": 9.6}, "epsilon_reported": 7.99, "accountant": "pld", "delta": 4e-4,
        "steps": 40, "sigma": 0.67, "sample_rate": 0.1, "n": 1258,
        "epsilon_curve": {"pld": [[1, 2.3], [20, 5.8], [40, 7.99]], "rdp": [[1, 3.1], [20, 7.3], [40, 9.6]]}})
    plan = Plan(objective="caption", clipping="per_sample", n=1258, sample_rate=0.1, sigma=0.67, clip_norm=1.0,
                steps=40, delta=4e-4, accountant="pld", adjacency="replace_one", target_epsilon=8.0, epsilon=7.99)
    from pipeline.privacy import budget

    budget.registry_id()  # the budget dp-train charged (its key): composing without one would be refused
    write_json("models/dp/ledger.json", {**plan.header(), "steps": 40, "epsilon": 7.99, "run": "this"})
    from pipeline.privacy import owner  # the run's owner-only record, of figures no report may print
    owner.write(owner.run_record("this"), {"batch_sizes": OWNER_BATCH_SIZES, "nonfinite_examples": 7919,
                                           "batch_size_p_values": {"mean": 0.318309}})
    write_json("results/eval/metrics.json", metrics_json())
    write_json("models/pretrain/history.json", history("loss", range(0, 300, 20)))
    write_json("models/dp/history.json", history("heldout_loss", range(0, 40, 10)))
    Path("data/synthetic").mkdir(parents=True)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
        "data/synthetic/contact_sheet.png")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["dp"]["noise_seed"] = 123456
    # Reading MLflow is tested on its own below; here it would only add a fresh database's set-up time.
    monkeypatch.setattr(report, "experiment_points", lambda *_: ([], "MLflow not read in this test"))
    return tmp_path, params


def test_report_has_the_table_privacy_and_figures_and_is_self_contained(project, monkeypatch):
    from pipeline.report import plots

    root, params = project
    tracker, drawn, plot_accuracy = RecordingTracker(), [], plots.plot_accuracy
    monkeypatch.setattr(plots, "plot_accuracy", lambda columns, rows, *a: drawn.append([r["label"] for r in rows])
                        or plot_accuracy(columns, rows, *a))
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=tracker))
    out = root / "results/report"
    page, md = (out / "report.html").read_text(), (out / "report.md").read_text()
    for text in ("(ε = 7.99, δ = 4.00e-04 = 1/2n)-DP", "2 of 2 checks passed", "PLD ε = 7.990", "RDP ε = 9.600",
                 "82.2 (77.4–86.7)", "90.0", "80.4", "50.0", "30.0 ± 5.0", "Zero-shot", "1-shot", "10-shot",
                 "DP (DP-Cap)", "Raw pixels (no encoder)", "41.0 (35.2–47.0)",
                 "per averaged coordinate std/B = 0.00533 (σ/B = 0.00533)",  # 0.67 / (0.1 · 1258)
                 "drawn to 12.12 std",  # the noise's edge (privacy/noise_edge.py)
                 "over its 40 steps std/(B·√T) = 0.000842"):  # ÷ √40
        assert text in page and text in md, text
    # Rows keep the evaluate stage's order (the JSON itself is key-sorted).
    table = page[page.index("<table class='acc'"):]
    rows = [table.index(m) for m in ("DP (DP-Cap)", "Not private", "Synthetic only", "Raw pixels", "Random init")]
    assert rows == sorted(rows)
    # Every DP accuracy beside its noise; every card's accuracy with its interval.
    assert "| DP (DP-Cap) (σ/B = 0.00533) | 82.2 (77.4–86.7) |" in md and "DP (DP-Cap) (σ/B = 0.00533)" in page
    assert drawn and all("DP (DP-Cap) (σ/B = 0.00533)" in labels for labels in drawn), drawn  # in the figure too
    assert md.count("95% CI") >= len(metrics_json()["models"]) + 1, md  # the cards' and the headline's
    for name, row in metrics_json()["sets"]["digits"]["results"].items():  # each card its own model's interval
        lo, hi = (100 * end for end in row["linear_probe_ci"])
        label = metrics_json()["models"][name]["label"]
        assert f"| {label} | **{100 * row['linear_probe']:.1f}%** | 95% CI {lo:.1f}–{hi:.1f}%; " in md, name
    assert "123456" not in page and "123456" not in md  # a known noise seed would undo the noise
    text = re.sub(r"base64,[A-Za-z0-9+/=]+", "", page + md)  # the figures' bytes hold every number by chance
    for private in ("7919", "131", "137", "139", "149", "0.318"):  # the owner's record (dp.log_private_stats unset)
        assert not re.search(rf"(?<![\d.]){re.escape(private)}(?!\d)", text), private
    assert "objective: mae" in page  # the params of the run are shown
    # Nothing is fetched: every image is inlined and no attribute points anywhere.
    sources = re.findall(r'\b(?:src|href)\s*=\s*["\']([^"\']*)', page)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    assert "<script" not in page and "<link" not in page
    for name in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md):  # Markdown images sit beside it
        assert (out / name).is_file(), name
    assert tracker.artifacts == [("results/report", "report"), ("results/privacy/privacy.json", None)]


def test_a_verification_of_another_dp_run_is_refused(project):
    """dp-train run again (another ε, the same steps) and the report run by hand before verify: the
    verification left would state the earlier run's ε for the new model."""
    root, params = project
    ver = json.loads((root / "results/privacy/verification.json").read_text())
    write_json("results/privacy/verification.json", {**ver, "run": "an earlier run"})
    write_json("results/privacy/privacy.json", {"private": True, "epsilon_composed": 1.0, "runs": 1})  # earlier
    with pytest.raises(VerificationFailed, match="another DP run"):
        report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    assert not (root / "results/report").exists()
    assert not (root / "results/privacy/privacy.json").exists(), "an earlier run's final ε outlived the refusal"


def test_an_evaluation_of_another_dp_run_is_refused(project):
    """dp-train and verify run again (another ε), evaluate not: the accuracies left are the earlier
    model's, and the report would put them beside the new run's ε."""
    root, params = project
    metrics = metrics_json()
    write_json("results/eval/metrics.json", {**metrics, "privacy": {**metrics["privacy"], "run": "earlier"}})
    with pytest.raises(VerificationFailed, match="metrics.json was made for another DP run .* run `dpfm evaluate`"):
        report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    assert not (root / "results/report").exists()


def test_every_epsilon_and_delta_the_report_states_is_rounded_up(project):
    """The accountant's ε = 7.98449 is a bound; "7.98" would state a smaller one. Every figure the
    report shows of ε or δ is rounded up (accounting.bound_text), in both renderings and the captions."""
    from pipeline.report import plots

    root, params = project
    ver = json.loads((root / "results/privacy/verification.json").read_text())
    ver.update({"epsilon": {"pld": 7.98449, "rdp": 9.60001}, "epsilon_reported": 7.98449, "delta": 3.97452e-4})
    write_json("results/privacy/verification.json", ver)
    finals, plot_epsilon = [], plots.plot_epsilon
    with pytest.MonkeyPatch.context() as m:
        m.setattr(plots, "plot_epsilon", lambda curves, target, final, *a: finals.append(final)
                  or plot_epsilon(curves, target, final, *a))
        report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    page, md = ((root / "results/report" / f).read_text() for f in ("report.html", "report.md"))
    for text in ("(ε = 7.99, δ = 3.98e-04 = 1/2n)-DP", "PLD ε = 7.985", "RDP ε = 9.601", "at δ = 3.98e-04",
                 "PLD 7.9845, RDP 9.6001 (target 8.0)", "σ = 0.67 at ε = 7.99"):
        assert text in page and text in md, text
    assert not re.search(r"ε = 7\.98\b|3\.97e-04|ε = 9\.600|RDP 9\.6000", page + md)
    # Every ε the report states is the verified one (never the target 8), or 0 and ∞ for the baselines.
    stated = set(re.findall(r"ε = ([\d.]+)", re.sub(r"base64,[A-Za-z0-9+/=]+", "", page + md)))
    assert stated <= {"7.99", "7.985", "9.601", "0"}, stated
    assert finals == [(40, 7.98449)]  # the ε figure's end point


def test_the_owners_composition_is_computed_on_request_and_no_stage_reads_which_sets_overlap(project, monkeypatch):
    """Which sets share examples is a fact about the private data, and so is how long composing only the
    runs on them takes (measured: 0.007 s when every run overlaps, 0.34 s when one example is replaced),
    while a stage's wall time is published. The report and verify compose every run charged without
    looking at the overlaps (verify: tests/test_verify.py); `dpfm owner-composition` writes the owner's
    figure when asked."""
    from pipeline import cli
    from pipeline.privacy import budget

    root, params = project
    ledger = read_json(root / "models/dp/ledger.json")
    sketch = np.zeros(1 << budget.SKETCH_BITS, dtype=bool)
    sketch[:3] = True
    for key, run in enumerate(("earlier", "this")):
        budget.record("set-a", sketch, run, Plan.from_header(ledger), key)
    write_json("models/dp/ledger.json", {**ledger, "run": "this", "data_identity": "set-a"})

    def overlaps(*args, **kw):
        raise AssertionError("a published stage read which sets share examples")

    with monkeypatch.context() as m:
        m.setattr(budget, "_load_sketch", overlaps)
        report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    kept = root / ".dpfm/owner/composition.json"
    assert not kept.exists()
    assert cli.main(["owner-composition"]) == 0
    assert read_json(kept)["runs"] == 2 and kept.stat().st_mode & 0o077 == 0


def test_failed_verification_is_the_first_thing_the_report_says(project):
    root, params = project
    ver = yaml.safe_load(Path("results/privacy/verification.json").read_text())
    ver["passed"], ver["checks"] = False, [check("sampler_is_poisson", passed=False)]
    write_json("results/privacy/verification.json", ver)
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    page = (root / "results/report/report.html").read_text()
    assert "class='verdict bad'" in page and "FAILED" in page and "0 of 1 checks passed" in page
    assert "✘ FAIL" in page


def test_privacy_utility_points_come_from_finished_mlflow_runs(local_mlflow, tmp_path):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = mlflow.tracking.MlflowClient()
    exp = client.create_experiment("dpfm")

    def stage_run(stage, parent, metrics, tags=(), params=(), status="FINISHED"):
        run = client.create_run(exp, tags={"dpfm.stage": stage, "mlflow.parentRunId": parent, **dict(tags)})
        for k, v in metrics.items():
            client.log_metric(run.info.run_id, k, v)
        for k, v in dict(params).items():
            client.log_param(run.info.run_id, k, v)
        client.set_terminated(run.info.run_id, status)

    digits = {"dpfm.primary_set": "digits", "dpfm.adjacency": "replace_one"}
    # An older pipeline: evaluate logged no ε (it comes from the dp-train run of the same parent), no set
    # tag (its logged evaluate.sets names it) and no adjacency tag (its logged params give it).
    stage_run("dp-train", "p1", {"epsilon": 2.0}, params={"dp.objective": "clip"})
    stage_run("evaluate", "p1", {"dp_linear_probe_acc": 0.6}, {"dvc.input.models/dp": "h1"},
              params={"evaluate.sets": '[{"name": "digits", "source": "digits"}]', "privacy.adjacency": "replace_one"})
    # One model evaluated twice: the latest run counts, once. Its pipeline was NOT PRIVATE as a whole.
    whole = client.create_run(exp, tags={"dpfm.pipeline": "true", "dpfm.private": "false"}).info.run_id
    stage_run("evaluate", "p2", {"dp_linear_probe_acc": 0.7, "epsilon": 8.0},
              {"dvc.input.models/dp": "h2", "dpfm.objective": "mae", **digits})
    stage_run("evaluate", whole, {"dp_linear_probe_acc": 0.75, "epsilon": 8.0, "digits.dp.linear_probe_ci_lo": 0.7,
                                  "digits.dp.linear_probe_ci_hi": 0.79},
              {"dvc.input.models/dp": "h2", "dpfm.objective": "mae", **digits})
    # An ε under add/remove is on another axis (about half replace-one's for the same mechanism).
    stage_run("evaluate", "p7", {"dp_linear_probe_acc": 0.8, "epsilon": 4.0},
              {"dvc.input.models/dp": "h6", "dpfm.objective": "mae", **digits, "dpfm.adjacency": "add_remove"})
    stage_run("evaluate", "p4", {"dp_linear_probe_acc": 0.99, "epsilon": 1.0}, {"dvc.input.models/dp": "h3", **digits},
              status="FAILED")
    # A test run's model (a known noise key) is no DP point, whatever ε its verification computed.
    stage_run("evaluate", "p5", {"dp_linear_probe_acc": 0.95, "epsilon": 4.0},
              {"dvc.input.models/dp": "h4", "dpfm.objective": "mae", "dpfm.model_private": "false", **digits})
    # A model evaluated on another set is on another axis: the figure's caption names one set.
    stage_run("evaluate", "p6", {"dp_linear_probe_acc": 0.91, "epsilon": 3.0},
              {"dvc.input.models/dp": "h5", "dpfm.objective": "mae", **digits, "dpfm.primary_set": "fashion"})
    # Evaluated over three seeds: its point is the released model's (the first seed's), and so is its interval.
    stage_run("evaluate", "p8", {"dp_linear_probe_acc": 0.776, "epsilon": 6.0,
                                 "digits.dp.linear_probe_ci_lo": 0.765, "digits.dp.linear_probe_ci_hi": 0.887,
                                 "digits.dp.first_seed_linear_probe_ci_lo": 0.758,
                                 "digits.dp.first_seed_linear_probe_ci_hi": 0.794},
              {"dvc.input.models/dp": "h7", "dpfm.objective": "caption", **digits})
    points, note = report_curves.experiment_points("dpfm", current_model_hash="h2", primary_set="digits")
    got = sorted((p["epsilon"], p["accuracy"], p["objective"], p["current"], p["private_as_a_whole"]) for p in points)
    assert got == [(2.0, 0.6, "clip", False, None), (6.0, 0.776, "caption", False, None),
                   (8.0, 0.75, "mae", True, False)]
    assert sorted((p["epsilon"], p["ci"]) for p in points) == [(2.0, None), (6.0, [0.758, 0.794]),
                                                               (8.0, [0.7, 0.79])]  # where it was logged
    assert "3 DP model(s) evaluated on digits" in note and "1 evaluation(s) under the other adjacency" in note
    assert [p["accuracy"] for p in report_curves.experiment_points("dpfm", None, "digits", "add_remove")[0]] == [0.8]
    assert [p["accuracy"] for p in report_curves.experiment_points("dpfm", None, "fashion")[0]] == [0.91]
    none, note = report_curves.experiment_points("elsewhere", None, "digits")
    assert none == [] and "not found" in note


def test_epsilon_curve_from_verification_or_recomputed():
    given = {"pld": [[1, 2.0], [10, 5.0]]}
    assert report_privacy.epsilon_curves({"epsilon_curve": given}) == {"pld": ([1, 10], [2.0, 5.0])}
    assert report_privacy.epsilon_curves({"epsilon_curve": [{"step": 1, "pld": 2.0}, {"step": 10, "pld": 5.0}]}) == \
        {"pld": ([1, 10], [2.0, 5.0])}
    ver = {"steps": 10, "sigma": 1.0, "sample_rate": 0.1, "delta": 1e-5, "epsilon": {"rdp": 0}}
    steps, eps = report_privacy.epsilon_curves(ver)["rdp"]
    assert steps[0] == 1 and steps[-1] == 10 and all(a < b for a, b in zip(eps, eps[1:]))
    # Recomputed for the run's adjacency: a replace-one run's curve ends at its replace-one ε (an
    # add/remove curve would end about a third lower here), and only PLD accounts it.
    ver = {**ver, "adjacency": "replace_one", "epsilon": {"pld": 0, "rdp": 0}}
    curves = report_privacy.epsilon_curves(ver)
    assert list(curves) == ["pld"]
    assert curves["pld"][1][-1] == pytest.approx(accounting.epsilon(1.0, 0.1, 10, 1e-5, adjacency="replace_one"))


# -- a real browser ----------------------------------------------------------------------------

# Appended to a copy of the page: an image that does not decode is reported on the console.
IMAGE_CHECK = ("<script>window.addEventListener('load', () => { for (const img of document.images) "
               "if (!img.complete || img.naturalWidth === 0) console.error('broken image: ' + img.alt); });</script>")


def render(page: str, work: Path, name: str) -> tuple[list[str], Image.Image]:
    """Open `page` alone in a fresh folder (so a relative reference would break) in headless Chromium:
    the console lines it logged and its screenshot."""
    folder = work / name
    folder.mkdir()
    (folder / "page.html").write_text(page.replace("</body>", IMAGE_CHECK + "</body>"))
    shot = folder / "shot.png"
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={folder / 'profile'}", "--enable-logging=stderr", "--v=0", "--hide-scrollbars",
         "--window-size=1100,1500", f"--screenshot={shot}", (folder / "page.html").as_uri()],
        capture_output=True, text=True, timeout=120)
    assert shot.is_file(), proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if ":CONSOLE" in line], Image.open(shot).convert("RGB")


def table_head_pixels(image: Image.Image) -> int:
    rgb = tuple(int(TABLE_HEAD_COLOR[i:i + 2], 16) for i in (1, 3, 5))
    return int((np.asarray(image) == rgb).all(axis=-1).sum())


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium package is not installed "
                                             "(apt-get install chromium); the browser check cannot run")
def test_report_renders_in_headless_chromium_and_the_screenshot_shows_the_table(project, tmp_path):
    root, params = project
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    page = (root / "results/report/report.html").read_text()
    console, shot = render(page, tmp_path, "report")
    assert console == []
    assert table_head_pixels(shot) > 5000  # the table's header row is on screen

    # The checks can fail: without the table, and with a broken image and a script error.
    start, end = page.index("<table class='acc'"), page.index("</table>", page.index("<table class='acc'"))
    _, no_table = render(page[:start] + page[end + len("</table>"):], tmp_path, "no-table")
    assert table_head_pixels(no_table) == 0
    broken = page.replace("</main>", "<img alt='lost' src='data:image/png;base64,AAAA'>"
                                     "<script>undefinedFunction()</script></main>")
    console, _ = render(broken, tmp_path, "broken")
    assert any("broken image: lost" in line for line in console)
    assert any("undefinedFunction" in line for line in console)


def test_data_card_reports_usable_n_and_never_the_exclusion_counts():
    from pipeline.report.privacy import data_card

    stats = {"source": "urls", "private": {"usable": 97, "rows": 100,
                                           "excluded": {"corrupt_image": 2, "missing_caption": 1}}}
    title, value, detail = data_card(stats)
    assert value == "97 usable"
    assert "100" not in detail and "corrupt" not in detail and "2" not in detail.replace(".dpfm", "")
    assert "data owner only" in detail
    # Measured: the same usable n from another count of rows read and excluded gives the same card.
    other = {"source": "urls", "private": {"usable": 97, "rows": 131, "excluded": {"missing_image": 34}}}
    assert data_card(other) == (title, value, detail)
    # An eval split carved out of the private data (shards.eval_fraction) is scored in public: the card says so.
    carved = {**stats, "eval": {"usable": 11}, "eval_from_private": True}
    assert "11 private examples held out for evaluation are NOT protected" in data_card(carved)[2]
    assert "NOT protected" not in detail


def test_headline_says_in_plain_words_whether_dp_beat_each_baseline():
    metrics = metrics_json()
    mechanism = {"n": 1258, "batch": 125.8, "sigma": 0.67, "epsilon": 7.99, "noise": 0.67 / 125.8, "per_batch": False,
                 "scale": "σ/B = 0.00533"}
    text = report_accuracy.headline_sentence("digits", metrics["sets"]["digits"], metrics["models"], mechanism)
    assert text.startswith("On digits, the DP model's linear probe reaches 82.2% (95% CI 77.4–86.7%; σ/B = 0.00533)")
    assert "it beats Random init by +32.2 points (95% CI +27.0 to +37.4)" in text
    assert "it is BELOW Not private (DP-Cap without DP, ε = ∞): −7.8 points (95% CI −11.1 to −4.4)" in text
    assert ("it cannot be told apart from Synthetic only (Syn-ViP): +1.8 points (95% CI −1.1 to +4.8), an interval "
            "that includes 0") in text
    assert text.index("Synthetic only") < text.index("Random init") < text.index("Not private")  # warm start first
    assert "did not improve on its synthetic warm start" in text and "n = 1258" in text  # and why, likely
    assert "σ·C/batch = 0.00533" in text
    # Dp-CLIP clips the batch's mean: its noise is 2σC per coordinate (0.00174 was printed, 770x too small)
    clip = report_accuracy.headline_sentence("digits", metrics["sets"]["digits"], metrics["models"],
                                             {**mechanism, "noise": 2 * 0.67, "per_batch": True})
    assert "noise std per coordinate is 2σ·C = 1.34 however large the batch" in clip and "shrinks" not in clip
    metrics["sets"]["digits"]["dp_versus"]["synthetic"] = {"diff": 0.05, "ci": [0.02, 0.08]}
    text = report_accuracy.headline_sentence("digits", metrics["sets"]["digits"], metrics["models"], mechanism)
    assert "it beats Synthetic only (Syn-ViP) by +5.0 points" in text and "warm start" not in text
    # Over evaluate.seeds trainings the row is their mean: the released checkpoint's own is named beside it.
    assert "released checkpoint" not in text
    metrics["sets"]["digits"]["results"]["dp"].update(
        seeds=3, first_seed={"linear_probe": 0.801, "linear_probe_ci": [0.752, 0.849]})
    text = report_accuracy.headline_sentence("digits", metrics["sets"]["digits"], metrics["models"],
                                             {**mechanism, "epsilon_composed": 15.23})
    assert text.startswith("On digits, the DP model's linear probe reaches 82.2% (95% CI 77.4–86.7%; σ/B = 0.00533), "
                           "the mean of 3 "
                           "DP trainings (with every DP run charged to the budget, ε = 15.23); the released "
                           "checkpoint's own, at ε = 7.99, is 80.1% (95% CI 75.2–84.9%): it beats")


def test_the_privacy_utility_curve_is_a_table_a_figure_and_a_sentence(project):
    root, params = project
    metrics = metrics_json()
    points = [{"init": init, "epsilon": eps, "epsilon_spent": spent, "seeds": 3, "linear_probe": acc,
               "linear_probe_ci": [acc - 0.03, acc + 0.03]}
              for init, base in (("pretrain", 0.8), ("random", 0.5))
              for eps, spent, acc in ((1, 0.98, base), (8, 7.9, base + 0.01), ("inf", None, base + 0.05))]
    metrics["privacy_utility"] = {"objective": "caption", "set": "digits", "n_probe_test": 270, "seeds": 3,
                                  "points": points}
    write_json("results/eval/metrics.json", metrics)
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    out = root / "results/report"
    page, md = (out / "report.html").read_text(), (out / "report.md").read_text()
    # Each ε's column carries the noise its points trained with: σ calibrated to that ε on the recipe's q and T.
    from pipeline.privacy import accounting

    ver, dp = read_json(root / "results/privacy/verification.json"), params["dp"]
    q, delta = dp["expected_batch_size"] / ver["n"], accounting.parse_delta(dp["delta"], ver["n"])
    noise = [accounting.calibrate_sigma(e, q, dp["steps"], delta, accountant=dp["accountant"],
                                        adjacency=ver.get("adjacency", "add_remove")) / dp["expected_batch_size"]
             for e in (1, 8)]
    assert f"| Linear probe | ε = 1 (σ/B = {noise[0]:.3g}) | ε = 8 (σ/B = {noise[1]:.3g}) | ε = ∞ |" in md
    ledger = read_json(root / "models/dp/ledger.json")  # the released model's own mechanism
    batch = ledger["sample_rate"] * ledger["n"]
    assert f"linear probe on digits; σ = {ver['sigma']:.3g}, σ/B = {ledger['sigma'] / batch:.3g}" in md
    assert "| DP from the synthetic warm start | 80.0 (77.0–83.0) | 81.0 (78.0–84.0) | 85.0 (82.0–88.0) |" in md
    assert "| DP from random init | 50.0 (47.0–53.0) |" in md
    assert "id='curve'" in page and "over 3 training seeds" in page
    assert (f"from the synthetic warm start, 80.0% (77.0–83.0) at ε = 1, σ/B = {noise[0]:.3g} → 81.0% (78.0–84.0) at "
            f"ε = 8, σ/B = {noise[1]:.3g} → 85.0% (82.0–88.0) at ε = ∞") in md
    assert "in parentheses, 95% intervals, each point the mean of 3 DP trainings at its ε" in md
    assert "(synthetic only, no DP training: 80.4% (75.6–85.2))" in md  # its own interval too
    assert (out / "privacy_utility_curve.png").is_file()


def test_the_loss_caption_names_where_the_held_out_split_comes_from(project):
    """The DP model's held-out loss is on public data unless the eval split was carved out of a web source
    (shards.eval_fraction): then the caption says so, and that it is not covered by ε."""
    root, params = project
    write_json("data/shards/stats.json", {"source": "digits", "eval_fraction": 0.3, "eval_from_private": False,
                                          "private": {"usable": 1000}, "eval": {"usable": 100}})
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    md = (root / "results/report/report.md").read_text()
    assert "loss on the public held-out split" in md and "carved out" not in md
    write_json("data/shards/stats.json", {"source": "urls", "eval_fraction": 0.1, "eval_from_private": True,
                                          "private": {"usable": 1000}, "eval": {"usable": 100}})
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    md = (root / "results/report/report.md").read_text()
    assert "held-out split carved out of the private data (shards.eval_fraction: NOT covered by ε)" in md
    assert "public held-out split" not in md
    # Without the stats (shards are never pushed) where the split came from is not known: not called public.
    (root / "data/shards/stats.json").unlink()
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    md = (root / "results/report/report.md").read_text()
    assert "held-out split (where it came from is recorded in the shards' stats.json, absent here)" in md
    assert "public held-out split" not in md


def test_without_a_curve_the_report_has_no_curve_section(project):
    root, params = project
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    md = (root / "results/report/report.md").read_text()
    assert "Privacy–utility curve" not in md and not (root / "results/report/privacy_utility_curve.png").exists()


def test_the_curve_caption_says_when_the_non_private_point_has_a_schedule_of_its_own():
    from pipeline.report.curves import twin_text

    recipe = {"steps": 40, "lr": 5e-4, "nonprivate": {"steps": None, "lr": None}, "nonprivate_clipped": False}
    assert twin_text(recipe) == "∞ is the same recipe without clipping or noise"
    assert twin_text({**recipe, "nonprivate_clipped": True}) == \
        "∞ is the same recipe without noise, clipped as the DP points are"
    own = twin_text({**recipe, "nonprivate": {"steps": 600, "lr": 1e-3, "warmup_steps": None}})
    assert "steps 600, lr 0.001" in own and "the DP points: steps 40, lr 0.0005" in own


def verdict_line(root) -> str:
    """report.md's first statement, under its title and subtitle."""
    return (root / "results/report/report.md").read_text().split("\n\n")[2]


def test_a_run_with_non_private_training_on_private_data_says_not_private_everywhere(project):
    """The curve's ε = ∞ point trains without DP on the private shards: the run's outputs as a whole
    are then not DP. The headline says so first, privacy.json and MLflow carry composed ε = ∞, and
    the registered model is tagged not private; without it, the composed ε is finite and logged."""
    import math

    from matplotlib.axes import Axes

    root, params = project
    params["dp"]["noise_seed"] = None
    params["curve"]["epsilons"] = [1, 8]
    private = RecordingTracker()
    titles, set_title = [], Axes.set_title  # the ε figure travels without the report: it says so itself
    recording = lambda ax, label, *a, **kw: titles.append(label) or set_title(ax, label, *a, **kw)  # noqa: E731
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Axes, "set_title", recording)
        report.run(params, SimpleNamespace(stage=stage("report"), tracker=private))
    assert not [t for t in titles if "NOT PRIVATE" in t]
    final = read_json(root / "results/privacy/privacy.json")
    assert final["private"] and final["not_private"] == []
    assert private.metrics["epsilon_composed"] == pytest.approx(final["epsilon_composed"])
    assert private.tags["model.private"] == "true" and float(private.tags["model.epsilon"]) == pytest.approx(
        final["epsilon_composed"], abs=1e-4)
    assert "NOT PRIVATE" not in (root / "results/report/report.md").read_text()
    assert final["runs"] == 1 and verdict_line(root).startswith("**(ε = 7.99, δ = ")  # one run: the model's own

    params["curve"]["epsilons"] = [1, 8, math.inf]
    public = RecordingTracker()
    from pipeline.report import plots

    plotted = []
    original = plots.plot_privacy_utility
    with pytest.MonkeyPatch.context() as m:  # the star: the model is DP at its ε, the run is not (hollow)
        m.setattr(plots, "plot_privacy_utility", lambda points, *a: plotted.extend(points) or original(points, *a))
        m.setattr(Axes, "set_title", recording)
        report.run(params, SimpleNamespace(stage=stage("report"), tracker=public))
    assert [p["private_as_a_whole"] for p in plotted if p["current"]] == [False]
    assert [t for t in titles if "NOT PRIVATE" in t] == [
        "NOT PRIVATE as a whole: ε = ∞ for the run's outputs (this ε is the model's)\n"]
    final = read_json(root / "results/privacy/privacy.json")
    assert not final["private"] and final["epsilon_composed"] == "inf"
    assert "the curve's ε = ∞ point trains without DP on the private shards" in final["not_private"]
    md = (root / "results/report/report.md").read_text()
    assert "NOT PRIVATE as a whole: the curve's ε = ∞ point" in md and "ε of this run's outputs | ∞" in md
    assert verdict_line(root).startswith("**NOT PRIVATE as a whole: the curve's ε = ∞ point")
    assert "class='verdict warn'" in (root / "results/report/report.html").read_text()
    assert "epsilon_composed" not in public.metrics and public.tags["dpfm.private"] == "false"
    assert "the curve's ε = ∞ point" in public.tags["dpfm.not_private"]  # the reasons beside the verdict
    assert public.tags["model.private"] == "false" and public.tags["model.epsilon"] == "inf"


def test_the_clipping_row_names_clip_groups_and_mask_views_only_when_set():
    from pipeline.report.content import clipping_options_text

    assert clipping_options_text({"encoder_clip_share": None, "mask_views": 1}) == ""
    text = clipping_options_text({"encoder_clip_share": 0.3, "mask_views": 4})
    assert "clipped to C·√0.3, the rest to C·√0.7" in text and "the mean over 4 masked views, clipped once" in text


def test_the_steps_row_names_the_weight_average_and_frozen_modules_only_when_set():
    from pipeline.report.content import released_weights_text

    assert released_weights_text({"ema_decay": 0.0}) == "" and released_weights_text({}) == ""
    assert "moving average of the iterates (decay 0.995)" in released_weights_text({"ema_decay": 0.995})
    frozen = released_weights_text({"ema_decay": 0.0, "frozen": ["encoder.blocks.2", "encoder.blocks.3"]})
    assert frozen == "; not trained, released as they started (no ε): encoder.blocks.2, encoder.blocks.3"
    assert released_weights_text({"frozen": []}) == ""


def test_the_star_is_this_evaluations_accuracy_whatever_mlflow_logged_for_the_model(project, monkeypatch):
    """MLflow's newest evaluation of the same model (another checkout's protocol, or an older run where this
    one's logging failed) said 50%: the star took it, beside a table and headline that say 82.2%."""
    from pipeline.report import plots

    root, params = project
    logged = [{"epsilon": 7.99, "accuracy": 0.5, "objective": "caption", "current": True, "ci": [0.45, 0.55]},
              {"epsilon": 2.0, "accuracy": 0.7, "objective": "caption", "current": False, "ci": None}]
    monkeypatch.setattr(report, "experiment_points", lambda *a: (logged, "2 DP model(s) in MLflow"))
    drawn, original = [], plots.plot_privacy_utility
    monkeypatch.setattr(plots, "plot_privacy_utility", lambda points, *a: drawn.extend(points) or original(points, *a))
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    assert sorted((p["accuracy"], p["current"]) for p in drawn) == [(0.7, False), (0.822, True)]


@pytest.mark.parametrize("runs", [2, 3])
def test_figures_pooled_over_several_dp_trainings_carry_what_they_compose_to(project, runs):
    """With evaluate.seeds = 3 the DP row is the mean of three DP models trained on the same examples,
    and the cards once put it beside one model's ε (7.99). Identical runs compose as one run of as many
    times the steps: the card must give that, the star the released model's own accuracy."""
    from pipeline.privacy import budget
    from pipeline.privacy.accounting import epsilon

    root, params = project
    params["dp"]["noise_seed"] = None
    params["curve"]["epsilons"] = [8]  # no ε = ∞ point: the run is private as a whole
    ledger = read_json(root / "models/dp/ledger.json")
    sketch = np.zeros(1 << budget.SKETCH_BITS, dtype=bool)
    sketch[:3] = True
    for key, run in enumerate(("this", "seed-1", "seed-2")[:runs]):
        budget.record("set-a", sketch, run, Plan.from_header(ledger), key)
    write_json("models/dp/ledger.json", {**ledger, "run": "this", "data_identity": "set-a"})
    metrics = metrics_json()
    dp_row = metrics["sets"]["digits"]["results"]["dp"]
    dp_row.update(seeds=runs, first_seed={"linear_probe": 0.801, "linear_probe_ci": [0.752, 0.849]})
    write_json("results/eval/metrics.json", metrics)
    from pipeline.report import plots

    stars = []
    original = plots.plot_privacy_utility
    with pytest.MonkeyPatch.context() as m:
        m.setattr(plots, "plot_privacy_utility", lambda points, *a: stars.extend(points) or original(points, *a))
        report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    composed = bound_text(epsilon(0.67, 0.1, runs * 40, 4e-4, adjacency="replace_one"), 2)  # rounded up
    assert 9 < float(composed) < 20
    md = (root / "results/report/report.md").read_text()
    card = next(line for line in md.splitlines() if line.startswith("| Privacy |"))
    assert f"**ε = {composed}**" in card and f"{runs} DP runs" in card
    assert "the released model alone: ε = 7.99" in card
    assert [(p["epsilon"], p["accuracy"]) for p in stars if p["current"]] == [(7.99, 0.801)]
    assert f"with every DP run charged to the budget, ε = {composed}" in md
    # ... and so does the first thing the report says, above the released model's own
    first = verdict_line(root)
    assert first.startswith(f"**(ε = {composed}, δ = ") and f"all this report releases ({runs} DP runs" in first
    assert "The released model alone is (ε = 7.99, δ = " in first


def test_the_experiment_plot_keeps_its_whole_legend_and_skips_points_it_cannot_place(project, monkeypatch):
    """A wide legend (a run NOT PRIVATE as a whole, the twin) was cut at both sides of the picture, and
    one run logged with a NaN accuracy or ε = ∞ stopped the whole report. Every edge of the PNG is now
    background, and such runs are left off the axes with a word in the caption."""
    import math

    from PIL import Image

    from pipeline.report import plots

    root, params = project
    points = [{"epsilon": 2.0, "accuracy": 0.8, "objective": "mae", "current": False, "private_as_a_whole": False},
              {"epsilon": 4.0, "accuracy": 0.85, "objective": "caption", "current": False},
              {"epsilon": 8.0, "accuracy": float("nan"), "objective": "clip", "current": False},
              {"epsilon": math.inf, "accuracy": 0.9, "objective": "clip", "current": False}]
    monkeypatch.setattr(report, "experiment_points", lambda *_: (points, "from MLflow"))
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    assert "from MLflow; 2 logged without a finite ε and accuracy, not drawn" in (
        root / "results/report/report.md").read_text()

    path = root / "pu.png"
    plots.plot_privacy_utility(points[:2] + [{**points[1], "current": True, "private_as_a_whole": False}],
                               {"synthetic": ("synthetic only", 0.7, [0.66, 0.74]),
                                "random": ("random init", 0.5, None),
                                "nonprivate": ("DP (non-private twin, without DP, ε = ∞)", 0.9, [0.88, 0.92])}, path)
    image = np.asarray(Image.open(path).convert("L"))
    edges = np.concatenate([image[0], image[-1], image[:, 0], image[:, -1]])
    assert edges.min() == 255, "the legend runs past the picture's edge"
    # A point's 95% interval, where its run logged one, is drawn as an error bar from lo to hi.
    bars = []
    monkeypatch.setattr(plots.plt.Axes, "errorbar", lambda ax, x, y, yerr, **kw: bars.append((x, y, yerr)))
    plots.plot_privacy_utility([{**points[1], "ci": [0.8, 0.87]}, points[0]], {}, path)
    assert [(x, y, [[round(a, 6) for a in e] for e in yerr]) for x, y, yerr in bars] == [(4.0, 85.0, [[5.0], [2.0]])]
    # The baselines' intervals too: the synthetic warm start's as a bar at ε = 0, a line's as a band.
    bars.clear()
    bands = []
    monkeypatch.setattr(plots.plt.Axes, "axhspan", lambda ax, lo, hi, **kw: bands.append((round(lo, 6), round(hi, 6))))
    baselines = {"synthetic": ("synthetic only", 0.7, [0.66, 0.74]), "random": ("random init", 0.5, None),
                 "nonprivate": ("non-private twin", 0.9, [0.88, 0.92])}
    plots.plot_privacy_utility([points[1]], baselines, path)
    assert [(x, y, [[round(a, 6) for a in e] for e in yerr]) for x, y, yerr in bars] == [(0, 70.0, [[4.0], [4.0]])]
    assert bands == [(88.0, 92.0)]
    bands.clear()
    curve = [{"init": "pretrain", "epsilon": e, "linear_probe": 0.8, "linear_probe_ci": [0.75, 0.85]} for e in (1, 8)]
    plots.plot_curve(curve, {"synthetic": ("synthetic only", 0.7, [0.66, 0.74]), "pixels": ("raw pixels", 0.6, None)},
                     path)
    assert bands == [(66.0, 74.0)]


def test_a_dp_clip_report_gives_its_noise_as_2_sigma_c_whatever_the_batch(project):
    """Dp-CLIP clips the batch's mean: its noise per coordinate is 2σC, which no batch size divides.
    Every place a DP accuracy is read beside its noise says so; none gives a σ/B."""
    root, params = project
    plan = Plan(objective="clip", clipping="per_batch", n=1258, sample_rate=0.1, sigma=0.67, clip_norm=1.0,
                steps=40, delta=4e-4, accountant="pld", adjacency="replace_one", target_epsilon=8.0, epsilon=7.99)
    write_json("models/dp/ledger.json", {**plan.header(), "steps": 40, "epsilon": 7.99, "run": "this"})
    write_json("results/eval/metrics.json", {**metrics_json(), "objective": "clip"})
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    md = (root / "results/report/report.md").read_text()
    assert plan.noise_std == pytest.approx(2 * 0.67 * 1.0)
    assert "| DP (DP-Cap) (2σC = 1.34, whatever B) | 82.2 (77.4–86.7) |" in md  # the table's row
    assert "linear probe on digits; σ = 0.67, 2σC = 1.34, whatever B" in md  # its card
    assert "2σ·C = 1.34 however large the batch" in md and "sensitivity 2·C (per batch)" in md
    assert "σ/B" not in md and "std/B" not in md


def test_a_run_that_logs_private_statistics_says_they_are_outside_its_epsilon(project):
    """dp.log_private_stats publishes the count of dropped non-finite private examples, which no ε
    covers: the mechanism table names it and the report's first words say NOT PRIVATE."""
    root, params = project
    params["dp"].update(noise_seed=None, log_private_stats=True)
    params["curve"]["epsilons"] = [8]
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    md = (root / "results/report/report.md").read_text()
    assert ("| released outside ε | counts of dropped non-finite private examples (dp.log_private_stats: true): not "
            "covered by the ε above |") in md
    assert verdict_line(root).startswith("**NOT PRIVATE as a whole: dp.log_private_stats publishes")
    assert not read_json(root / "results/privacy/privacy.json")["private"]


def test_each_figure_draws_each_models_own_values(tmp_path, monkeypatch):
    """The accuracy bars, the curve's bands and the experiment plot's star, as matplotlib is asked to
    draw them: each bar and band is its own row's value and interval, the star this run's point, inside
    the axes."""
    from pipeline.report import plots

    bars, bands, stars, limits, lines, ticks = [], [], [], [], [], []
    monkeypatch.setattr(plots.plt.Axes, "bar", lambda ax, xs, ys, w, yerr, label, **kw: bars.append(
        (label, np.round(ys, 6).tolist(), np.round(yerr, 6).tolist())))
    monkeypatch.setattr(plots.plt.Axes, "fill_between", lambda ax, xs, lo, hi, **kw: bands.append(
        (list(xs), [round(v, 6) for v in lo], [round(v, 6) for v in hi])))
    scatter = plots.plt.Axes.scatter
    monkeypatch.setattr(plots.plt.Axes, "scatter", lambda ax, x, y, **kw: (
        stars.append((x, y, kw["label"])) if kw.get("marker") == "*" else None) or scatter(ax, x, y, **kw))
    monkeypatch.setattr(plots, "_save", lambda fig, path: limits.append(fig.axes[0].get_ylim()) or plots.plt.close(fig))
    rows = [{"name": "dp", "label": "DP", "cells": [(0.822, None, [0.774, 0.867]), (0.3, 0.05, None)]},
            {"name": "synthetic", "label": "Synthetic", "cells": [(0.804, None, [0.756, 0.852]), None]}]
    plots.plot_accuracy(["linear probe", "1-shot"], rows, 0.1, tmp_path / "a.png")
    assert bars == [("DP", [82.2, 30.0], [[4.8, 5.0], [4.5, 5.0]]), ("Synthetic", [80.4], [[4.8], [4.8]])]
    curve = [{"init": "pretrain", "epsilon": e, "linear_probe": acc, "linear_probe_ci": [acc - 0.05, acc + 0.02]}
             for e, acc in ((8, 0.8), (1, 0.7), ("inf", 0.85))]
    with monkeypatch.context() as m:  # the curve's line and its ticks: each point at its own ε and accuracy
        line, set_xticks = plots.plt.Axes.plot, plots.plt.Axes.set_xticks
        m.setattr(plots.plt.Axes, "plot", lambda ax, xs, ys, **kw: lines.append((list(xs), list(ys)))
                  or line(ax, xs, ys, **kw))
        m.setattr(plots.plt.Axes, "set_xticks", lambda ax, at, labels: ticks.append((list(at), list(labels)))
                  or set_xticks(ax, at, labels))
        plots.plot_curve(curve, {}, tmp_path / "c.png")
    assert bands == [([0.0, 3.0, 4.0], [65.0, 75.0, 80.0], [72.0, 82.0, 87.0])]  # ε 1, 8, ∞ in order
    assert lines == [([0.0, 3.0, 4.0], [70.0, 80.0, 85.0])] and ticks == [([0.0, 3.0, 4.0], ["1", "8", "∞"])]
    points = [{"epsilon": 2.0, "accuracy": 0.5, "objective": "mae", "current": False},
              {"epsilon": 7.99, "accuracy": 0.95, "objective": "mae", "current": True}]
    plots.plot_privacy_utility(points, {}, tmp_path / "p.png")
    assert stars == [(7.99, 95.0, "this run")]
    assert limits[-1][0] <= 95.0 <= limits[-1][1], limits[-1]  # the star on the axes


# -- each figure the report states, from the input it must come from ---------------------------------

def a_plan(**kw) -> Plan:
    """A digits-sized DP-Cap plan; C = 1 and σ = std there, so tests that tell them apart set C."""
    base = dict(objective="caption", clipping="per_sample", n=1258, sample_rate=0.1, sigma=0.67, clip_norm=1.0,
                steps=40, delta=4e-4, accountant="pld", adjacency="replace_one", target_epsilon=8.0, epsilon=7.99)
    return Plan(**{**base, **kw})


def a_ver(**kw) -> dict:
    """verification.json of a run that passed, as the report reads it."""
    base = {"passed": True, "checks": [], "run": "this", "epsilon": {"pld": 7.99, "rdp": 9.6},
            "epsilon_reported": 7.99, "accountant": "pld", "delta": 4e-4, "steps": 40, "sigma": 0.67,
            "sample_rate": 0.1, "n": 1258}
    return {**base, **kw}


def number_after(text: str, prefix: str) -> float:
    """The figure the report printed after `prefix`."""
    return float(re.search(re.escape(prefix) + r"\s*([0-9.]+)", text).group(1))


# -- privacy.py ---------------------------------------------------------------------------------

def test_per_batch_noise_over_the_steps_is_divided_by_root_t():
    p = a_plan(objective="clip", clipping="per_batch", steps=37)
    text = report_privacy.noise_text(a_ver(steps=37), p)
    assert number_after(text, "std/√T =") == pytest.approx(p.noise_std / math.sqrt(p.steps), rel=1e-2)


def test_sigma_over_b_is_the_multiplier_over_the_expected_batch_not_the_std():
    p = a_plan(clip_norm=2.5)  # std = σ·C ≠ σ
    shown = number_after(report_privacy.noise_scale_text(p), "σ/B =")
    assert shown == pytest.approx(p.sigma / (p.sample_rate * p.n), rel=1e-2)


def test_the_other_adjacencys_epsilon_is_rounded_up():
    value = 3.98441  # to nearest: 3.9844, a smaller bound than the accountant's
    text = report_privacy.adjacency_text(a_ver(adjacency="replace_one", epsilon_add_remove={"pld": value}))
    assert number_after(text, "PLD ε =") >= value


def test_the_add_remove_text_names_the_released_n():
    v = a_ver(n=1258, steps=40)
    text = report_privacy.adjacency_text(v)
    assert "n = 1258," in text and "does NOT cover" in text


def test_final_privacy_carries_the_compositions_own_figures(monkeypatch):
    c = {"epsilon": 12.5, "epsilon_dp_runs": 12.5, "delta": 1e-6, "runs": 3,
         "by_run": [{"objective": "mae"}, {"objective": "caption"}, {"objective": "mae"}]}
    monkeypatch.setattr(report_privacy.budget, "composition", lambda ledger, delta: c)
    monkeypatch.setattr(report_privacy.release, "not_private_reasons", lambda *a: [])
    final = report_privacy.final_privacy({}, {}, a_ver(epsilon_reported=3.25), {})
    assert (final["epsilon_run"], final["epsilon_dp_runs"], final["epsilon_composed"]) == (3.25, 12.5, 12.5)
    assert final["delta_composed"] == c["delta"] and final["runs"] == c["runs"]
    assert final["objectives"] == ["mae", "caption", "mae"]
    # NOT PRIVATE as a whole: ε = ∞, and what the DP runs alone compose to stays beside it (MLflow, the report).
    c.update(epsilon=math.inf, epsilon_dp_runs=4.5)
    monkeypatch.setattr(report_privacy.release, "not_private_reasons", lambda *a: ["trained without DP"])
    final = report_privacy.final_privacy({}, {}, a_ver(), {})
    assert (final["private"], final["epsilon_composed"], final["epsilon_dp_runs"]) == (False, math.inf, 4.5)


# -- accuracy.py --------------------------------------------------------------------------------

@pytest.mark.parametrize("ci", [[0.0, 0.02], [-0.02, 0.0]])
def test_an_interval_ending_at_zero_includes_zero(ci):
    text = report_accuracy.verdict("X", {"diff": sum(ci) / 2, "ci": ci})
    assert "cannot be told apart" in text and "beats" not in text and "BELOW" not in text


def test_the_k_shot_legend_gives_the_few_shot_repeats():
    protocol = {**metrics_json()["protocol"], "fewshot": {"shots": [1], "repeats": 5},
                "finetune": {"enabled": True, "repeats": 3}}
    text = report_accuracy.protocol_legend(protocol, ["Linear probe", "1-shot"], "caption")
    assert f"over {protocol['fewshot']['repeats']} seeded class-balanced subsets" in text


# -- content.py ---------------------------------------------------------------------------------

def test_a_card_without_a_paired_comparison_gives_dp_minus_the_model():
    lp = {"dp": 0.822, "random": 0.5}
    models = {"dp": {"label": "DP"}, "random": {"label": "Random"}}
    cards = content.summary_cards(a_ver(), {}, None, lp, {}, models, {}, "digits",
                                  {"private": True, "runs": 1}, "σ/B = 0.005")
    detail = next(d for k, _, d in cards if k == "Random")
    assert detail == f"DP model {report_accuracy.signed(100 * (lp['dp'] - lp['random']))} points"


def mech(privacy, **kw) -> dict:
    rows = content.mechanism_rows(a_ver(**kw), a_plan(), {}, privacy)
    return dict(rows)


def test_the_sampling_row_gives_the_expected_batch_q_times_n():
    rows = mech({"private": True, "runs": 1, "objectives": ["caption"], "epsilon_composed": 7.99,
                 "delta_composed": 4e-4}, sample_rate=0.05, n=2000, steps=37)
    assert "(expected batch 100)" in rows["sampling"]


def test_the_composed_epsilon_row_is_rounded_up():
    value = 7.98441  # to nearest at 4 places: 7.9844
    rows = mech({"private": True, "runs": 2, "objectives": ["caption", "caption"], "epsilon_composed": value,
                 "delta_composed": 4e-4})
    assert float(rows["ε over all DP runs charged to data/budget"].split()[0]) >= value


def test_a_not_private_run_gives_what_its_dp_runs_compose_to():
    privacy = {"private": False, "runs": 2, "objectives": ["caption", "caption"], "epsilon_composed": math.inf,
               "epsilon_dp_runs": 12.3456, "epsilon_run": 7.99, "not_private": ["a reason"]}
    text = mech(privacy)["ε of this run's outputs"]
    assert number_after(text, "compose to") == pytest.approx(privacy["epsilon_dp_runs"])


def test_the_set_note_gives_probe_train_and_probe_test_sizes(tmp_path):
    metrics = metrics_json()
    s = metrics["sets"]["digits"]
    (note,) = [x["note"] for x in content.accuracy_sets(metrics, "caption", tmp_path, "σ/B = 0.005")]
    assert f"split into {s['n_probe_train']} probe-train / {s['n_probe_test']} probe-test images" in note


def test_the_headline_states_the_reported_accountants_epsilon(project):
    root, params = project
    v = read_json(root / "results/privacy/verification.json")
    write_json(root / "results/privacy/verification.json", {**v, "epsilon": {"pld": 5.5, "rdp": 7.99}})
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    md = (root / "results/report/report.md").read_text()
    assert f"σ = 0.67 at ε = {bound_text(v['epsilon_reported'], 2)}" in md


# -- render.py ----------------------------------------------------------------------------------

def test_best_in_column_is_the_highest():
    rows = [{"cells": [(0.5, None, None), None]}, {"cells": [(0.9, None, None), (0.3, 0.1, None)]},
            {"cells": [(0.7, None, None), (0.6, 0.1, None)]}]
    assert report_render.best_per_column(rows) == [0.9, 0.6]


def test_the_verdict_over_several_runs_gives_the_composed_delta():
    """Composed over runs, δ is the smallest of theirs (budget.composition), not this run's own."""
    privacy = {"private": True, "runs": 2, "epsilon_composed": 12.3, "delta_composed": 1e-6}
    r = {"verification": a_ver(checks=[{"name": "a", "passed": True, "detail": ""}]), "privacy": privacy,
         "delta_text": report_privacy.delta_text(4e-4, "1/2n")}
    _, big, _ = report_render.verdict(r, ", ")
    assert big.startswith(f"(ε = {bound_text(privacy['epsilon_composed'], 2)}, "
                          f"δ = {bound_text(privacy['delta_composed'], 2, exponent=True)})-DP")


def test_labels_and_check_details_are_escaped_in_the_html(project):
    root, params = project
    v = read_json(root / "results/privacy/verification.json")
    v["checks"] = [{"name": "sampler", "passed": True, "detail": "q <b>&amp;</b> n"}]
    write_json(root / "results/privacy/verification.json", v)
    metrics = metrics_json()
    metrics["models"]["random"]["label"] = "Random <i>init</i>"
    write_json(root / "results/eval/metrics.json", metrics)
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    page = (root / "results/report/report.html").read_text()
    assert "q <b>&amp;</b> n" not in page and "Random <i>init</i>" not in page
    assert "q &lt;b&gt;&amp;amp;&lt;/b&gt; n" in page and "Random &lt;i&gt;init&lt;/i&gt;" in page


# -- curves.py ----------------------------------------------------------------------------------

def test_the_curve_caption_counts_only_the_dp_trainings(tmp_path):
    points = [{"init": "pretrain", "epsilon": e, "epsilon_spent": spent, "linear_probe": 0.8,
               "linear_probe_ci": [0.77, 0.83]} for e, spent in ((1, 0.98), (8, 7.9), ("inf", None))]
    curve = {"objective": "caption", "set": "digits", "n_probe_test": 270, "points": points}
    section = report_curves.curve_section(curve, {}, tmp_path / "c.png", {"steps": 40, "lr": 5e-4})
    dp_points = sum(p["epsilon"] != "inf" for p in points)
    assert f"{dp_points} of the points are DP trainings" in section["caption"]


# -- plots.py -----------------------------------------------------------------------------------

def test_the_epsilon_figure_marks_the_final_epsilon_rounded_up_on_labelled_axes(tmp_path, monkeypatch):
    notes, axes = [], []
    annotate = Axes.annotate
    monkeypatch.setattr(Axes, "annotate", lambda ax, text, *a, **kw: notes.append(text) or annotate(ax, text, *a, **kw))
    monkeypatch.setattr(plots, "_save", lambda fig, path: axes.append(fig.axes[0]) or plots.plt.close(fig))
    final = (40, 7.98441)
    plots.plot_epsilon({"pld": ([1, 20, 40], [2.0, 5.0, final[1]])}, 8.0, final, tmp_path / "e.png")
    assert number_after(notes[0], "ε =") >= final[1]
    ax = axes[0]
    assert "step" in ax.get_xlabel() and "ε" in ax.get_ylabel()
    assert list(ax.lines[0].get_xdata()) == [1, 20, 40]  # steps along x, as the x label says


def test_the_warm_starts_interval_bar_is_its_own_asymmetric_interval(tmp_path, monkeypatch):
    bars, labels, axes = [], [], []
    monkeypatch.setattr(Axes, "errorbar", lambda ax, x, y, yerr, **kw: bars.append((x, y, yerr)))
    scatter = Axes.scatter
    monkeypatch.setattr(Axes, "scatter", lambda ax, x, y, **kw: labels.append((x, kw.get("label")))
                        or scatter(ax, x, y, **kw))
    monkeypatch.setattr(plots, "_save", lambda fig, path: axes.append(fig.axes[0]) or plots.plt.close(fig))
    acc, ci = 0.7, [0.6, 0.74]
    plots.plot_privacy_utility([{"epsilon": 4.0, "accuracy": 0.85, "objective": "mae", "current": False}],
                               {"synthetic": ("synthetic only", acc, ci)}, tmp_path / "p.png")
    ((x, y, yerr),) = bars
    assert x == 0 and y == pytest.approx(100 * acc)
    assert [yerr[0][0], yerr[1][0]] == pytest.approx([100 * (acc - ci[0]), 100 * (ci[1] - acc)])
    # the warm start sits at ε = 0 (it saw no private data), and says so in the legend
    assert [label for x, label in labels if x == 0] == ["synthetic only, ε = 0"]
    ax = axes[0]
    assert "ε" in ax.get_xlabel() and "accuracy" in ax.get_ylabel()


def test_the_legend_reads_refits_finetune_repeats_zero_shot_rule_and_blocks_from_the_protocol():
    """Each clause of the legend is its own protocol field: the probe's refits, the fine-tune repeats (not
    the few-shot ones), the objective's own zero-shot rule and which blocks were pooled."""
    protocol = {**metrics_json()["protocol"], "probe_refits": 4, "last_k_blocks": 2,
                "fewshot": {"shots": [1], "repeats": 5}, "finetune": {"enabled": True, "repeats": 3}}
    text = report_accuracy.protocol_legend(protocol, ["Linear probe", "1-shot FT", "Zero-shot"], "caption")
    assert "over 4 refits of the linear probe" in text
    assert "fine-tuned on K examples per class (AdamW), mean ± std over 3 subsets" in text
    assert "the last 2 block(s)" in text and "every block" not in text
    assert "captions have the lowest loss" in text  # DP-Cap scores classes by caption loss
    clip = report_accuracy.protocol_legend({**protocol, "last_k_blocks": "all", "probe_refits": 0},
                                           ["Linear probe", "Zero-shot"], "clip")
    assert "prompt embedding is closest (cosine)" in clip and "lowest loss" not in clip
    assert "every block" in clip and "refits" not in clip


def test_the_warm_start_reason_gives_the_expected_batch_not_n():
    """DP-SGD's noise shrinks with the expected batch q·n: the sentence explaining a missing gain must give
    that batch, not the dataset's size."""
    metrics = metrics_json()
    mechanism = {"n": 1258, "batch": 125.8, "sigma": 0.67, "epsilon": 7.99, "noise": 0.67 / 125.8, "per_batch": False,
                 "scale": "σ/B = 0.00533"}
    text = report_accuracy.headline_sentence("digits", metrics["sets"]["digits"], metrics["models"], mechanism)
    assert f"an expected batch of {mechanism['batch']:.0f} and σ" in text


def test_the_reports_warm_start_reason_gives_the_runs_batch_and_noise_per_averaged_coordinate(project):
    """The headline's numbers come from this run's mechanism: batch q·n, and σ·C divided by it (the noise on
    the averaged gradient), not the undivided std."""
    root, params = project
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    md = (root / "results/report/report.md").read_text()
    ver, ledger = read_json(root / "results/privacy/verification.json"), read_json(root / "models/dp/ledger.json")
    batch = ver["sample_rate"] * ver["n"]
    assert f"an expected batch of {batch:.0f} and σ" in md
    assert number_after(md, "σ·C/batch =") == pytest.approx(ledger["sigma"] * ledger["clip_norm"] / batch, rel=1e-2)


def test_a_one_seed_curve_caption_says_one_seed_not_training_seeds(tmp_path):
    """Over one seed the band covers the test images only: the caption must not claim seeds it never pooled."""
    points = [{"init": "pretrain", "epsilon": e, "epsilon_spent": spent, "linear_probe": 0.8,
               "linear_probe_ci": [0.77, 0.83]} for e, spent in ((1, 0.98), ("inf", None))]
    curve = {"objective": "caption", "set": "digits", "n_probe_test": 270, "points": points}
    section = report_curves.curve_section(curve, {}, tmp_path / "c.png", {"steps": 40, "lr": 5e-4})
    assert "over the test images, one seed" in section["caption"] and "training seeds" not in section["caption"]
    section = report_curves.curve_section({**curve, "seeds": 3}, {}, tmp_path / "c.png", {"steps": 40, "lr": 5e-4})
    assert "over 3 training seeds" in section["caption"] and "one seed" not in section["caption"]


def test_the_twins_own_schedule_lists_only_what_differs_from_the_dp_points():
    """dp.nonprivate may repeat a DP value: the caption names only the settings the ε = ∞ point changes."""
    recipe = {"steps": 40, "lr": 5e-4, "nonprivate": {"steps": 80, "lr": 5e-4}, "nonprivate_clipped": False}
    assert report_curves.twin_text(recipe) == ("∞ is the recipe without clipping or noise, on a schedule of its own "
                                               "(dp.nonprivate: steps 80; the DP points: steps 40, lr 0.0005)")
    same = {**recipe, "nonprivate": {"steps": 40, "lr": 5e-4}}
    assert report_curves.twin_text(same) == "∞ is the same recipe without clipping or noise"


def test_the_set_note_gives_chance_in_percent_and_names_raw_pixels_only_when_scored(tmp_path):
    """Chance is a fraction in metrics.json and a percentage in the note; the raw-pixels sentence explains a
    row, so it is there only when that row is."""
    metrics = metrics_json()
    s = metrics["sets"]["digits"]
    (note,) = [x["note"] for x in content.accuracy_sets(metrics, "caption", tmp_path, "σ/B = 0.005")]
    assert f"chance {100 * s['chance']:.1f}%" in note and "raw pixels" in note
    del s["results"]["pixels"], s["dp_versus"]["pixels"]
    (note,) = [x["note"] for x in content.accuracy_sets(metrics, "caption", tmp_path, "σ/B = 0.005")]
    assert "raw pixels" not in note


def test_the_privacy_card_of_a_run_not_private_as_a_whole_says_so():
    """The card's ε is ∞ then; its detail must say why, not read like a composition of private runs."""
    lp, models = {"dp": 0.822}, {"dp": {"label": "DP"}}

    def privacy_card(privacy):
        cards = content.summary_cards(a_ver(), {}, None, lp, {}, models, {}, "digits", privacy, "σ/B = 0.005")
        return next((v, d) for k, v, d in cards if k == "Privacy")

    value, detail = privacy_card({"private": False, "runs": 1, "epsilon_composed": math.inf})
    assert value == "ε = ∞" and "NOT PRIVATE as a whole" in detail
    value, detail = privacy_card({"private": True, "runs": 2, "epsilon_composed": 12.3})
    assert value == f"ε = {bound_text(12.3, 2)}" and "NOT PRIVATE" not in detail


def test_the_cards_give_the_primary_sets_accuracies_whatever_other_sets_follow(project):
    """With several eval sets the cards are the first set's (the headline's): a later set's rows must not
    stand in for them."""
    root, params = project
    metrics = metrics_json()
    other = {**metrics["sets"]["digits"], "results": {
        n: {**r, "linear_probe": 0.111, "linear_probe_ci": [0.1, 0.12]} for n, r in
        metrics["sets"]["digits"]["results"].items()}}
    metrics["sets"]["zzz-other"] = other  # sorts after the primary set in the key-sorted JSON
    write_json("results/eval/metrics.json", metrics)
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    md = (root / "results/report/report.md").read_text()
    for name, row in metrics_json()["sets"]["digits"]["results"].items():
        label = metrics["models"][name]["label"]
        assert f"| {label} | **{100 * row['linear_probe']:.1f}%** |" in md, name
    assert "**11.1%**" not in md


def test_the_reports_figures_draw_every_baseline_this_run_scored(project, monkeypatch):
    """The experiment plot shows synthetic, non-private and random init; the curve synthetic, random init
    and raw pixels: each with its own accuracy and interval from the primary set."""
    root, params = project
    metrics = metrics_json()
    metrics["privacy_utility"] = {"objective": "caption", "set": "digits", "n_probe_test": 270, "points": [
        {"init": "pretrain", "epsilon": e, "epsilon_spent": spent, "linear_probe": 0.8, "linear_probe_ci": [0.77, 0.83]}
        for e, spent in ((8, 7.9), ("inf", None))]}
    write_json("results/eval/metrics.json", metrics)
    drawn, pu, curve = {}, plots.plot_privacy_utility, plots.plot_curve
    monkeypatch.setattr(plots, "plot_privacy_utility", lambda p, b, path: drawn.update(pu=b) or pu(p, b, path))
    monkeypatch.setattr(plots, "plot_curve", lambda p, b, path: drawn.update(curve=b) or curve(p, b, path))
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    results, models = metrics["sets"]["digits"]["results"], metrics["models"]

    def expected(names):
        return {n: (models[n]["label"], results[n]["linear_probe"], results[n]["linear_probe_ci"]) for n in names}

    assert drawn["pu"] == expected(("synthetic", "nonprivate", "random"))
    assert drawn["curve"] == expected(("synthetic", "random", "pixels"))


@pytest.mark.parametrize("whole", [False, None])
def test_the_caption_explains_hollow_points_only_when_one_is_drawn(project, monkeypatch, whole):
    """A hollow point is a run known NOT PRIVATE as a whole (False); a run not yet known (None) is drawn
    filled, so the caption explains hollow points only for the former."""
    root, params = project
    params["dp"]["noise_seed"] = None
    params["curve"]["epsilons"] = [8]  # no ε = ∞ point: this run is private as a whole
    points = [{"epsilon": 2.0, "accuracy": 0.7, "objective": "caption", "current": False, "ci": None,
               "private_as_a_whole": whole}]
    monkeypatch.setattr(report, "experiment_points", lambda *a: (points, "1 DP model(s) in MLflow"))
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    md = (root / "results/report/report.md").read_text()
    assert ("A hollow point is a model DP at its ε from a run NOT PRIVATE as a whole" in md) == (whole is False)


def test_k_shot_columns_run_in_increasing_k_each_with_its_own_mean():
    """Columns are read left to right as more shots: 1, 5, 10, not in the order the JSON happened to hold."""
    few = {str(k): {"mean": k / 20, "std": 0.01} for k in (10, 1, 5)}
    s = {"results": {"dp": {"linear_probe": 0.8, "linear_probe_ci": [0.7, 0.9], "fewshot_logreg": few}}}
    columns, (row,) = report_render.accuracy_table(s, {"dp": {"label": "DP"}})
    assert columns == ["Linear probe", "1-shot", "5-shot", "10-shot"]
    assert [c[0] for c in row["cells"][1:]] == [0.05, 0.25, 0.5]


def test_the_markdown_table_bolds_the_best_in_each_column_only(project):
    """The legend says 'Bold: best in column': the highest linear probe (non-private, 90.0) is bold, the DP
    row's lower one is not."""
    root, params = project
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    md = (root / "results/report/report.md").read_text()
    assert "| Not private (DP-Cap without DP, ε = ∞) | **90.0 (86.3–93.3)** |" in md
    assert "| DP (DP-Cap) (σ/B = 0.00533) | 82.2 (77.4–86.7) |" in md


def test_a_figure_caption_from_mlflow_is_escaped_in_the_html(project, monkeypatch):
    """The privacy–utility caption carries MLflow's source line (an experiment's name is anyone's text):
    it must reach the page as text, not markup."""
    root, params = project
    monkeypatch.setattr(report, "experiment_points", lambda *a: ([], "MLflow experiment '<b>x</b>' not found"))
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    page = (root / "results/report/report.html").read_text()
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page


def test_the_accuracy_figure_draws_chance_in_percent_on_a_percent_axis(tmp_path, monkeypatch):
    """Bars are in % (0-100): the chance line must be on the same scale and the axis say %."""
    lines, axes = [], []
    axhline = Axes.axhline
    monkeypatch.setattr(Axes, "axhline", lambda ax, y, **kw: lines.append((y, kw.get("label"))) or axhline(ax, y, **kw))
    monkeypatch.setattr(plots, "_save", lambda fig, path: axes.append(fig.axes[0]) or plots.plt.close(fig))
    rows = [{"name": "dp", "label": "DP", "cells": [(0.822, None, [0.774, 0.867])]}]
    plots.plot_accuracy(["Linear probe"], rows, 0.102, tmp_path / "a.png")
    assert lines == [(pytest.approx(10.2), "chance (10%)")]
    assert "%" in axes[0].get_ylabel() and axes[0].get_ylim() == (0, 100)


def test_a_run_not_private_as_a_whole_is_drawn_hollow(tmp_path, monkeypatch):
    """The docstring's promise: such a model is DP at its ε but its run is not; the point is drawn with no
    fill, only a DP-coloured edge, and a private run's point filled."""
    drawn = []
    scatter = Axes.scatter
    monkeypatch.setattr(Axes, "scatter", lambda ax, x, y, **kw: drawn.append(
        (x, kw.get("marker"), kw["color"], kw["edgecolor"])) or scatter(ax, x, y, **kw))
    points = [{"epsilon": 2.0, "accuracy": 0.7, "objective": "mae", "current": False, "private_as_a_whole": False},
              {"epsilon": 4.0, "accuracy": 0.8, "objective": "mae", "current": False, "private_as_a_whole": True}]
    plots.plot_privacy_utility(points, {}, tmp_path / "p.png")
    dp = plots.MODEL_COLORS["dp"]
    assert drawn == [(2.0, "o", "none", dp), (4.0, "o", dp, "white")]


def test_the_experiment_plots_y_range_holds_each_points_interval(tmp_path, monkeypatch):
    """An error bar is cut off where the axes end: the y range must reach each logged interval's ends."""
    limits = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: limits.append(fig.axes[0].get_ylim()) or plots.plt.close(fig))
    ci = [0.6, 0.9]
    plots.plot_privacy_utility([{"epsilon": 4.0, "accuracy": 0.85, "objective": "mae", "current": False, "ci": ci}],
                               {}, tmp_path / "p.png")
    ((lo, hi),) = limits
    assert lo <= 100 * ci[0] and hi >= 100 * ci[1]


def test_the_curves_x_axis_is_labelled_epsilon(tmp_path, monkeypatch):
    """The curve's x ticks are ε values (and ∞): the label must say so."""
    axes = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: axes.append(fig.axes[0]) or plots.plt.close(fig))
    curve = [{"init": "pretrain", "epsilon": e, "linear_probe": 0.8, "linear_probe_ci": [0.75, 0.85]} for e in (1, 8)]
    plots.plot_curve(curve, {}, tmp_path / "c.png")
    assert axes[0].get_xlabel().startswith("ε") and "accuracy" in axes[0].get_ylabel()


def test_the_dp_loss_panel_draws_the_held_out_loss_at_its_steps(tmp_path, monkeypatch):
    """The right panel is the DP model's held-out loss (public data), never a training loss on private data."""
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or plots.plt.close(fig))
    dp_hist = {"step": [0, 10, 20], "metrics": [{"loss": 9.0, "heldout_loss": 3.0}, {"loss": 8.0},
                                                {"loss": 7.0, "heldout_loss": 2.0}]}
    plots.plot_losses(history("loss", range(0, 30, 10)), dp_hist, tmp_path / "l.png")
    (line,) = figures[0].axes[1].lines
    assert list(line.get_xdata()) == [0, 20] and list(line.get_ydata()) == [3.0, 2.0]


def test_a_run_from_before_the_adjacency_choice_counts_as_add_remove():
    """Runs that logged neither the tag nor the param predate replace-one: their ε is add/remove's, about half
    a replace-one ε, so counting them as replace-one would draw them on the wrong axis."""
    def run(tags=(), params=()):
        return SimpleNamespace(data=SimpleNamespace(tags=dict(tags), params=dict(params)))

    assert report_curves.adjacency_of(run()) == "add_remove"
    assert report_curves.adjacency_of(run(params={"privacy.adjacency": "replace_one"})) == "replace_one"
    assert report_curves.adjacency_of(run({"dpfm.adjacency": "add_remove"}, {"privacy.adjacency": "replace_one"})) \
        == "add_remove"


def test_a_pipe_in_a_markdown_cell_stays_in_its_cell(project):
    """report.md's tables split cells at `|`: a check's detail or an eval set's name holding one would
    spill into the next column and shift every cell after it. Each table row keeps its column count."""
    root, params = project
    ver = read_json(root / "results/privacy/verification.json")
    ver["checks"][0]["detail"] = "|z| ≤ 12.12 std"
    write_json(root / "results/privacy/verification.json", ver)
    report.run(params, SimpleNamespace(stage=stage("report"), tracker=RecordingTracker()))
    md = (root / "results/report/report.md").read_text()
    assert "| pass | sampler_is_poisson | \\|z\\| ≤ 12.12 std |" in md
    table = md.split("### Verification checks")[1].split("\n\n")[1].splitlines()
    assert {len(re.split(r"(?<!\\)\|", line)) for line in table} == {5}
