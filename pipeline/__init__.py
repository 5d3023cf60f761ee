"""dpfm: differentially private vision foundation models as a Snakemake pipeline."""

__version__ = "0.1.0"
