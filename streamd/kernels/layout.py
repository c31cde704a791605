"""The block-major KV pool's shape contract (and the rotary store's arguments), shared by the Triton
kernels and their references (no triton import here: the CPU engine runs the references on machines
without triton)."""

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


def check_rotary_args(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
) -> None:
    """Argument checks of `rotary_store_kv`, shared by the kernel and the reference; host metadata only."""
    check_cache(kv_cache, layer)
    num_tokens, _, head_dim = query.shape
    if key.shape != value.shape or key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} "
            "must be [num_tokens, heads, head_dim] with equal tokens and head_dim"
        )
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    if cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [{num_tokens}, {head_dim}]")
    if kv_cache.shape[3] != key.shape[1] or kv_cache.shape[5] != head_dim:
        raise ValueError(f"key {tuple(key.shape)} does not match cache {tuple(kv_cache.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    for name, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        if weight is not None and weight.shape != (head_dim,):
            raise ValueError(f"{name} must be [{head_dim}] (one weight per head_dim), got {tuple(weight.shape)}")
