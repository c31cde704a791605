"""Triton helpers shared by the layer kernels (`rmsnorm`, `activation`, `fp8`), each written once: the SiLU-and-mul
with transformers' rounding, and the FP8 row quantization (a row's scale = max(absmax / 448, KV_MIN_SCALE), its
codes round(x / scale) in e4m3). One copy keeps a fused FP8 layer's values bit for bit those of the bfloat16
kernels, quantized.

e4m3 codes are encoded with integer arithmetic (`e4m3_bits`): round to nearest even, saturating at 448, as the
hardware's conversion does; Triton's interpreter rounds without carrying a mantissa overflow into the exponent
(124.0 becomes 64), so one encoding serves both and the CPU tests check the codes bit for bit against torch's
conversion (`layout.quantize_rows` is the reference). A module of its own: a helper imported from `rmsnorm.py`
would make `streamd.kernels.rmsnorm` the module instead of the function.
"""

from __future__ import annotations

import triton.language as tl

from streamd.kernels._triton_utils import jit_helper
from streamd.kernels.layout import FP8_MAX, KV_MIN_SCALE

MIN_SCALE = tl.constexpr(KV_MIN_SCALE)
QMAX = tl.constexpr(FP8_MAX)


@jit_helper
def silu_mul(gate: tl.tensor, up: tl.tensor, dtype: tl.constexpr) -> tl.tensor:
    """silu(gate) * up in float32, SiLU's result rounded to `dtype` before the multiply (not the product)."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return act * up


@jit_helper
def e4m3_bits(y: tl.tensor) -> tl.tensor:
    """float32 values -> their e4m3fn codes as int32 (0..255): round to nearest even, |y| > 448 saturates, NaN
    is NaN (0x7F with its sign)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = tl.minimum(tl.abs(y), QMAX).to(tl.int32, bitcast=True)
    # normal (|y| >= 2^-6): keep 3 mantissa bits, nearest even, exponent rebiased 127 -> 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: the 24-bit significand shifted to units of 2^-9, nearest even
    shift = tl.minimum(14 - ((mag >> 23) - 127), 25)
    significand = (mag & 0x7FFFFF) | 0x800000
    sub = (significand + (1 << (shift - 1)) - 1 + ((significand >> shift) & 1)) >> shift
    code = sign | tl.where(mag < 0x3C800000, sub, normal)  # 0x3C800000 is 2^-6
    return tl.where(y != y, sign | 0x7F, code)  # noqa: PLR0124 (NaN stays NaN)


@jit_helper
def lane_max(absmax: tl.tensor, x: tl.tensor) -> tl.tensor:
    """The running |x| maxima of a row's lanes; a NaN stays (Triton's max would drop it)."""
    return tl.maximum(absmax, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)


@jit_helper
def row_scale(absmax: tl.tensor) -> tl.tensor:
    """A row's scale from its lanes' |x| maxima: NaN where a lane saw a NaN, as the reference's absmax is."""
    nan = tl.max((absmax != absmax).to(tl.int32), 0)  # noqa: PLR0124 (a NaN lane)
    return tl.where(nan > 0, float("nan"), tl.maximum(tl.max(absmax, 0) / QMAX, MIN_SCALE))


@jit_helper
def store_codes(codes_ptr: tl.tensor, offs: tl.tensor, y: tl.tensor, scale: tl.tensor, mask: tl.tensor) -> None:
    tl.store(codes_ptr + offs, e4m3_bits(tl.div_rn(y, scale)).to(tl.uint8), mask=mask)
