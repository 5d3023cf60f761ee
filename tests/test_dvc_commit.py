"""What a Snakemake run versions in DVC (pipeline/dvc_commit.py): the stages it finished, under params.yaml's
values. Committing every stage wrote params.yaml's values into dvc.lock beside outputs a partial run never
remade, and a `--config` override's outputs beside params.yaml's values."""

import json
import os
from pathlib import Path

import pytest

from pipeline import dvc_commit
from pipeline.dvc_cache import cache_dir, recorded_files
from pipeline.config import load_params
from pipeline.stages import stage
from pipeline.tracking import PARENT_ENV


@pytest.fixture
def dvc_calls(in_tmp, monkeypatch):
    calls = []
    monkeypatch.setattr(dvc_commit.subprocess, "run", lambda args, **kw: calls.append(args[4:]) or
                        dvc_commit.subprocess.CompletedProcess(args, 0, "", ""))
    return calls


def finish(monkeypatch, parent, *stage_names, params=None):
    monkeypatch.setenv(PARENT_ENV, parent)
    for name in stage_names:  # as each job's `dpfm <stage>` does once it succeeds
        dvc_commit.record_done(name, params or load_params())


def test_a_run_commits_the_stages_it_ran_and_no_other(dvc_calls, monkeypatch, capsys):
    """`snakemake synthetic` after dp.lr was edited: committing dp-train too recorded the new lr beside the
    model trained with the old one, and `dvc status` called it up to date."""
    finish(monkeypatch, "run-1", "synthetic", "pretrain")
    dvc_commit.commit_run("run-1", load_params())
    assert dvc_calls == [["--force", "--quiet", "pretrain", "synthetic"]]
    assert "DVC: outputs of pretrain, synthetic cached" in capsys.readouterr().out
    assert not (dvc_commit.DONE_ROOT / "run-1").exists()  # spent
    dvc_commit.commit_run("run-2", load_params())  # a run that ran nothing (all up to date, or --touch)
    assert dvc_calls == [["--force", "--quiet", "pretrain", "synthetic"]]


def test_stages_a_failed_run_finished_are_committed_by_the_next_run(dvc_calls, monkeypatch):
    """dp-train finished, then evaluate failed: the next run skips dp-train as up to date, and committed
    only what it ran, so dvc.lock never had dp-train and `dvc repro` trained it (and charged the budget)
    again. A stage an earlier run finished under params edited since (its newest marker says which), or
    whose outputs are gone (a later run failed in it: Snakemake deletes them), is not committed."""
    finish(monkeypatch, "run-0", "tokenizer")  # the oldest run: params.yaml's tokenizer...
    finish(monkeypatch, "run-1", "tokenizer", params=load_params(overrides=["tokenizer.vocab_size=300"]))
    os.utime(dvc_commit.DONE_ROOT / "run-0/tokenizer", ns=(10**18, 10**18))  # ...then another, which is what
    os.utime(dvc_commit.DONE_ROOT / "run-1/tokenizer", ns=(2 * 10**18, 2 * 10**18))  # models/tokenizer holds
    finish(monkeypatch, "run-1", "pretrain", "dp-train", params=load_params(overrides=["pretrain.lr=0.5"]))
    finish(monkeypatch, "run-1", "synthetic", "verify")  # then run-1 fails: no commit
    finish(monkeypatch, "run-2", "verify", "evaluate")
    for out in stage("dp-train").all_outputs + stage("tokenizer").all_outputs:  # synthetic's are gone
        Path(out).mkdir(parents=True) if out.endswith("/") else Path(out).touch()
    dvc_commit.commit_run("run-2", load_params())
    assert dvc_calls == [["--force", "--quiet", "dp-train", "evaluate", "verify"]]
    assert not dvc_commit.DONE_ROOT.exists()  # every marker spent: pretrain's and the tokenizer's are stale


def test_stages_run_with_config_overrides_are_not_committed(dvc_calls, monkeypatch, capsys):
    """`snakemake --config dp='{epsilon: 16}'`: dvc.lock recorded params.yaml's ε = 8 beside a model trained at
    ε = 16, a stronger guarantee than the one it has."""
    finish(monkeypatch, "run-1", "synthetic", "dp-train", "verify")
    overridden = load_params(overrides=["dp.epsilon=16"])
    dvc_commit.commit_run("run-1", overridden)
    assert dvc_calls == [["--force", "--quiet", "synthetic"]]  # its params are params.yaml's
    said = capsys.readouterr().err
    assert "DVC does not version dp-train, verify: they ran with params other than params.yaml's" in said


