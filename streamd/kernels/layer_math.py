"""The decoder layer's elementwise arithmetic, once, for every kernel that writes its result: the RMSNorm (with the
residual add before it) and the SiLU-and-mul, each with transformers' rounding to the activations' dtype between
steps. `rmsnorm` and `activation` store the values; `fp8` quantizes them. One copy keeps a fused FP8 layer's values
bit for bit those of the bfloat16 kernels (a module of its own: a Triton helper imported from `rmsnorm.py` would
make `streamd.kernels.rmsnorm` the module instead of the function).
"""

from __future__ import annotations

import triton.language as tl

from streamd.kernels._triton_utils import jit_helper


@jit_helper
def add_norm_row(
    x_ptr: tl.tensor,
    res_ptr: tl.tensor,
    w_ptr: tl.tensor,
    res_out_ptr: tl.tensor,
    offs: tl.tensor,
    mask: tl.tensor,
    hidden: tl.tensor,
    eps: tl.tensor,
    dtype: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
) -> tl.tensor:
    """One row (pointers at its start): x (+ residual, the sum rounded to `dtype` and stored at res_out), then
    weight * (x / rms(x)) with the normalised row rounded to `dtype` first; float32, before its final rounding."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        summed = x.to(dtype)
        tl.store(res_out_ptr + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return (x * inv_rms).to(dtype).to(tl.float32) * w


@jit_helper
def silu_mul(gate: tl.tensor, up: tl.tensor, dtype: tl.constexpr) -> tl.tensor:
    """silu(gate) * up in float32, SiLU's result rounded to `dtype` before the multiply (not the product)."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return act * up
