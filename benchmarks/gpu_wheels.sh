#!/usr/bin/env bash
# Wheels the GPU benchmark machine lacks (it has CUDA PyTorch, numpy, scipy, pyarrow, sentencepiece,
# scikit-learn, but no package registry): downloaded here into .gpu-wheels/ (git-ignored), carried
# there, and installed with
#   pip install --no-index --no-deps --target /tmp/site .gpu-wheels/*.whl && export PYTHONPATH=/tmp/site:$PWD
# Versions are the ones this project's .venv resolved; pure-Python except rpds-py, dm-tree and sentencepiece
# (the machine's own 0.2.2 stalls training the tokenizer: pipeline/data/tokenizer.py).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu-wheels
mkdir -p "$out"
pip=(python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$out")
"${pip[@]}" jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
    sentencepiece==0.2.3 braceexpand==0.1.7 webdataset==1.0.2 opacus==1.6.0 dp-accounting==0.6.0 dm-tree==0.1.10 \
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0  # the CUDA tests
ls -la "$out"
