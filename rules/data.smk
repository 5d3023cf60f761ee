# Data: private/eval shards, synthetic images, the public-text tokenizer.


rule shards:
    output:
        stage_outputs("shards"),
    params:
        sections=stage_params("shards"),
    log:
        "logs/shards.log",
    benchmark:
        "logs/benchmarks/shards.tsv"
    threads: stage("shards").resources.threads
    resources:
        **stage_resources("shards"),
    conda:
        STAGE_ENV
    shell:
        "dpfm shards --threads {threads} --sections-json {params.sections:q} 2>&1 | tee {log}"


rule synthetic:
    output:
        stage_outputs("synthetic"),
    params:
        sections=stage_params("synthetic"),
    log:
        "logs/synthetic.log",
    benchmark:
        "logs/benchmarks/synthetic.tsv"
    threads: stage("synthetic").resources.threads
    resources:
        **stage_resources("synthetic"),
    conda:
        STAGE_ENV
    shell:
        "dpfm synthetic --threads {threads} --sections-json {params.sections:q} 2>&1 | tee {log}"


rule tokenizer:
    output:
        stage_outputs("tokenizer"),
    params:
        sections=stage_params("tokenizer"),
    log:
        "logs/tokenizer.log",
    benchmark:
        "logs/benchmarks/tokenizer.tsv"
    threads: stage("tokenizer").resources.threads
    resources:
        **stage_resources("tokenizer"),
    conda:
        STAGE_ENV
    shell:
        "dpfm tokenizer --threads {threads} --sections-json {params.sections:q} 2>&1 | tee {log}"
