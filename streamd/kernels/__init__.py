"""Paged-attention and decoder-layer kernels: Triton implementations, exported here, and plain-torch
references.

``streamd.kernels`` exports the Triton versions, which always run the Triton kernel: compiled on CUDA
tensors, through Triton's interpreter on CPU tensors (slow; for tests). ``streamd.kernels.reference``
holds plain-torch functions with the same signatures; the engine uses those on CPU. The Triton versions
are imported on first use, so a CPU-only install without triton (the CPU container image) can import
``streamd.kernels.reference``.

KV cache layout (ARCHITECTURE.md): one block-major pool
``kv_cache[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`` (2 = key, value).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamd.kernels.activation import silu_and_mul
    from streamd.kernels.block_copy import copy_blocks
    from streamd.kernels.decode_attention import paged_decode_attention
    from streamd.kernels.fp8 import fp8_matmul, fp8_product, quantize_fp8, silu_and_mul_fp8
    from streamd.kernels.kv_store import store_kv
    from streamd.kernels.prefill_attention import paged_prefill_attention
    from streamd.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_fp8, rmsnorm, rmsnorm_fp8
    from streamd.kernels.rotary import rotary_store_kv

_MODULE_OF = {
    "paged_decode_attention": "decode_attention",
    "paged_prefill_attention": "prefill_attention",
    "store_kv": "kv_store",
    "copy_blocks": "block_copy",
    "rmsnorm": "rmsnorm",
    "fused_add_rmsnorm": "rmsnorm",
    "silu_and_mul": "activation",
    "rotary_store_kv": "rotary",
    "quantize_fp8": "fp8",
    "rmsnorm_fp8": "rmsnorm",
    "fused_add_rmsnorm_fp8": "rmsnorm",
    "silu_and_mul_fp8": "fp8",
    "fp8_matmul": "fp8",
    "fp8_product": "fp8",
}
__all__ = list(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name = _MODULE_OF[name]
    module = importlib.import_module(f"{__name__}.{module_name}")
    # every name the module owns, at once: importing `rmsnorm.py` for `fused_add_rmsnorm` makes this package's
    # `rmsnorm` attribute the module, which the function must replace before anyone reads it
    globals().update({n: getattr(module, n) for n, m in _MODULE_OF.items() if m == module_name})
    return globals()[name]
