"""What a Snakemake run versions in DVC: the stages it ran, as params.yaml states them. `dvc commit` of
every stage at the end of a run wrote params.yaml's values into dvc.lock beside outputs made under
others: a stage a partial run did not reach (params edited since it ran), or a run with `--config`
overrides; `dvc status` then called stale outputs up to date."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pipeline.tracking import PARENT_ENV

# A marker per stage a Snakemake run (its MLflow parent) finished, holding the digest of its params.
DONE_ROOT = Path(".dpfm/snakemake-done")


def record_done(stage_name: str, params: dict) -> None:
    """Mark `stage_name` finished, with `params`, by the Snakemake run this job belongs to (none when run
    by hand)."""
    from pipeline.stages import params_digest

    parent = os.environ.get(PARENT_ENV)
    if parent:
        (DONE_ROOT / parent).mkdir(parents=True, exist_ok=True)
        (DONE_ROOT / parent / stage_name).write_text(params_digest(params, stage_name))


def stages_to_commit(parent: str, config: dict, params_path: str = "params.yaml") -> tuple[list[str], list[str]]:
    """(the stages to commit, those the run finished under params other than params.yaml's).

    Besides the run's own, the stages earlier runs finished before they failed: the next run skips them
    as up to date, so they were never committed (dvc repro trained such a dp-train, and charged the
    budget, again). Each is committed when its params are params.yaml's now, as its marker records, and
    its outputs are still there."""
    from pipeline.config import load_params
    from pipeline.stages import params_digest, stage, tracked

    on_disk = load_params(params_path)
    done = sorted(p.name for p in (DONE_ROOT / parent).glob("*")) if (DONE_ROOT / parent).is_dir() else []
    earlier = {}  # stage -> its newest marker of an earlier run
    for marker in sorted(DONE_ROOT.glob("*/*"), key=lambda m: m.stat().st_mtime_ns):
        if marker.parent.name != parent and marker.name not in done:
            earlier[marker.name] = marker

    def same(name: str) -> bool:
        sections = stage(name).sections
        return json.dumps(tracked(config, sections), sort_keys=True) == json.dumps(tracked(on_disk, sections),
                                                                                   sort_keys=True)
    kept = [n for n, m in earlier.items() if m.read_text() == params_digest(on_disk, n)
            and all(Path(out).exists() for out in stage(n).all_outputs)]  # not deleted since by a failed rerun
    return sorted([n for n in done if same(n)] + kept), [n for n in done if not same(n)]


def commit_run(parent: str, config: dict, python: str = sys.executable) -> None:
    """`dvc commit` the stages this run finished, with a line saying what DVC now versions."""
    from pipeline.config import ParamsError

    try:
        committed, overridden = stages_to_commit(parent, config)
    except ParamsError as e:  # params.yaml edited during the run into one that does not validate
        print(f"\nWARNING: DVC does not version this run: {e}", file=sys.stderr)
        return
    finally:
        shutil.rmtree(DONE_ROOT, ignore_errors=True)  # every run's markers: those not committed are stale
    if overridden:
        print(f"\nWARNING: DVC does not version {', '.join(overridden)}: they ran with params other than "
              "params.yaml's (--config), which dvc.lock would record; set them in params.yaml and run again",
              file=sys.stderr)
    if not committed:
        return
    done = subprocess.run([python, "-m", "dvc", "commit", "--force", "--quiet", *committed], capture_output=True,
                          text=True)
    if done.returncode:
        print(f"\nWARNING: `dvc commit` failed, so DVC does not version this run:\n{done.stderr.strip()}",
              file=sys.stderr)
    else:
        print(f"\nDVC: outputs of {', '.join(committed)} cached and recorded in dvc.lock (`git add dvc.lock`, "
              "then `dvc push`)")
