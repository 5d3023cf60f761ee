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

DONE_ROOT = Path(".dpfm/snakemake-done")  # a marker per stage a Snakemake run (its MLflow parent) finished


def record_done(stage_name: str) -> None:
    """Mark `stage_name` finished by the Snakemake run this job belongs to (none when run by hand)."""
    parent = os.environ.get(PARENT_ENV)
    if parent:
        (DONE_ROOT / parent).mkdir(parents=True, exist_ok=True)
        (DONE_ROOT / parent / stage_name).touch()


def stages_to_commit(parent: str, config: dict, params_path: str = "params.yaml") -> tuple[list[str], list[str]]:
    """(the stages the run finished under params.yaml's values, those it finished under others)."""
    from pipeline.config import load_params
    from pipeline.stages import stage, tracked

    done = sorted(p.name for p in (DONE_ROOT / parent).glob("*")) if (DONE_ROOT / parent).is_dir() else []
    on_disk = load_params(params_path)

    def same(name: str) -> bool:
        sections = stage(name).sections
        return json.dumps(tracked(config, sections), sort_keys=True) == json.dumps(tracked(on_disk, sections),
                                                                                   sort_keys=True)
    return [n for n in done if same(n)], [n for n in done if not same(n)]


def commit_run(parent: str, config: dict, python: str = sys.executable) -> None:
    """`dvc commit` the stages this run finished, with a line saying what DVC now versions."""
    from pipeline.config import ParamsError

    try:
        committed, overridden = stages_to_commit(parent, config)
    except ParamsError as e:  # params.yaml edited during the run into one that does not validate
        print(f"\nWARNING: DVC does not version this run: {e}", file=sys.stderr)
        return
    finally:
        shutil.rmtree(DONE_ROOT / parent, ignore_errors=True)
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
