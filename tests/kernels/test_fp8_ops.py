"""FP8 activations and the FP8 GEMM (`streamd.kernels.fp8`) against their torch references: e4m3 codes bit for bit
against torch's conversion at every rounding boundary (the interpreter's own conversion gets these wrong, so the
kernels encode in integers), the fused norm and SiLU-and-mul writing codes, and the GEMM's epilogue scales, on
awkward sizes; the same kernels compiled on CUDA (marked)."""

from __future__ import annotations

import pytest
import torch
from paged_testlib import interpreter_runs_dynamic_loops

import streamd.kernels as K
from streamd.kernels import reference as ref
from streamd.kernels.layout import FP8, FP8_MAX, Fp8Rows

# the kernels loop over a row's columns and K: an interpreter that cannot run such loops (triton 3.6's with
# numpy >= 2.4) runs the CPU cases not at all
DEVICES = (["cpu"] if interpreter_runs_dynamic_loops() else []) + (
    [pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else []
)
cuda = pytest.mark.cuda
# cuBLAS's FP8 GEMM on Hopper: its partial sums are not float32 throughout (measured on an H200: 3e-3 of the largest
# output at k = 14,336, against the exact products)
CUBLAS_FP8 = 5e-3


def _bits(rows: Fp8Rows) -> torch.Tensor:
    return rows.codes.view(torch.uint8)


def _grid_and_midpoints() -> torch.Tensor:
    """Every finite e4m3 value, each midpoint between neighbours (ties: nearest even), and one float32 ulp either
    side of each midpoint, both signs, plus 0, -0, values under half the smallest subnormal, and 448 itself."""
    values = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()  # 0 .. 448, ascending
    mids = (values[1:] + values[:-1]) / 2
    near = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))])
    tiny = torch.tensor([0.0, 2.0**-11, 2.0**-10 * 1.0001, 1e-30])
    positive = torch.cat([values, near, tiny])
    return torch.cat([positive, -positive, torch.tensor([-0.0, FP8_MAX])])


@pytest.mark.parametrize("device", DEVICES)
def test_codes_equal_torch_conversion_at_every_boundary(device: str) -> None:
    # rows whose absmax is 448: scale 1, so x / scale is x and every code boundary is exercised as given
    y = _grid_and_midpoints()
    y = y[torch.randperm(len(y))]
    x = torch.nn.functional.pad(y, (0, -len(y) % 64)).view(-1, 64)
    x[:, 0] = FP8_MAX
    got = K.quantize_fp8(x.to(device))
    assert torch.equal(got.scales.cpu(), torch.ones(x.shape[0]))
    assert torch.equal(_bits(got).cpu(), x.to(FP8).view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cols", [1, 77, 300])
def test_quantize_matches_reference(device: str, cols: int) -> None:
    x = (torch.randn(9, cols) * torch.logspace(-5, 4, 9)[:, None]).to(device)
    x[4] = 0.0  # a zero row: the smallest scale, zero codes
    got, want = K.quantize_fp8(x), ref.quantize_fp8(x)
    assert torch.equal(got.scales, want.scales)
    assert torch.equal(_bits(got), _bits(want))
    assert K.quantize_fp8(x[:0]).codes.shape == (0, cols)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_stay_what_the_reference_makes_them(device: str) -> None:
    """A NaN makes its row's scale NaN and its codes NaN; an infinity makes the scale infinite (its own code NaN,
    inf / inf); as the reference, not a finite row that hides them."""
    x = torch.randn(4, 40)
    x[1, 3], x[2, 5], x[3, 7] = float("nan"), float("inf"), -float("inf")
    got, want = K.quantize_fp8(x.to(device)), ref.quantize_fp8(x)
    torch.testing.assert_close(got.scales.cpu(), want.scales, equal_nan=True)
    assert torch.equal(got.codes.cpu().float().isnan(), want.codes.float().isnan())
    assert torch.equal(_bits(got)[0].cpu(), _bits(want)[0])

def _assert_same(got: Fp8Rows, want: Fp8Rows) -> None:
    assert torch.equal(got.scales, want.scales) and torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [48, 130])
def test_norms_write_the_codes_of_norm_then_quantize(device: str, dtype: torch.dtype, hidden: int) -> None:
    """One launch equals the norm kernel (tested against transformers' arithmetic elsewhere) followed by
    `quantize_fp8`, bit for bit, and stays within a code of the references' composition."""
    x = torch.randn(7, hidden + 3).to(device, dtype)[:, 3:]  # strided rows
    residual = torch.randn(7, hidden).to(device, dtype)
    weight = (1 + 0.3 * torch.randn(hidden)).to(device, dtype)
    _assert_same(K.rmsnorm_fp8(x, weight, 1e-5), K.quantize_fp8(K.rmsnorm(x, weight, 1e-5)))
    rows, summed = K.fused_add_rmsnorm_fp8(x, residual, weight, 1e-5)
    normed, want_summed = K.fused_add_rmsnorm(x, residual, weight, 1e-5)
    _assert_same(rows, K.quantize_fp8(normed))
    assert torch.equal(summed, want_summed)
    _assert_near(rows, ref.fused_add_rmsnorm_fp8(x, residual, weight, 1e-5)[0])


