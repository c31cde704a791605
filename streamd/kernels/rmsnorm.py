"""RMSNorm, alone or fused with the residual add before it (Triton).

Owns ``rmsnorm`` and ``fused_add_rmsnorm``: one program per row keeps the whole hidden vector in
registers, so the residual sum, the mean of squares, the scaling and the weight take one read of each
input and one write of each output. Rounding follows the unfused transformers sequence: the residual
sum is rounded to the activations' dtype before it is normalised, and the normalised row is rounded
to that dtype before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton.language as tl

from streamd.kernels._triton_utils import dual_kernel, next_pow2
from streamd.kernels.layer_math import add_norm_row
from streamd.kernels.layout import check_norm_args


@dual_kernel
def _rmsnorm_kernel(
    x_ptr: tl.tensor,
    res_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    res_out_ptr: tl.tensor,
    hidden: tl.tensor,
    eps: tl.tensor,
    s_x: tl.tensor,
    s_res: tl.tensor,
    s_out: tl.tensor,
    s_res_out: tl.tensor,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    dtype = out_ptr.dtype.element_ty
    y = add_norm_row(
        x_ptr + row * s_x,
        res_ptr + row * s_res,
        w_ptr,
        res_out_ptr + row * s_res_out,
        offs,
        mask,
        hidden,
        eps,
        dtype,
        HAS_RESIDUAL,
    )
    tl.store(out_ptr + row * s_out + offs, y.to(dtype), mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
) -> None:
    rows, hidden = x.shape
    if rows == 0:
        return
    block = next_pow2(hidden)
    res = residual if residual is not None else x
    res_out = residual_out if residual_out is not None else out
    _rmsnorm_kernel.launch(
        x.device,
        (rows,),
        x,
        res,
        weight,
        out,
        res_out,
        hidden,
        eps,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        res_out.stride(0),
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
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


__all__ = ["fused_add_rmsnorm", "rmsnorm"]
