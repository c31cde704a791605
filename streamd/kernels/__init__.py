"""Paged-attention and decoder-layer kernels: Triton implementations, exported here, and plain-torch
references.

``streamd.kernels`` exports the Triton versions, which always run the Triton kernel: compiled on CUDA
tensors, through Triton's interpreter on CPU tensors (slow; for tests). ``streamd.kernels.reference``
holds plain-torch functions with the same signatures; the engine uses those on CPU.

KV cache layout (ARCHITECTURE.md): one block-major pool
``kv_cache[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`` (2 = key, value).
"""


from __future__ import annotations

import importlib
from typing import Any

# Exported lazily, so that `streamd.kernels.reference` (the CPU path) imports without triton, which
# exists only on Linux x86_64/aarch64.
_EXPORTS = {"copy_blocks": "block_copy", "paged_decode_attention": "decode_attention",
            "store_kv": "kv_store", "paged_prefill_attention": "prefill_attention", "rmsnorm": "rmsnorm",
            "fused_add_rmsnorm": "rmsnorm", "silu_and_mul": "activation", "rotary_store_kv": "rotary"}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'streamd.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"streamd.kernels.{_EXPORTS[name]}"), name)
