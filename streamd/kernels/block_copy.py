"""Batched copy of whole KV-cache blocks (all layers, K and V) in one Triton launch.

Owns ``copy_blocks``, which executes the copy-on-write orders of the block manager: block dst[i]
becomes a copy of block src[i]. The grid is (pair, chunk of the block): a block of the block-major
pool is one contiguous region when the pool is contiguous past its first dimension (the usual case,
copied as a flat range; the engine passes its pool's blocks as rows of words, [num_blocks, words], so an
8-bit pool's scales move with their codes); otherwise each element's offset is rebuilt from the pool's strides.
Destinations must be distinct and must not be sources in the same call (copy-on-write guarantees it:
destinations are freshly allocated).
"""

from __future__ import annotations

import torch
import triton.language as tl

from streamd.kernels._triton_utils import cdiv, dual_kernel

_CHUNK = 4096  # elements per program: 8 KB of bf16, wide loads, plenty of programs per block


@dual_kernel
def _copy_blocks_kernel(
    kv_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    s_blk: tl.tensor,
    numel: tl.tensor,
    n1: tl.tensor,
    n2: tl.tensor,
    n3: tl.tensor,
    n4: tl.tensor,
    n5: tl.tensor,
    s1: tl.tensor,
    s2: tl.tensor,
    s3: tl.tensor,
    s4: tl.tensor,
    s5: tl.tensor,
    CHUNK: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
) -> None:
    pair = tl.program_id(0)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < numel
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    if CONTIGUOUS:
        elem = offs.to(tl.int64)
    else:
        # Row-major index within the block [n1, n2, n3, n4, n5] -> strided element offset.
        i5 = offs % n5
        r = offs // n5
        i4 = r % n4
        r = r // n4
        i3 = r % n3
        r = r // n3
        i2 = r % n2
        i1 = r // n2
        elem = (
            i1.to(tl.int64) * s1
            + i2.to(tl.int64) * s2
            + i3.to(tl.int64) * s3
            + i4.to(tl.int64) * s4
            + i5.to(tl.int64) * s5
        )
    x = tl.load(kv_ptr + src * s_blk + elem, mask=mask)
    tl.store(kv_ptr + dst * s_blk + elem, x, mask=mask)


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In place: kv_cache[dst[i]] = kv_cache[src[i]] for all i, in one launch (src, dst int64 [n]); kv_cache is
    the 6-D pool or its blocks as rows [num_blocks, elements]."""
    if kv_cache.dim() == 2 and kv_cache.stride(1) == 1:
        kv_cache = kv_cache.view(kv_cache.shape[0], 1, 1, 1, 1, kv_cache.shape[1])
    if kv_cache.dim() != 6:
        raise ValueError(f"kv_cache must be 6-D or [num_blocks, elements], got {tuple(kv_cache.shape)}")
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must be equal 1-D shapes")
    n = src.shape[0]
    if n == 0:
        return
    block = kv_cache[0]
    numel = block.numel()
    sizes = kv_cache.shape[1:]
    strides = kv_cache.stride()[1:]
    _copy_blocks_kernel.launch(
        kv_cache.device,
        (n, cdiv(numel, _CHUNK)),
        kv_cache,
        src,
        dst,
        kv_cache.stride(0),
        numel,
        *sizes,
        *strides,
        CHUNK=_CHUNK,
        CONTIGUOUS=block.is_contiguous(),
        num_warps=4,
    )


__all__ = ["copy_blocks"]
