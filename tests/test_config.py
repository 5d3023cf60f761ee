import json
import re
from pathlib import Path

import pytest
import yaml

from pipeline.cli import job_params, main
from pipeline import cli
from pipeline.config import (ADDED_KNOBS, ParamsError, apply_overrides, earlier_forms, load_params, merge, numbers,
                             read_resolved, read_yaml, typed, write_resolved)
from pipeline.models.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]


def errors_for(*overrides):
    with pytest.raises(ParamsError) as e:
        load_params(overrides=list(overrides))
    return e.value.problems


def test_default_params_are_valid(in_tmp):
    params = load_params()
    assert params["dp"]["epsilon"] == 8.0


@pytest.mark.parametrize("override, expected", [
    ("dp.epsilon=eight", "dp.epsilon: 'eight' is not allowed (type); allowed: number > 0 and <= 100"),
    ("dp.epsilon=-1", "dp.epsilon: -1 is not allowed (exclusiveMinimum); allowed: number > 0 and <= 100"),
    ("dp.epsilon=1000", "dp.epsilon: 1000 is not allowed (maximum); allowed: number > 0 and <= 100"),
    ("dp.objective=simclr", "dp.objective: 'simclr' is not allowed (enum); allowed: one of mae, caption, clip"),
    ("dp.delta=1.5", "dp.delta: 1.5 is not allowed (oneOf); allowed: number > 0 and < 1 or one of 1/2n"),
    ("dp.delta=1/n", "dp.delta: '1/n' is not allowed (oneOf)"),  # δ must be below 1/n
    ("run.seed=18446744073709551616", "run.seed: 18446744073709551616 is not allowed (maximum)"),
    ("model.mask_ratio=0", "model.mask_ratio=0 masks no patch"),
    ("pretrain.steps=1.5", "pretrain.steps: 1.5 is not allowed (type); allowed: integer >= 0"),
    ("verify.accountants=[pld]", "verify.accountants: ['pld'] is not allowed (minItems)"),
    ("model.patch_size=5", "model.img_size=32 is not a multiple of model.patch_size=5: the image must cut into "
                           "whole patches (the nearest that do: 4 or 8)"),
    ("model.decoder_heads=3", "model.decoder_width=64 does not split into model.decoder_heads=3 heads"),
    # values as params.yaml spells them: a const ("any value" before), .inf ("inf", which YAML reads as a string)
    ("evaluate.last_k_blocks=0", "evaluate.last_k_blocks: 0 is not allowed (anyOf); allowed: integer >= 1 or all"),
    # an if/then of keys that go together: the keys it needs, not "allowed: object"
    ("evaluate.sets=[{name: x, source: folder}]", "evaluate.sets.0 (name: x, source: folder) needs path, or train and test"),
    ("curve.epsilons=[1, inf]", "curve.epsilons.1: 'inf' is not allowed (oneOf); allowed: number > 0 and <= 100 "
                                "or one of .inf"),
])
def test_each_violation_names_key_and_allowed_values(in_tmp, override, expected):
    problems = errors_for(override)
    assert len(problems) == 1
    assert problems[0].startswith(expected)


def test_the_model_shapes_are_checked_for_the_objective_trained(in_tmp):
    """The text tower is the captioner's and CLIP's: its shape is refused before any work for them, not
    found by the model's build hours into a run; an MAE run never builds it."""
    for objective in ("caption", "clip", "clip-public"):
        assert errors_for(f"dp.objective={objective}", "model.text_heads=3") == [
            f"model.text_width=64 does not split into model.text_heads=3 heads (the {objective} model's text tower)"]
    assert load_params(overrides=["dp.objective=mae", "model.text_heads=3"])["model"]["text_heads"] == 3
    # 6 splits into 2 heads, but the MAE decoder's 2-D sin-cos positions give each axis a sine and a cosine half.
    assert errors_for("model.decoder_width=6", "model.decoder_heads=2") == [
        "model.decoder_width=6 is not a multiple of 4 (the MAE decoder's 2-D position embedding)"]
    assert load_params(overrides=["model.decoder_width=8", "model.decoder_heads=2"])["model"]["decoder_width"] == 8


def test_earlier_forms_strip_the_newest_knobs_while_neutral_and_stop_at_one_set_otherwise():
    """A resumed run looks for its state under the params earlier versions wrote; a knob set away from
    its neutral value did not exist before, so no form older than it can be the same run."""
    from pipeline.config import ADDED_KNOBS, earlier_forms

    params = {"other": {"x": 1}}
    for section, key, neutral in ADDED_KNOBS:
        params.setdefault(section, {})[key] = neutral
    assert len(earlier_forms(params)) == len(ADDED_KNOBS)
    assert earlier_forms(params)[-1] == {"other": {"x": 1}, "dp": {}, "model": {}}
    params["dp"]["frozen"] = ["decoder"]
    newer = [key for _, key, _ in ADDED_KNOBS[ADDED_KNOBS.index(("dp", "frozen", [])) + 1:]]
    forms = earlier_forms(params)
    assert len(forms) == len(newer)  # the knobs newer than dp.frozen, then no further
    assert all(k not in forms[-1]["dp"] and k not in forms[-1]["model"] for k in newer)
    assert forms[-1]["dp"]["frozen"] == ["decoder"] and forms[-1]["dp"]["compile"] is False


