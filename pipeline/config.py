"""params.yaml: loading, `--set` overrides, and validation with errors that name the key path."""

from __future__ import annotations

import copy
import difflib
import hashlib
import math
import re
from pathlib import Path

import jsonschema
import yaml

from pipeline.io import atomic_path

SCHEMA_PATH = Path("schemas/params.schema.yaml")
PARAMS_PATH = Path("params.yaml")
RESOLVED_DIR = Path(".dpfm/params")  # the validated params of Snakemake runs, one file per config


# Knobs added to params.yaml after runs were made with it, oldest first, each with the value that does
# what dpfm did before the knob existed. Resumable state is keyed by the params (pipeline/train.py:
# state_dir), so without this list the upgrade that adds a knob would orphan every finished or
# stopped run: dp-train would train it again, with a fresh noise key, and charge it to the data's
# budget a second time. Append here whenever a knob is added; never reorder.
ADDED_KNOBS = (
    ("dp", "compile", False),               # 2026-11-24
    ("model", "caption_mask_ratio", 0.0),   # 2026-11-25
    ("dp", "encoder_clip_share", None),     # 2026-11-26
    ("dp", "mask_views", 1),
    ("dp", "ema_decay", 0.0),
    ("dp", "frozen", []),
    ("model", "public_negatives", 256),     # 2026-11-27
    ("dp", "nonprivate_clipped", False),    # 2026-11-30
    ("dp", "compile_backend", "inductor"),  # 2026-12-02
)


def earlier_forms(params: dict) -> list[dict]:
    """`params` as earlier versions of dpfm wrote the same run, newest first: the added knobs taken
    out one by one, newest first, while each is at its neutral value (a knob set otherwise did not
    exist before, so no earlier run can match). Sections the params do not hold are passed over."""
    forms, form = [], params
    for section, key, neutral in reversed(ADDED_KNOBS):
        if key not in form.get(section, {}):
            continue
        if form[section][key] != neutral:
            break
        form = {**form, section: {k: v for k, v in form[section].items() if k != key}}
        forms.append(form)
    return forms


class ParamsError(ValueError):
    """Invalid parameters; `problems` holds one readable line per violation."""

    def __init__(self, problems: list[str], source: str = "params"):
        self.problems = problems
        super().__init__(f"{source} is invalid:\n  - " + "\n  - ".join(problems))


def load_schema(path: str | Path = SCHEMA_PATH) -> dict:
    return yaml.safe_load(Path(path).read_text())


class _UniqueKeys(yaml.SafeLoader):
    """YAML whose mappings refuse a key written twice: PyYAML keeps the last silently, so a second
    `epsilon:` under `dp:` would set the privacy budget unseen (keys a `<<` merge brings may be
    overridden, as YAML means them to be)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is written twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1}): "
                    "keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path):
    """A params file as written: ParamsError (naming it) when it is absent, not YAML, or repeats a key."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError([f"{path} does not exist" if not path.exists() else f"{path} is not a file"], source=str(path))
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_UniqueKeys)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ParamsError([f"not valid YAML: {e}"], source=str(path)) from None


def load_params(path: str | Path = PARAMS_PATH, overrides: list[str] = (), schema_path=SCHEMA_PATH) -> dict:
    """Read params.yaml, apply `section.key=value` overrides, validate; raise ParamsError if wrong."""
    params = read_yaml(path)
    if params is not None and not isinstance(params, dict):
        raise ParamsError([f"expected sections (a mapping), got a {type(params).__name__}"], source=str(path))
    params = apply_overrides(numbers(params or {}), overrides)
    validate(params, load_schema(schema_path), source=str(path))
    return params


# PyYAML reads YAML 1.1, where a float needs a dot and a signed exponent: 1e-5 and 1.0e5 are strings.
EXPONENT_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+")