def test_a_stage_run_by_hand_marks_nothing(in_tmp, monkeypatch):
    monkeypatch.delenv(PARENT_ENV, raising=False)
    dvc_commit.record_done("dp-train", load_params())
    assert not dvc_commit.DONE_ROOT.exists() and not os.path.exists(".dpfm/snakemake-done")


def test_a_params_file_broken_during_the_run_versions_nothing(dvc_calls, monkeypatch, capsys):
    finish(monkeypatch, "run-1", "synthetic")
    config = load_params()
    with open("params.yaml", "a") as f:
        f.write("unknown_section: 1\n")
    dvc_commit.commit_run("run-1", config)
    assert dvc_calls == [] and "DVC does not version this run: params.yaml is invalid" in capsys.readouterr().err


def test_the_cache_is_the_one_dvc_uses_its_local_config_first(tmp_path):
    """DVC reads .dvc/config.local over .dvc/config: a shared cache named in config, a private one in
    config.local (as `dvc cache dir --local` writes it), is sealed and read where DVC writes."""
    (tmp_path / ".dvc").mkdir()
    assert cache_dir(tmp_path) == tmp_path / ".dvc" / "cache"
    (tmp_path / ".dvc/config").write_text("[cache]\n    dir = ../shared-cache\n")
    assert cache_dir(tmp_path) == (tmp_path / "shared-cache").resolve()
    (tmp_path / ".dvc/config.local").write_text("[cache]\n    dir = /srv/own-cache\n")
    assert cache_dir(tmp_path) == Path("/srv/own-cache")


def test_a_cache_set_for_the_user_or_the_machine_is_the_one_dvc_uses_when_the_checkout_sets_none(tmp_path,
                                                                                                 monkeypatch):
    """`dvc cache dir --global` (a team's shared cache) over `--system`, each relative to its own file and
    `~` expanded: the budget's key lands there at `dvc add`, so that is the cache named and read."""
    user, machine, home = (tmp_path / name for name in ("user", "machine", "home"))
    for directory in (user, machine, home, tmp_path / ".dvc"):
        directory.mkdir()
    monkeypatch.setenv("DVC_GLOBAL_CONFIG_DIR", str(user))
    monkeypatch.setenv("DVC_SYSTEM_CONFIG_DIR", str(machine))
    monkeypatch.setenv("HOME", str(home))
    (machine / "config").write_text("[cache]\n    dir = site-cache\n")
    assert cache_dir(tmp_path) == (machine / "site-cache").resolve()
    (user / "config").write_text("[cache]\n    dir = ~/team-cache\n")
    assert cache_dir(tmp_path) == (home / "team-cache").resolve()
    (tmp_path / ".dvc/config").write_text("[cache]\n    dir = ../shared-cache\n")
    assert cache_dir(tmp_path) == (tmp_path / "shared-cache").resolve()


def make_outputs(*stage_names, skip=()):
    for name in stage_names:
        for out in stage(name).all_outputs:
            if out not in skip:
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                Path(out).mkdir(parents=True) if out.endswith("/") else Path(out).touch()


def test_a_stage_a_failed_run_finished_under_params_yamls_values_is_committed(dvc_calls, monkeypatch):
    """The positive case for a stage other than dp-train: the marker must hold that stage's own params
    digest, or the tokenizer a failed run finished is never versioned."""
    finish(monkeypatch, "run-1", "tokenizer")  # then run-1 fails
    finish(monkeypatch, "run-2", "synthetic")
    make_outputs("tokenizer")
    dvc_commit.commit_run("run-2", load_params())
    assert dvc_calls == [["--force", "--quiet", "synthetic", "tokenizer"]]


def test_the_newest_marker_wins_by_time_not_by_run_name(dvc_calls, monkeypatch):
    """Run ids are random: the run named "a" may be the newer one. Its tokenizer (vocab 300) is what
    models/tokenizer holds, so params.yaml's tokenizer (the older run "b") must not be committed."""
    finish(monkeypatch, "b", "tokenizer")  # older, params.yaml's values
    finish(monkeypatch, "a", "tokenizer", params=load_params(overrides=["tokenizer.vocab_size=300"]))  # newer
    os.utime(dvc_commit.DONE_ROOT / "b/tokenizer", ns=(10**18, 10**18))
    os.utime(dvc_commit.DONE_ROOT / "a/tokenizer", ns=(2 * 10**18, 2 * 10**18))
    finish(monkeypatch, "run-3", "synthetic")
    make_outputs("tokenizer")
    dvc_commit.commit_run("run-3", load_params())
    assert dvc_calls == [["--force", "--quiet", "synthetic"]]


