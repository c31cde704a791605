"""FP8 (e4m3) activations and the FP8 matmul behind `Fp8Linear` (Triton kernels around cuBLAS's FP8 GEMM).

Why: an FP8 Linear reads half of bfloat16's weight bytes, but it needs its input quantized per row (absmax / 448
and the codes). In torch that is four or five kernels a Linear, as long as the GEMM itself at decode sizes
(benchmarks/NOTES.md, "Issue 28"). Here the quantization is one launch, or none: the RMSNorm before the QKV and
gate/up GEMMs and the SiLU-and-mul before the down GEMM write e4m3 codes and their row scales directly
(`rmsnorm_fp8`, `fused_add_rmsnorm_fp8`, `silu_and_mul_fp8`). `fp8_matmul` multiplies codes by codes on the FP8
tensor cores (cuBLAS) and applies both scales (row x channel) and the bias in one pass after.

Codes are encoded with integer arithmetic (`_e4m3_bits`): round to nearest even, saturating at 448. That is what
the hardware's conversion does, but Triton's interpreter rounds without carrying a mantissa overflow into the
exponent (124.0 becomes 64), so one encoding serves both and the CPU tests check the codes bit for bit against
torch's conversion. The quantization follows `layout.quantize_fp8_rows` (the reference): scale = max(absmax /
448, KV_MIN_SCALE), codes = round(x / scale).
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from streamd.kernels._triton_utils import cdiv, dual_kernel, jit_helper, next_pow2
from streamd.kernels.layer_math import add_norm_row, silu_mul
from streamd.kernels.layout import FP8, FP8_MAX, KV_MIN_SCALE, Fp8Rows, check_gate_up, check_norm_args, product_dtype

MIN_SCALE = tl.constexpr(KV_MIN_SCALE)
QMAX = tl.constexpr(FP8_MAX)
_MAX_BLOCK = 2048
# a whole row of gate/up in one tile up to 16,384 columns (Llama-3.1-8B's 14,336): each pass one iteration
_SILU_BLOCK = 16384


@jit_helper
def _e4m3_bits(y: tl.tensor) -> tl.tensor:
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
def _lane_max(absmax: tl.tensor, x: tl.tensor) -> tl.tensor:
    """The running |x| maxima of a row's lanes; a NaN stays (Triton's max would drop it)."""
    return tl.maximum(absmax, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)


@jit_helper
def _row_scale(absmax: tl.tensor) -> tl.tensor:
    """A row's scale from its lanes' |x| maxima: NaN where a lane saw a NaN, as the reference's absmax is."""
    nan = tl.max((absmax != absmax).to(tl.int32), 0)  # noqa: PLR0124 (a NaN lane)
    return tl.where(nan > 0, float("nan"), tl.maximum(tl.max(absmax, 0) / QMAX, MIN_SCALE))


@jit_helper
def _store_codes(codes_ptr: tl.tensor, offs: tl.tensor, y: tl.tensor, scale: tl.tensor, mask: tl.tensor) -> None:
    tl.store(codes_ptr + offs, _e4m3_bits(tl.div_rn(y, scale)).to(tl.uint8), mask=mask)


@dual_kernel
def _quantize_kernel(
    x_ptr: tl.tensor,
    codes_ptr: tl.tensor,
    scales_ptr: tl.tensor,
    cols: tl.tensor,
    s_x: tl.tensor,
    s_codes: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    absmax = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * s_x + offs, mask=offs < cols, other=0.0).to(tl.float32)
        absmax = _lane_max(absmax, x)
    scale = _row_scale(absmax)
    tl.store(scales_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * s_x + offs, mask=offs < cols, other=0.0).to(tl.float32)
        _store_codes(codes_ptr + row * s_codes, offs, x, scale, offs < cols)


