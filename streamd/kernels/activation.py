"""SiLU-and-multiply of a merged gate/up projection (Triton).

Owns ``silu_and_mul``: the MLP's ``silu(gate) * up`` where gate and up are the two halves of one
[rows, 2 * intermediate] projection output, in one kernel (instead of a SiLU kernel, a multiply kernel
and the two GEMMs' separate outputs). Rounding follows transformers: SiLU's result is rounded to the
activations' dtype before the multiply.
"""

from __future__ import annotations

import torch
import triton.language as tl

from streamd.kernels._triton_utils import cdiv, dual_kernel, next_pow2
from streamd.kernels.layer_math import silu_mul
from streamd.kernels.layout import check_gate_up

_MAX_BLOCK = 1024


@dual_kernel
def _silu_and_mul_kernel(
    x_ptr: tl.tensor, out_ptr: tl.tensor, inter: tl.tensor, s_x: tl.tensor, s_out: tl.tensor, BLOCK: tl.constexpr
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * s_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_out + cols, silu_mul(gate, up, dtype).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [rows, 2 * inter] (gate, then up) -> silu(gate) * up [rows, inter]; a new tensor of x's dtype."""
    check_gate_up(x, "silu_and_mul")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(_MAX_BLOCK, next_pow2(inter))
    _silu_and_mul_kernel.launch(
        x.device, (rows, cdiv(inter, block)), x, out, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out


__all__ = ["silu_and_mul"]
