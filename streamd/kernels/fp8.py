"""FP8 (e4m3) activations and the FP8 GEMM behind `Fp8Linear` (Triton).

Why: an FP8 Linear reads half of bfloat16's weight bytes, but it needs its input quantized per row (absmax / 448
and the codes). In torch that is four or five kernels a Linear, as long as the GEMM itself at decode sizes
(benchmarks/NOTES.md, "Issue 28"). Here the quantization is one launch, or none: the RMSNorm before the QKV and
gate/up GEMMs and the SiLU-and-mul before the down GEMM write e4m3 codes and their row scales directly
(`rmsnorm_fp8`, `fused_add_rmsnorm_fp8`, `silu_and_mul_fp8`). `fp8_matmul` multiplies codes by codes on the FP8
tensor cores and applies both scales (row x channel) in its epilogue. Hopper's FP8 MMA accumulates with fewer bits
than float32; the GEMM moves its partial sums into a float32 accumulator every BLOCK_K (128 or 256) products, as
cuBLAS does without its fast-accumulation flag.

Codes are encoded with integer arithmetic (`_e4m3_bits`): round to nearest even, saturating at 448. That is what
the hardware's conversion does, but Triton's interpreter rounds without carrying a mantissa overflow into the
exponent (124.0 becomes 64), so one encoding serves both and the CPU tests check the codes bit for bit against
torch's conversion. The quantization follows `layout.quantize_fp8_rows` (the reference): scale = max(absmax /
448, KV_MIN_SCALE), codes = round(x / scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from streamd.kernels._triton_utils import cdiv, dual_kernel, jit_helper, next_pow2
from streamd.kernels.layout import FP8, FP8_MAX, KV_MIN_SCALE, Fp8Rows, check_norm_args

MIN_SCALE = tl.constexpr(KV_MIN_SCALE)
QMAX = tl.constexpr(FP8_MAX)
_MAX_BLOCK = 2048


@jit_helper
def _e4m3_bits(y: tl.tensor) -> tl.tensor:
    """float32 values -> their e4m3fn codes as int32 (0..255): round to nearest even, |y| > 448 saturates."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = tl.minimum(tl.abs(y), QMAX).to(tl.int32, bitcast=True)
    # normal (|y| >= 2^-6): keep 3 mantissa bits, nearest even, exponent rebiased 127 -> 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: the 24-bit significand shifted to units of 2^-9, nearest even
    shift = tl.minimum(14 - ((mag >> 23) - 127), 25)
    significand = (mag & 0x7FFFFF) | 0x800000
    sub = (significand + (1 << (shift - 1)) - 1 + ((significand >> shift) & 1)) >> shift
    return sign | tl.where(mag < 0x3C800000, sub, normal)  # 0x3C800000 is 2^-6


@jit_helper
def _row_scale(absmax: tl.tensor) -> tl.tensor:
    return tl.maximum(absmax / QMAX, MIN_SCALE)


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
        absmax = tl.maximum(absmax, tl.abs(x))
    scale = _row_scale(tl.max(absmax, 0))
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
    """`rmsnorm._rmsnorm_kernel`'s arithmetic (the normalised row rounded to the activations' dtype), then the
    row's quantization in place of the store."""
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
    y = ((x * inv_rms).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
    scale = _row_scale(tl.max(tl.abs(y), 0))
    tl.store(scales_ptr + row, scale)
    _store_codes(codes_ptr + row * s_codes, offs, y, scale, mask)


@jit_helper
def _silu_mul(x_ptr: tl.tensor, inter: tl.tensor, cols: tl.tensor, mask: tl.tensor, dtype: tl.constexpr) -> tl.tensor:
    """`activation._silu_and_mul_kernel`'s value of `cols` (rounded to `dtype`), float32."""
    gate = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype).to(tl.float32)


