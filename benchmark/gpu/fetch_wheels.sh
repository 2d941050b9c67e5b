#!/usr/bin/env bash
# Wheels the device machine's image lacks for benchmark/gpu/e2e_8b.py (it has torch, triton,
# transformers, safetensors, tokenizers, numpy, psutil, ...; not pyzmq, xgrammar, pydantic).
# Run here, in the repo root; they land in .whl/ (git-ignored through .git/info/exclude), for a
# device call that names .whl in `carry` and starts with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
PKGS=(pyzmq==27.3.0 xgrammar==0.2.7 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${PKGS[@]}"
ls -la .whl && du -sh .whl
