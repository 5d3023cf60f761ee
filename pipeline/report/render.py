"""The report as Markdown and as one self-contained HTML page (CSS inline, images as data URIs,
no script and no network)."""

from __future__ import annotations

import base64
import html
from pathlib import Path

import yaml

from pipeline.privacy.accounting import bound_text
from pipeline.privacy.release import public_params

# (metrics key, column title); few-shot keys expand to one column per K.
PROTOCOLS = (("linear_probe", "Linear probe"), ("fewshot_logreg", "{k}-shot"),
             ("fewshot_finetune", "{k}-shot FT"), ("zero_shot", "Zero-shot"))


def accuracy_table(set_metrics: dict, models: dict, order: list[str] | None = None) -> tuple[list[str], list[dict]]:
    """Columns and rows ({name, label, cells: [(mean, std, ci) or None]}) of one eval set, rows in
    `order`: std over few-shot subsets, ci the 95% bootstrap interval [lo, hi] (linear probe, zero-shot)."""
    results = set_metrics["results"]
    order = [n for n in (order or []) if n in results] + [n for n in results if n not in (order or [])]
    results = {n: results[n] for n in order}
    keys: list[tuple[str, str | None, str]] = []
    for key, title in PROTOCOLS:
        values = [r[key] for r in results.values() if key in r]
        if not values:
            continue
        if isinstance(values[0], dict):
            shots = sorted({int(k) for v in values for k in v})
            keys += [(key, str(k), title.format(k=k)) for k in shots]
        else:
            keys.append((key, None, title))
    rows = []
    for name, r in results.items():
        cells = []
        for key, k, _ in keys:
            v = r.get(key)
            if v is None or (k is not None and k not in v):
                cells.append(None)
            else:
                cells.append((v[k]["mean"], v[k]["std"], None) if k is not None else (v, None, r.get(f"{key}_ci")))
        rows.append({"name": name, "label": models.get(name, {}).get("label", name), "cells": cells})
    return [t for _, _, t in keys], rows


def best_per_column(rows: list[dict]) -> list[float | None]:
    cols = zip(*[r["cells"] for r in rows]) if rows else []
    return [max((c[0] for c in col if c is not None), default=None) for col in cols]


def fmt_acc(cell) -> str:
    if cell is None:
        return "—"
    mean, std, ci = cell
    text = f"{100 * mean:.1f}"
    if std is not None:
        text += f" ± {100 * std:.1f}"
    if ci is not None:
        text += f" ({100 * ci[0]:.1f}–{100 * ci[1]:.1f})"
    return text


def params_yaml(params: dict) -> str:
    return yaml.safe_dump(public_params(params), sort_keys=False, allow_unicode=True, width=100)


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _figure(path: Path, caption: str, cls: str = "") -> str:
    return (f'<figure class="{cls}">{_img(path, caption)}<figcaption>{html.escape(caption)}</figcaption>'
            f"</figure>")


TABLE_HEAD_COLOR = "#243447"  # used nowhere else on the page: a screenshot test looks for it

CSS = """
:root{--ink:#1d2430;--muted:#5b6472;--line:#e3e6eb;--dp:#c8313e;--ok:#1e7a3c;--okbg:#eaf6ee;--bad:#b3261e;
--badbg:#fdecea;--head:#1f3a5f}
*{box-sizing:border-box}
body{font:15px/1.5 -apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;color:var(--ink);
margin:0;background:#f6f7f9}
main{max-width:1040px;margin:0 auto;padding:28px 32px 48px;background:#fff;min-height:100vh}
h1{font-size:26px;margin:0 0 4px}h2{font-size:19px;margin:34px 0 10px;padding-bottom:4px;
border-bottom:1px solid var(--line)}h3{font-size:15px;margin:18px 0 6px}
.sub{color:var(--muted);margin:0 0 18px;font-size:14px}
.verdict{border-radius:8px;padding:14px 18px;margin:8px 0 18px;border:1px solid}
.verdict.ok{background:var(--okbg);border-color:#9fd3b0}.verdict.bad{background:var(--badbg);border-color:#f0a8a2}
.verdict.warn{background:#fff4e0;border-color:#f0c27a}.verdict.warn .big{color:#8a5300}
.verdict .big{font-size:21px;font-weight:700}.verdict.ok .big{color:var(--ok)}.verdict.bad .big{color:var(--bad)}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(170px,1fr));gap:12px;margin:0 0 8px}
.card{border:1px solid var(--line);border-radius:8px;padding:10px 14px}
.card .k{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:22px;font-weight:700}.card .d{color:var(--muted);font-size:13px}
table{border-collapse:collapse;margin:8px 0;font-variant-numeric:tabular-nums}
th,td{padding:6px 12px;border-bottom:1px solid var(--line);text-align:right;white-space:nowrap}
th:first-child,td:first-child{text-align:left}
table.acc thead th{background:TABLE_HEAD;color:#fff;font-weight:600}
table.acc tr.dp td{background:#fdf1f2}table.acc tr.dp td:first-child{border-left:4px solid var(--dp)}
td.best{font-weight:700}.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:8px}
.note{color:var(--muted);font-size:13px;margin:4px 0 12px}
.pass{color:var(--ok);font-weight:700}.fail{color:var(--bad);font-weight:700}
table.checks td,table.mech td{text-align:left;white-space:normal}table.checks td:first-child{white-space:nowrap}
figure{margin:10px 0 18px}figure img{max-width:100%;height:auto;border:1px solid var(--line);border-radius:6px}
figcaption{color:var(--muted);font-size:13px;margin-top:4px}
.grid2{display:grid;grid-template-columns:1fr 1fr;gap:16px}
figure.sheet img{width:min(100%,420px);image-rendering:pixelated}figure.bars img{max-width:760px}
.headline{font-size:16px;margin:0 0 14px}
details{margin:8px 0}summary{cursor:pointer;color:var(--head);font-weight:600}
pre{background:#f6f7f9;border:1px solid var(--line);border-radius:6px;padding:10px 14px;font-size:12.5px;
overflow:auto}
footer{color:var(--muted);font-size:12px;margin-top:36px;border-top:1px solid var(--line);padding-top:10px}
@media print{body{background:#fff}main{padding:0}}
""".replace("TABLE_HEAD", TABLE_HEAD_COLOR)