@dual_kernel
def _silu_and_mul_fp8_kernel(
    x_ptr: tl.tensor,
    codes_ptr: tl.tensor,
    scales_ptr: tl.tensor,
    inter: tl.tensor,
    s_x: tl.tensor,
    s_codes: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    x_row = x_ptr + row * s_x
    absmax = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        absmax = tl.maximum(absmax, tl.abs(_silu_mul(x_row, inter, cols, cols < inter, dtype)))
    scale = _row_scale(tl.max(absmax, 0))
    tl.store(scales_ptr + row, scale)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = _silu_mul(x_row, inter, cols, cols < inter, dtype)
        _store_codes(codes_ptr + row * s_codes, cols, y, scale, cols < inter)


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """`fp8_matmul`'s tiling: BLOCK_M x BLOCK_N output tiles, BLOCK_K deep, `stages` in flight."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    group_m: int = 8


def default_config(rows: int, n: int, k: int) -> GemmConfig:
    """The tiling for `rows` activation rows times a weight [n, k]: the fastest of a sweep on an H200 at the
    Llama-3.1-8B and 3.2-1B Linears (benchmarks/fp8_gemm.py, results/fp8-gemm-2026-11-28-h200.json). Few rows
    read the weight once and want many narrow tiles to spread it over the GPU; many rows want big ones."""
    wide = n >= 16384  # a gate/up projection
    if rows <= 16:
        return GemmConfig(16, 32 if n <= 4096 else 64 if not n > 16384 else 128, 256 if k >= 4096 else 128, 4, 4)
    if rows <= 64:
        return GemmConfig(64, 64, 256 if k >= 8192 else 128, 4, 4)
    if rows <= 256:
        return GemmConfig(128, 256, 128, 4, 8) if wide else GemmConfig(64, 128, 128, 3, 8)
    if rows <= 512:
        return GemmConfig(128, 256, 128, 4, 8) if wide else GemmConfig(128, 128, 128, 3, 8)
    return GemmConfig(128, 256, 128, 4, 8)


@dual_kernel(do_not_specialize=("rows",))
def _fp8_matmul_kernel(
    a_ptr: tl.tensor,
    a_scale_ptr: tl.tensor,
    w_ptr: tl.tensor,
    w_scale_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    rows: tl.tensor,
    n: tl.tensor,
    k: tl.tensor,
    s_a: tl.tensor,
    s_w: tl.tensor,
    s_out: tl.tensor,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
) -> None:
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(n, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_m
    pid_n = (pid % (GROUP_M * tiles_n)) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * s_a + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * s_w + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(0, k, BLOCK_K):
        k_mask = start + offs_k < k
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < rows) & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=(offs_n[None, :] < n) & k_mask[:, None], other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
        else:  # Hopper's FP8 MMA accumulates in less than float32: promote to `acc` once per BLOCK_K
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < rows, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < n, other=0.0)
    acc = acc * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < n, other=0.0).to(tl.float32)[None, :]
    out_mask = (offs_m[:, None] < rows) & (offs_n[None, :] < n)
    tl.store(
        out_ptr + offs_m[:, None].to(tl.int64) * s_out + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=out_mask,
    )


def fp8_matmul(
    x: Fp8Rows,
    codes: torch.Tensor,
    scales: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """(x.codes * x.scales) @ (codes * scales).T + bias: x [rows, k] e4m3 with float32 row scales [rows], the
    weight's codes [n, k] e4m3 with float32 channel scales [n]; float32 accumulation, [rows, n] in `out_dtype`."""
    rows, k = x.codes.shape
    n = codes.shape[0]
    if codes.shape[1] != k or x.scales.shape != (rows,) or scales.shape != (n,):
        raise ValueError(
            f"fp8_matmul wants x [rows, k] with scales [rows] and a weight [n, k] with scales [n], got "
            f"{tuple(x.codes.shape)}, {tuple(x.scales.shape)}, {tuple(codes.shape)}, {tuple(scales.shape)}"
        )
    out = torch.empty((rows, n), dtype=out_dtype, device=x.codes.device)
    if rows == 0:
        return out
    cfg = config or default_config(rows, n, k)
    grid = (cdiv(rows, cfg.block_m) * cdiv(n, cfg.block_n),)
    _fp8_matmul_kernel.launch(
        x.codes.device,
        grid,
        x.codes,
        x.scales,
        codes,
        scales,
        bias if bias is not None else scales,
        out,
        rows,
        n,
        k,
        x.codes.stride(0),
        codes.stride(0),
        out.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        HAS_BIAS=bias is not None,
        UPCAST=x.codes.device.type != "cuda",
        num_warps=cfg.warps,
        num_stages=cfg.stages,
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
    if residual is None:
        raise ValueError("fused_add_rmsnorm_fp8 needs a residual")
    return _rmsnorm_fp8(x, residual, weight, eps)


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Rows:
    """`silu_and_mul(x)` quantized (its rows rounded to x's dtype first), one launch."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(
            f"silu_and_mul_fp8 wants x [rows, 2 * intermediate] with unit column stride, got "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    rows, inter = x.shape[0], x.shape[1] // 2
    out = _new_rows(x, inter)
    if rows:
        block = min(_MAX_BLOCK, next_pow2(inter))
        _silu_and_mul_fp8_kernel.launch(
            x.device,
            (rows,),
            x,
            out.codes.view(torch.uint8),
            out.scales,
            inter,
            x.stride(0),
            out.codes.stride(0),
            BLOCK=block,
            num_warps=min(8, max(1, block // 256)),
        )
    return out


__all__ = ["fp8_matmul", "fused_add_rmsnorm_fp8", "quantize_fp8", "rmsnorm_fp8", "silu_and_mul_fp8"]
