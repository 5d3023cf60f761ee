"""dpfm: differentially private vision foundation models as a Snakemake pipeline."""

from pathlib import Path

__version__ = "0.1.0"

# The project root holds params.yaml, schemas/ and the artifacts; stages run with it as cwd.
PACKAGE_DIR = Path(__file__).resolve().parent
