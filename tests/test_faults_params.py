"""dp-train's params and disk: contradictory dp params stop `dpfm dp-train` before any work (no image
decoded, no state, no secret key) with a message naming the problem, and a full disk during a
checkpoint write keeps the previous checkpoint and says so (and why the checkpoint is written through
a file object: torch.save to a path hides ENOSPC)."""

from __future__ import annotations

import errno

import pytest
import torch
from stage_runs import project

from pipeline import checkpoints
from pipeline import cli


@pytest.fixture
def no_tracking(monkeypatch):
    """In-process `dpfm` calls without an MLflow store (these tests are about the stage, not tracking)."""
    from contextlib import contextmanager

    from pipeline.tracking import NullRun

    monkeypatch.setattr("pipeline.tracking.stage_run", contextmanager(lambda *a, **kw: (yield NullRun())))


@pytest.mark.parametrize("override, message", [
    ("dp.epsilon=0.000001", "unreachable"),
    ("dp.delta=0.01", ">= 1/n"),
    ("dp.expected_batch_size=5000", "exceeds the 1258 usable private examples"),
    ("dp.sigma=0.1", "above the target dp.epsilon=8.0"),
])
def test_contradictory_dp_params_stop_dpfm_before_any_work(data_dir, tmp_path, monkeypatch, capsys, no_tracking,
                                                          override, message):
    work = project(data_dir, tmp_path)
    monkeypatch.chdir(work)
    decoded = []
    monkeypatch.setattr("pipeline.privacy.training.split_loader", lambda *a, **k: decoded.append(a))
    assert cli.main(["dp-train", "--set", override, "--set", "dp.noise_seed=null"]) == 2
    err = capsys.readouterr().err
    assert "dpfm: dp params (n=1258 usable private examples) is invalid:\n  - " in err and message in err
    assert "Traceback" not in err and not decoded  # no image decoded
    assert not (work / "models/dp").exists() and not (work / ".dpfm/state").exists()  # no state, no secret key


@pytest.mark.parametrize("carved", [True, False])
def test_a_held_out_split_carved_from_the_private_data_that_fails_to_read_names_it_to_the_owner_only(
        data_dir, tmp_path, monkeypatch, capsys, no_tracking, carved):
    """dp-train reads its held-out split before any step: carved out of the private data (shards.eval_fraction),
    a failed read's message (a member's key) reached stderr, and so logs/dp-train.log, in a traceback."""
    import json

    from pipeline.data.loader import BatchLoader

    work = project(data_dir, tmp_path)
    monkeypatch.chdir(work)
    stats = json.loads((work / "data/shards/stats.json").read_text())
    (work / "data/shards/stats.json").write_text(json.dumps({**stats, "eval_from_private": carved}))

    def unreadable(self, indices):
        raise ValueError("member private-key-000042.jpg is not what the index says")

    monkeypatch.setattr(BatchLoader, "load", unreadable)
    if not carved:  # a public split's failure is the user's to read whole
        with pytest.raises(ValueError, match="private-key-000042"):
            cli.main(["dp-train", "--set", "privacy.testing=true"])
        return
    assert cli.main(["dp-train", "--set", "privacy.testing=true"]) == 1
    err = capsys.readouterr().err
    assert "reading the held-out split carved out of the private data failed (ValueError)" in err
    assert "private-key-000042" not in err and "Traceback" not in err
    assert "private-key-000042" in (work / ".dpfm/owner/dp-train.log").read_text()


def test_disk_full_during_a_checkpoint_write_keeps_the_previous_one_and_says_so(data_dir, tmp_path, monkeypatch,
                                                                                capsys, no_tracking):
    work = project(data_dir, tmp_path)
    monkeypatch.chdir(work)
    real_save, saves = torch.save, []

    def full_disk(obj, f, *args, **kw):  # the second checkpoint meets a full disk half-way
        saves.append(1)
        if len(saves) == 2:
            f.write(b"\0" * 1000)
            with open("/dev/full", "wb") as full:  # a real ENOSPC from the kernel
                real_save(obj, full)
        return real_save(obj, f, *args, **kw)

    monkeypatch.setattr(torch, "save", full_disk)
    assert cli.main(["dp-train"]) == 1
    last_line = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    [state] = (work / ".dpfm/state").glob("dp-train-*")
    assert last_line == (f"dpfm: No space left on device while writing {state.relative_to(work)}/checkpoint.pt; "
                         "any previous checkpoint.pt is intact: free space and re-run")
    assert torch.load(state / "checkpoint.pt", weights_only=False)["step"] == 2
    assert sorted(p.name for p in state.iterdir()) == ["checkpoint.pt", "ledger.jsonl"]  # no temp file left