def verdict(r: dict, sep: str) -> tuple[str, str, str]:
    """The first thing the report says, (kind, headline, detail): what everything it releases is, not
    the released model alone, when the two differ (the curve's points and extra seeds are trained on
    the same private data; an ε = ∞ point or a non-private twin makes the whole run not private)."""
    ver, privacy = r["verification"], r["privacy"]
    checks = (f"{sum(c['passed'] for c in ver['checks'])} of {len(ver['checks'])} checks passed, reported with "
              f"the {ver['accountant'].upper()} accountant ("
              + sep.join(f"{a.upper()} ε = {bound_text(v, 3)}" for a, v in ver["epsilon"].items()) + ")")
    if not ver["passed"]:
        return "bad", "Privacy verification FAILED — do not publish this model as private", f"Not verified: {checks}."
    model = f"(ε = {bound_text(ver['epsilon_reported'], 2)}, δ = {r['delta_text']})-DP"
    if not privacy["private"]:
        return ("warn", "NOT PRIVATE as a whole: " + "; ".join(privacy["not_private"]),
                f"The released model alone is {model}, verified: {checks}.")
    if privacy["runs"] > 1:
        runs = f"{privacy['runs']} DP runs charged to data/budget"
        return ("ok", f"(ε = {bound_text(privacy['epsilon_composed'], 2)}, "
                      f"δ = {bound_text(privacy['delta_composed'], 2, exponent=True)})-DP: all this report releases "
                      f"({runs})", f"The released model alone is {model}, verified: {checks}.")
    return "ok", model, f"Verified: {checks}."


