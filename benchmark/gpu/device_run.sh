#!/usr/bin/env bash
# The one prepared command for the device machine (one H200, under 10 minutes): installs the wheels
# that benchmark/gpu/fetch_wheels.sh put in .whl/ (carry ".whl"), runs the GPU tests (real CUDA graph
# capture, kernels at GPU dtypes), the kernel checks (bandwidth runs capped at BUDGET_S), then the
# 8B-shape end-to-end benchmark; results and logs go to $OUT (default benchmark/results).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmark/results}
BUDGET_S=${BUDGET_S:-200}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/sgl-kernel-ext/python PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu_device.txt"
rc=0
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider test/kernels test/test_cuda_graph_runner.py \
  test/test_noise.py test/test_sampler.py 2>&1 | tee "$OUT/gpu_pytest.log" || rc=1
python3 benchmark/gpu/run_device_checks.py --budget-s "$BUDGET_S" 2>&1 | tee "$OUT/gpu_device_checks.log" || rc=1
python3 benchmark/gpu/e2e_8b.py 2>&1 | tee "$OUT/gpu_e2e_8b.log" || rc=1
cp benchmark/results/gpu_device_checks.* benchmark/results/gpu_e2e_8b.* "$OUT/" 2>/dev/null
exit $rc