def numbers(values):
    """`values` with every string leaf written as a number in exponent form (1e-5, 2E3, 1.0e5) read as
    the float it spells, as YAML 1.2 and Python read it: params.yaml, `--set` and `--config` alike."""
    if isinstance(values, dict):
        return {k: numbers(v) for k, v in values.items()}
    if isinstance(values, list):
        return [numbers(v) for v in values]
    return float(values) if isinstance(values, str) and EXPONENT_FLOAT.fullmatch(values) else values


def apply_overrides(params: dict, overrides) -> dict:
    """Return a copy with each `a.b.c=value` applied; value is parsed as YAML (so 8, 1e-5, null, [a, b])."""
    params = copy.deepcopy(params)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()  # 'dp.epsilon = 4' names dp.epsilon
        if not sep or not key:
            raise ParamsError([f"--set {item!r}: expected section.key=value"])
        node = params
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise ParamsError([f"--set {item!r}: {part!r} is not a section"])
            node = node[part]
        try:
            node[leaf] = numbers(yaml.safe_load(raw))
        except yaml.YAMLError as e:
            raise ParamsError([f"--set {item!r}: the value is not valid YAML ({e.problem}); quote strings that "
                               "hold { } [ ] : or #, e.g. shards.urls=\"['s3://b/{0..9}.tar']\""]) from None
    return params


def typed(values):
    """Snakemake's `--config dp='{epsilon: 2}'` hands nested values over as strings ('2'): read each
    string leaf as the plain YAML scalar it spells, as params.yaml and `--set` are read, so 2 is a number
    and null is None. Snakemake has parsed the YAML already (quotes removed): a leaf is never parsed again,
    or `"exp #2"` would lose its end as a comment and `"data: raw"` would become a mapping."""
    if isinstance(values, dict):
        return {k: typed(v) for k, v in values.items()}
    if isinstance(values, list):
        return [typed(v) for v in values]
    if isinstance(values, str) and values.strip() and _PLAIN.resolve(yaml.ScalarNode, values, (True, False)) != STR:
        return yaml.safe_load(values)  # a number, bool or null: the whole string is one
    return values


_PLAIN, STR = yaml.SafeLoader(""), "tag:yaml.org,2002:str"  # what a plain scalar resolves to, as safe_load does


def merge(params: dict, overrides: dict) -> dict:
    """params with `overrides` merged in key by key (a section given in part keeps its other keys)."""
    out = copy.deepcopy(params)
    for k, v in overrides.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# JSON Schema counts 1000.0 as an integer, and the code counts with ints (range, ceil): a count written
# 1e3 (read as 1000.0) is refused here, naming its key, not by the accountant when dp-train starts.
StrictValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=(
    jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, x: isinstance(x, int) and not isinstance(x, bool))))


# The one place a value may be infinite: the curve's ε = ∞ point. JSON Schema's bounds do not catch NaN
# (every comparison with it is false) nor ∞ where a key has no upper bound.
INFINITE_ALLOWED = ("curve.epsilons",)


def non_finite_problems(values, key: str = "") -> list[str]:
    """Every NaN, and every ±∞ outside INFINITE_ALLOWED (+∞ only), in `values`, named by its key: a NaN ε in
    curve.epsilons was trained as the ε = ∞ point, without DP and without its NOT PRIVATE label."""
    if isinstance(values, dict):
        return [p for k, v in values.items() for p in non_finite_problems(v, f"{key}.{k}" if key else str(k))]
    if isinstance(values, list):
        return [p for i, v in enumerate(values) for p in non_finite_problems(v, f"{key}[{i}]")]
    if not isinstance(values, float) or math.isfinite(values):
        return []
    if values == math.inf and key.split("[")[0] in INFINITE_ALLOWED:
        return []
    hint = " (only curve.epsilons takes .inf)" if values == math.inf else ""
    return [f"{key}={values} is not a finite number{hint}"]


