"""The block-major KV pool's shape contract, shared by the Triton kernels and their references (no triton
import here: the CPU engine runs the references on machines without triton)."""

from __future__ import annotations

import torch


def check_cache(kv_cache: torch.Tensor, layer: int) -> None:
    """Shape checks on the block-major pool; all host-side metadata, no device sync."""
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError(
            "kv_cache must be [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    if not 0 <= layer < kv_cache.shape[1]:
        raise IndexError(f"layer {layer} out of range for {kv_cache.shape[1]} layers")

