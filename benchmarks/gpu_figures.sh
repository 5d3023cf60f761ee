#!/usr/bin/env bash
# The GPU figures (docs/results.md: DP overhead, throughput, the loader, the scale table), on a machine
# with CUDA PyTorch and no package registry. Prepare here:
#   bash benchmarks/gpu_wheels.sh                        # .gpu-wheels/: the packages it lacks
#   make fashion-mnist && tar cf - data/public/fashion-mnist | xz -9 > .gpu-carry/fashion.txz
#   tar czf .gpu-carry/work.tgz -C DIR rows n-full/models  # optional: a scale DIR's rows and warm start
# (.gpu-carry/ is git-ignored; carrying DIR's warm start keeps its untrained rows valid there), then
#   bash benchmarks/gpu_figures.sh OUT_DIR PART [args]
# The table at 224 px has a warm start of its own, so a DIR of its own (the benchmark refuses a DIR whose
# warm start another recipe made): SCALE_DIR=/tmp/scale224 ... table --set model.size=tiny
#   --set model.img_size=224 --set model.patch_size=16 --set synthetic.resolution=224
#   --set synthetic.samples_per_shard=125 [--objectives ...]  (the 2,000 shader images in 16 shards, a core
#   each, not 2: the same images in the same order, so the same warm start)
# PART: throughput [gpu_throughput args; --profile BATCH for a per-op table] | loader [loader args] |
# routes [clipping_routes args: the GPU's WRITE_COST] | rounding [sum_rounding args: the others' rounding in
# bf16 on CUDA] | noise [noise_draw args: the noise's edge and cost on CUDA] | probe [probe_speed args: the
# logistic probe on the GPU against the CPU's] | table|validate [scale_utility args].
# Each part runs under LIMIT seconds (default 500) and appends to files in OUT_DIR (a call brings
# back 8 at most): figures.txt (every part's output, under a header), util.csv (the GPU's utilisation
# every 0.5 s, by part: TAG, default PART), scale.log (the scale parts' whole output, a clock time on
# every line, to place the training in the samples), rows.tgz (the finished rows) and work.tgz (rows and
# training state: carry it to the next call to resume; STATE=0 skips it).
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1 part=$2
shift 2
export PYTHONUNBUFFERED=1
if ! python3 -c 'import jsonschema, dp_accounting, opacus, webdataset' 2>/dev/null; then
  if [ ! -d /tmp/site ]; then  # installed beside, then renamed: a failed install is not taken as done next call
    rm -rf /tmp/site.part && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site.part .gpu-wheels/*.whl && mv /tmp/site.part /tmp/site || exit 1
  fi
  export PYTHONPATH=/tmp/site:$PWD
fi
work=${SCALE_DIR:-/tmp/scale}
if [ "$part" = table ] || [ "$part" = validate ] || [ "$part" = probe ]; then  # Fashion-MNIST, carried (see above)
  [ -d data/public/fashion-mnist/src ] || python3 -c 'import tarfile; tarfile.open(".gpu-carry/fashion.txz").extractall()' \
    || exit 1
  if [ ! -d "$work" ] && [ -f .gpu-carry/work.tgz ]; then mkdir -p "$work" && tar xzf .gpu-carry/work.tgz -C "$work"; fi
fi
tag=${TAG:-$part}
echo "== $tag: $(date +%T) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader) $*" \
  | tee -a "$out/figures.txt"
python3 -c 'import sys, torch, sentencepiece, numpy; print("   python", sys.version.split()[0], "torch", torch.__version__,
  "sentencepiece", sentencepiece.__version__, "numpy", numpy.__version__)' 2>&1 | tee -a "$out/figures.txt"
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 500 \
  | sed -u "s/^/$tag, /" >> "$out/util.csv" &
sampler=$!
stamp() {  # every line (tqdm's \r updates too) with the clock time, to line up with the samples
  stdbuf -oL tr '\r' '\n' | python3 -uc 'import sys, time
for line in sys.stdin: print(time.strftime("%H:%M:%S"), line, end="", flush=True)'
}
status=
gpu=(--set dp.data_workers=12 --set dp.physical_batch_size=1024 --set pretrain.data_workers=4)
case $part in
  throughput) timeout "${LIMIT:-500}" python3 -m benchmarks.gpu_throughput "$@" 2>&1 | grep -v absl | tee -a "$out/figures.txt" ;;
  loader) timeout "${LIMIT:-500}" python3 benchmarks/loader.py --workers 12 "$@" 2>&1 | tee -a "$out/figures.txt" ;;
  routes) timeout "${LIMIT:-500}" python3 -m benchmarks.clipping_routes --device cuda "$@" 2>&1 | tee -a "$out/figures.txt" ;;
  rounding) timeout "${LIMIT:-500}" python3 -m benchmarks.sum_rounding --device cuda --precision bf16 "$@" 2>&1 \
    | tee -a "$out/figures.txt" ;;
  probe) timeout "${LIMIT:-500}" python3 -m benchmarks.probe_speed --device cuda "$@" 2>&1 | grep -v Warning \
    | tee -a "$out/figures.txt" ;;
  noise) timeout "${LIMIT:-500}" python3 -m benchmarks.noise_draw --device cuda --models captioner-s16-224 "$@" 2>&1 \
    | tee -a "$out/figures.txt" ;;
  validate|table)
    flag=$( [ "$part" = validate ] && echo --validate --sizes full )
    # Through a file, not a pipe: the probe's refit workers outlive the benchmark by minutes and would
    # hold a pipe open; `tail --pid` ends with the benchmark itself.
    timeout "${LIMIT:-500}" python3 -m benchmarks.scale_utility --dir "$work" $flag "${gpu[@]}" "$@" > "$out/raw" 2>&1 &
    bench=$!
    tail -n +1 -f --pid=$bench "$out/raw" | stamp | tee -a "$out/scale.log" \
      | grep --line-buffered -v -e absl -e 'step/s' -e 'steps$' -e Warning -e worker_number | tee -a "$out/figures.txt"
    wait $bench
    status=$?
    rm -f "$out/raw"
    tar czf "$out/rows.tgz" -C "$work" rows  # the finished rows alone: small, they always come back
    # and every training's state (not the shards, which the next call rebuilds); STATE=0 skips it where
    # the models outgrow what a call brings back (a ViT-S/16 and its optimiser: hundreds of MB)
    [ "${STATE:-1}" = 0 ] || tar czf "$out/work.tgz" -C "$work" --exclude='data/shards' --exclude='data/synthetic' \
      rows $(cd "$work" && ls -d n-*) ;;
  *) echo "unknown PART $part" >&2; status=2 ;;
esac
status=${status:-$?}  # the part's own exit status (a crash, or 124 past LIMIT), not the packing's
# $! is the sampler's sed: nvidia-smi ends on its next write to the closed pipe, or here if it is this shell's
kill $sampler 2>/dev/null; pkill -P $$ -f "nvidia-smi --query-gpu=timestamp" 2>/dev/null
exit "$status"
