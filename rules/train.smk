# Training: non-private synthetic pretraining, then DP-SGD on the private shards.
# Both start through pipeline/launch.py: one process, torchrun over the job's GPUs, or srun + torchrun over
# its nodes (resources.gpu is the job's total, as the SLURM plugin reads it; profiles/slurm sets it).


rule pretrain:
    input:
        stage_inputs("pretrain"),
    output:
        stage_outputs("pretrain"),
    params:
        sections=stage_params("pretrain"),
    log:
        "logs/pretrain.log",
    benchmark:
        "logs/benchmarks/pretrain.tsv"
    threads: stage("pretrain").resources.threads
    resources:
        **stage_resources("pretrain"),
    conda:
        STAGE_ENV
    shell:
        "python -m pipeline.launch --nodes {resources.nodes} --gpus {resources.gpu} -- "
        "dpfm pretrain --threads {threads} --sections-json {params.sections:q} 2>&1 | tee {log}"


rule dp_train:
    input:
        stage_inputs("dp-train"),
    output:
        stage_outputs("dp-train"),
    params:
        sections=stage_params("dp-train"),
    log:
        "logs/dp-train.log",
    benchmark:
        "logs/benchmarks/dp-train.tsv"
    threads: stage("dp-train").resources.threads
    resources:
        **stage_resources("dp-train"),
    conda:
        STAGE_ENV
    shell:
        "python -m pipeline.launch --nodes {resources.nodes} --gpus {resources.gpu} -- "
        "dpfm dp-train --threads {threads} --sections-json {params.sections:q} 2>&1 | tee {log}"
