# dpfm: shards -> synthetic -> tokenizer -> pretrain -> dp-train -> verify -> curve -> evaluate -> report.
# Rules come from the stage table in pipeline/stages/__init__.py (the same table writes dvc.yaml);
# rules/scan.smk scatters the shards stage's scan of a web source over jobs.
from snakemake.utils import min_version

min_version("9.0")


# Read by the workflow's own Snakemake only: a job takes the params it validated (rules/common.smk), so
# params.yaml half-edited, or gone, while a workflow runs fails none of its jobs.
if workflow.is_main_process:

    configfile: "params.yaml"


include: "rules/common.smk"


# The file of params the workflow validated (rules/common.smk): passed to every job, a SLURM job's too.
envvars:
    RESOLVED_ENV,


include: "rules/stages.smk"
include: "rules/scan.smk"


rule all:
    input:
        "results/report",
        "results/eval/metrics.json",
        "results/privacy/verification.json",
    default_target: True
