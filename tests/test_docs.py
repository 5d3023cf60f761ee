"""The documentation (README.md, docs/*.md, pipeline/privacy/README.md) against the code it describes.

- README.md stays short (at most README_MAX_LINES lines);
- every relative link and image points to a file that exists (and an #anchor to a heading in it);
- every command shown parses: `dpfm ...` with the real argument parser, `make X` against the
  Makefile's targets, `python -m benchmarks.NAME` / `python benchmarks/NAME.py` against the file and
  its flags, `snakemake ...` against `snakemake --help` and the stage table's outputs and rule names;
- every params key named (`dp.epsilon`, `--set shards.scan_groups=4`, `-S dp.epsilon=2`) is in
  params.yaml;
- every test named (`tests/test_x.py::test_name`, or `::test_name` after a file is named; `test_na…`:
  a test whose name starts so) is in that file, so an invariant's evidence is a test that runs.

Each check reports the file, the line and the offending text. `test_the_checks_catch_mistakes`
feeds the same checks a page of planted mistakes, so a check that stopped finding anything fails.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "pipeline/privacy/README.md"]
README_MAX_LINES = 120

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
SHELL_FENCES = {"", "sh", "bash", "shell", "console"}
CODE_SPAN = re.compile(r"`([^`]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# A leading `VAR=value` and a `.venv/bin/` on the program are how the docs run things; neither
# changes what is run.
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
RAW_PREFIX = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:\./)?(?:\.venv/bin/)?")
COMMAND_START = re.compile(r"^(?:dpfm(?:\s|$)|python3? -m benchmarks\.|python3? benchmarks/|make(?:\s|$)|snakemake(?:\s|$))")
# Inline, `dpfm` and `make` alone name the program; with an argument they are a command.
INLINE_START = re.compile(r"^(?:dpfm |python3? -m benchmarks\.|python3? benchmarks/|make |snakemake(?:\s|$))")
ELLIPSIS = {"...", "…"}
# `section.key` (and deeper) where `section` is a top-level key of params.yaml; not part of a path,
# a module or a longer dotted name.
PARAM_TOKEN = re.compile(r"(?<![\w./\-$<{@])([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)(?![\w(/-]|\.\w)")
# `report.md`, `model.pt`, `tokenizer.json`: file names whose stem happens to be a params section.
FILE_EXTENSIONS = {"md", "html", "pt", "json", "jsonl", "yaml", "yml", "py", "png", "txt", "zip", "tsv",
                   "csv", "parquet", "idx", "npy", "tar", "tgz", "gz", "log", "smk", "lock", "db", "sh", "rst",
                   "model", "key", "whl"}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def blank(match: re.Match) -> str:
    """The matched text with everything but newlines blanked, so offsets and line numbers hold."""
    return re.sub(r"[^\n]", " ", match.group(0))


def prose(text: str) -> str:
    """`text` without its fenced blocks and inline code."""
    return CODE_SPAN.sub(blank, FENCE.sub(blank, text))


# ---- links -------------------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub(blank, path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(text):
        s = slug(m.group(1))
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def link_problems(path: Path, text: str) -> list[str]:
    problems = []
    body = prose(text)
    for m in LINK.finditer(body):
        target = m.group(1)
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        where = f"{rel(path)}:{line_of(body, m.start())}: ({target})"
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{where}: {rel(dest)} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading #{anchor} in {rel(dest)}")
    return problems


# ---- commands ----------------------------------------------------------------------------------------

def shown_commands(text: str) -> list[tuple[int, str]]:
    """(line, command) for each command in a shell block (continuations joined, comments skipped) and
    each inline code span that starts like one of the commands checked here."""
    found = []
    for block in FENCE.finditer(text):
        if block.group(1).strip().lower() not in SHELL_FENCES:
            continue
        first = line_of(text, block.start(2))
        pending, start = "", first
        for i, line in enumerate(block.group(2).split("\n")):
            stripped = line.strip()
            if not pending:
                start = first + i
                if not stripped or stripped.startswith("#"):
                    continue
                stripped = stripped.removeprefix("$ ")
            if stripped.endswith("\\"):
                pending += stripped[:-1].rstrip() + " "
                continue
            found.append((start, pending + stripped))
            pending = ""
    found = [(n, c) for n, c in found if COMMAND_START.match(RAW_PREFIX.sub("", c))]
    body = FENCE.sub(blank, text)
    for m in CODE_SPAN.finditer(body):
        span = " ".join(m.group(1).split())
        if INLINE_START.match(RAW_PREFIX.sub("", span)):
            found.append((line_of(body, m.start()), span))
    return sorted(found)


def program_argv(command: str) -> list[str]:
    argv = shlex.split(command, comments=True)
    while argv and ENV_ASSIGNMENT.match(argv[0]):
        argv = argv[1:]
    if argv:
        argv[0] = re.sub(r"^(?:\./)?\.venv/bin/", "", argv[0])
    return argv


@functools.lru_cache(maxsize=1)
def dpfm_parser():
    from pipeline.cli import build_parser

    return build_parser()


def dpfm_problem(args: list[str]) -> str | None:
    from pipeline.stages import STAGES

    args = [a for a in args if a not in ELLIPSIS]
    if "<stage>" in args:  # `dpfm <stage> ...`: every stage takes it
        for st in STAGES:
            problem = dpfm_problem([st.name if a == "<stage>" else a for a in args])
            if problem:
                return problem
        return None
    parser = dpfm_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    if len(args) == 1:  # a bare `dpfm <command>` names the command; its required options come with it
        return None if args[0] in commands else f"no dpfm command {args[0]!r}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(args)
    except SystemExit:
        return "dpfm's parser refuses it: " + (err.getvalue().strip().splitlines() or ["(no message)"])[-1]
    return None


@functools.lru_cache(maxsize=1)
def make_targets() -> frozenset[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([^\s:#=][^:=]*?)\s*:(?!=)", line)
        if m:
            targets.update(m.group(1).split())
        if line.startswith(".PHONY:"):
            targets.update(line.split(":", 1)[1].split())
    return frozenset(targets)


def make_problem(args: list[str]) -> str | None:
    missing = [a for a in args if a not in ELLIPSIS and not a.startswith("-") and "=" not in a
               and a not in make_targets()]
    return f"no Makefile target {', '.join(missing)}" if missing else None


def benchmark_problem(argv: list[str]) -> str | None:
    if argv[1] == "-m":
        name, args = argv[2].removeprefix("benchmarks."), argv[3:]
        path = ROOT / "benchmarks" / (name.replace(".", "/") + ".py")
    else:
        path, args = ROOT / argv[1], argv[2:]
    if not path.is_file():
        return f"{rel(path)} does not exist"
    source = path.read_text()
    # Options a shared parser adds (benchmarks.peak_memory.growth_parser) count as the benchmark's.
    for helper in re.findall(r"^from benchmarks\.(\w+) import", source, re.M):
        source += (ROOT / "benchmarks" / f"{helper}.py").read_text()
    unknown = [flag for flag in (a.split("=", 1)[0] for a in args if a.startswith("--"))
               if not re.search(rf"[\"']{re.escape(flag)}[\"']", source)]
    return f"{rel(path)} has no option {', '.join(unknown)}" if unknown else None


@functools.lru_cache(maxsize=1)
def snakemake_options() -> dict[str, str]:
    """Every option of `snakemake --help` (the installed version, with its plugins), mapped to how many
    values it takes: '0', a count, '?' (an optional one) or '*' (a list)."""
    exe = Path(sys.executable).parent / "snakemake"
    exe = str(exe) if exe.exists() else shutil.which("snakemake")
    assert exe, "snakemake is not installed (make install)"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120, check=True).stdout
    options = {}
    for line in out.splitlines():
        if not re.match(r"^  -", line):
            continue
        header = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        for alias in re.split(r",\s+(?=-)", header):
            name, _, metavar = alias.partition(" ")
            metavar = metavar.strip()
            if not metavar:
                arity = "0"
            elif "..." in metavar:
                arity = "*"
            elif metavar.startswith("["):
                arity = "?"
            else:
                arity = str(len(metavar.split()))
            options[name] = arity
    return options


@functools.lru_cache(maxsize=1)
def snakemake_targets() -> tuple[frozenset[str], frozenset[str]]:
    """(outputs of the stage table, rule names of the Snakefile) that a target may name."""
    from pipeline.stages import STAGES

    outputs = {o.rstrip("/") for st in STAGES for o in st.all_outputs}
    rules = {st.name.replace("-", "_") for st in STAGES}  # rules/stages.smk names them so
    for path in [ROOT / "Snakefile", *sorted((ROOT / "rules").glob("*.smk"))]:
        rules.update(re.findall(r"^\s*(?:rule|checkpoint)\s+(\w+)\s*:", path.read_text(), re.M))
    return frozenset(outputs), frozenset(rules)


def snakemake_problem(args: list[str], options: dict[str, str]) -> str | None:
    outputs, rules = snakemake_targets()
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg in ELLIPSIS:
            continue
        if arg.startswith("-") and arg != "-":
            name, has_value, _ = arg.partition("=")
            if name not in options:
                return f"snakemake has no option {name}"
            arity = options[name]
            if has_value or arity == "0":
                continue
            if arity == "?":
                i += 1 if i < len(args) and not args[i].startswith("-") else 0
            elif arity == "*":
                while i < len(args) and not args[i].startswith("-"):
                    i += 1
            else:
                i += int(arity)
            continue
        if "/" in arg:
            if arg.rstrip("/") not in outputs:
                return f"target {arg} is no output of the stage table ({', '.join(sorted(outputs))})"
        elif arg not in rules:
            return f"target {arg} is no rule of the Snakefile ({', '.join(sorted(rules))})"
    return None


def command_problem(command: str, options: dict[str, str]) -> str | None:
    try:
        argv = program_argv(command)
    except ValueError as e:
        return f"does not split as a shell command: {e}"
    program = argv[0]
    if program == "dpfm":
        return dpfm_problem(argv[1:])
    if program == "make":
        return make_problem(argv[1:])
    if program == "snakemake":
        return snakemake_problem(argv[1:], options)
    return benchmark_problem(argv)


def command_problems(path: Path, text: str, options: dict[str, str]) -> list[str]:
    problems = []
    for line, command in shown_commands(text):
        problem = command_problem(command, options)
        if problem:
            problems.append(f"{rel(path)}:{line}: `{command}`: {problem}")
    return problems


# ---- params keys -------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def key_problems(path: Path, text: str) -> list[str]:
    problems = []
    for m in PARAM_TOKEN.finditer(text):
        parts = m.group(1).split(".")
        if parts[0] not in params() or parts[-1] in FILE_EXTENSIONS:
            continue
        node = params()
        for depth, part in enumerate(parts):
            if not isinstance(node, dict) or part not in node:
                problems.append(f"{rel(path)}:{line_of(text, m.start())}: `{m.group(1)}`: params.yaml has no "
                                f"{'.'.join(parts[:depth + 1])}")
                break
            node = node[part]
    return problems


TEST_FILE_OR_NAME = re.compile(r"tests/(test_\w+\.py)|::(test_\w+)( ?…)?")


@functools.cache
def named_tests(file: str) -> frozenset[str] | None:
    path = ROOT / "tests" / file
    return frozenset(re.findall(r"^def (test_\w+)", path.read_text(), re.M)) if path.is_file() else None


def named_test_problems(path: Path, text: str) -> list[str]:
    """`::test_x` names a test of the last test file named before it; `test_x…` any test whose name starts so."""
    problems, file = [], None
    for m in TEST_FILE_OR_NAME.finditer(text):
        if m.group(1):
            file = m.group(1)
            if named_tests(file) is None:
                problems.append(f"{rel(path)}:{line_of(text, m.start())}: tests/{file} does not exist")
            continue
        names, name = (named_tests(file) if file else None) or frozenset(), m.group(2)
        if not (any(t.startswith(name) for t in names) if m.group(3) else name in names):
            problems.append(f"{rel(path)}:{line_of(text, m.start())}: `::{name}{m.group(3) or ''}`: "
                            f"{'tests/' + file if file else 'no test file named before it'} has no such test")
    return problems


# ---- the tests ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def snakemake_help() -> dict[str, str]:
    return snakemake_options()


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move text to docs/"


def test_every_page_starts_with_a_title():
    untitled = [rel(p) for p in DOCS if not p.read_text().startswith("# ")]
    assert not untitled, f"pages without a `# Title` first line: {untitled}"


def test_relative_links_and_images_resolve():
    problems = [p for path in DOCS for p in link_problems(path, path.read_text())]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_shown_command_parses(snakemake_help):
    shown = {" ".join(RAW_PREFIX.sub("", c).split()[:2]) for path in DOCS for _, c in shown_commands(path.read_text())}
    # The collector itself: the quick start, a stage, the cluster and the benchmarks must be among them.
    for expected in ("make run", "make test", "dpfm plan", "snakemake --workflow-profile", "python -m"):
        assert expected in shown, f"no `{expected} ...` found in the docs: is the command collector broken?"
    problems = [p for path in DOCS for p in command_problems(path, path.read_text(), snakemake_help)]
    assert not problems, "commands that do not parse:\n" + "\n".join(problems)


def test_every_dpfm_command_prints_its_help_as_written():
    """argparse formats an option's help with %, never a description: a `%%` there is printed as is."""
    commands = next(a for a in dpfm_parser()._actions if a.dest == "command").choices
    shown = {name: sub.format_help() for name, sub in commands.items()}
    assert "plan" in shown and "1-10% of n" in shown["plan"]
    assert not [name for name, text in shown.items() if "%%" in text]