def test_a_full_disk_under_plain_torch_save_would_be_unreadable():
    """Why Checkpointer writes through a file object: torch.save(path) hides ENOSPC."""
    with pytest.raises(RuntimeError, match="unexpected pos"):
        torch.save({"x": torch.zeros(1000)}, "/dev/full")
    with pytest.raises(OSError) as e, open("/dev/full", "wb") as f:
        torch.save({"x": torch.zeros(1000)}, f)
    assert e.value.errno == errno.ENOSPC


@pytest.mark.parametrize("overrides, message", [
    (["dp.objective=clip"], "the clip model masks nothing"),
    (["dp.objective=caption"], "the caption model masks nothing"),
    (["dp.clipping=opacus-ghost", "dp.precision=fp32"], "opacus-ghost clips every row apart"),
])
def test_mask_views_where_nothing_masks_or_rows_are_clipped_apart_stop_dpfm_before_any_work(
        data_dir, tmp_path, monkeypatch, capsys, no_tracking, overrides, message):
    """dp.mask_views on CLIP or a captioner that masks nothing would train on copies; Opacus would clip
    each view as an example (up to K·C per example)."""
    work = project(data_dir, tmp_path)
    monkeypatch.chdir(work)
    decoded = []
    monkeypatch.setattr("pipeline.privacy.training.split_loader", lambda *a, **k: decoded.append(a))
    sets = sum((["--set", o] for o in [*overrides, "dp.mask_views=2", "dp.noise_seed=null"]), [])
    assert cli.main(["dp-train", *sets]) == 2
    err = capsys.readouterr().err
    assert "dpfm: dp params is invalid:\n  - " in err and message in err
    assert "Traceback" not in err and not decoded
    assert not (work / "models/dp").exists() and not (work / ".dpfm/state").exists()


def test_more_public_negatives_than_the_public_corpus_holds_stop_dpfm_before_any_work(
        data_dir, tmp_path, monkeypatch, capsys, no_tracking):
    """clip-public draws its negatives from the public caption corpus: asking for more than it holds
    is said plainly, before anything is charged or decoded."""
    work = project(data_dir, tmp_path)
    monkeypatch.chdir(work)
    decoded = []
    monkeypatch.setattr("pipeline.privacy.training.split_loader", lambda *a, **k: decoded.append(a))
    sets = ["--set", "dp.objective=clip-public", "--set", "model.public_negatives=100000", "--set", "dp.noise_seed=null"]
    assert cli.main(["dp-train", *sets]) == 2
    err = capsys.readouterr().err
    assert "dpfm: model params is invalid:\n  - model.public_negatives=100000, but the public caption corpus holds" in err
    assert "Traceback" not in err and not decoded
    assert not (work / "models/dp").exists() and not (work / ".dpfm/state").exists()


@pytest.mark.parametrize("frozen, more, message", [
    ("[encoder.block.0]", [], "dp.frozen names ['encoder.block.0'], which are not modules of the MaskedAutoencoder"),
    ("[encoder, decoder_embed, mask_token, decoder_blocks, decoder_norm, decoder_pred]", [],
     "freezes every parameter of the MaskedAutoencoder: nothing would train"),
    ("[encoder]", ["--set", "dp.encoder_clip_share=0.5"],
     "encoder_clip_share=0.5 gives the image encoder its own share of C, but none of its parameters trains"),
    ("[decoder_embed, mask_token, decoder_blocks, decoder_norm, decoder_pred]", ["--set", "dp.encoder_clip_share=0.5"],
     "encoder_clip_share=0.5 gives the rest of the model its own share of C, but none of its parameters trains"),
])
def test_frozen_modules_that_do_not_exist_or_leave_nothing_to_train_or_to_a_clip_group_stop_dpfm_before_any_work(
        data_dir, tmp_path, monkeypatch, capsys, no_tracking, frozen, more, message):
    """Checked before anything is charged to the data's budget or decoded: a misspelt name would
    otherwise train every module, or stop a run that had already charged its ε."""
    work = project(data_dir, tmp_path)
    monkeypatch.chdir(work)
    decoded = []
    monkeypatch.setattr("pipeline.privacy.training.split_loader", lambda *a, **k: decoded.append(a))
    assert cli.main(["dp-train", "--set", f"dp.frozen={frozen}", *more, "--set", "dp.noise_seed=null"]) == 2
    err = capsys.readouterr().err
    assert "dpfm: dp params is invalid:\n  - " in err and message in err
    assert "Traceback" not in err and not decoded
    assert not (work / "models/dp").exists() and not (work / ".dpfm/state").exists()


