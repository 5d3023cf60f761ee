# Downstream evaluation and the report. Their outputs are registered for `snakemake --report`
# (captions in report/); the run report itself is results/report/report.html.


report: "../report/workflow.rst"


rule evaluate:
    input:
        stage_inputs("evaluate"),
    output:
        [report(p, caption="../report/metrics.rst", category="Evaluation") for p in stage_outputs("evaluate")],
    params:
        sections=stage_params("evaluate"),
    log:
        "logs/evaluate.log",
    benchmark:
        "logs/benchmarks/evaluate.tsv"
    threads: stage("evaluate").resources.threads
    resources:
        **stage_resources("evaluate"),
    conda:
        STAGE_ENV
    shell:
        "dpfm evaluate --threads {threads} --sections-json {params.sections:q} 2>&1 | tee {log}"


rule report:
    input:
        stage_inputs("report"),
    output:
        [
            report(p, caption="../report/report.rst", category="Report", htmlindex="report.html")
            for p in stage_outputs("report")
        ],
    params:
        sections=stage_params("report"),
    log:
        "logs/report.log",
    benchmark:
        "logs/benchmarks/report.tsv"
    threads: stage("report").resources.threads
    resources:
        **stage_resources("report"),
    conda:
        STAGE_ENV
    shell:
        "dpfm report --threads {threads} --sections-json {params.sections:q} 2>&1 | tee {log}"
