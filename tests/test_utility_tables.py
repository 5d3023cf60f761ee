"""README's and docs/results.md's digits tables are the run kept in benchmarks/utility_rows/digits.json
(benchmarks/utility.py's JSON line), every figure rounded as printed, and every DP row carries its σ and σ/B."""

import json
import re

from test_scale_utility import GAIN_CI, PERCENT_CI, ROOT, as_printed, number

KEPT = ROOT / "benchmarks" / "utility_rows" / "digits.json"
INITS = {"raw pixels": "pixels", "synthetic only": "synthetic", "random init": "random",
         "synthetic": "synthetic", "random": "random"}
COLUMNS = ["objective", "init", "ε", "σ", "σ/B", "linear probe (95% CI)", "gain over synthetic-only (paired 95% CI)",
           "zero-shot"]


def epsilon_key(text):
    if text in (None, "—", ""):
        return None
    return "inf" if text in ("inf", "∞") else float(text)


def kept_rows() -> dict:
    run = json.loads(KEPT.read_text())
    return {(r["objective"], r["init"], epsilon_key(r["epsilon"])): r for r in [run["pixels"], *run["rows"]]}


def digits_table(text: str, heading: str) -> list[dict]:
    """The rows of the first table under `heading`, as {column: cell}."""
    section = text.split(heading, 1)[1]
    lines = ("|" + section.split("\n|", 1)[1]).split("\n\n", 1)[0].splitlines()  # from its first line to a blank one
    cells = [[c.strip().replace("**", "") for c in line.strip().strip("|").split("|")] for line in lines]
    assert cells[0] == COLUMNS, f"{heading}: columns {cells[0]}"
    return [dict(zip(COLUMNS, row)) for row in cells[2:]]


def off(printed, values) -> bool:
    """Whether figures printed in percent (or points) are further from the kept fractions than rounding allows."""
    return max(abs(number(p) - 100 * v) for p, v in zip(printed, values)) > 0.051


def mismatches(table: list[dict]) -> list[str]:
    """Every figure of `table` the kept run does not give, and every DP row without its noise."""
    kept, wrong = kept_rows(), []
    for cells in table:
        key = (None if cells["objective"] == "—" else cells["objective"], INITS[cells["init"]], epsilon_key(cells["ε"]))
        label = "/".join(str(k) for k in key)
        row = kept.get(key)
        if row is None:
            wrong.append(f"{label}: not in {KEPT.name}")
            continue
        if off(PERCENT_CI.search(cells["linear probe (95% CI)"]).groups(), (row["acc"], *row["ci"])):
            wrong.append(f"{label}: probe {cells['linear probe (95% CI)']} against {100 * row['acc']:.1f}%")
        if "sigma" in row:
            noise = cells["σ/B"]
            value = row["noise_per_coordinate"] if noise.startswith("2σC = ") else row["sigma_over_b"]
            noise = noise.removeprefix("2σC = ")
            if not noise or number(noise) != as_printed(value, noise):
                wrong.append(f"{label}: σ/B {noise or 'missing'} against {value:.3g}")
            if not cells["σ"] or number(cells["σ"]) != as_printed(row["sigma"], cells["σ"]):
                wrong.append(f"{label}: σ {cells['σ'] or 'missing'} against {row['sigma']:.4g}")
        gain = cells["gain over synthetic-only (paired 95% CI)"]
        if gain:
            g = row["gain_over_synthetic"]
            if off(GAIN_CI.search(gain).groups(), (g["diff"], *g["ci"])):
                wrong.append(f"{label}: gain {gain} against {100 * g['diff']:+.1f}")
        zero = PERCENT_CI.fullmatch(cells["zero-shot"])
        if cells["zero-shot"] and not zero:
            wrong.append(f"{label}: zero-shot {cells['zero-shot']} without its interval")
        elif zero and off(zero.groups(), (row["zero_shot"], *row["zero_shot_ci"])):
            wrong.append(f"{label}: zero-shot {cells['zero-shot']} against {100 * row['zero_shot']:.1f}%")
    return wrong


TABLES = (("README.md", "## Quick check: the bundled digits"), ("docs/results.md", "## Utility: what the encoders are worth"))


def test_the_digits_tables_are_the_kept_run():
    for path, heading in TABLES:
        table = digits_table((ROOT / path).read_text(), heading)
        assert len(table) >= 6, path  # pixels, synthetic only, random init and a DP row per objective
        assert mismatches(table) == [], path


def test_the_check_catches_a_moved_figure_and_a_missing_sigma():
    text = (ROOT / "README.md").read_text()
    table = digits_table(text, TABLES[0][1])
    dp = next(i for i, row in enumerate(table) if row["σ"])
    moved = [dict(row) for row in table]
    moved[dp]["linear probe (95% CI)"] = re.sub(r"^(\d+)\.(\d)", lambda m: f"{m[1]}.{(int(m[2]) + 3) % 10}",
                                                moved[dp]["linear probe (95% CI)"])  # 92.6% -> 92.9%
    assert any("probe" in m for m in mismatches(moved))
    unmarked = [dict(row) for row in table]
    unmarked[dp]["σ/B"] = ""
    assert any("σ/B missing" in m for m in mismatches(unmarked))
    regained = [dict(row) for row in table]
    regained[dp]["gain over synthetic-only (paired 95% CI)"] = "+9.9 (+9.0 to +9.9)"
    assert any("gain" in m for m in mismatches(regained))