@pytest.mark.parametrize("overrides, message", [
    (["dp.noise_seed=5", "privacy.testing=false"], "dp.noise_seed fixes the noise key"),
    (["dp.nonprivate_baseline=true", "privacy.nonprivate_on_private_data=false"],
     "dp.nonprivate_baseline trains WITHOUT differential privacy"),
])
def test_what_voids_privacy_is_refused_before_any_work(data_dir, tmp_path, monkeypatch, capsys, no_tracking,
                                                       overrides, message):
    """A known noise key (finding: two runs with the same seed drew the same batches and noise and were
    composed as independent) and non-private training on private data need to be asked for by name."""
    work = project(data_dir, tmp_path)
    monkeypatch.chdir(work)
    assert cli.main(["dp-train", *sum((["--set", o] for o in overrides), [])]) == 2
    err = capsys.readouterr().err
    assert "privacy is invalid" in err and message in err and "Traceback" not in err
    assert not (work / "models/dp").exists() and not (work / ".dpfm/state").exists()


@pytest.mark.parametrize("objective", ["mae", "caption", "clip"])
def test_a_known_noise_key_runs_only_as_a_test_and_is_never_private(data_dir, tmp_path, monkeypatch, local_mlflow,
                                                                     objective):
    """Saved `private: false`, verified, and never registered: the registry holds no model, and every
    MLflow run of it says NOT PRIVATE with the reason."""
    import mlflow

    work = project(data_dir, tmp_path)
    monkeypatch.chdir(work)
    sets = ["dp.noise_seed=5", "privacy.testing=true", "dp.steps=2", "model.size=micro", "model.img_size=16",
            "dp.init=random", f"dp.objective={objective}"]
    assert cli.main(["dp-train", *sum((["--set", o] for o in sets), [])]) == 0
    assert checkpoints.load(work / "models/dp/checkpoint.pt").private is False
    assert cli.main(["verify", *sum((["--set", o] for o in sets), [])]) == 0
    client = mlflow.tracking.MlflowClient()
    assert client.search_registered_models() == []
    runs = client.search_runs([client.get_experiment_by_name("dpfm").experiment_id])
    assert {r.data.tags["dpfm.stage"] for r in runs} == {"dp-train", "verify"}
    assert all(r.data.tags.get("dpfm.private") == "false" and "a test run" in r.data.tags["dpfm.not_private"]
               for r in runs), [r.data.tags for r in runs]


def test_a_run_that_publishes_what_its_epsilon_does_not_cover_is_not_private_as_a_whole():
    """Under add/remove neighbours n itself is private, and the run publishes it exactly (the ledger,
    MLflow, the report); dp.log_private_stats publishes the non-finite count; the twin and the curve's
    ε = ∞ point train without DP; an eval split carved out of the private data is scored in public: the
    ε covers the model, not the run's outputs."""
    import yaml

    from pipeline.privacy import release

    from pathlib import Path

    params = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    params["privacy"]["testing"], params["dp"]["noise_seed"], params["curve"]["epsilons"] = False, None, [8]
    params["dp"]["nonprivate_baseline"] = False
    assert release.not_private_reasons(params, {}) == []
    params["privacy"]["adjacency"] = "add_remove"
    assert release.not_private_reasons(params, {}) == [
        "privacy.adjacency add_remove: its ε does not cover the exact n the run publishes (replace_one covers it)"]
    params["privacy"]["adjacency"], params["dp"]["log_private_stats"] = "replace_one", True
    assert release.not_private_reasons(params, {}) == ["dp.log_private_stats publishes the non-finite count outside ε"]
    params["dp"]["log_private_stats"], params["curve"]["epsilons"] = False, [8, float("inf")]
    [reason] = release.not_private_reasons(params, {})
    assert reason == "the curve's ε = ∞ point trains without DP on the private shards"
    params["curve"]["inits"] = []  # a curve of no init trains no point: its ∞ is never trained
    assert release.not_private_reasons(params, {}) == []
    params["dp"]["nonprivate_baseline"] = True  # the ε = ∞ twin
    assert release.not_private_reasons(params, {}) == ["dp.nonprivate_baseline trains without DP on the private shards"]
    params["dp"]["nonprivate_baseline"] = False
    assert release.not_private_reasons(params, {"eval_from_private": True}) == [
        "the eval split is carved out of the private data (shards.eval_fraction)"]
    # A known noise key voids the noise whatever privacy.testing says (dp-train refuses the pair; a
    # checkpoint or a run made before that check is judged the same).
    params["dp"]["noise_seed"] = 7
    assert release.not_private_reasons(params, {}) == [
        "a test run (privacy.testing; a known dp.noise_seed voids the noise)"]
    # privacy.testing alone too: its checkpoint is saved private=False and never registered.
    params["dp"]["noise_seed"], params["privacy"]["testing"] = None, True
    assert release.not_private_reasons(params, {}) == [
        "a test run (privacy.testing; a known dp.noise_seed voids the noise)"]