def validate(params: dict, schema: dict | None = None, source: str = "params") -> None:
    schema = schema or load_schema()
    problems = non_finite_problems(params)
    if problems:
        raise ParamsError(problems, source=source)
    validator = StrictValidator(schema)
    problems = [_describe_error(e, schema) for e in validator.iter_errors(params)]
    if problems:
        raise ParamsError(sorted(set(problems)), source=source)
    problems = model_shape_problems(params["model"], params["dp"]["objective"])
    if problems:
        raise ParamsError(problems, source=source)


def model_shape_problems(model: dict, objective: str) -> list[str]:
    """Model settings the schema takes one by one but no model can be built from, each named by its
    keys: the synthetic warm start always builds the MAE, and the DP objective its own model. (The
    encoder's width and heads come from the size table, which is consistent: tests/test_models.py.)"""
    problems = []
    img, patch = model["img_size"], model["patch_size"]
    if img % patch:
        return [f"model.img_size={img} is not a multiple of model.patch_size={patch}: the image must cut into "
                f"whole patches (the nearest that do: {' or '.join(map(str, _divisors_around(img, patch)))})"]
    patches = (img // patch) ** 2
    if model["mask_ratio"] == 0:
        problems.append("model.mask_ratio=0 masks no patch: the MAE (the synthetic warm start) would have nothing to "
                        "reconstruct, its loss 0 and nothing trained")
    ratios = [("mask_ratio", model["mask_ratio"])]  # the MAE (pretrain) drops this share
    if objective == "caption":
        ratios.append(("caption_mask_ratio", model["caption_mask_ratio"]))
    for key, ratio in ratios:
        if int(patches * (1 - ratio)) < 1:
            problems.append(f"model.{key}={ratio} keeps no patch of the {patches} an image cuts into "
                            f"(model.img_size={img} / model.patch_size={patch}): lower it, or use smaller patches")
    width, heads = model["decoder_width"], model["decoder_heads"]
    if width % heads:
        problems.append(f"model.decoder_width={width} does not split into model.decoder_heads={heads} heads")
    if width % 4:  # its 2-D sin-cos position embedding gives each axis a sine and a cosine half
        problems.append(f"model.decoder_width={width} is not a multiple of 4 (the MAE decoder's 2-D position embedding)")
    width, heads = model["text_width"], model["text_heads"]
    if objective in ("caption", "clip", "clip-public") and width % heads:
        problems.append(f"model.text_width={width} does not split into model.text_heads={heads} heads "
                        f"(the {objective} model's text tower)")
    return problems


def _divisors_around(n: int, k: int) -> list[int]:
    """The largest divisor of n below k and the smallest above it (where there is one)."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return [d for d in (max(d for d in divisors if d < k), min((d for d in divisors if d > k), default=None)) if d]


def write_resolved(params: dict, directory: str | Path = RESOLVED_DIR) -> Path:
    """Validated params as one file the jobs of a Snakemake run read (`dpfm <stage> --resolved`). Its
    first line holds a digest of the rest, so a job reads exactly what was validated; its name holds
    the digest too, so each config has its own file and nothing rewrites one a running workflow's jobs
    still read: a second `snakemake` (which the lock then refuses) writes another file."""
    text = yaml.safe_dump(params, sort_keys=True)  # YAML, not JSON: it spells ∞ (curve.epsilons)
    digest = _digest(text)
    path = Path(directory) / f"resolved-{digest[:16]}.yaml"
    text = f"# sha256: {digest}\n{text}"
    if not (path.exists() and path.read_text() == text):
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    return path


def read_resolved(path: str | Path) -> dict:
    """The params `write_resolved` wrote, refused if the file no longer matches its digest."""
    if not str(path):
        raise ParamsError(["--resolved names no file (Snakemake passes its jobs the file in DPFM_RESOLVED_PARAMS)"])
    path = Path(path)
    if not path.is_file():
        raise ParamsError([f"{path} does not exist (Snakemake writes it when it reads its config)"], source=str(path))
    first, _, text = path.read_text().partition("\n")
    if first != f"# sha256: {_digest(text)}":
        raise ParamsError([f"{path} was changed after it was validated; run snakemake again"], source=str(path))
    return yaml.safe_load(text)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def sections_of(params: dict, sections) -> dict:
    """The part of params a stage may read: only its declared sections."""
    return {name: params[name] for name in sections}


# -- readable errors ---------------------------------------------------------------------------

def _describe_error(error: jsonschema.ValidationError, schema: dict) -> str:
    path = ".".join(str(p) for p in error.absolute_path) or "<top level>"
    kind = error.validator
    if kind == "additionalProperties":
        node = _subschema(schema, list(error.absolute_path))
        allowed = sorted(node.get("properties", {}))
        unknown = sorted(str(k) for k in set(error.instance) - set(allowed))  # YAML keys may be null or numbers
        prefix = f"{path}." if error.absolute_path else ""
        close = [f"{prefix}{c}" for u in unknown for c in difflib.get_close_matches(u, allowed, n=1)]
        return (f"unknown key {', '.join(prefix + u for u in unknown)}"
                + (f" (did you mean {', '.join(close)}?)" if close else "") + f" (allowed keys: {', '.join(allowed)})")
    if kind == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        prefix = f"{path}." if error.absolute_path else ""
        return f"missing key {prefix}{missing}"
    alternatives = error.validator_value if kind in ("anyOf", "oneOf") else None
    if alternatives and all(set(a) == {"required"} for a in alternatives):  # keys that go together (an if/then)
        given = ", ".join(f"{k}: {_as_yaml(v)}" for k, v in error.instance.items() if not isinstance(v, (dict, list)))
        return f"{path} ({given}) needs " + ", or ".join(" and ".join(a["required"]) for a in alternatives)
    allowed = describe_allowed(_subschema(schema, list(error.absolute_path)), schema)
    whole = isinstance(error.instance, float) and error.instance.is_integer() and "integer" in allowed
    return (f"{path}: {error.instance!r} is not allowed ({kind}); allowed: {allowed}"
            + (f" (write it as the integer {int(error.instance)})" if whole else ""))


def _resolve(node: dict, schema: dict) -> dict:
    """Follow local `$ref`s (`#/$defs/name`) to the schema they point at."""
    while "$ref" in node:
        ref = node["$ref"]
        if not ref.startswith("#/"):
            raise ValueError(f"only local $refs are supported, got {ref}")
        node = schema
        for part in ref[2:].split("/"):
            node = node[part]
    return node


def _subschema(schema: dict, path: list) -> dict:
    node = _resolve(schema, schema)
    for part in path:
        if isinstance(part, int):
            node = _resolve(node.get("items", {}), schema)
        else:
            node = _resolve(node.get("properties", {}).get(part, {}), schema)
    return node


def describe_allowed(node: dict, schema: dict) -> str:
    """Render what a schema accepts, e.g. `number > 0 and <= 100` or `one of mae, caption, clip`."""
    node = _resolve(node, schema)
    if "oneOf" in node or "anyOf" in node:
        return " or ".join(describe_allowed(n, schema) for n in node.get("oneOf", node.get("anyOf")))
    if "enum" in node:
        return "one of " + ", ".join(_as_yaml(v) for v in node["enum"])
    if "const" in node:
        return _as_yaml(node["const"])
    kind = node.get("type", "any value")
    bounds = [f"{op} {node[key]}" for key, op in
              (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))
              if key in node]
    if kind == "array" and "items" in node:
        kind = f"a list of ({describe_allowed(node['items'], schema)}) with"
        if "minItems" in node:
            bounds.append(f"at least {node['minItems']} items")
        if node.get("uniqueItems"):
            bounds.append("no duplicates")
    if kind == "string" and "minLength" in node:
        bounds.append(f"at least {node['minLength']} characters")
    return f"{kind} " + " and ".join(bounds) if bounds else str(kind)


def _as_yaml(value) -> str:
    """A value as params.yaml spells it (.inf, null, 'all')."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
