#!/usr/bin/env bash
# Run by Snakemake in the new environment, from the project's directory (`snakemake --sdm conda`):
# the project and its pinned dependencies, as `make install` installs them into .venv.
set -euo pipefail
python -m pip install --quiet -c constraints.txt -e .
