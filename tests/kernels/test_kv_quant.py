"""The 8-bit KV cache (`cache.kv_cache_dtype` int8 / fp8): the reference quantizer's error bound, the Triton
stores against the reference bit for bit, and both attentions over an 8-bit pool against the references and
against dense float64 attention over the dequantized pool, on awkward shapes with NaN in every byte (and every
scale) no kernel may read.

Triton's interpreter (3.x) rounds float32 to e4m3 without carrying a mantissa overflow into the exponent
(124.0 becomes 64, not 128: tried here), so the interpreted fp8 store tests feed values already on the e4m3
grid, with each row's absmax a power of two times 448; the CUDA test of the same store takes any values.
"""

from __future__ import annotations

import pytest
import torch
from paged_testlib import assert_close, interpreter_runs_dynamic_loops, make_paged, naive_attention

import streamd.kernels as K
from streamd.kernels import reference as ref
from streamd.kernels.layout import KV_QMAX, dequantize_rows, quantize_rows

FP8 = torch.float8_e4m3fn
QUANT = [torch.int8, FP8]
needs_loops = pytest.mark.skipif(
    not interpreter_runs_dynamic_loops(), reason="this triton's interpreter cannot run data-dependent loops"
)


@pytest.mark.parametrize("dtype", QUANT)
def test_quantize_rows_error_is_within_half_a_step(dtype):
    x = torch.randn(50, 3, 72) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 1] = 0.0  # a zero row: zero codes, no NaN
    codes, scales = quantize_rows(x, dtype)
    back = dequantize_rows(codes, scales, torch.float32)
    assert codes.dtype == dtype and scales.shape == x.shape[:-1]
    assert torch.equal(back[7, 1], torch.zeros(72))
    absmax = x.abs().amax(-1, keepdim=True)
    assert torch.allclose(scales, (absmax[..., 0] / KV_QMAX[dtype]).clamp_min(1e-12))
    if dtype == torch.int8:
        bound = scales[..., None] / 2 * (1 + 1e-6)  # half a code
    else:
        bound = x.abs() * 2**-4 + scales[..., None] * 2**-9  # e4m3: 3 mantissa bits; the subnormal floor
    assert ((back - x).abs() <= bound).all()
    assert (codes.float().abs().amax(-1) == KV_QMAX[dtype])[x.abs().amax(-1) > 0].all(), "absmax maps to QMAX"