def _assert_near(got: Fp8Rows, want: Fp8Rows) -> None:
    """Within the layer kernels' tolerance of their references (3%, for the interpreter's bfloat16) and one e4m3
    step (an eighth) of the value."""
    torch.testing.assert_close(got.scales, want.scales, rtol=3e-2, atol=0)
    a, b = got.dequantize(torch.float32), want.dequantize(torch.float32)
    assert ((a - b).abs() <= b.abs() * (1 / 8 + 3e-2) + want.scales[:, None] * 2**-8).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [40, 2500])  # 2,500: over the kernel's 2,048-column block, two passes
def test_silu_and_mul_writes_the_codes_of_silu_then_quantize(device: str, dtype: torch.dtype, inter: int) -> None:
    x = (torch.randn(5, 2 * inter + 5) * 3).to(device, dtype)[:, 5:]
    _assert_same(K.silu_and_mul_fp8(x), K.quantize_fp8(K.silu_and_mul(x)))
    _assert_near(K.silu_and_mul_fp8(x), ref.silu_and_mul_fp8(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_scales_an_fp8_product_as_the_matmul_would(device: str, dtype: torch.dtype) -> None:
    """Given the gate/up product unscaled and its scales, the SiLU-and-mul writes the codes it writes after
    `fp8_matmul`'s own scale pass, bit for bit."""
    x = ref.quantize_fp8(torch.randn(6, 64, device=device).to(dtype))
    w = ref.quantize_fp8(torch.randn(2 * 48, 64, device=device) * 0.1)
    scaled = K.silu_and_mul_fp8(K.fp8_matmul(x, w.codes, w.scales, dtype))
    product = K.fp8_product(x, w.codes, dtype)
    _assert_same(K.silu_and_mul_fp8(product, scales=(x.scales, w.scales)), scaled)
    want = ref.silu_and_mul_fp8(ref.fp8_product(x, w.codes, dtype), scales=(x.scales, w.scales))
    _assert_near(K.silu_and_mul_fp8(product, scales=(x.scales, w.scales)), want)
    with pytest.raises(ValueError, match="scales must be"):
        K.silu_and_mul_fp8(product, scales=(x.scales, w.scales[:5]))


def test_fp8_ops_reject_bad_shapes() -> None:
    with pytest.raises(ValueError, match="quantize_fp8 wants x"):
        K.quantize_fp8(torch.randn(4))
    with pytest.raises(ValueError, match="silu_and_mul_fp8 wants"):
        K.silu_and_mul_fp8(torch.randn(3, 5))
    with pytest.raises(ValueError, match="residual"):
        K.fused_add_rmsnorm_fp8(torch.randn(3, 8), torch.randn(3, 9), torch.ones(8), 1e-5)
    x, w = ref.quantize_fp8(torch.randn(3, 32)), ref.quantize_fp8(torch.randn(5, 16))
    with pytest.raises(ValueError, match=r"fp8_matmul wants x \[rows, k\]"):
        K.fp8_matmul(x, w.codes, w.scales, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,n,k", [(1, 48, 48), (19, 112, 80), (70, 16, 160)])  # cuBLAS: n, k by 16
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_matmul_matches_reference(device: str, rows: int, n: int, k: int, bias: bool) -> None:
    x = ref.quantize_fp8(torch.randn(rows, k, device=device) * 4)
    w = ref.quantize_fp8(torch.randn(n, k, device=device) * 0.05)
    b = torch.randn(n, device=device) if bias else None
    want = ref.fp8_matmul(x, w.codes, w.scales, torch.float32, b)
    got = K.fp8_matmul(x, w.codes, w.scales, torch.float32, b)
    close = 1e-5 if device == "cpu" else CUBLAS_FP8
    torch.testing.assert_close(got, want, rtol=close, atol=close * want.abs().max().item())
    for dtype in (torch.bfloat16, torch.float16):  # (float16's product is taken in bfloat16: its range)
        got = K.fp8_matmul(x, w.codes, w.scales, dtype, b)
        assert got.dtype == dtype
        # rounded twice (the codes' product, then the scaled value plus the bias): a bfloat16 step of the larger
        torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-8 * want.abs().max().item())


@cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_fp8_matmul_on_cuda_equals_scaled_mm(rows: int) -> None:
    """Against torch's rowwise-scaled FP8 GEMM (bfloat16 out, as it writes) and the float32 reference, on a
    decode-sized 8B down projection; in a CUDA graph."""
    x = ref.quantize_fp8(torch.randn(rows, 14336, device="cuda", dtype=torch.bfloat16))
    w = ref.quantize_fp8(torch.randn(1024, 14336, device="cuda", dtype=torch.bfloat16) * 0.02)
    exact = ref.fp8_matmul(x, w.codes, w.scales, torch.float32)
    cublas = torch._scaled_mm(x.codes, w.codes.t(), scale_a=x.scales[:, None].contiguous(),
                              scale_b=w.scales[None, :].contiguous(), out_dtype=torch.bfloat16)
    got = K.fp8_matmul(x, w.codes, w.scales, torch.float32)
    scale = exact.abs().max().item()
    torch.testing.assert_close(got, exact, rtol=CUBLAS_FP8, atol=CUBLAS_FP8 * scale)
    torch.testing.assert_close(cublas.float(), exact, rtol=2**-8, atol=1e-3 * scale)
    want = exact
    graph = torch.cuda.CUDAGraph()
    K.fp8_matmul(x, w.codes, w.scales, torch.bfloat16)
    with torch.cuda.graph(graph):
        out = K.fp8_matmul(x, w.codes, w.scales, torch.bfloat16)
    graph.replay()
    torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=CUBLAS_FP8 * want.abs().max().item())
