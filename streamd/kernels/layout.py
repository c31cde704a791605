"""What the Triton kernels and their references agree on, with no triton import (the CPU engine runs the
references on machines without triton): the block-major KV pool's shape contract and the 8-bit rows' reference
quantizer, the FP8 activations' record (`Fp8Rows`) and product dtype, and the argument checks of the rotary store,
the norms and the SiLU-and-mul."""

from __future__ import annotations

from dataclasses import dataclass

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


# 8-bit KV (`cache.kv_cache_dtype`): each (token, KV head) row of head_dim values is stored as 8-bit codes and
# one float32 scale, absmax / QMAX, so the row's largest value maps to the format's largest finite code.
# The scales live beside the codes in the same block (`engine/worker/cache_engine.py`), as
# kv_scales[num_blocks, num_layers, 2, num_kv_heads, block_size].
KV_QUANT_NAMES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # `cache.kv_cache_dtype`'s 8-bit values
KV_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
KV_QUANT_DTYPES = tuple(KV_QMAX)
# The smallest scale stored: a row of zeros gets this (its codes are zeros) instead of a division by zero.
KV_MIN_SCALE = 1e-12


# FP8 activations (`Fp8Linear`'s input): one row's codes in e4m3 and one float32 scale, the same arithmetic as an
# 8-bit KV row (`quantize_rows`): scale = max(absmax / 448, KV_MIN_SCALE), codes = round(x / scale), nearest even.
FP8 = torch.float8_e4m3fn
FP8_MAX = KV_QMAX[FP8]


@dataclass(frozen=True, slots=True)
class Fp8Rows:
    """Activations [rows, cols] as e4m3 codes and float32 row scales [rows]: x = codes * scales[:, None]; `dtype`
    is the activations' own (what a Linear fed these rows returns)."""

    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def empty(cls, x: torch.Tensor, cols: int) -> Fp8Rows:
        """Room for x's rows quantized, `cols` codes each (a kernel's output)."""
        rows = x.shape[0]
        codes = torch.empty((rows, cols), dtype=FP8, device=x.device)
        return cls(codes, torch.empty(rows, dtype=torch.float32, device=x.device), x.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """codes x scales, in `dtype` (default: the activations' own)."""
        return dequantize_rows(self.codes, self.scales, dtype or self.dtype)


def product_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The dtype an FP8 codes' product is written in for a result in `out_dtype` (`fp8_product`): float16 cannot
    hold the codes' sums (448 x 448 a product, thousands summed), so its product is bfloat16's."""
    return torch.bfloat16 if out_dtype == torch.float16 else out_dtype


def kv_quantized(kv_cache: torch.Tensor) -> bool:
    """Whether the pool holds 8-bit codes (then its scales come with it)."""
    return kv_cache.dtype in KV_QUANT_DTYPES


def check_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """An 8-bit pool comes with its scales [num_blocks, num_layers, 2, num_kv_heads, block_size] and a float
    pool without; host metadata only."""
    if not kv_quantized(kv_cache):
        if kv_scales is not None:
            raise ValueError(f"kv_scales given for a {kv_cache.dtype} pool (only 8-bit pools have scales)")
        return
    if kv_scales is None or kv_scales.shape != kv_cache.shape[:5] or kv_scales.dtype != torch.float32:
        got = None if kv_scales is None else (tuple(kv_scales.shape), kv_scales.dtype)
        want = tuple(kv_cache.shape[:5])
        raise ValueError(f"a {kv_cache.dtype} pool needs float32 kv_scales of shape {want}, got {got}")


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes [..., head_dim] in `dtype`, scales [...] float32): the reference of the
    kernels' store. int8 rounds half away from zero (as the kernels' truncating conversion of x +- 0.5 does);
    float8 rounds to nearest even (the hardware's conversion)."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / KV_QMAX[dtype]).clamp_min(KV_MIN_SCALE)
    y = xf / scale[..., None]
    if dtype == torch.int8:
        y = torch.where(y >= 0, y + 0.5, y - 0.5).trunc().clamp(-127, 127)
    return y.to(dtype), scale


def write_kv_rows(
    kv: torch.Tensor,
    scales: torch.Tensor | None,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """The plain-torch stores' write: token t's key and value [tokens, kv_heads, head_dim] at (blocks[t],
    offsets[t]) of one layer `kv` [num_blocks, 2, kv_heads, block_size, head_dim], as 8-bit codes with their
    `scales` (the layer's [num_blocks, 2, kv_heads, block_size]) when given."""
    for i, x in enumerate((key, value)):
        if scales is None:
            kv[blocks, i, :, offsets] = x.to(kv.dtype)
            continue
        codes, row_scales = quantize_rows(x, kv.dtype)
        kv[blocks, i, :, offsets] = codes
        scales[blocks, i, :, offsets] = row_scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., head_dim] x scales [...] -> values in `dtype` (computed in float32, then rounded)."""
    return (codes.float() * scales[..., None]).to(dtype)


def check_norm_args(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    """The norms' argument checks (the Triton norms' and `fp8`'s); host metadata only."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"rmsnorm wants x [rows, hidden] and weight [hidden], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.stride(1) != 1:
        raise ValueError("rmsnorm wants rows with unit stride along hidden")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)} {x.dtype}"
        )


def check_gate_up(x: torch.Tensor, what: str) -> None:
    """A merged gate/up projection's output, as the SiLU-and-mul kernels take it; host metadata only."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(
            f"{what} wants x [rows, 2 * intermediate] with unit column stride, got {tuple(x.shape)} "
            f"strides {x.stride()}"
        )