def test_every_params_key_named_exists():
    problems = [p for path in DOCS for p in key_problems(path, path.read_text())]
    assert not problems, "params keys the docs name that params.yaml lacks:\n" + "\n".join(problems)


def test_every_test_named_exists():
    problems = [p for path in DOCS for p in named_test_problems(path, path.read_text())]
    assert not problems, "tests the docs name that do not exist:\n" + "\n".join(problems)


PLANTED = """# Planted mistakes

See [the old engine page](dp-engine.md), [a missing heading](privacy.md#no-such-heading) and
![a missing figure](images/none.png).

```sh
dpfm dp-train --sett dp.epsilon=4
DPFM_NODES=2 .venv/bin/snakemake --workflow-profile profiles/slurm --no-such-option
snakemake models/nowhere
make deploy
python -m benchmarks.scale_utility --dir /tmp/x \\
    --no-such-flag 3
```

Run `dpfm frobnicate`, `python benchmarks/nothing.py` and `dpfm epsilon --sigma 1`, then set
`dp.epsilonn` (or `--set shards.scan_group=4`, `-S privacy.adjacent=replace_one`,
`dp.nonprivate.stepz`). Not keys: `report.md`, `model.pt`, `pipeline.cli`, `results/report/report.html`.
Shown by `tests/test_docs.py::test_the_readme_is_short`, `::test_every_page_starts…` and `::test_the_readme_is_long`,
`::test_no_such_prefix…` and `tests/test_nowhere.py::test_anything`.
"""


