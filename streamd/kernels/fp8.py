"""FP8 (e4m3) activations and the FP8 matmul behind `Fp8Linear` (Triton kernels around cuBLAS's FP8 GEMM).

Why: an FP8 Linear reads half of bfloat16's weight bytes, but it needs its input quantized per row (absmax / 448
and the codes). In torch that is four or five kernels a Linear, as long as the GEMM itself at decode sizes
(benchmarks/NOTES.md, "Issue 28"). Here the quantization is one launch (`quantize_fp8`), or none: the RMSNorm
before the QKV and gate/up GEMMs (`rmsnorm.rmsnorm_fp8`, `fused_add_rmsnorm_fp8`) and the SiLU-and-mul before the
down GEMM (`silu_and_mul_fp8`) write e4m3 codes and their row scales directly. `fp8_matmul` multiplies codes by
codes on the FP8 tensor cores (cuBLAS) and applies both scales (row x channel) and the bias in one pass after.
The codes' arithmetic (`layer_math.e4m3_bits`, the row scale) is shared with the norm kernel.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from streamd.kernels._triton_utils import cdiv, dual_kernel, jit_helper, next_pow2
from streamd.kernels.layer_math import lane_max, row_scale, silu_mul, store_codes
from streamd.kernels.layout import Fp8Rows, check_gate_up, product_dtype

_MAX_BLOCK = 2048
# a whole row of gate/up in one tile up to 16,384 columns (Llama-3.1-8B's 14,336): each pass one iteration
_SILU_BLOCK = 16384


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
        absmax = lane_max(absmax, x)
    scale = row_scale(absmax)
    tl.store(scales_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * s_x + offs, mask=offs < cols, other=0.0).to(tl.float32)
        store_codes(codes_ptr + row * s_codes, offs, x, scale, offs < cols)


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
        absmax = lane_max(absmax, y)
    scale = row_scale(absmax)
    tl.store(scales_ptr + row, scale)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = _silu_mul(x_row, inter, cols, cols < inter, dtype, rs, col_scales_ptr, SCALED)
        store_codes(codes_ptr + row * s_codes, cols, y, scale, cols < inter)


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


def _check_rows(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{what} wants x [rows, cols] with unit column stride, got {tuple(x.shape)} {x.stride()}")


def quantize_fp8(x: torch.Tensor) -> Fp8Rows:
    """x [rows, cols] -> e4m3 codes and float32 row scales, one launch."""
    _check_rows(x, "quantize_fp8")
    out = Fp8Rows.empty(x, x.shape[1])
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
    out = Fp8Rows.empty(x, inter)
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


__all__ = ["fp8_matmul", "fp8_product", "quantize_fp8", "silu_and_mul_fp8"]
