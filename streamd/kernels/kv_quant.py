"""The 8-bit KV cache's arithmetic inside the Triton kernels, shared by the stores and the attentions.

A row (one token's head_dim values of one KV head) is stored as codes ``round(x / scale)`` and one float32
``scale = max(absmax / QMAX, KV_MIN_SCALE)`` (`layout.quantize_rows` is the reference): int8 rounds half away
from zero by truncating ``x +- 0.5``, float8 e4m3 by the conversion's round-to-nearest-even. The attentions
never dequantize a tile: codes convert exactly to the dot's dtype and the scales multiply the scores (keys) and
the probabilities (values), one multiply per token instead of per element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from streamd.kernels._triton_utils import jit_helper
from streamd.kernels.layout import KV_MIN_SCALE, KV_QMAX, check_scales

MIN_SCALE = tl.constexpr(KV_MIN_SCALE)


@jit_helper
def _codes(x: tl.tensor, scale: tl.tensor, INT8: tl.constexpr) -> tl.tensor:
    """x [rows, cols] float32 over its rows' scales [rows]: the codes as float32, for the store's conversion (int8:
    rounded half away from zero and clamped here; e4m3: rounded by the conversion)."""
    y = x / scale[:, None]
    if INT8:
        y = tl.minimum(tl.maximum(tl.where(y >= 0.0, y + 0.5, y - 0.5), -127.0), 127.0)
    return y


@jit_helper
def quantize_rows(x: tl.tensor, QMAX: tl.constexpr, INT8: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """x [rows, cols] (masked entries 0) -> (codes [rows, cols] float32, to be converted by the store; scales
    [rows] float32)."""
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1) / QMAX, MIN_SCALE)
    return _codes(x, scale, INT8), scale


@jit_helper
def quantize_halves(
    x1: tl.tensor, x2: tl.tensor, QMAX: tl.constexpr, INT8: tl.constexpr
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """`quantize_rows` of rows held as two halves [rows, half] each (the rotary store's): one scale per row."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    scale = tl.maximum(tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1)) / QMAX, MIN_SCALE)
    return _codes(x1, scale, INT8), _codes(x2, scale, INT8), scale


@jit_helper
def store_row_scales(
    sc_ptr: tl.tensor,
    slot: tl.tensor,
    heads: tl.tensor,
    mask: tl.tensor,
    k_scale: tl.tensor,
    v_scale: tl.tensor,
    s_sc_blk: tl.tensor,
    s_sc_kv: tl.tensor,
    s_sc_head: tl.tensor,
    s_sc_tok: tl.tensor,
    PAGE: tl.constexpr,
) -> None:
    """One token's key and value scales [heads] at its slot; `sc_ptr` at the layer's scales."""
    dst = sc_ptr + (slot // PAGE) * s_sc_blk + (slot % PAGE) * s_sc_tok + heads * s_sc_head
    tl.store(dst, k_scale, mask=mask)
    tl.store(dst + s_sc_kv, v_scale, mask=mask)


@dataclass(frozen=True, slots=True)
class ScaleArgs:
    """What a kernel launch passes for the pool's scales: `args`, the kernels' trailing runtime arguments (sc_ptr,
    sc_layer_off, s_sc_blk, s_sc_kv, s_sc_head, s_sc_tok; for a float pool any tensor, never read), and `flags`,
    the constexprs that compile the 8-bit paths in."""

    args: tuple[object, ...]
    flags: dict[str, object]

    @property
    def quant(self) -> bool:
        return bool(self.flags["KV_QUANT"])


_FLOAT_POOL_FLAGS: dict[str, object] = {"KV_QUANT": False, "KV_INT8": False, "KV_QMAX": 1.0}


def scale_args(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, layer: int) -> ScaleArgs:
    """The launch arguments of `kv_scales` (checked against the pool: an 8-bit pool needs them)."""
    check_scales(kv_cache, kv_scales)
    if kv_scales is None:
        return ScaleArgs((kv_cache, 0, 0, 0, 0, 0), _FLOAT_POOL_FLAGS)
    s = kv_scales.stride()
    dtype = kv_cache.dtype
    flags: dict[str, object] = {"KV_QUANT": True, "KV_INT8": dtype == torch.int8, "KV_QMAX": KV_QMAX[dtype]}
    return ScaleArgs((kv_scales, layer * s[1], s[0], s[2], s[3], s[4]), flags)
