"""Paged-attention and decoder-layer kernels: Triton implementations, exported here, and plain-torch
references.

``streamd.kernels`` exports the Triton versions, which always run the Triton kernel: compiled on CUDA
tensors, through Triton's interpreter on CPU tensors (slow; for tests). ``streamd.kernels.reference``
holds plain-torch functions with the same signatures; the engine uses those on CPU.

KV cache layout (ARCHITECTURE.md): one block-major pool
``kv_cache[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`` (2 = key, value).
"""


import importlib.util

# Triton exists only on Linux x86_64/aarch64: elsewhere this package exports nothing and the CPU engine
# uses `streamd.kernels.reference`, which imports no triton.
if importlib.util.find_spec("triton") is not None:
    from streamd.kernels.activation import silu_and_mul
    from streamd.kernels.block_copy import copy_blocks
    from streamd.kernels.decode_attention import paged_decode_attention
    from streamd.kernels.kv_store import store_kv
    from streamd.kernels.prefill_attention import paged_prefill_attention
    from streamd.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
    from streamd.kernels.rotary import rotary_store_kv

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv", "copy_blocks", "rmsnorm",
           "fused_add_rmsnorm", "silu_and_mul", "rotary_store_kv"]
