"""The int4 matmul in C (`kernels/native/int4_matmul.c`, `lowbit.native_int4`) against the float64 product of
the dequantized weight and against torch's kernel, on awkward sizes: every group size, input widths of one
group, row tiles of 4 with a remainder (1, 3, 5, 9 rows), several 64-row blocks, scales and zeros of mixed
signs and magnitudes, outlier activations, and a weight of two parts (a Q8_0 weight's halves) summed before
its one rounding. Tolerance: the output is bfloat16, one rounding of a float32 sum; the sums run in another
order than torch's kernel, so the two may differ by one bfloat16 step."""

from __future__ import annotations

import pytest
import torch

from streamd.kernels import lowbit, native_cpu

pytestmark = pytest.mark.skipif(
    native_cpu.int4_matmul() is None or lowbit.packed_row_block() != 64,
    reason="no AVX-512 BF16 here (or no C compiler), or torch packs int4 rows in blocks other than 64",
)


def _weight(rows: int, width: int, group: int, seed: int) -> lowbit.Int4Weight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, width), generator=g, dtype=torch.uint8)
    groups = -(-width // group)
    scales = torch.rand(rows, groups, generator=g) * 0.05 + 1e-4
    zeros = torch.randn(rows, groups, generator=g) * 0.1
    return lowbit.pack_int4(codes, scales, zeros, group, torch.bfloat16)


def _native(x: torch.Tensor, *parts: lowbit.Int4Weight) -> torch.Tensor | None:
    kernel = lowbit.native_int4(parts)
    assert kernel is not None
    return kernel(x)


def _exact(x: torch.Tensor, weight: lowbit.Int4Weight) -> torch.Tensor:
    return x.double() @ lowbit.dequantize_t(weight).double()  # the kernels' weight: (q - 8) * scale + zero


def _bf16_step(values: torch.Tensor) -> torch.Tensor:
    """One bfloat16 rounding step at each value's magnitude (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(values.abs().clamp_min(1e-30))) - 7)


@pytest.mark.parametrize(
    "rows, width, group, n",
    [(64, 32, 32, 1), (128, 576, 32, 3), (192, 256, 64, 5), (64, 384, 128, 9), (256, 512, 256, 4), (64, 1536, 32, 2)],
)
def test_equals_the_exact_product_within_a_rounding(rows: int, width: int, group: int, n: int) -> None:
    weight = _weight(rows, width, group, seed=rows + width + n)
    x = torch.randn(n, width, generator=torch.Generator().manual_seed(n))
    x[:, :: max(1, width // 7)] *= 20  # outliers, as real activations have
    x = x.to(torch.bfloat16)
    out = _native(x, weight)
    assert out is not None and out.shape == (n, rows) and out.dtype == torch.bfloat16
    exact = _exact(x, weight)
    # a bfloat16 rounding of the float32 sum, plus float32 sums over `width` terms of its largest products
    scale = (x.double().abs() @ lowbit.dequantize_t(weight).double().abs()).max()
    assert ((out.double() - exact).abs() <= _bf16_step(exact) + 1e-5 * scale).all()
    theirs = lowbit._INT4_MM(x, weight.packed, weight.group_size, weight.scales_and_zeros)
    assert ((out.double() - theirs.double()).abs() <= _bf16_step(exact) + 1e-5 * scale).all()


def test_threads_split_rows_and_change_no_bit() -> None:
    weight = _weight(320, 576, 32, seed=7)
    x = torch.randn(6, 576).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _native(x, weight)
        torch.set_num_threads(2)
        two = _native(x, weight)
    finally:
        torch.set_num_threads(before)
    assert one is not None and two is not None and torch.equal(one, two)


def test_rows_of_one_call_are_those_of_single_row_calls() -> None:
    """A tile of 4 rows shares one unpacking of the weight; each row's output is what it gets alone."""
    weight = _weight(128, 320, 64, seed=3)
    x = torch.randn(7, 320).to(torch.bfloat16)
    together = _native(x, weight)
    alone = [_native(x[i : i + 1].contiguous(), weight) for i in range(7)]
    assert together is not None and all(a is not None for a in alone)
    assert torch.equal(together, torch.cat([a for a in alone if a is not None]))


def test_two_parts_are_summed_before_one_rounding() -> None:
    """A Q8_0 weight's halves: the high half's outputs are ~16x the low half's and largely cancel them, so
    rounding each half to bfloat16 first (torch's kernel, then an add) loses what one rounding keeps."""
    high, low = _weight(128, 576, 32, seed=11), _weight(128, 576, 32, seed=12)
    x = torch.randn(3, 576).to(torch.bfloat16)
    out = _native(x, high, low)
    exact = _exact(x, high) + _exact(x, low)
    assert out is not None
    scale = (x.double().abs() @ (lowbit.dequantize_t(high).double().abs() + lowbit.dequantize_t(low).double().abs()))
    assert ((out.double() - exact).abs() <= _bf16_step(exact) + 1e-5 * scale.max()).all()


def test_what_it_does_not_take_goes_to_torchs_kernels() -> None:
    x = torch.randn(2, 64).to(torch.bfloat16)
    assert lowbit.native_int4([_weight(80, 64, 32, seed=1)]) is None  # a 64-row block and a 16-row tail
    assert lowbit.native_int4([_weight(64, 64, 32, seed=1), _weight(64, 64, 64, seed=1)]) is None  # two groups
    assert lowbit.native_int4([_weight(64, 40, 32, seed=1)]) is None  # an input padded to the group
    float_scales = _weight(64, 64, 32, seed=1)
    float_scales = lowbit.Int4Weight(float_scales.packed, float_scales.scales_and_zeros.float(), 32, 64, 64)
    assert lowbit.native_int4([float_scales]) is None
    whole = lowbit.native_int4([_weight(64, 64, 32, seed=2)])
    assert whole is not None
    assert whole(x.float()) is None  # float32 activations
    assert whole(torch.randn(4, 32).to(torch.bfloat16)) is None  # another width
    assert whole(x.t().contiguous().t()) is None  # not contiguous