def test_unknown_key_lists_allowed_keys(in_tmp):
    (problem,) = errors_for("dp.epsilom=3")
    assert problem.startswith("unknown key dp.epsilom (did you mean dp.epsilon?) (allowed keys: accountant, "
                              "checkpoint_every, clip_norm, clipping, compile, compile_backend, data_workers, delta,")
    (far,) = errors_for("dp.zzz=3")  # nothing close: no guess
    assert far.startswith("unknown key dp.zzz (allowed keys: ")


def test_spaces_around_a_set_key_name_the_key(in_tmp):
    """`--set 'dp.epsilon = 4'` was refused as 'unknown key dp.epsilon ', its trailing space unseen."""
    assert load_params("params.yaml", ["dp.epsilon = 4"])["dp"]["epsilon"] == 4


def test_unknown_section(in_tmp):
    params = yaml.safe_load(open("params.yaml"))
    params["optim"] = {"lr": 1}
    yaml.safe_dump(params, open("params.yaml", "w"))
    (problem,) = errors_for()
    assert problem.startswith("unknown key optim (allowed keys: curve, dp, evaluate, model,")


def test_missing_key(in_tmp):
    params = yaml.safe_load(open("params.yaml"))
    del params["dp"]["clip_norm"]
    yaml.safe_dump(params, open("params.yaml", "w"))
    assert errors_for() == ["missing key dp.clip_norm"]


def test_a_number_in_exponent_form_is_a_number_wherever_it_is_written(in_tmp):
    """PyYAML reads YAML 1.1, where 1e-5 (no dot) and 1.0e5 (no sign) are strings: `--set dp.delta=1e-5`
    was refused as "not allowed (type)", and so was `delta: 1e-5` in params.yaml."""
    assert load_params(overrides=["dp.delta=1e-5", "dp.lr=2E-3"])["dp"]["delta"] == 1e-5
    text = open("params.yaml").read().replace("  delta: 1/2n", "  delta: 1e-6", 1)
    open("params.yaml", "w").write(text)
    assert load_params()["dp"]["delta"] == 1e-6
    assert apply_overrides({"a": {}}, ["a.b=x1e5", "a.c=1.0e5"])["a"] == {"b": "x1e5", "c": 1e5}


def test_a_count_written_as_a_float_is_refused_by_the_schema_naming_its_key(in_tmp):
    """JSON Schema takes 1000.0 as an integer: `--set dp.steps=1e3` passed validate, the shards and pretrain
    ran, and dp-train's accountant refused it without naming the key."""
    for written in ("1e3", "1000.0"):
        with pytest.raises(ParamsError, match=re.escape("dp.steps: 1000.0 is not allowed (type); allowed: integer >= 1 "
                                                        "(write it as the integer 1000)")):
            load_params(overrides=[f"dp.steps={written}"])
    assert load_params(overrides=["dp.steps=1000", "dp.epsilon=8.0"])["dp"]["steps"] == 1000  # a number may be whole


def test_overrides_parse_yaml_values():
    out = apply_overrides({"dp": {"epsilon": 8, "sigma": 1.0}}, ["dp.epsilon=3", "dp.sigma=null"])
    assert out == {"dp": {"epsilon": 3, "sigma": None}}
    signed = apply_overrides({"shards": {}}, ["shards.urls=['https://h/a.tar?sig=x=y']"])  # the key ends at the first =
    assert signed == {"shards": {"urls": ["https://h/a.tar?sig=x=y"]}}


def test_bad_override_syntax():
    with pytest.raises(ParamsError, match="expected section.key=value"):
        apply_overrides({}, ["dp.epsilon"])


def test_cli_reports_errors_before_any_work(in_tmp, capsys):
    assert main(["shards", "--set", "shards.eval_fraction=2"]) == 2
    err = capsys.readouterr().err
    assert "shards.eval_fraction: 2 is not allowed (oneOf); allowed: number >= 0 and < 1 or null" in err
    assert not (in_tmp / "data").exists()
    assert not (in_tmp / "mlflow.db").exists()


@pytest.mark.parametrize("value, message", [
    ("curve.epsilons=[1, .nan]", "curve.epsilons[1]=nan is not a finite number"),
    ("model.mask_ratio=.nan", "model.mask_ratio=nan is not a finite number"),
    ("dp.epsilon=.nan", "dp.epsilon=nan is not a finite number"),
    ("dp.clip_norm=.inf", "dp.clip_norm=inf is not a finite number (only curve.epsilons takes .inf)"),
    ("shards.eval_fraction=.nan", "shards.eval_fraction=nan is not a finite number"),
    ("curve.epsilons=[1, -.inf]", "curve.epsilons[1]=-inf is not a finite number")])
