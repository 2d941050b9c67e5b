"""Kernel tests: on a machine without CUDA the Triton kernels run under TRITON_INTERPRET=1 on
CPU tensors (test/conftest.py sets it before anything imports triton). Input builders:
kernel_inputs.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("sgl_kernel_ext") is None:  # not pip-installed: use the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sgl-kernel-ext" / "python"))

# Without triton every test module here is skipped with that reason: each imports
# kernel_inputs first, whose importorskip("triton") skips the module (a conftest cannot skip).


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)
