"""The `report` stage: one self-contained HTML page (opens offline in any browser) and Markdown.

Content (pipeline/report/): the params, ε with its accountant and the verification checks, the
accuracy table beside the baselines, loss curves, ε against step, privacy–utility across the MLflow
experiment's runs, and the synthetic contact sheet.
"""

from __future__ import annotations

from pipeline.io import atomic_dir, read_json, write_json
from pipeline.privacy import budget, release
from pipeline.privacy.plan import Plan
from pipeline.privacy.run_checks import check_made_for
from pipeline.report import content
from pipeline.report.curves import experiment_points
from pipeline.report.privacy import final_privacy
from pipeline.report.render import render_html, render_markdown


def run(params: dict, ctx) -> None:
    st = ctx.stage
    # An earlier run's final ε must not outlive a failed report (it may count fewer runs than the budget).
    st.output("privacy").unlink(missing_ok=True)
    dp_dir, stats_path = st.input("dp"), st.input("shards") / "stats.json"
    ver, metrics = read_json(st.input("verification")), read_json(st.input("metrics"))
    check_made_for(ver.get("run"), st.input("verification"), dp_dir, "dpfm verify")
    check_made_for(metrics["privacy"].get("run"), st.input("metrics"), dp_dir, "dpfm evaluate")  # its accuracies
    ledger = read_json(dp_dir / "ledger.json")
    stats = read_json(stats_path) if stats_path.exists() else None
    from pipeline.tracking import dvc_hash

    points = experiment_points(params["run"]["experiment"], dvc_hash(str(dp_dir)) if dp_dir.exists() else None,
                               metrics["primary_set"], ver.get("adjacency", "add_remove"))
    final = final_privacy(params, ledger, ver, stats or {})
    histories = (read_json(st.input("pretrain") / "history.json"), read_json(dp_dir / "history.json"))
    with atomic_dir(st.output("report")) as out:
        page = content.build(params, ver, Plan.from_header(ledger), metrics, out, points, final, histories,
                             st.input("synthetic") / "contact_sheet.png", stats)
        (out / "report.md").write_text(render_markdown(page))
        (out / "report.html").write_text(render_html(page))
    write_json(st.output("privacy"), {**final, "epsilon_composed": str(final["epsilon_composed"])
                                      if not final["private"] else final["epsilon_composed"]})
    # The last stage: every DP training of this run (dp-train, the curve, the seeds) is charged by now.
    ctx.tracker.log_metrics({"epsilon_dp_runs": final["epsilon_dp_runs"], "dp_runs_on_data": final["runs"]}
                            | ({"epsilon_composed": final["epsilon_composed"]} if final["private"] else {}))
    ctx.tracker.set_tags({"dpfm.private": str(final["private"]).lower()}
                         | release.not_private_tags(final["not_private"]))
    # Every registered version on this budget, whichever run (or Snakemake invocation) registered it.
    ctx.tracker.tag_dp_models(release.registry_tags(final["epsilon_composed"], final["delta_composed"], final["runs"],
                                                    final["not_private"]),
                              budget.registry_id())
    ctx.tracker.log_artifact(str(st.output("report")), "report")
    ctx.tracker.log_artifact(str(st.output("privacy")))
    print(f"report: {st.output('report')}/report.html")
