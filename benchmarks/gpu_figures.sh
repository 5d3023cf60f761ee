#!/usr/bin/env bash
# The GPU figures (docs/results.md: DP overhead, throughput, the scale table), on a machine with
# CUDA PyTorch and no package registry:
# bring the wheels (`benchmarks/gpu_wheels.sh`) and Fashion-MNIST (`make fashion-mnist`, then
# `tar czf .gpu-carry/fashion.tgz data/public/fashion-mnist`) along, then
#   bash benchmarks/gpu_figures.sh OUT_DIR throughput|validate|table [extra scale_utility args]
# Writes each benchmark's output, the GPU's utilisation every 0.5 s and the finished rows to OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1 part=$2
shift 2
export PYTHONUNBUFFERED=1
if ! python3 -c 'import jsonschema, dp_accounting, opacus, webdataset' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu-wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
[ -d data/public/fashion-mnist/src ] || tar xzf .gpu-carry/fashion.tgz
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 500 > "$out/gpu_util_$part.csv" &
sampler=$!
work=${SCALE_DIR:-/tmp/scale}
[ -f .gpu-carry/rows.tgz ] && mkdir -p "$work" && tar xzf .gpu-carry/rows.tgz -C "$work"  # resume
gpu=(--set dp.data_workers=12 --set dp.physical_batch_size=1024 --set pretrain.data_workers=4)
case $part in
  throughput) timeout "${LIMIT:-500}" python3 -m benchmarks.gpu_throughput --max-batch 512 "$@" 2>&1 | grep -v absl | tee "$out/throughput.txt" ;;
  validate) timeout "${LIMIT:-500}" python3 -m benchmarks.scale_utility --dir "$work" --validate --sizes full "${gpu[@]}" "$@" 2>&1 \
              | grep -v -e absl -e 'step/s' | tee -a "$out/validate.txt" ;;
  table) timeout "${LIMIT:-500}" python3 -m benchmarks.scale_utility --dir "$work" "${gpu[@]}" "$@" 2>&1 \
           | grep -v -e absl -e 'step/s' | tee -a "$out/table.txt" ;;
esac
kill $sampler
tar czf "$out/rows.tgz" -C "$work" rows $( [ -f "$work/scaling.png" ] && echo scaling.png )