def test_the_checks_catch_mistakes(snakemake_help):
    page = ROOT / "docs" / "planted.md"  # never written: the checks read the text given
    reported = "\n".join(link_problems(page, PLANTED) + command_problems(page, PLANTED, snakemake_help)
                         + key_problems(page, PLANTED) + named_test_problems(page, PLANTED))
    for mistake in ("(dp-engine.md)", "#no-such-heading", "images/none.png", "--sett", "--no-such-option",
                    "models/nowhere", "make deploy", "--no-such-flag", "dpfm frobnicate", "nothing.py",
                    "dpfm epsilon --sigma 1", "`dp.epsilonn`", "`shards.scan_group`", "`privacy.adjacent`",
                    "`dp.nonprivate.stepz`", "`::test_the_readme_is_long`", "`::test_no_such_prefix…`",
                    "tests/test_nowhere.py does not exist"):
        assert mistake in reported, f"{mistake!r} was not reported:\n{reported}"
    # Not reported: file names and modules that look like keys, and a profile's path (an option's value,
    # behind `VAR=value` and `.venv/bin/`) taken for a target.
    for fine in ("report.md", "model.pt", "pipeline.cli", "profiles/slurm is no", "--workflow-profile",
                 "test_the_readme_is_short`", "test_every_page_starts"):
        assert fine not in reported.replace("--workflow-profile profiles/slurm --no-such-option`", ""), \
            f"{fine!r} was reported:\n{reported}"
    # The continuation line joins its command, reported at the line the command starts on.
    assert "docs/planted.md:11: `python -m benchmarks.scale_utility --dir /tmp/x --no-such-flag 3`" in reported


def test_no_benchmark_takes_the_name_of_a_standard_module():
    """`python benchmarks/X.py`, as several docstrings show it, puts benchmarks/ first on sys.path: a
    benchmarks/tokenize.py stopped every such run (numpy's import of inspect found it, not Python's)."""
    names = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert names & set(sys.stdlib_module_names) == set()
