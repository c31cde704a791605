"""The CPU path never imports Triton: the CPU container image ships without it (its wheel carries CUDA
tools), so the engine's CPU kernels and the package's lazy exports must work with triton absent."""

from __future__ import annotations

import subprocess
import sys

import pytest

BLOCK_TRITON = "import sys; sys.modules['triton'] = None\n"


def run_without_triton(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_TRITON + code], capture_output=True, text=True, timeout=120)


def test_cpu_kernel_ops_need_no_triton() -> None:
    result = run_without_triton(
        "import torch\n"
        "from streamd.engine.worker.model_runner import kernel_ops\n"
        "ops = kernel_ops(torch.device('cpu'))\n"
        "cache = torch.zeros(4, 1, 2, 1, 8, 4)\n"
        "cache[0] = 1.0\n"
        "ops.copy_blocks(cache, torch.tensor([0]), torch.tensor([2]))\n"
        "print(ops.__name__, int(cache[2].sum()))\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["streamd.kernels.reference", str(2 * 8 * 4)]


def test_triton_exports_load_on_first_use() -> None:
    result = run_without_triton(
        "import streamd.kernels as K\n"
        "try:\n"
        "    K.store_kv\n"
        "except ImportError as exc:\n"
        "    print('ImportError', exc.name)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "ImportError"


def test_unknown_export_is_an_attribute_error() -> None:
    import streamd.kernels as K

    with pytest.raises(AttributeError, match="no_such_kernel"):
        K.no_such_kernel  # noqa: B018


def test_a_module_that_shares_a_function_name_loads_as_the_function() -> None:
    """`rmsnorm.py` owns `rmsnorm` and three more: asking for another first imports the module, which makes the
    package's `rmsnorm` attribute the module until the lazy export puts every function of it in place."""
    code = (
        "import streamd.kernels as K\n"
        "K.fused_add_rmsnorm_fp8\n"
        "print(callable(K.rmsnorm), type(K.rmsnorm).__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "function"]
