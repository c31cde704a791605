"""Kernel-test setup: the Triton interpreter on CPU-only machines, and a fresh seed per test.

On a machine without CUDA, TRITON_INTERPRET=1 is set here, at conftest import, before any kernel
test imports triton. ``streamd.kernels`` also picks the interpreter by tensor device at each launch,
so the CPU tests run interpreted even if another test module imported triton first; on a CUDA
machine the variable is left alone, because triton's stdlib must be compiled there.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # `import torch` does not import triton
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def fresh_seed(request: pytest.FixtureRequest) -> int:
    """Fresh random data each run; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("STREAMD_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    torch.manual_seed(seed)
    print(f"seed={seed}")
    return seed
