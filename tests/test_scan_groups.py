"""The shards stage's scan scattered over Snakemake jobs (rules/scan.smk, index.scan_group): the DAG
it plans, the same index for any number of groups, and scan jobs that resume from the per-shard cache."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from shard_data import write_set
from snakemake_project import planned_rules, set_params, snakemake_project

from pipeline.cli import main
from pipeline.config import ParamsError
from pipeline.data import index
from pipeline.data.index import shard_group
from pipeline.data.shards import ShardDataset
from pipeline.progress import ShareBar
from pipeline.stages import shards as shards_stage

BIN = Path(sys.executable).parent
STAGE_RULES = {"shards", "synthetic", "tokenizer", "pretrain", "dp_train", "verify", "curve", "evaluate", "report"}


def snakemake(work: Path, *args: str) -> str:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([str(BIN / "snakemake"), "--cores", "2", *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


def web_project(work: Path, shards_dir: Path, **shards) -> Path:
    """A project whose private data are the five local tar shards in `shards_dir` (a `urls` source)."""
    snakemake_project(work)
    set_params(work, {"shards": {"source": "urls", "urls": [str(shards_dir / "s-{000000..000004}.tar")],
                                 "image_size": 8, "eval_fraction": 0.3, **shards},  # both splits to compare
                      "curve": {"epsilons": [2]}})  # an ε = ∞ point on a web source is refused as the run starts
    return work


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("web")
    write_set(directory, n=50, per_shard=10)
    return directory


@pytest.fixture(scope="module")
def two_and_one_groups(tmp_path_factory, shards_dir):
    """`snakemake data/shards` with 2 scan groups and with 1, each in its own project and cache."""
    runs = {}
    for groups in (2, 1):
        work = web_project(tmp_path_factory.mktemp(f"groups{groups}"), shards_dir, scan_groups=groups)
        runs[groups] = work, snakemake(work, "data/shards")
    return runs


# -- the split -----------------------------------------------------------------------------------------

def test_groups_are_contiguous_near_equal_slices_that_make_up_the_list():
    for n in (0, 1, 5, 10, 101):
        urls = [f"s{i}.tar" for i in range(n)]
        for groups in (1, 2, 3, 7):
            parts = [shard_group(urls, g, groups) for g in range(groups)]
            assert sum(parts, []) == urls
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError, match="not in 0..2"):
        shard_group(["a.tar"], 3, 3)


def test_only_sources_scanned_where_they_live_have_scan_jobs():
    with pytest.raises(ParamsError, match="not scanned in groups"):
        shards_stage.scan({"shards": {"source": "download"}}, 0, 1, threads=1)


# -- the DAG -------------------------------------------------------------------------------------------

def test_dry_run_plans_one_scan_job_per_group_then_the_shards_gather(tmp_path, shards_dir):
    out = snakemake(web_project(tmp_path, shards_dir, scan_groups=3), "-n", "-p")
    jobs = re.findall(r"^(?:local)?rule (\w+):", out, flags=re.M)
    assert jobs.count("scan_shards") == 3 and jobs.count("shards") == 1
    assert max(i for i, j in enumerate(jobs) if j == "scan_shards") < jobs.index("shards")
    summaries = [f"data/cache/scan/groups/{g}-of-3.json" for g in range(3)]
    gather = out.split("rule shards:\n")[1].split("\n\n")[0]
    assert f"input: {', '.join(summaries)}" in gather
    assert set(re.findall(r"--group (\d) --groups 3 ", out)) == {"0", "1", "2"}
    assert planned_rules(out) == STAGE_RULES | {"scan_shards"}


@pytest.mark.parametrize("source", ["digits", "download"])
def test_digits_and_download_plan_no_scan_jobs(tmp_path, source):
    work = snakemake_project(tmp_path)
    set_params(work, {"shards": {"source": source, "path": "pairs.parquet", "scan_groups": 3}, "curve": {"epsilons": [2]}})
    out = snakemake(work, "-n")
    assert planned_rules(out) == STAGE_RULES and "scan_shards" not in out


# -- real runs -----------------------------------------------------------------------------------------

def test_two_scan_groups_give_the_same_index_as_one(two_and_one_groups):
    (two, _), (one, _) = two_and_one_groups[2], two_and_one_groups[1]
    for split in ("private", "eval"):
        rows = [pq.read_table(w / "data/shards" / split / "index.parquet").to_pylist() for w in (two, one)]
        assert rows[0] == rows[1] and rows[0]
    stats = json.loads((two / "data/shards/stats.json").read_text())
    assert stats == json.loads((one / "data/shards/stats.json").read_text())
    assert stats["private"]["usable"] == len(ShardDataset(two / "data/shards/private"))
    assert stats["private"]["usable"] + stats["eval"]["usable"] == 50


def test_each_group_scans_its_slice_and_the_gather_only_merges(two_and_one_groups):
    work, out = two_and_one_groups[2]
    summaries = [json.loads((work / f"data/cache/scan/groups/{g}-of-2.json").read_text()) for g in range(2)]
    assert [s["shards"] for s in summaries] == [2, 3] and all(s["listed"] == 5 for s in summaries)
    assert [s["scanned"] for s in summaries] == [2, 3] and not any("samples" in s for s in summaries)
    # The gather found every scan in the cache; the count is the owner's (unreadable shards are never
    # cached), so the published log does not say it.
    assert "5 of 5 shard scans found in the cache" in (work / ".dpfm/owner/shards.log").read_text()
    assert "found in the cache" not in (work / "logs/shards.log").read_text()
    assert planned_rules(out) == {"scan_shards", "shards"}


def test_scheduling_changes_replan_nothing_and_a_split_change_only_the_gather(two_and_one_groups):
    work, _ = two_and_one_groups[2]
    assert planned_rules(snakemake(work, "-n", "data/shards")) == set()
    original = (work / "params.yaml").read_text()
    try:
        set_params(work, {"shards": {"workers": 2}})  # scan processes: the index is the same
        assert planned_rules(snakemake(work, "-n", "data/shards")) == set()
        set_params(work, {"shards": {"eval_fraction": 0.5}})  # the split, not the scans
        assert planned_rules(snakemake(work, "-n", "data/shards")) == {"shards"}
    finally:
        (work / "params.yaml").write_text(original)


def test_rerunning_a_group_takes_every_scan_from_the_cache(two_and_one_groups, monkeypatch):
    work, _ = two_and_one_groups[2]
    monkeypatch.chdir(work)

    def rescan(url, check_size):
        raise AssertionError(f"{url} was scanned again")

    monkeypatch.setattr(index, "scan_shard", rescan)  # a rescan would be counted as a skipped shard
    assert main(["scan-shards", "--group", "1", "--groups", "2", "--threads", "1", "--summary", "again.json"]) == 0
    summary = json.loads((work / "again.json").read_text())
    assert (summary["shards"], summary["cached"], summary["scanned"], summary["skipped"]) == (3, 3, 0, [])


def test_a_share_bar_prints_the_same_lines_whatever_its_total_an_empty_group_too(capsys):
    """A scan group's bar is published (logs/scan_shards/{g}.log); with more groups than shards, the groups
    left empty stayed at 0% while the others reached 100%: how many shards img2dataset finished, which
    is the owner's."""
    shown = []
    for total in (0, 1, 3, 250):
        with ShareBar(total, "scan shards") as bar:
            for _ in range(total):
                bar.update()
        shown.append(capsys.readouterr().err)
    assert len(set(shown)) == 1 and "100%" in shown[0], shown


def test_a_share_bar_reads_100_percent_once_every_piece_is_done_before_it_closes(capsys):
    with ShareBar(3, "scan shards") as bar:
        for _ in range(3):
            bar.update()
        assert bar.bar.n == 100 and "100%" in capsys.readouterr().err


def test_a_share_bar_cut_short_by_a_failure_stays_at_the_share_done(capsys):
    with pytest.raises(RuntimeError), ShareBar(4, "download") as bar:
        bar.update()
        raise RuntimeError("a download failed")
    shown = capsys.readouterr().err
    assert "25%" in shown and "100%" not in shown, shown
