#!/usr/bin/env bash
# The prepared command for the device machine (one H200): installs the wheels that
# benchmark/gpu/fetch_wheels.sh put in .whl/ (carry ".whl"), then runs STAGES (default all three,
# ~8-9 minutes; split them over two calls if a call's limit is near):
#   tests    the GPU tests: --device cuda end to end in every mode (test_cuda_smoke.py), real CUDA
#            graph capture against eager forwards, kernels at GPU dtypes
#   kernels  run_device_checks.py, bandwidth runs capped at BUDGET_S seconds
#   e2e      e2e_8b.py, full / VeriCache / lossy on a random-weight 8B-shape model
#   determinism  --enable-deterministic-inference on the triton backend, compiled (~1-2 minutes):
#            fixed_split_attention's forms bitwise equal at Llama-3-8B's shape, batch_invariant_matmul
#            rows, and end to end on CUDA (alone == under load == VeriCache, bfloat16)
#   placement  e2e_8b.py --placement: full vs vc-auto under a device KV budget of 4 requests' exact KV,
#            the rest on the host tier, its copies on the side stream ordered by events; and vc-auto-host,
#            the exact pool in pinned host memory read through a device page cache (~3-4 minutes)
# Results and logs go to $OUT (default benchmark/results). Exit status 1 if any stage failed.
# DRY_RUN=1: the CPU path of the same stages (no wheels, no nvidia-smi; the scripts' --dry-run, the
# tests stage collects only), e.g. DRY_RUN=1 STAGES=placement OUT=/tmp/x bash benchmark/gpu/device_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmark/results}
BUDGET_S=${BUDGET_S:-150}
STAGES=${STAGES:-tests kernels e2e determinism placement}
DRY_RUN=${DRY_RUN:-}
DRY=${DRY_RUN:+--dry-run}
PY=python3
mkdir -p "$OUT"
if [ -n "$DRY_RUN" ]; then
  PY=${PYTHON:-python3}
  export PYTHONPATH=$PWD/python:$PWD/sgl-kernel-ext/python PYTHONUNBUFFERED=1
else
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/python:$PWD/sgl-kernel-ext/python PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu_device.txt"
fi
rc=0
for stage in $STAGES; do
  echo "== $(date +%T) $stage"
  case $stage in
    tests) timeout 240 $PY -m pytest -q -m gpu -p no:cacheprovider ${DRY_RUN:+--collect-only} \
             test/test_cuda_smoke.py test/test_cuda_graph_runner.py test/kernels test/test_noise.py \
             test/test_sampler.py test/test_copy_stream.py 2>&1 | tee "$OUT/gpu_pytest.log" || rc=1 ;;
    kernels) $PY benchmark/gpu/run_device_checks.py --budget-s "$BUDGET_S" $DRY ${DRY:+--out "$OUT/gpu_device_checks"} \
               2>&1 | tee "$OUT/gpu_device_checks.log" || rc=1 ;;
    e2e) $PY benchmark/gpu/e2e_8b.py $DRY ${DRY:+--out "$OUT/gpu_e2e_8b"} 2>&1 | tee "$OUT/gpu_e2e_8b.log" || rc=1 ;;
    determinism) timeout 300 $PY -m pytest -q -p no:cacheprovider ${DRY_RUN:+--collect-only} \
                   test/test_deterministic_triton.py test/kernels/test_fixed_split_attention.py \
                   test/kernels/test_batch_invariant_matmul.py 2>&1 | tee "$OUT/gpu_determinism.log" || rc=1 ;;
    placement) $PY benchmark/gpu/e2e_8b.py --placement $DRY ${DRY:+--out "$OUT/gpu_e2e_8b_placement"} 2>&1 \
                 | tee "$OUT/gpu_e2e_8b_placement.log" || rc=1 ;;
    *) echo "unknown stage $stage" >&2; rc=1 ;;
  esac
done
[ -n "$DRY_RUN" ] || [ "$OUT" = benchmark/results ] \
  || cp benchmark/results/gpu_device_checks.* benchmark/results/gpu_e2e_8b.* "$OUT/" 2>/dev/null
exit $rc
