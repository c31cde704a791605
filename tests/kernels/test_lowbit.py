"""torch's packed low-bit CPU kernels (through `streamd.kernels.lowbit`) against their float references, on
awkward shapes: rows not a multiple of 16 (padded), inputs not a multiple of the group (padded), one row to
many, more than one packing chunk (1,024 rows).

Tolerance: the kernels take bfloat16 activations and scales, so the reference is computed in float32 from the
same bfloat16-rounded inputs and scales; what remains is accumulation order and the bfloat16 output's rounding
(2^-8 relative), bounded here by 1% of the output's largest magnitude."""

from __future__ import annotations

import pytest
import torch

from streamd.kernels import lowbit

BF16 = torch.bfloat16


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("rows,cols,group", [(7, 32, 32), (100, 96, 32), (33, 40, 32), (1040, 130, 64), (16, 256, 256)])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_int4_matches_its_reference(rows: int, cols: int, group: int, batch: int) -> None:
    gen = torch.Generator().manual_seed(rows * cols + batch)
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    groups = -(-cols // group)
    scales = torch.rand(rows, groups, generator=gen) * 0.05 + 1e-3
    zeros = torch.randn(rows, groups, generator=gen) * 0.05
    x = torch.randn(batch, cols, generator=gen).to(BF16)
    weight = lowbit.pack_int4(codes, scales, zeros, group, BF16)
    ref_w = lowbit.dequantize_int4(codes, scales.to(BF16).float(), zeros.to(BF16).float(), group)
    close(lowbit.int4_linear(x, weight), lowbit.linear_reference(x, ref_w))


def test_int4_keeps_leading_dimensions() -> None:
    codes = torch.randint(0, 16, (48, 64), dtype=torch.uint8)
    weight = lowbit.pack_int4(codes, torch.full((48, 2), 0.01), torch.zeros(48, 2), 32, BF16)
    assert lowbit.int4_linear(torch.randn(2, 5, 64).to(BF16), weight).shape == (2, 5, 48)


def test_int4_refuses_a_group_size_torch_has_no_kernel_for() -> None:
    with pytest.raises(ValueError, match="group size must be one of"):
        lowbit.pack_int4(torch.zeros(16, 48, dtype=torch.uint8), torch.ones(16, 3), torch.zeros(16, 3), 16, BF16)


@pytest.mark.parametrize("rows,cols,batch", [(7, 33, 1), (100, 576, 5), (64, 40, 17)])
def test_int8_matches_its_reference(rows: int, cols: int, batch: int) -> None:
    weight = torch.randn(rows, cols) * 0.1
    q = lowbit.quantize_int8(weight, BF16)
    x = torch.randn(batch, cols).to(BF16)
    ref_w = q.codes[:, :cols].float() * q.scales.float()[:, None]
    close(lowbit.int8_linear(x, q), lowbit.linear_reference(x, ref_w))
    # round to nearest per row: within half a step of the float weight, plus the bfloat16 scale's rounding
    step = q.scales.float()[:, None]
    assert ((ref_w - weight).abs() <= step * 0.5 + step * 127 * 2**-8).all()


@pytest.mark.parametrize("rows,cols,group", [(7, 32, 32), (100, 96, 32), (33, 40, 32), (1040, 130, 64), (80, 64, 32)])
def test_dequantize_t_undoes_torchs_packing(rows: int, cols: int, group: int) -> None:
    """Full 64-row blocks, a 16/32/48-row tail, padded inputs, more than one packing chunk: every code back in
    its place, scaled as the kernel scales it (float32 from the bfloat16 scales)."""
    gen = torch.Generator().manual_seed(rows + cols)
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    groups = -(-cols // group)
    scales, zeros = torch.rand(rows, groups, generator=gen) + 0.01, torch.randn(rows, groups, generator=gen)
    weight = lowbit.pack_int4(codes, scales, zeros, group, BF16)
    ref = lowbit.dequantize_int4(codes, scales.to(BF16).float(), zeros.to(BF16).float(), group)
    torch.testing.assert_close(lowbit.dequantize_t(weight)[:cols, :rows], ref.t(), rtol=0, atol=1e-6)


def test_this_build_packs_in_a_layout_we_unpack() -> None:
    assert lowbit.packed_row_block() in (64, 32)


@pytest.mark.parametrize("rows,cols,batch", [(7, 33, 47), (100, 576, 48), (1040, 130, 49), (192, 64, 130)])
def test_dense_linear_matches_the_packed_kernels(rows: int, cols: int, batch: int) -> None:
    """The many-rows path (one dequantization, one bfloat16 matmul) against the float reference, for an int4
    weight, a Q8_0-style sum of two int4 halves, and an int8 weight."""
    gen = torch.Generator().manual_seed(rows * batch)
    x = torch.randn(batch, cols, generator=gen).to(BF16)
    groups = -(-cols // 32)
    halves = [torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.rand(rows, groups, generator=gen) * 0.05 + 1e-3 for _ in range(2)]
    zeros = [torch.randn(rows, groups, generator=gen) * 0.05 for _ in range(2)]
    parts = [lowbit.pack_int4(c, s, z, 32, BF16) for c, s, z in zip(halves, scales, zeros, strict=True)]
    refs = [
        lowbit.dequantize_int4(c, s.to(BF16).float(), z.to(BF16).float(), 32)
        for c, s, z in zip(halves, scales, zeros, strict=True)
    ]
    close(lowbit.dense_linear(x, parts[:1], (rows, cols)), lowbit.linear_reference(x, refs[0]))
    close(lowbit.dense_linear(x, parts, (rows, cols)), lowbit.linear_reference(x, refs[0] + refs[1]))
    int8 = lowbit.quantize_int8(torch.randn(rows, cols, generator=gen), BF16)
    ref8 = int8.codes[:, :cols].float() * int8.scales.float()[:, None]
    close(lowbit.dense_linear(x, [int8], (rows, cols)), lowbit.linear_reference(x, ref8))


def awkward_rows(batch: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows, the first with one huge outlier and the last all zeros (when there are two or more)."""
    x = torch.randn(batch, cols, generator=gen)
    if batch:
        x[0, cols // 2] = 1e4
    if batch > 1:
        x[-1] = 0
    return x


@pytest.mark.parametrize("rows,cols", [(13, 70), (100, 33), (48, 576), (1040, 130)])
@pytest.mark.parametrize("batch", [0, 1, 3, 17, 130])
def test_w8a8_matches_its_reference(rows: int, cols: int, batch: int) -> None:
    """The int8 x int8 path (activations as two int8 halves, `torch._int_mm`, float32 scaling) against its float64
    reference. Tolerance: the int32 sums are exact and the rounding is decided alike, so what remains is the
    float32 scaling (a few roundings of 2^-24): 1e-6 of each output's magnitude bound sum(|x| |w|)."""
    gen = torch.Generator().manual_seed(rows * cols + batch)
    codes, scales = lowbit.per_row_int8(torch.randn(rows, cols, generator=gen) * 0.1)
    weight = lowbit.W8A8Weight(codes, scales)
    x = awkward_rows(batch, cols, gen)
    out = lowbit.w8a8_linear(lowbit.quantize_rows(x), weight, torch.float32)
    ref = lowbit.w8a8_reference(x, codes, scales)
    bound = x.double().abs() @ (codes.double() * scales.double()[:, None]).abs().t()
    assert out.shape == (batch, rows) and out.dtype == torch.float32
    assert ((out.double() - ref).abs() <= 1e-6 * bound).all()


@pytest.mark.parametrize("batch,cols", [(1, 70), (3, 33), (17, 576), (130, 130)])
def test_activation_halves_keep_a_row_within_scale_over_508(batch: int, cols: int) -> None:
    """x = scale * (hi + lo / 254) to within scale / 508 even in a row whose outlier sets the scale (one int8 half
    alone: within scale / 2, which rounds the rest of that row to 0); a zero row stays zero."""
    x = awkward_rows(batch, cols, torch.Generator().manual_seed(batch))
    rows = lowbit.quantize_rows(x)
    high, low = rows.codes[:batch].double(), rows.codes[batch:].double()
    back = (high + low / 254) * rows.scales.double()
    # plus x / scale's float32 rounding (up to 127 * 2^-24 of a step)
    assert ((back - x.double()).abs() <= rows.scales.double() * (1 / 508 + 2**-16)).all()
    assert rows.codes.abs().max() <= 127
    if batch > 1:
        assert torch.equal(back[-1], torch.zeros(cols, dtype=torch.float64))


@pytest.mark.parametrize("rows,cols", [(13, 70), (100, 576)])
def test_per_row_int8_is_within_half_a_step(rows: int, cols: int) -> None:
    weight = torch.randn(rows, cols) * 0.1
    weight[3] = 0
    codes, scales = lowbit.per_row_int8(weight)
    step = scales[:, None]
    assert ((codes.float() * step - weight).abs() <= step * (0.5 + 2**-16)).all()  # + w / step's float32 rounding
    assert scales[3] == 1 and not codes[3].any()