def test_published_params_hide_a_noise_key_and_leave_the_run_its_own():
    """The report's params and a checkpoint's config are published: a key in them would let anyone who
    reads it subtract the noise."""
    import json

    from pipeline.privacy import release

    params = {"dp": {"noise_seed": 918273645, "lr": 0.1}, "run": {"seed": 0}}
    shown = release.public_params(params)
    assert shown == {"dp": {"noise_seed": "(set; hidden)", "lr": 0.1}, "run": {"seed": 0}}
    assert "918273645" not in json.dumps(shown) and params["dp"]["noise_seed"] == 918273645
    assert release.public_params({"dp": {"noise_seed": None}})["dp"]["noise_seed"] is None


@pytest.mark.parametrize("source, explicit, allowed", [
    ("digits", None, True), ("fashion-mnist", None, True), ("urls", None, False), ("img2dataset", None, False),
    ("urls", True, True), ("digits", False, False)])
def test_nonprivate_training_on_private_data_is_opt_in_for_web_sources(source, explicit, allowed):
    from pipeline.config import ParamsError
    from pipeline.privacy import release

    privacy = {"nonprivate_on_private_data": explicit, "testing": False}
    assert release.nonprivate_allowed(privacy, source) is allowed
    if allowed:
        release.check_nonprivate(privacy, source, "the curve's ε = ∞ point")
    else:
        with pytest.raises(ParamsError, match="WITHOUT differential privacy"):
            release.check_nonprivate(privacy, source, "the curve's ε = ∞ point")


def test_the_workflow_start_refuses_what_dp_train_would_from_the_params_alone():
    """`dpfm validate` (release.check_asked_for, as a workflow starts) refuses the ε = ∞ twin on a web source
    and a known noise key, each as dp-train would, before a stage holds a GPU; asked for by name, each passes."""
    from pathlib import Path

    import yaml

    from pipeline.config import ParamsError
    from pipeline.privacy import release

    params = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    params["privacy"]["testing"], params["dp"]["noise_seed"], params["curve"]["epsilons"] = False, None, [8]
    params["shards"]["source"], params["dp"]["nonprivate_baseline"] = "urls", False
    release.check_asked_for(params)  # nothing outside ε asked for
    params["dp"]["nonprivate_baseline"] = True
    with pytest.raises(ParamsError, match="dp.nonprivate_baseline trains WITHOUT differential privacy"):
        release.check_asked_for(params)
    params["privacy"]["nonprivate_on_private_data"] = True
    release.check_asked_for(params)
    params["dp"]["nonprivate_baseline"], params["dp"]["noise_seed"] = False, 5
    with pytest.raises(ParamsError, match="dp.noise_seed fixes the noise key"):
        release.check_asked_for(params)
    params["privacy"]["testing"] = True
    release.check_asked_for(params)


def test_a_negative_thread_count_is_refused_by_its_option(capsys):
    """`--threads -3` reached torch.set_num_threads and ended in its traceback."""
    from pipeline import cli

    with pytest.raises(SystemExit) as stopped:
        cli.main(["verify", "--threads", "-3"])
    assert stopped.value.code == 2 and "--threads: must be 0 (every core) or more, got -3" in capsys.readouterr().err


@pytest.mark.parametrize("stage_name,missing,maker", [("report", "results/privacy/verification.json", "verify"),
                                                     ("curve", "data/shards/stats.json", "shards"),
                                                     ("evaluate", "results/privacy/verification.json", "verify")])
def test_a_stage_run_before_its_input_names_the_stage_that_makes_it(in_tmp, no_tracking, capsys, stage_name,
                                                                    missing, maker):
    """`dpfm report` in a fresh project printed `[Errno 2] No such file or directory: '...'`."""
    from pipeline import cli

    assert cli.main([stage_name]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dpfm: {missing} is missing: `dpfm {maker}` makes it (snakemake runs every stage it needs)")
