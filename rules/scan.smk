# The shards stage's scan, scattered: for a source scanned where it lives (urls, img2dataset),
# shards.scan_groups jobs each scan one contiguous slice of the shard list into the per-shard scan
# cache (`dpfm scan-shards`, resuming from what the cache holds) and write a small summary; the
# `shards` rule takes every summary as input and then only merges the cached scans. The group count
# comes from params, so the DAG is known when it is built (no checkpoint), and each job resolves the
# shard list itself, the same way, so all agree on it (should an img2dataset folder change between
# jobs, the gather scans whatever no job did). `download` and `digits` have no scan jobs.
#
# Written by hand, not generated from the stage table: its output is a cache, not data of record,
# and it has no DVC stage (DVC runs `dpfm shards`, which scans the shards itself in one stage). A
# plain rule with a `group` wildcard rather than Snakemake's `scattergather`: the count stays a
# params.yaml key checked by the schema (not a workflow-wide directive that `--set-scatter` changes
# behind it), and a job gets its group as a number rather than a "2-of-3" item to parse.


rule scan_shards:
    output:
        scan_summary(),
    params:
        # A function, as in the stage rules: URL brace patterns pass through unexpanded.
        tracked=lambda wildcards: scan_params(),
        groups=scan_groups(),
        python=JOB_PYTHON,
    log:
        "logs/scan_shards/{group}.log",
    benchmark:
        benchmark_file("scan_shards/{group}", private=True)
    wildcard_constraints:
        group=r"\d+",
    # Scan processes: locally every core (one group on a laptop); profiles/slurm sets threads,
    # memory and runtime per job.
    threads: workflow.cores
    conda:
        STAGE_ENV
    shell:
        "{params.python} -m pipeline.cli scan-shards --group {wildcards.group} --groups {params.groups}"
        " --threads {threads} --resolved \"$DPFM_RESOLVED_PARAMS\" --summary {output} 2>&1 | (trap '' TERM INT; exec tee {log})"