def test_an_earlier_stage_with_any_output_missing_is_not_committed(dvc_calls, monkeypatch):
    """report's directory is there but its metrics file (privacy.json) is not: committing it would
    record a version DVC cannot cache."""
    finish(monkeypatch, "run-1", "report")
    finish(monkeypatch, "run-2", "synthetic")
    metrics = [o for o in stage("report").all_outputs if not o.endswith("/")]
    assert metrics and any(o.endswith("/") for o in stage("report").all_outputs)
    make_outputs("report", skip=metrics)
    dvc_commit.commit_run("run-2", load_params())
    assert dvc_calls == [["--force", "--quiet", "synthetic"]]


def test_a_stage_this_run_overrode_is_not_committed_through_an_earlier_runs_marker(dvc_calls, monkeypatch, capsys):
    """run-0 trained dp-train under params.yaml's ε; run-2 retrained it at ε = 16 (--config). The model on
    disk is run-2's: dp-train must not be committed (and not twice), whatever run-0's marker says."""
    finish(monkeypatch, "run-0", "dp-train")
    os.utime(dvc_commit.DONE_ROOT / "run-0/dp-train", ns=(10**18, 10**18))
    overridden = load_params(overrides=["dp.epsilon=16"])
    finish(monkeypatch, "run-2", "dp-train", "synthetic", params=overridden)
    make_outputs("dp-train", "synthetic")
    dvc_commit.commit_run("run-2", overridden)
    assert dvc_calls == [["--force", "--quiet", "synthetic"]]
    assert "DVC does not version dp-train" in capsys.readouterr().err


def test_a_run_whose_every_stage_was_overridden_commits_nothing(dvc_calls, monkeypatch, capsys):
    """`dvc commit` with no targets commits every stage in dvc.yaml: with nothing to commit, it must not run."""
    overridden = load_params(overrides=["dp.epsilon=16"])
    finish(monkeypatch, "run-1", "dp-train", params=overridden)
    dvc_commit.commit_run("run-1", overridden)
    assert dvc_calls == []
    assert "DVC does not version dp-train" in capsys.readouterr().err


def test_a_failed_dvc_commit_is_reported_even_when_silent(in_tmp, monkeypatch, capsys):
    monkeypatch.setattr(dvc_commit.subprocess, "run", lambda args, **kw:
                        dvc_commit.subprocess.CompletedProcess(args, 1, "", ""))
    finish(monkeypatch, "run-1", "synthetic")
    dvc_commit.commit_run("run-1", load_params())
    said = capsys.readouterr()
    assert "`dvc commit` failed" in said.err and "DVC: outputs of" not in said.out


def test_a_params_file_broken_during_the_run_still_spends_every_marker(dvc_calls, monkeypatch):
    """Markers left behind are read by the next run as stages an earlier run finished."""
    finish(monkeypatch, "run-1", "synthetic")
    config = load_params()
    with open("params.yaml", "a") as f:
        f.write("unknown_section: 1\n")
    dvc_commit.commit_run("run-1", config)
    assert dvc_calls == [] and not dvc_commit.DONE_ROOT.exists()


def test_only_a_directory_version_in_the_cache_is_listed_with_its_cached_files(in_tmp):
    """A pointer recording a directory lists its files' cache objects; one recording a single file, or a
    directory whose listing `dvc fetch` has not brought, lists nothing."""
    objects = Path(".dvc/cache/files/md5")
    (objects / "ab").mkdir(parents=True)
    (objects / "ab" / ("c" * 30 + ".dir")).write_text(json.dumps([{"relpath": "runs.jsonl", "md5": "de" + "f" * 30}]))
    (objects / "ab" / ("c" * 30)).write_text("a single file's bytes")
    for name, md5 in (("dir", "ab" + "c" * 30 + ".dir"), ("file", "ab" + "c" * 30), ("unfetched", "01" * 16 + ".dir")):
        Path(f"{name}.dvc").write_text(f"outs:\n- md5: {md5}\n  path: {name}\n")
    assert recorded_files(Path("dir.dvc")) == {"runs.jsonl": objects / "de" / ("f" * 30)}
    assert recorded_files(Path("file.dvc")) is None and recorded_files(Path("unfetched.dvc")) is None