@dual_kernel
def _rmsnorm_fp8_kernel(
    x_ptr: tl.tensor,
    res_ptr: tl.tensor,
    w_ptr: tl.tensor,
    codes_ptr: tl.tensor,
    scales_ptr: tl.tensor,
    res_out_ptr: tl.tensor,
    hidden: tl.tensor,
    eps: tl.tensor,
    s_x: tl.tensor,
    s_res: tl.tensor,
    s_codes: tl.tensor,
    s_res_out: tl.tensor,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
) -> None:
    """`rmsnorm._rmsnorm_kernel`'s row (`layer_math.add_norm_row`, rounded to the activations' dtype), quantized in
    place of the store."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    dtype = x_ptr.dtype.element_ty
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
    y = y.to(dtype).to(tl.float32)
    scale = _row_scale(tl.abs(y))
    tl.store(scales_ptr + row, scale)
    _store_codes(codes_ptr + row * s_codes, offs, y, scale, mask)


@jit_helper
def _scaled(
    x: tl.tensor, row_scale: tl.tensor, col_ptr: tl.tensor, cols: tl.tensor, mask: tl.tensor, dtype: tl.constexpr
) -> tl.tensor:
    """An FP8 product's values times their row and column scales, rounded to `dtype` (`_scale_kernel`'s value)."""
    return (x * row_scale * tl.load(col_ptr + cols, mask=mask, other=0.0)).to(dtype).to(tl.float32)


@jit_helper
def _silu_mul(
    x_ptr: tl.tensor,
    inter: tl.tensor,
    cols: tl.tensor,
    mask: tl.tensor,
    dtype: tl.constexpr,
    row_scale: tl.tensor,
    col_ptr: tl.tensor,
    SCALED: tl.constexpr,
) -> tl.tensor:
    """`activation._silu_and_mul_kernel`'s value of `cols` (`layer_math.silu_mul`, rounded to `dtype`), float32;
    SCALED: x is an FP8 product, scaled first (as `fp8_matmul` would have)."""
    gate = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        gate = _scaled(gate, row_scale, col_ptr, cols, mask, dtype)
        up = _scaled(up, row_scale, col_ptr, inter + cols, mask, dtype)
    return silu_mul(gate, up, dtype).to(dtype).to(tl.float32)


@dual_kernel
def _silu_and_mul_fp8_kernel(
    x_ptr: tl.tensor,
    codes_ptr: tl.tensor,
    scales_ptr: tl.tensor,
    row_scales_ptr: tl.tensor,
    col_scales_ptr: tl.tensor,
    inter: tl.tensor,
    s_x: tl.tensor,
    s_codes: tl.tensor,
    BLOCK: tl.constexpr,
    SCALED: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    x_row = x_ptr + row * s_x
    rs = tl.load(row_scales_ptr + row) if SCALED else 1.0
    absmax = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = _silu_mul(x_row, inter, cols, cols < inter, dtype, rs, col_scales_ptr, SCALED)
        absmax = _lane_max(absmax, y)
    scale = _row_scale(absmax)
    tl.store(scales_ptr + row, scale)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = _silu_mul(x_row, inter, cols, cols < inter, dtype, rs, col_scales_ptr, SCALED)
        _store_codes(codes_ptr + row * s_codes, cols, y, scale, cols < inter)


@dual_kernel
def _scale_kernel(
    p_ptr: tl.tensor,
    a_scale_ptr: tl.tensor,
    w_scale_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    n: tl.tensor,
    s_p: tl.tensor,
    s_out: tl.tensor,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
) -> None:
    """out[row, cols] = p[row, cols] * a_scale[row] * w_scale[cols] (+ bias[cols]), in float32 (out may be p)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    p = tl.load(p_ptr + row * s_p + cols, mask=mask, other=0.0).to(tl.float32)
    y = p * tl.load(a_scale_ptr + row) * tl.load(w_scale_ptr + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    """The unit scale `_scaled_mm` takes, one per device, made by the first FP8 matmul there: the load-time probe
    (`engine/worker/fp8.py`), never inside a CUDA graph's capture, where it would be filled only on replay."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"the first FP8 matmul on {device} ran inside a CUDA graph capture; run one eagerly first")
    return torch.ones((), dtype=torch.float32, device=device)


def fp8_product(x: Fp8Rows, codes: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x.codes @ codes.T, unscaled, in `product_dtype(out_dtype)` (cuBLAS's per-tensor FP8 GEMM with unit scales):
    for a kernel after it that applies the scales itself (`silu_and_mul_fp8`)."""
    unit = _unit_scale(x.codes.device)
    return torch._scaled_mm(x.codes, codes.t(), scale_a=unit, scale_b=unit, out_dtype=product_dtype(out_dtype))


def _check_matmul(x: Fp8Rows, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
    rows, k = x.codes.shape
    n = codes.shape[0]
    vectors = [x.scales, scales] + ([] if bias is None else [bias])
    if (
        codes.shape[1] != k
        or x.scales.shape != (rows,)
        or scales.shape != (n,)
        or (bias is not None and bias.shape != (n,))
    ):
        raise ValueError(
            f"fp8_matmul wants x [rows, k] with scales [rows] and a weight [n, k] with scales [n] (and a bias [n]), "
            f"got {tuple(x.codes.shape)}, {tuple(x.scales.shape)}, {tuple(codes.shape)}, {tuple(scales.shape)}"
            + ("" if bias is None else f", {tuple(bias.shape)}")
        )
    if any(v.stride(-1) != 1 for v in vectors if v.numel() > 1) or {x.scales.dtype, scales.dtype} != {torch.float32}:
        raise ValueError("fp8_matmul wants float32 scales and a bias, each with unit stride")


def fp8_matmul(
    x: Fp8Rows, codes: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """(x.codes * x.scales) @ (codes * scales).T + bias: x [rows, k] e4m3 with float32 row scales [rows], the
    weight's codes [n, k] e4m3 with float32 channel scales [n]; [rows, n] in `out_dtype`.

    The codes' product is cuBLAS's per-tensor FP8 GEMM with unit scales (float32 accumulation, written in
    `product_dtype`); one Triton pass then applies the row and channel scales and the bias, in place where the
    dtypes agree. Measured on an H200 (benchmarks/fp8_gemm.py), that GEMM is the fastest FP8 one at every size of
    the 8B and 1B Linears: torch's rowwise-scaled one is slower than bfloat16 below ~128 rows, and a Triton GEMM
    either accumulated in Hopper's reduced-precision FP8 MMA (0.5-1% errors) or, promoting to float32 every tile,
    ran up to 3x slower. In a 16-bit model the pass rounds twice (the product, then the scaled value)."""
    _check_matmul(x, codes, scales, bias)
    product = fp8_product(x, codes, out_dtype)
    out = product if product.dtype == out_dtype else torch.empty_like(product, dtype=out_dtype)
    rows, n = product.shape
    if rows:
        block = min(_MAX_BLOCK, next_pow2(n))
        _scale_kernel.launch(
            out.device,
            (rows, cdiv(n, block)),
            product,
            x.scales,
            scales,
            bias if bias is not None else scales,
            out,
            n,
            product.stride(0),
            out.stride(0),
            BLOCK=block,
            HAS_BIAS=bias is not None,
            num_warps=4,
        )
    return out


def _new_rows(x: torch.Tensor, cols: int) -> Fp8Rows:
    """Room for the quantized rows of x (cols of them each)."""
    codes = torch.empty((x.shape[0], cols), dtype=FP8, device=x.device)
    return Fp8Rows(codes, torch.empty(x.shape[0], dtype=torch.float32, device=x.device), x.dtype)


def _check_rows(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{what} wants x [rows, cols] with unit column stride, got {tuple(x.shape)} {x.stride()}")


def quantize_fp8(x: torch.Tensor) -> Fp8Rows:
    """x [rows, cols] -> e4m3 codes and float32 row scales, one launch."""
    _check_rows(x, "quantize_fp8")
    out = _new_rows(x, x.shape[1])
    if x.shape[0]:
        block = min(_MAX_BLOCK, next_pow2(x.shape[1]))
        _quantize_kernel.launch(
            x.device,
            (x.shape[0],),
            x,
            out.codes.view(torch.uint8),
            out.scales,
            x.shape[1],
            x.stride(0),
            out.codes.stride(0),
            BLOCK=block,
            num_warps=min(8, max(1, block // 256)),
        )
    return out


def _rmsnorm_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[Fp8Rows, torch.Tensor]:
    """The quantized rows of rmsnorm(x [+ residual]) and the sum (x itself without a residual)."""
    check_norm_args(x, residual, weight)
    rows, hidden = x.shape
    out = _new_rows(x, hidden)
    res = residual if residual is not None else x
    summed = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    if rows:
        block = next_pow2(hidden)
        _rmsnorm_fp8_kernel.launch(
            x.device,
            (rows,),
            x,
            res,
            weight,
            out.codes.view(torch.uint8),
            out.scales,
            summed,
            hidden,
            eps,
            x.stride(0),
            res.stride(0),
            out.codes.stride(0),
            summed.stride(0),
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(8, max(1, block // 256)),
        )
    return out, summed


def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Rows:
    """`rmsnorm(x, weight, eps)` quantized (the normalised rows rounded to x's dtype first), one launch."""
    return _rmsnorm_fp8(x, None, weight, eps)[0]


def fused_add_rmsnorm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Fp8Rows, torch.Tensor]:
    """`fused_add_rmsnorm` with its normalised rows quantized: (codes and scales, x + residual), one launch."""
    return _rmsnorm_fp8(x, residual, weight, eps)


def silu_and_mul_fp8(x: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> Fp8Rows:
    """`silu_and_mul(x)` quantized (its rows rounded to x's dtype first), one launch. `scales` (row scales [rows],
    column scales [2 * intermediate]): x is an FP8 gate/up product still to be scaled (`fp8_product`), which this
    does on the way, as `fp8_matmul`'s pass would have."""
    check_gate_up(x, "silu_and_mul_fp8")
    if scales is not None and (scales[0].shape != (x.shape[0],) or scales[1].shape != (x.shape[1],)):
        raise ValueError(
            f"silu_and_mul_fp8's scales must be [{x.shape[0]}] and [{x.shape[1]}], got "
            f"{tuple(scales[0].shape)} and {tuple(scales[1].shape)}"
        )
    rows, inter = x.shape[0], x.shape[1] // 2
    out = _new_rows(x, inter)
    if rows:
        block = min(_SILU_BLOCK, next_pow2(inter))
        row_scales, col_scales = scales if scales is not None else (out.scales, out.scales)
        _silu_and_mul_fp8_kernel.launch(
            x.device,
            (rows,),
            x,
            out.codes.view(torch.uint8),
            out.scales,
            row_scales,
            col_scales,
            inter,
            x.stride(0),
            out.codes.stride(0),
            BLOCK=block,
            SCALED=scales is not None,
            num_warps=min(16, max(1, block // 512)),
        )
    return out


__all__ = ["fp8_matmul", "fp8_product", "fused_add_rmsnorm_fp8", "quantize_fp8", "rmsnorm_fp8", "silu_and_mul_fp8"]
