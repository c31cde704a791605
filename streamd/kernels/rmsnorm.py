"""RMSNorm, alone or fused with the residual add before it (Triton).

Owns ``rmsnorm`` and ``fused_add_rmsnorm``, and their ``_fp8`` forms, which write the normalised rows as
e4m3 codes and row scales for an FP8 projection (`fp8.py`; `layer_math`'s quantization): one program per row
keeps the whole hidden vector in registers, so the residual sum, the mean of squares, the scaling and the
weight take one read of each input and one write of each output. Rounding follows the unfused transformers
sequence: the residual sum is rounded to the activations' dtype before it is normalised, and the normalised row
is rounded to that dtype before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton.language as tl

from streamd.kernels._triton_utils import dual_kernel, next_pow2
from streamd.kernels.layer_math import row_scale, store_codes
from streamd.kernels.layout import Fp8Rows, check_norm_args


@dual_kernel
def _rmsnorm_kernel(
    x_ptr: tl.tensor,
    res_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    res_out_ptr: tl.tensor,
    scales_ptr: tl.tensor,
    hidden: tl.tensor,
    eps: tl.tensor,
    s_x: tl.tensor,
    s_res: tl.tensor,
    s_out: tl.tensor,
    s_res_out: tl.tensor,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    FP8: tl.constexpr,
) -> None:
    """One row; FP8: the normalised row (rounded to the activations' dtype) stored as e4m3 codes (out_ptr: bytes)
    and its scale, for an FP8 projection."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * s_res + offs, mask=mask, other=0.0).to(tl.float32)
        summed = x.to(dtype)
        tl.store(res_out_ptr + row * s_res_out + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = ((x * inv_rms).to(dtype).to(tl.float32) * w).to(dtype)
    if FP8:
        y = y.to(tl.float32)
        scale = row_scale(tl.abs(y))
        tl.store(scales_ptr + row, scale)
        store_codes(out_ptr + row * s_out, offs, y, scale, mask)
    else:
        tl.store(out_ptr + row * s_out + offs, y, mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | Fp8Rows,
    residual_out: torch.Tensor | None,
) -> None:
    """One program a row; `out` a tensor of x's dtype, or quantized rows (`Fp8Rows`)."""
    rows, hidden = x.shape
    if rows == 0:
        return
    block = next_pow2(hidden)
    res = residual if residual is not None else x
    if isinstance(out, Fp8Rows):
        values, scales = out.codes.view(torch.uint8), out.scales
    else:
        values, scales = out, weight  # (scales: never read unquantized)
    res_out = residual_out if residual_out is not None else values
    _rmsnorm_kernel.launch(
        x.device,
        (rows,),
        x,
        res,
        weight,
        values,
        res_out,
        scales,
        hidden,
        eps,
        x.stride(0),
        res.stride(0),
        values.stride(0),
        res_out.stride(0),
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        FP8=isinstance(out, Fp8Rows),
        num_warps=min(8, max(1, block // 256)),
    )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) per row of x [rows, hidden]; a new tensor of x's dtype."""
    check_norm_args(x, None, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual) for x, residual [rows, hidden]; new tensors, inputs untouched."""
    check_norm_args(x, residual, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(out)
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out


def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Rows:
    """`rmsnorm(x, weight, eps)` quantized (the normalised rows rounded to x's dtype first), one launch."""
    check_norm_args(x, None, weight)
    out = Fp8Rows.empty(x, x.shape[1])
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rmsnorm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Fp8Rows, torch.Tensor]:
    """`fused_add_rmsnorm` with its normalised rows quantized: (codes and scales, x + residual), one launch."""
    check_norm_args(x, residual, weight)
    out = Fp8Rows.empty(x, x.shape[1])
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out


__all__ = ["fused_add_rmsnorm", "fused_add_rmsnorm_fp8", "rmsnorm", "rmsnorm_fp8"]