def _kv_inputs(dtype: torch.dtype, shape: tuple[int, ...], on_grid: bool) -> torch.Tensor:
    """bf16 keys or values; for the interpreted fp8 store, values on the e4m3 grid (module doc)."""
    if not on_grid:
        return torch.randn(shape).to(torch.bfloat16)
    power = 2.0 ** torch.randint(-3, 3, shape[:-1])
    x = torch.randn(shape).clamp(-400, 400).to(FP8).float() * power[..., None]
    # Each row's absmax (448 x its power) in the first half of the head for even tokens, the second for odd
    # ones: a rotary store quantizes the halves apart, and both must count towards the row's scale.
    column = 1 + (torch.arange(shape[0]) % 2)[:, *([None] * (len(shape) - 2))] * (shape[-1] // 2)
    x.scatter_(-1, column.expand(*shape[:-1])[..., None], (448.0 * power)[..., None])
    return x.to(torch.bfloat16)


def _pools(dtype, num_blocks, kv_heads, page, head_dim, device="cpu"):
    kv = torch.zeros(num_blocks, 2, 2, kv_heads, page, head_dim, dtype=dtype, device=device)
    scales = torch.full((num_blocks, 2, 2, kv_heads, page), -1.0, device=device)
    return kv, scales, kv.clone(), scales.clone()


def _assert_same_pool(kv, scales, want_kv, want_scales, dtype):
    assert torch.equal(scales, want_scales)
    assert torch.equal(kv.view(torch.uint8), want_kv.view(torch.uint8)), f"{dtype} codes differ"
    assert torch.equal(scales[:, 0], torch.full_like(scales[:, 0], -1.0)), "another layer was written"


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("tokens,kv_heads,head_dim,page", [(7, 3, 24, 4), (1, 1, 64, 16), (33, 2, 80, 8)])
def test_store_kv_matches_reference_bit_for_bit(dtype, tokens, kv_heads, head_dim, page):
    num_blocks = -(-tokens // page) + 2
    kv, scales, want_kv, want_scales = _pools(dtype, num_blocks, kv_heads, page, head_dim)
    key = _kv_inputs(dtype, (tokens, kv_heads, head_dim), dtype == FP8)
    value = _kv_inputs(dtype, (tokens, kv_heads, head_dim), dtype == FP8)
    slots = torch.randperm(num_blocks * page)[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1
    K.store_kv(key, value, kv, 1, slots, kv_scales=scales)
    ref.store_kv(key, value, want_kv, 1, slots, kv_scales=want_scales)
    _assert_same_pool(kv, scales, want_kv, want_scales, dtype)
    stored = slots[slots >= 0]
    got = dequantize_rows(kv[stored // page, 1, 0, :, stored % page], scales[stored // page, 1, 0, :, stored % page],
                          torch.float32)
    assert_close(got, key[slots >= 0].float(), torch.bfloat16, "a stored key read back")


@pytest.mark.parametrize("dtype", QUANT)
def test_rotary_store_kv_quantizes_as_the_reference(dtype):
    tokens, heads, kv_heads, head_dim, page = 9, 6, 2, 32, 4
    kv, scales, want_kv, want_scales = _pools(dtype, 5, kv_heads, page, head_dim)
    q = torch.randn(tokens, heads, head_dim).to(torch.bfloat16)
    k = torch.randn(tokens, kv_heads, head_dim).to(torch.bfloat16)
    v = _kv_inputs(dtype, (tokens, kv_heads, head_dim), dtype == FP8)
    angle = torch.randn(tokens, head_dim // 2).repeat(1, 2)
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    slots = torch.randperm(5 * page)[:tokens]
    slots[2] = -1
    got = K.rotary_store_kv(q, k, v, cos, sin, kv, 1, slots, kv_scales=scales)
    want = ref.rotary_store_kv(q, k, v, cos, sin, want_kv, 1, slots, kv_scales=want_scales)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    # The rotated key may differ from the reference's by a bfloat16 ulp before quantizing (so may its row's scale):
    # the stored values by one step and that ulp, no more.
    if dtype == FP8:  # the rotated keys are off the e4m3 grid (module doc); the values on it: stored exactly
        assert torch.equal(kv[:, 1, 1].view(torch.uint8), want_kv[:, 1, 1].view(torch.uint8))
        return
    live = slots[slots >= 0]
    blk, off = live // page, live % page
    got_k = dequantize_rows(kv[blk, 1, 0, :, off], scales[blk, 1, 0, :, off], torch.float32)
    want_k = dequantize_rows(want_kv[blk, 1, 0, :, off], want_scales[blk, 1, 0, :, off], torch.float32)
    step = want_scales[blk, 1, 0, :, off][..., None] * 1.01
    assert ((got_k - want_k).abs() <= step + want_k.abs() * 2**-7).all()
    assert torch.equal(scales[:, 1, 1], want_scales[:, 1, 1]), "value scales"


def _quantized_case(dtype: torch.dtype, lens: list[int], page: int, kv_heads: int, head_dim: int):
    """`make_paged`'s pool, quantized: every NaN the kernels must not read becomes a NaN scale."""
    case = make_paged(lens, page=page, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.float32)
    codes, scales = quantize_rows(case.kv_cache, dtype)
    scales[torch.isnan(case.kv_cache).any(-1)] = float("nan")
    dense = dequantize_rows(codes, scales, torch.float32)
    return case, codes, scales, dense


@needs_loops
@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_over_an_8bit_pool(dtype, num_splits):
    page, kv_heads, group, head_dim = 8, 2, 3, 40
    lens = [1, page - 1, page + 1, 3 * page + 5, 0]
    case, codes, scales, dense = _quantized_case(dtype, lens, page, kv_heads, head_dim)
    query = torch.randn(len(lens), kv_heads * group, head_dim).to(torch.bfloat16)
    args = (query, codes, case.layer, case.block_tables, case.seq_lens, head_dim**-0.5)
    out = K.paged_decode_attention(*args, kv_scales=scales, num_splits=num_splits, block_n=16)
    want = ref.paged_decode_attention(*args, kv_scales=scales)
    assert_close(out, want, torch.bfloat16, "decode vs reference")
    case.kv_cache = dense
    assert_close(out, naive_attention(query, case, [[n - 1] for n in lens], head_dim**-0.5), torch.bfloat16, "dense")
    with pytest.raises(ValueError, match="needs float32 kv_scales"):
        K.paged_decode_attention(*args)


@needs_loops
@pytest.mark.parametrize("dtype", QUANT)
def test_prefill_over_an_8bit_pool(dtype):
    page, kv_heads, group, head_dim = 8, 1, 4, 32
    lens, q_lens = [1, 9, 30, 21, 12], [1, 9, 7, 1, 0]
    case, codes, scales, dense = _quantized_case(dtype, lens, page, kv_heads, head_dim)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), kv_heads * group, head_dim).to(torch.bfloat16)
    args = (query, codes, case.layer, case.block_tables, qsl, case.seq_lens, head_dim**-0.5)
    out = K.paged_prefill_attention(*args, kv_scales=scales, block_m=16, block_n=16)
    assert_close(out, ref.paged_prefill_attention(*args, kv_scales=scales), torch.bfloat16, "prefill vs reference")
    positions = [list(range(n - q, n)) for n, q in zip(lens, q_lens)]
    case.kv_cache = dense
    assert_close(out, naive_attention(query, case, positions, head_dim**-0.5), torch.bfloat16, "dense")


def test_the_reference_prefill_attends_a_fresh_prompt_over_what_the_pool_holds():
    """Given the step's own float K/V (the CPU engine's path for a float pool), a fresh prompt's chunk on an
    8-bit pool still attends over what the pool holds: the same output as gathering them back from it."""
    page, head_dim, n = 4, 16, 10
    kv, scales, _, _ = _pools(torch.int8, 4, 1, page, head_dim)
    key, value = torch.randn(n, 1, head_dim), torch.randn(n, 1, head_dim)
    slots = torch.arange(n)
    ref.store_kv(key, value, kv, 1, slots, kv_scales=scales)
    tables = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    args = (torch.randn(n, 2, head_dim), kv, 1, tables, torch.tensor([0, n], dtype=torch.int32),
            torch.tensor([n], dtype=torch.int32), 0.25)
    from_pool = ref.paged_prefill_attention(*args, kv_scales=scales)
    given = ref.paged_prefill_attention(*args, key=key, value=value, kv_scales=scales)
    torch.testing.assert_close(given, from_pool, atol=1e-6, rtol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", QUANT)
def test_store_and_attend_on_cuda(dtype):
    """Any values (the compiled fp8 conversion rounds correctly); codes within one step of the reference."""
    tokens, kv_heads, head_dim, page = 37, 2, 128, 16
    kv, scales, want_kv, want_scales = _pools(dtype, 6, kv_heads, page, head_dim, "cuda")
    key = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(6 * page, device="cuda")[:tokens]
    K.store_kv(key, value, kv, 1, slots, kv_scales=scales)
    ref.store_kv(key, value, want_kv, 1, slots, kv_scales=want_scales)
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    got = dequantize_rows(kv, scales, torch.float32)
    want = dequantize_rows(want_kv, want_scales, torch.float32)
    step = want_scales.abs()[..., None]
    # int8: one code; e4m3: one ulp at the value's own exponent (32 x scale, the top binade's step, hid bad rounding)
    bound = step * 1.01 if dtype == torch.int8 else want.abs() * 2**-3 + step * 2**-9
    assert ((got - want).abs() <= bound).all()
    tables = torch.arange(6, dtype=torch.int32, device="cuda").view(2, 3)
    lens = torch.tensor([37, 20], dtype=torch.int32, device="cuda")
    query = torch.randn(2, 8, head_dim, device="cuda", dtype=torch.bfloat16)
    args = (query, kv, 1, tables, lens, head_dim**-0.5)
    out = K.paged_decode_attention(*args, kv_scales=scales)
    assert_close(out, ref.paged_decode_attention(*args, kv_scales=scales), torch.bfloat16, "cuda decode")


@pytest.mark.parametrize("dtype", QUANT)
def test_the_cpu_planned_path_matches_the_reference_on_an_8bit_pool(dtype):
    """The CPU engine's own store and decode (`cpu_attention`, planned once per step) quantize and dequantize as
    the references do."""
    from streamd.kernels import cpu_attention

    page, kv_heads, group, head_dim = 4, 2, 3, 16
    lens = [1, 6, 13]
    case, codes, scales, _ = _quantized_case(dtype, lens, page, kv_heads, head_dim)
    key, value = torch.randn(3, kv_heads, head_dim), torch.randn(3, kv_heads, head_dim)
    slots = torch.tensor([int(case.block_tables[i, (n - 1) // page]) * page + (n - 1) % page
                          for i, n in enumerate(lens)])  # each sequence's last position: this step's token
    want_codes, want_scales = codes.clone(), scales.clone()
    cpu_attention.store_kv(key, value, case.layer, cpu_attention.plan_store(slots, cpu_attention.pool_rows(codes, scales)))
    ref.store_kv(key, value, want_codes, case.layer, slots, kv_scales=want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales.nan_to_num(-7.0), want_scales.nan_to_num(-7.0))
    query = torch.randn(len(lens), kv_heads * group, head_dim)
    plan = cpu_attention.plan_decode(case.block_tables, case.seq_lens, cpu_attention.pool_rows(codes, scales))
    got = cpu_attention.decode_attention(query, case.layer, plan, head_dim**-0.5)
    want = ref.paged_decode_attention(query, codes, case.layer, case.block_tables, case.seq_lens, head_dim**-0.5,
                                      kv_scales=scales)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", QUANT)
def test_an_8bit_pool_whose_scales_end_off_a_row_is_padded_and_addressed_as_rows(dtype):
    """One layer, one KV head, 4-token blocks of 64-wide heads: a block's codes (512 bytes) and scales (32 bytes)
    end half-way through a row of codes, so the allocation pads each block to a whole row, and the CPU's planned
    store and decode, which address the pool as rows, read and write the same values as the reference does on
    the pool's views."""
    from streamd.engine.worker.cache_engine import KVLayout, allocate_pool
    from streamd.kernels import cpu_attention

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=4, dtype=dtype)
    assert layout.bytes_per_block == 576 and layout.code_bytes_per_block + layout.scale_bytes_per_block == 544
    pool = allocate_pool(layout, 5, "cpu")
    pool.blocks.zero_()
    want = allocate_pool(layout, 5, "cpu")
    want.blocks.zero_()
    tables = torch.tensor([[3, 0, 4], [1, 2, 0]], dtype=torch.int32)
    lens = torch.tensor([11, 6], dtype=torch.int32)
    for pos in range(11):  # every position of both sequences, one token a step
        live = [s for s in range(2) if pos < int(lens[s])]
        slots = torch.tensor([int(tables[s, pos // 4]) * 4 + pos % 4 for s in live])
        key, value = torch.randn(len(live), 1, 64), torch.randn(len(live), 1, 64)
        plan = cpu_attention.plan_store(slots, cpu_attention.pool_rows(pool.kv_cache, pool.kv_scales))
        cpu_attention.store_kv(key, value, 0, plan)
        ref.store_kv(key, value, want.kv_cache, 0, slots, kv_scales=want.kv_scales)
    assert torch.equal(pool.blocks, want.blocks)
    query = torch.randn(2, 3, 64)
    plan = cpu_attention.plan_decode(tables, lens, cpu_attention.pool_rows(pool.kv_cache, pool.kv_scales))
    got = cpu_attention.decode_attention(query, 0, plan, 0.125)
    expected = ref.paged_decode_attention(query, want.kv_cache, 0, tables, lens, 0.125, kv_scales=want.kv_scales)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