def render_html(r: dict) -> str:
    """r: the report's content, as built by pipeline.report.content.build."""
    e = html.escape
    ver = r["verification"]
    kind, big, detail = verdict(r, " · ")
    out = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
           f"<meta name='viewport' content='width=device-width,initial-scale=1'><title>{e(r['title'])}</title>"
           f"<style>{CSS}</style></head><body><main>",
           f"<h1>{e(r['title'])}</h1><p class='sub'>{e(r['subtitle'])}</p>",
           f"<section class='verdict {kind}' id='verdict'><div class='big'>{e(big)}</div>"
           f"<div>{e(detail)}</div></section>",
           f"<p class='headline'>{e(r['headline'])}</p>",
           "<div class='cards'>" + "".join(
               f"<div class='card'><div class='k'>{e(k)}</div><div class='v'>{e(v)}</div>"
               f"<div class='d'>{e(d)}</div></div>"
               for k, v, d in r["cards"]) + "</div>"]
    for s in r["sets"]:
        best = best_per_column(s["rows"])
        head = "".join(f"<th>{e(c)}</th>" for c in ["Model"] + s["columns"])
        body = []
        for row in s["rows"]:
            cells = "".join(
                f"<td class='{'best' if c is not None and b is not None and abs(c[0] - b) < 1e-12 else ''}'>"
                f"{e(fmt_acc(c))}</td>" for c, b in zip(row["cells"], best))
            swatch = f"<span class='swatch' style='background:{r['colors'].get(row['name'], '#888')}'></span>"
            body.append(f"<tr class='{e(row['name'])}'><td>{swatch}{e(row['label'])}</td>{cells}</tr>")
        out.append(f"<h2>Downstream accuracy · {e(s['name'])}</h2><p class='note'>{e(s['note'])}</p>"
                   f"<table class='acc' id='accuracy-{e(s['name'])}'><thead><tr>{head}</tr></thead>"
                   f"<tbody>{''.join(body)}</tbody></table><p class='note'>{e(s['legend'])}</p>")
        if s.get("figure"):
            out.append(_figure(s["figure"], f"Accuracy on {s['name']} (%); error bars: 95% bootstrap interval over "
                               "the test images (linear probe, zero-shot), std over subsets (few-shot).", "bars"))
    f = r["figures"]
    if r.get("curve"):
        c = r["curve"]
        head = "".join(f"<th>{e(col)}</th>" for col in ["Linear probe"] + c["columns"])
        body = "".join(f"<tr><td>{e(row['label'])}</td>" + "".join(f"<td>{e(fmt_acc(x))}</td>" for x in row["cells"])
                       + "</tr>" for row in c["rows"])
        out.append(f"<h2>Privacy–utility curve</h2><table class='acc' id='curve'><thead><tr>{head}</tr></thead>"
                   f"<tbody>{body}</tbody></table>" + _figure(c["figure"], c["caption"]))
    out.append("<h2>Privacy and utility</h2><div class='grid2'>"
               + _figure(f["privacy_utility"], r["pu_caption"]) + _figure(f["epsilon"], r["eps_caption"]) + "</div>")
    checks = "".join(f"<tr><td class='{'pass' if c['passed'] else 'fail'}'>{'✔ pass' if c['passed'] else '✘ FAIL'}</td>"
                     f"<td>{e(c['name'])}</td><td>{e(c['detail'])}</td></tr>" for c in ver["checks"])
    mech = "".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in r["mechanism"])
    out.append(f"<h3>Mechanism</h3><table class='mech'>{mech}</table>"
               f"<h3>Verification checks</h3><table class='checks'>{checks}</table>")
    out.append("<h2>Training</h2>" + _figure(f["losses"], r["loss_caption"]))
    out.append("<h2>Synthetic pretraining images</h2>" + _figure(f["contact_sheet"], r["sheet_caption"], "sheet"))
    out.append(f"<h2>Parameters</h2><details open><summary>params.yaml of this run</summary>"
               f"<pre>{e(r['params_yaml'])}</pre></details>")
    out.append(f"<footer>{e(r['footer'])}</footer></main></body></html>\n")
    return "\n".join(out)


def _row(*cells) -> str:
    """A markdown table row; a `|` in a cell (an eval set's name, a check's detail) would end the cell."""
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def render_markdown(r: dict) -> str:
    ver = r["verification"]
    md = [f"# {r['title']}", "", f"_{r['subtitle']}_", ""]
    _, big, detail = verdict(r, ", ")
    md.append(f"**{big}.** {detail}")
    md += ["", r["headline"], "", "| | | |", "| --- | --- | --- |"]
    md += [_row(k, f"**{v}**", d) for k, v, d in r["cards"]]
    for s in r["sets"]:
        best = best_per_column(s["rows"])
        md += ["", f"## Downstream accuracy · {s['name']}", "", s["note"], "",
               _row("Model", *s["columns"]),
               "| --- |" + " ---: |" * len(s["columns"])]
        for row in s["rows"]:
            cells = [f"**{fmt_acc(c)}**" if c is not None and b is not None and abs(c[0] - b) < 1e-12 else fmt_acc(c)
                     for c, b in zip(row["cells"], best)]
            md.append(_row(row["label"], *cells))
        md += ["", s["legend"]]
        if s.get("figure"):
            md += ["", f"![accuracy on {s['name']}]({Path(s['figure']).name})"]
    f = r["figures"]
    if r.get("curve"):
        c = r["curve"]
        md += ["", "## Privacy–utility curve", "", _row("Linear probe", *c["columns"]),
               "| --- |" + " ---: |" * len(c["columns"])]
        md += [_row(row["label"], *map(fmt_acc, row["cells"])) for row in c["rows"]]
        md += ["", f"![privacy-utility curve]({Path(c['figure']).name})", "", c["caption"]]
    md += ["", "## Privacy and utility", "", f"![privacy-utility]({f['privacy_utility'].name})", "", r["pu_caption"],
           "", f"![epsilon against step]({f['epsilon'].name})", "", r["eps_caption"], "", "### Mechanism", "",
           "| | |", "| --- | --- |"] + [_row(k, v) for k, v in r["mechanism"]]
    md += ["", "### Verification checks", "", "| result | check | detail |", "| --- | --- | --- |"]
    md += [_row("pass" if c["passed"] else "**FAIL**", c["name"], c["detail"]) for c in ver["checks"]]
    md += ["", "## Training", "", f"![losses]({f['losses'].name})", "", r["loss_caption"],
           "", "## Synthetic pretraining images", "", f"![synthetic images]({f['contact_sheet'].name})", "",
           r["sheet_caption"], "", "## Parameters", "", "```yaml", r["params_yaml"].rstrip(), "```", "",
           r["footer"], ""]
    return "\n".join(md)
