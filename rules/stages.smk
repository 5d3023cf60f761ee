# One rule per stage of the stage table (pipeline/stages/__init__.py), generated in one loop: the table
# is the single source of truth, as it is for dvc.yaml. Training stages (those asking for GPUs)
# start through pipeline/launch.py: one process, torchrun over the job's GPUs, or srun + torchrun
# over its nodes (resources.gpu is the job's total, as the SLURM plugin reads it). The shards rule
# also takes the summaries of its scan jobs (rules/scan.smk) as inputs: stage_inputs.


# Outputs registered for `snakemake --report` (captions in report/); the run report itself is
# results/report/report.html.
report: "../report/workflow.rst"


for st in STAGES:

    rule:
        name:
            st.name.replace("-", "_")
        input:
            stage_inputs(st),
        output:
            rule_outputs(st),
        params:
            # Functions: their values are not expanded as wildcards, so braces pass through unchanged
            # (URL brace patterns, "a photo of a {c}." templates).
            tracked=lambda wildcards, name=st.name: stage_params(name),
            # Bound here: the shell command is evaluated when the job runs, after the loop has moved on.
            command=lambda wildcards, resources, st=st: stage_command(st, resources),
        log:
            f"logs/{st.name}.log",
        benchmark:
            benchmark_file(st.name, st.touches_private_data)
        threads: st.resources.threads
        resources:
            **stage_resources(st.name),
        conda:
            STAGE_ENV
        # SLURM's SIGTERM before the time limit reaches this shell too: it waits for the stage to save its
        # checkpoint and exits with the stage's code (bash runs a trap once the pipeline ends), where
        # untrapped it died at once and the job ended under the stage. tee ignores it and logs to the end.
        shell:
            "trap : TERM INT; {params.command} --threads {threads} --resolved \"$DPFM_RESOLVED_PARAMS\" 2>&1 | (trap '' TERM INT; exec tee {log})"