def test_a_value_that_is_not_finite_is_refused_naming_its_key(in_tmp, capsys, value, message):
    """JSON Schema's bounds pass NaN (every comparison with it is false) and ∞ where a key has no upper
    bound: a NaN in curve.epsilons was trained as the ε = ∞ point, without DP and unlabelled; a NaN mask
    ratio was a traceback; dp.clip_norm=.inf passed the plan, clipped nothing and was charged."""
    assert main(["validate", "--set", value]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert main(["validate", "--set", "curve.epsilons=[1, .inf]"]) == 0  # the curve's ε = ∞ point stays


def test_an_override_that_is_not_yaml_is_one_clear_line():
    with pytest.raises(ParamsError, match=r"--set 'shards.urls=\[/a/\{0..3\}.tar\]': the value is not valid YAML"):
        apply_overrides({"shards": {"urls": []}}, ["shards.urls=[/a/{0..3}.tar]"])


@pytest.mark.parametrize("sets, message", [
    (["shards.source=img2dataset", "shards.path=/nonexistent"], "shards.path=/nonexistent is not a folder"),
    (["shards.source=download", "shards.path=/nonexistent.csv"], "shards.path=/nonexistent.csv does not exist"),
    (["shards.source=urls", "shards.urls=['/nonexistent/{0..1}.tar']"], "none of the shards could be read"),
    # contradictions the stage finds in the params: one line, exit 2, as the schema's (once a traceback, exit 1)
    (["shards.source=img2dataset", "shards.path=null"], "shards.source=img2dataset needs shards.path"),
    (["shards.source=urls", "shards.limit=50"], "shards.limit subsamples a labelled set"),
    (["shards.source=urls", "shards.private_limit=50"], "shards.private_limit subsamples a labelled set's"),
    (["shards.eval_fraction=0"], "shards.eval_fraction=0 with source digits leaves the digits eval set empty"),
    (["shards.limit=5"], "shards.limit=5 leaves the digits eval split empty"),
])
def test_a_bad_source_or_shards_setting_exits_2_with_one_line_and_keeps_the_previous_shards(in_tmp, capsys, sets, message):
    (in_tmp / "data/shards").mkdir(parents=True)
    (in_tmp / "data/shards/index.parquet").write_bytes(b"the previous index")
    assert main(["shards", *sum((["--set", s] for s in sets), [])]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert (in_tmp / "data/shards/index.parquet").read_bytes() == b"the previous index"


def test_snakemake_config_overrides_are_typed_and_bad_values_exit_2(tmp_path):
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root, snakemake = Path(__file__).resolve().parents[1], Path(sys.executable).parent / "snakemake"
    for item in ("Snakefile", "rules", "schemas", "envs", "profiles", "params.yaml"):
        (shutil.copytree if (root / item).is_dir() else shutil.copy)(root / item, tmp_path / item)

    def dry(*config):
        return subprocess.run([str(snakemake), "-n", "-p", "--cores", "1", "--config", *config, "--", "models/dp"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)

    ok = dry("dp={epsilon: 2, sigma: null}")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "warning" not in ok.stderr
    # Every job reads the one file Snakemake validated and wrote, named by the variable its shell reads.
    commands = {line.split("--resolved ")[1].split()[0] for line in ok.stdout.splitlines() if "--resolved " in line}
    assert commands == {'"$DPFM_RESOLVED_PARAMS"'}, commands
    (resolved,) = (tmp_path / ".dpfm/params").iterdir()
    params = read_resolved(resolved)
    assert params["dp"]["epsilon"] == 2 and params["dp"]["sigma"] is None  # numbers and None, not strings
    assert "--sections-json" not in ok.stdout and '"epsilon"' not in ok.stdout  # no params on the shell line
    bad = dry("dp={epsilon: -2}")
    assert bad.returncode == 2 and "dp.epsilon: -2 is not allowed" in bad.stderr and "Traceback" not in bad.stderr
    assert dry("dp={delta: 1e-5}").returncode == 0  # a number, as YAML 1.2 reads it
    warned = dry("dp={steps: 2}")  # warned, not refused
    assert warned.returncode == 0 and "dpfm: warning: dp: warmup_steps=4 outlasts steps=2" in warned.stderr
    bad = dry("model={patch_size: 5}")  # settings the schema takes one by one, no model builds from
    assert bad.returncode == 2 and "model.img_size=32 is not a multiple of model.patch_size=5" in bad.stderr
    text = (tmp_path / "params.yaml").read_text()
    (tmp_path / "params.yaml").write_text(text.replace("\ndp:\n", "\ndp:\n  epsilon: 1.0\n", 1))  # the budget, twice
    bad = dry("dp={sigma: null}")
    assert bad.returncode == 2 and "key 'epsilon' is written twice" in bad.stderr and "Traceback" not in bad.stderr
    (tmp_path / "params.yaml").write_text(text)
    # A web source with the default curve's ε = ∞ point: refused as the workflow starts, not by the
    # curve job after pretrain and dp-train (release.check_asked_for); asked for by name, it plans.
    web = "shards={source: urls, urls: ['/data/w-{000000..000009}.tar']}"
    bad = dry(web)
    assert bad.returncode == 2 and "curve.epsilons' ε = ∞ point trains WITHOUT differential privacy" in bad.stderr, \
        bad.stderr[-2000:]
    assert dry(web, "privacy={nonprivate_on_private_data: true}").returncode == 0
    assert dry(web, "curve={epsilons: [1, 8]}").returncode == 0
    assert dry(web, "curve={inits: []}").returncode == 0  # no init: the curve trains no point, ∞ or other
    # What dp-train refuses from its params alone (params_check.py), refused before the shards are built.
    bad = dry("dp={objective: clip, mask_views: 2}")
    assert bad.returncode == 2 and "its views would be copies" in bad.stderr and "Traceback" not in bad.stderr, \
        bad.stderr[-2000:]


def test_a_key_written_twice_is_refused_naming_both_lines_and_a_merge_may_be_overridden(tmp_path):
    """PyYAML keeps the last of a repeated key: a second `epsilon:` under `dp:` set the budget unseen."""
    text = (ROOT / "params.yaml").read_text()
    (tmp_path / "params.yaml").write_text(text.replace("\ndp:\n", "\ndp:\n  epsilon: 1.0\n", 1))
    with pytest.raises(ParamsError, match=r"key 'epsilon' is written twice \(lines \d+ and \d+\)"):
        load_params(tmp_path / "params.yaml", schema_path=ROOT / "schemas/params.schema.yaml")
    (tmp_path / "anchors.yaml").write_text("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  y: 3\n")
    assert read_yaml(tmp_path / "anchors.yaml")["other"] == {"x": 1, "y": 3}
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ParamsError, match="expected sections"):
        load_params(tmp_path / "list.yaml", schema_path=ROOT / "schemas/params.schema.yaml")


def test_a_job_reads_the_params_its_workflow_validated_whatever_is_edited_or_parsed_since(tmp_path):
    """A SLURM job is a Snakemake of its own: it reads the Snakefile, and params.yaml as it is when the
    job starts. Each job once wrote the one resolved file again from that, as did a second `snakemake`
    before its lock refused it, so the jobs still pending in a workflow took params edited while it ran.
    Here the job is started as the SLURM plugin starts one (--mode remote, --target-jobs, --no-hooks,
    with the workflow's variables), after an edit of params.yaml and a second workflow's parse."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root, snakemake = Path(__file__).resolve().parents[1], Path(sys.executable).parent / "snakemake"
    for item in ("Snakefile", "rules", "schemas", "envs", "profiles", "params.yaml"):
        (shutil.copytree if (root / item).is_dir() else shutil.copy)(root / item, tmp_path / item)

    def snake(*args, **env):
        return subprocess.run([str(snakemake), "--cores", "1", "models/tokenizer", *args], cwd=tmp_path,
                              env={**os.environ, **env}, capture_output=True, text=True, timeout=300)

    assert snake("-n").returncode == 0  # the workflow: validates params.yaml and writes its file
    (validated,) = (tmp_path / ".dpfm/params").iterdir()
    text = validated.read_text()
    assert read_resolved(validated)["tokenizer"]["vocab_size"] == 512
    params = tmp_path / "params.yaml"
    params.write_text(params.read_text().replace("vocab_size: 512", "vocab_size: 300"))  # edited meanwhile
    assert snake("-n", "--config", "tokenizer={vocab_size: 400}").returncode == 0  # another workflow's parse
    assert validated.read_text() == text
    files = sorted((tmp_path / ".dpfm/params").iterdir())
    params.write_text(params.read_text()[:200] + "\n  [half-typed")  # and being edited when the job starts

    job = ("--mode", "remote", "--target-jobs", "tokenizer:", "--no-hooks")
    done = snake(*job, DPFM_RESOLVED_PARAMS=str(validated.relative_to(tmp_path)))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "vocabulary of 512 pieces" in (tmp_path / "logs/tokenizer.log").read_text()
    assert sorted((tmp_path / ".dpfm/params").iterdir()) == files and validated.read_text() == text
    orphan = snake(*job, DPFM_RESOLVED_PARAMS="")  # a job without its workflow's variable reads nothing else
    assert orphan.returncode == 2 and "--resolved names no file" in orphan.stderr, orphan.stderr[-2000:]


def test_resolved_params_keep_infinity_and_templates_and_refuse_an_edit(in_tmp):
    """The file Snakemake's jobs read holds ∞ (curve.epsilons) and `{c}` templates as params.yaml
    does; a file changed after validation is refused, not read."""
    params = load_params("params.yaml")
    params["curve"]["epsilons"] = [1, 8.0, float("inf")]
    params["evaluate"]["sets"] = [{"name": "d", "source": "digits", "templates": ["a photo of a {c}."]}]
    path = write_resolved(params)
    assert read_resolved(path) == params and write_resolved(params) == path
    with pytest.raises(ParamsError, match="takes no --set or --params"):
        job_params("other.yaml", [], str(path))
    path.write_text(path.read_text().replace("epsilon: 8.0", "epsilon: 80.0"))
    with pytest.raises(ParamsError, match="was changed after it was validated"):
        read_resolved(path)
    with pytest.raises(ParamsError, match="takes no --set"):
        job_params("params.yaml", ["dp.epsilon=1"], str(path))
    with pytest.raises(ParamsError, match="--resolved names no file"):  # a job's unset variable: not params.yaml
        job_params("params.yaml", [], "")


def test_a_job_given_gpus_that_torch_cannot_see_is_refused_not_run_on_the_cpu(monkeypatch):
    import torch

    from pipeline.cli import resolve_device
    from pipeline.launch import JOB_GPUS_ENV

    monkeypatch.setenv(JOB_GPUS_ENV, "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for requested in ("auto", "cuda"):
        with pytest.raises(ParamsError, match="this job was given 2 GPU\\(s\\) but torch .* sees no CUDA device"):
            resolve_device(requested)
    assert resolve_device("cpu") == "cpu"  # said outright: the GPUs are idle by choice
    monkeypatch.setenv(JOB_GPUS_ENV, "0")
    assert resolve_device("auto") == "cpu"


def test_a_key_that_is_not_a_string_is_named_not_a_crash(in_tmp):
    """YAML's `?` is a mapping with a null key, `1: x` one with an integer key: both are unknown keys."""
    for text in ("?", "1: x\n"):
        open("params.yaml", "w").write(text)
        with pytest.raises(ParamsError, match="unknown key"):
            load_params("params.yaml")


# The keys of the sections that key a training's resumable state (pipeline/train.py: state_dir) as
# they were before the first knob of ADDED_KNOBS: any key added since must be registered there.
KEYED_BEFORE_ADDED_KNOBS = {
    "run": {"device", "experiment", "seed", "threads"},
    "model": {"decoder_depth", "decoder_heads", "decoder_width", "img_size", "mask_ratio", "max_caption_len",
              "norm_pix_loss", "patch_size", "size", "text_depth", "text_heads", "text_width"},
    "dp": {"accountant", "checkpoint_every", "clip_norm", "clipping", "data_workers", "delta", "encoder_lr_scale",
           "epsilon", "eval_every", "expected_batch_size", "init", "log_private_stats", "lr", "noise_seed",
           "nonprivate", "nonprivate_baseline", "objective", "optimizer", "physical_batch_size", "precision",
           "sigma", "steps", "warmup_steps", "weight_decay"},
    "pretrain": {"batch_size", "checkpoint_every", "data_workers", "grad_clip", "log_every", "lr", "precision",
                 "steps", "warmup_steps", "weight_decay"},
}


def test_every_knob_added_since_runs_were_keyed_is_registered_with_a_neutral_value_the_schema_takes(in_tmp):
    """Without its entry in ADDED_KNOBS, the upgrade that adds a knob makes every finished run train
    again and be charged to the data's budget twice."""
    import json

    from pipeline.config import ADDED_KNOBS

    params = load_params()
    for section, before in KEYED_BEFORE_ADDED_KNOBS.items():
        added = set(params[section]) - before
        assert added == {k for s, k, _ in ADDED_KNOBS if s == section}, f"register {section}: {sorted(added)}"
    assert len({(s, k) for s, k, _ in ADDED_KNOBS}) == len(ADDED_KNOBS)
    for section, key, neutral in ADDED_KNOBS:
        load_params(overrides=[f"{section}.{key}={json.dumps(neutral)}"])


# Settings dp-train refuses from its params alone, per objective: each with the words of its refusal.
REFUSED_DP_SETTINGS = {
    "mae": [(["dp.clipping=opacus-ghost"], "can let one example exceed the clip norm"),
            (['dp.frozen=["encoder.nope"]'], "dp.frozen names ['encoder.nope']"),
            (['dp.frozen=["encoder", "decoder_embed", "mask_token", "decoder_blocks", "decoder_norm", "decoder_pred"]'],
             "freezes every parameter")],
    "caption": [(["dp.clipping=opacus-hooks"], "cannot run the caption model"),
                (["dp.mask_views=2"], "its views would be copies"),
                (["dp.clipping=vmap", "dp.encoder_clip_share=0.5", 'dp.frozen=["encoder"]'],
                 "none of its parameters")],
    "clip": [(["dp.precision=fp16"], "overflows a whole-batch loss's gradient"),
             (["dp.mask_views=2"], "its views would be copies"),
             (["dp.clipping=opacus-hooks", "dp.encoder_clip_share=0.5"], "has one clip bound")],
}


@pytest.mark.parametrize("objective", sorted(REFUSED_DP_SETTINGS))
def test_dpfm_validate_refuses_what_dp_train_would_before_anything_runs(in_tmp, capsys, objective):
    """dp-train refused these only once it ran, after the shards and pretrain (hours of GPU on a cluster);
    `dpfm validate`, and so a workflow's start (rules/common.smk), refuses them with no shards built."""
    from pipeline import cli

    assert cli.main(["validate", "--set", f"dp.objective={objective}"]) == 0
    capsys.readouterr()
    for settings, words in REFUSED_DP_SETTINGS[objective]:
        sets = [a for s in [f"dp.objective={objective}", *settings] for a in ("--set", s)]
        assert cli.main(["validate", *sets]) == 2, settings
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, (settings, err)


def test_a_warm_up_longer_than_its_run_is_warned_for_each_schedule_that_has_one(in_tmp, capsys):
    """A warm-up past the last step leaves the rate climbing for the whole run: a DP run so set spends its ε
    at a fraction of its lr. `dpfm validate` names each schedule (and the workflow's start, below)."""
    from pipeline import cli

    assert cli.main(["validate"]) == 0
    assert "warning" not in capsys.readouterr().out  # params.yaml's schedules warm up within their runs
    sets = ["pretrain.steps=10", "dp.steps=2", "dp.nonprivate.steps=3"]
    assert cli.main(["validate", *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert "pretrain: warmup_steps=30 outlasts steps=10, so the learning rate climbs" in out and "0.33 × its lr" in out
    assert "dp: warmup_steps=4 outlasts steps=2" in out and "0.5 × its lr" in out
    assert "dp.nonprivate (the ε = ∞ twin): warmup_steps=4 outlasts steps=3" in out
    # Equal is a full warm-up: the last step runs at the lr. The twin's own warm-up can fix its schedule.
    assert cli.main(["validate", "--set", "dp.steps=4", "--set", "dp.nonprivate.steps=3",
                     "--set", "dp.nonprivate.warmup_steps=1"]) == 0
    assert "warning" not in capsys.readouterr().out
    assert cli.main(["validate", "--set", "dp.nonprivate.warmup_steps=5000"]) == 0  # the twin's warm-up alone
    out = capsys.readouterr().out
    assert "dp.nonprivate (the ε = ∞ twin): warmup_steps=5000 outlasts" in out and "dp: warmup" not in out


def test_dpfm_validate_checks_dp_trains_plan_once_the_shards_give_n(in_tmp, capsys):
    """What dp-train refuses before any image (δ ≥ 1/n, a batch larger than n, an ε no σ reaches) needs n:
    `dpfm validate` checks it once the shards are built, and says it could not before."""
    from pipeline import cli

    bad = ["--set", "dp.delta=0.05"]  # a number the schema takes; 1/n is 0.01 below
    assert cli.main(["validate", *bad]) == 0
    assert "dp-train's privacy plan needs n" in capsys.readouterr().out
    (in_tmp / "data/shards").mkdir(parents=True)
    (in_tmp / "data/shards/stats.json").write_text(json.dumps({"private": {"usable": 100}}))
    assert cli.main(["validate", *bad]) == 2
    assert "dp params (n=100 usable private examples) is invalid" in capsys.readouterr().err
    assert cli.main(["validate", "--set", "dp.expected_batch_size=101"]) == 2
    assert "dp.expected_batch_size=101 exceeds the 100 usable private examples" in capsys.readouterr().err
    assert cli.main(["validate", "--set", "dp.expected_batch_size=50"]) == 0
    assert "the privacy plans of dp-train and the curve's points at the shards' n" in capsys.readouterr().out
    # A curve point dp-train's own plan does not show: ε = 100 in one step, σ below the noise edge.
    point = ["--set", "dp.expected_batch_size=50", "--set", "dp.steps=1", "--set", "curve.epsilons=[2, 100]"]
    assert cli.main(["validate", *point]) == 2
    assert "the curve's point at ε = 100 (dp params, curve.epsilons' ε)" in capsys.readouterr().err
    assert cli.main(["validate", *point, "--set", "curve.inits=[]"]) == 0  # no curve: no point to plan
    capsys.readouterr()
    # Shards built with other shards params: their n is not the n dp-train will plan with.
    from pipeline.config import load_params
    from pipeline.stages import params_digest

    def built_with(*overrides):
        digest = params_digest(load_params(overrides=list(overrides)), "shards")
        (in_tmp / "data/shards/stats.json").write_text(json.dumps({"private": {"usable": 100}, "params_digest": digest}))

    built_with("shards.limit=500")
    assert cli.main(["validate", *bad]) == 0
    assert "was built with others" in capsys.readouterr().out
    built_with()
    assert cli.main(["validate", *bad]) == 2
    assert "dp params (n=100 usable private examples) is invalid" in capsys.readouterr().err
    # Planned under the run's adjacency: a σ that reaches ε only under add/remove is short under replace-one.
    from pipeline.privacy import accounting

    steps = load_params()["dp"]["steps"]
    add_remove = accounting.calibrate_sigma(8.0, 0.5, steps, 1 / 200, adjacency="add_remove")
    fixed = ["--set", "dp.expected_batch_size=50", "--set", "curve.inits=[]", "--set", f"dp.sigma={add_remove}"]
    assert cli.main(["validate", *fixed, "--set", "privacy.adjacency=add_remove"]) == 0
    capsys.readouterr()
    assert cli.main(["validate", *fixed]) == 2
    assert "above the target dp.epsilon=8.0" in capsys.readouterr().err


def wrong_values(spec: dict) -> list:
    """Values of the wrong kind for a key of schema `spec`: a mapping for every key (no key takes an
    arbitrary one), and where the schema gives a scalar type, a value of another type."""
    kinds = spec.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    wrong = [{"wrong_zz": 1}]
    if {"integer", "number", "boolean"} & set(kinds) and "string" not in kinds:
        wrong.append("not_a_value")
    if kinds == ["integer"] or kinds == ["integer", "null"]:
        wrong += [1.5, True]  # YAML's true is a Python bool, an int to isinstance: not a count of 1
    return wrong


SCHEMA = yaml.safe_load((ROOT / "schemas/params.schema.yaml").read_text())
KEYS = [(f"{section}.{key}", spec) for section, body in SCHEMA["properties"].items()
        for key, spec in body.get("properties", {}).items()]


@pytest.mark.parametrize("key, spec", KEYS, ids=[k for k, _ in KEYS])
def test_every_key_refuses_a_value_of_the_wrong_kind_naming_itself(in_tmp, key, spec):
    """Every key of the schema, not a list of some: a key loosened to take anything (`dp.clip_norm: {}`)
    would let `abc` reach the accountant."""
    for value in wrong_values(spec):
        assert any(re.search(rf"(^|\s){re.escape(key)}\b", p) for p in errors_for(f"{key}={json.dumps(value)}")), (
            key, value)


# (test_config.py already has json, re, yaml, pytest, ROOT, errors_for, ParamsError, apply_overrides,
#  load_params, read_resolved, read_yaml, write_resolved)


def test_a_params_path_that_is_absent_or_a_folder_is_refused_saying_which(tmp_path):
    for path, words in ((tmp_path / "nope.yaml", "does not exist"), (tmp_path, "is not a file")):
        with pytest.raises(ParamsError, match=re.escape(f"{path} {words}")):
            read_yaml(path)


def test_a_params_file_that_is_not_utf8_text_is_refused_as_not_yaml(tmp_path):
    (tmp_path / "params.yaml").write_bytes(b"dp:\n  epsilon: \xff\xfe\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        read_yaml(tmp_path / "params.yaml")


def test_a_key_written_twice_names_the_lines_of_both(tmp_path):
    (tmp_path / "p.yaml").write_text("dp:\n  epsilon: 8\n  sigma: null\n  epsilon: 1\n")
    with pytest.raises(ParamsError, match=re.escape("key 'epsilon' is written twice (lines 2 and 4)")):
        read_yaml(tmp_path / "p.yaml")


def test_a_params_file_of_one_value_is_refused_as_not_sections(tmp_path):
    (tmp_path / "p.yaml").write_text("8\n")
    with pytest.raises(ParamsError, match=re.escape("expected sections (a mapping), got a int")):
        load_params(tmp_path / "p.yaml", schema_path=ROOT / "schemas/params.schema.yaml")


def test_an_invalid_params_file_is_named_in_the_error(in_tmp):
    (in_tmp / "mine.yaml").write_text((in_tmp / "params.yaml").read_text())
    with pytest.raises(ParamsError) as e:
        load_params("mine.yaml", ["dp.epsilon=-1"])
    assert str(e.value).startswith("mine.yaml is invalid:\n  - dp.epsilon: -1")


def test_an_exponent_number_is_read_with_either_sign_and_in_lists_but_only_when_whole(in_tmp):
    assert numbers({"a": ["1e+5", "-2E-3", "+.5e1", "1e5x", "e5"]}) == {"a": [1e5, -2e-3, 5.0, "1e5x", "e5"]}
    assert load_params(overrides=["curve.epsilons=[1e-1, 2E0]"])["curve"]["epsilons"] == [0.1, 2.0]


def test_a_set_with_no_key_or_one_through_a_value_is_refused_naming_the_part():
    with pytest.raises(ParamsError, match="expected section.key=value"):
        apply_overrides({"dp": {}}, ["=4"])
    with pytest.raises(ParamsError, match="'epsilon' is not a section"):
        apply_overrides({"dp": {"epsilon": 8}}, ["dp.epsilon.x=1"])


def test_overrides_leave_the_params_they_were_given_unchanged():
    params = {"dp": {"epsilon": 8}}
    assert apply_overrides(params, ["dp.epsilon=2"]) == {"dp": {"epsilon": 2}}
    assert params == {"dp": {"epsilon": 8}}


def test_snakemake_config_strings_that_are_empty_or_not_yaml_are_kept_as_written():
    given = {"run": {"experiment": "", "device": "[cpu"}, "dp": {"epsilon": "2", "sigma": "null"}}
    assert typed(given) == {"run": {"experiment": "", "device": "[cpu"}, "dp": {"epsilon": 2, "sigma": None}}


def test_a_config_section_given_in_part_keeps_its_other_keys():
    params = {"dp": {"epsilon": 8, "sigma": 1.0}, "run": {"seed": 0}}
    assert merge(params, {"dp": {"epsilon": 2}, "curve": {"seeds": 1}}) == {
        "dp": {"epsilon": 2, "sigma": 1.0}, "run": {"seed": 0}, "curve": {"seeds": 1}}


def test_every_violation_is_reported_not_only_the_first(in_tmp):
    assert errors_for("dp.epsilon=-1", "pretrain.steps=1.5") == [
        "dp.epsilon: -1 is not allowed (exclusiveMinimum); allowed: number > 0 and <= 100",
        "pretrain.steps: 1.5 is not allowed (type); allowed: integer >= 0"]


def test_the_integer_hint_is_given_only_for_a_whole_float_where_an_integer_is_wanted(in_tmp):
    assert errors_for("pretrain.steps=1.5") == ["pretrain.steps: 1.5 is not allowed (type); allowed: integer >= 0"]
    assert errors_for("dp.epsilon=1000.0") == [
        "dp.epsilon: 1000.0 is not allowed (maximum); allowed: number > 0 and <= 100"]


def test_a_caption_mask_ratio_is_refused_only_for_the_captioner_and_only_when_it_keeps_no_patch(in_tmp):
    small = ["model.patch_size=8"]  # 16 patches: 0.9 keeps 1, 0.95 none
    assert load_params(overrides=[*small, "model.mask_ratio=0.9"])["model"]["mask_ratio"] == 0.9
    for objective in ("mae", "clip", "clip-public"):  # models that never read it
        load_params(overrides=[*small, f"dp.objective={objective}", "model.caption_mask_ratio=0.95"])
    assert errors_for(*small, "dp.objective=caption", "model.caption_mask_ratio=0.95") == [
        "model.caption_mask_ratio=0.95 keeps no patch of the 16 an image cuts into (model.img_size=32 / "
        "model.patch_size=8): lower it, or use smaller patches"]


def test_a_mask_ratio_of_0_is_refused_whatever_the_objective(in_tmp):
    """The synthetic warm start builds the MAE for every objective."""
    for objective in ("mae", "caption", "clip", "clip-public"):
        (problem,) = errors_for(f"dp.objective={objective}", "model.mask_ratio=0")
        assert problem.startswith("model.mask_ratio=0 masks no patch"), objective


def test_writing_resolved_params_again_repairs_a_file_changed_since(in_tmp):
    params = load_params()
    path = write_resolved(params)
    path.write_text(path.read_text() + "# edited\n")
    assert write_resolved(params) == path and read_resolved(path) == params


def test_a_missing_section_is_named_as_a_top_level_key(in_tmp):
    params = yaml.safe_load(open("params.yaml"))
    del params["curve"]
    yaml.safe_dump(params, open("params.yaml", "w"))
    assert errors_for() == ["missing key curve"]


def test_a_list_with_a_repeated_value_is_refused_saying_no_duplicates(in_tmp):
    assert errors_for("curve.epsilons=[1, 1]") == [
        "curve.epsilons: [1, 1] is not allowed (uniqueItems); allowed: a list of (number > 0 and <= 100 or one of "
        ".inf) with no duplicates"]


def test_only_curve_epsilons_takes_infinity_not_the_rest_of_its_section(in_tmp):
    assert errors_for("curve.seeds=.inf") == ["curve.seeds=inf is not a finite number (only curve.epsilons takes .inf)"]


def test_earlier_forms_pass_over_knobs_of_a_section_the_params_do_not_hold():
    dp = {k: neutral for s, k, neutral in ADDED_KNOBS if s == "dp"}
    forms = earlier_forms({"dp": {"lr": 0.1, **dp}})
    assert len(forms) == len(dp) and forms[-1] == {"dp": {"lr": 0.1}}


def test_each_added_knob_at_its_neutral_value_is_valid_for_every_objective_and_a_model_default(in_tmp):
    """A knob's neutral value is what dpfm did before it: runs of every objective were made then, and a
    model knob's neutral value is what the model does when params do not name it."""
    sets = [a for s, k, neutral in ADDED_KNOBS for a in ("--set", f"{s}.{k}={json.dumps(neutral)}")]
    for objective in ("mae", "caption", "clip", "clip-public"):
        assert cli.main(["validate", "--set", f"dp.objective={objective}", *sets]) == 0, objective
    assert all(getattr(ModelConfig(), k) == neutral for s, k, neutral in ADDED_KNOBS if s == "model")


def test_a_quoted_snakemake_config_string_is_kept_whole():
    """Snakemake reads --config's YAML itself and drops the quotes: a `#` or a `: ` inside a quoted string
    is text, not a comment or a mapping, while plain numbers and null are typed."""
    from snakemake.cli import parse_config

    given = parse_config(['run={experiment: "exp #2"}', 'shards={path: "raw: 2024"}',
                          "dp={epsilon: 2, sigma: null, delta: 1e-6, adaptive: false}"])
    assert numbers(typed(given)) == {"run": {"experiment": "exp #2"}, "shards": {"path": "raw: 2024"},
                                     "dp": {"epsilon": 2, "sigma": None, "delta": 1e-6, "adaptive": False}}
