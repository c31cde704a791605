"""Paged-attention kernels: Triton implementations, exported here, and plain-torch references.

``streamd.kernels`` exports the Triton versions, which always run the Triton kernel: compiled on CUDA
tensors, through Triton's interpreter on CPU tensors (slow; for tests). ``streamd.kernels.reference``
holds plain-torch functions with the same signatures; the engine uses those on CPU.

KV cache layout (ARCHITECTURE.md): one block-major pool
``kv_cache[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`` (2 = key, value).
"""

from streamd.kernels.block_copy import copy_blocks
from streamd.kernels.decode_attention import paged_decode_attention
from streamd.kernels.kv_store import store_kv
from streamd.kernels.prefill_attention import paged_prefill_attention

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv", "copy_blocks"]
