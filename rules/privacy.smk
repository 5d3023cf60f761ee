# Privacy: independent re-accounting of what dp-train recorded.


rule verify:
    input:
        stage_inputs("verify"),
    output:
        stage_outputs("verify"),
    params:
        sections=stage_params("verify"),
    log:
        "logs/verify.log",
    benchmark:
        "logs/benchmarks/verify.tsv"
    threads: stage("verify").resources.threads
    resources:
        **stage_resources("verify"),
    conda:
        STAGE_ENV
    shell:
        "dpfm verify --threads {threads} --sections-json {params.sections:q} 2>&1 | tee {log}"
