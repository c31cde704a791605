"""The C decode glue (`kernels/native/cpu_decode.c`) against the torch references, on awkward sizes: head widths
not a multiple of the 8-lane sums, GQA groups, unequal context lengths over shuffled blocks whose every unread
slot is NaN, a padded row (slot -1) that must not be stored, and rows a stride apart. Tolerances: the C sums
round in another order than torch's (float32), and the outputs are bfloat16 (one rounding step apart at most)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from paged_testlib import make_paged

from streamd.kernels import native_cpu, reference
from streamd.kernels.layout import quantize_rows

lib = native_cpu.load()
pytestmark = pytest.mark.skipif(lib is None, reason=f"{native_cpu.unavailable_reason()}")
BF16 = {"atol": 1e-2, "rtol": 1e-2}  # a bfloat16 rounding step of values of order 1
ONE_BF16_STEP = {"atol": 1e-4, "rtol": 8e-3}  # at most one rounding step apart at any size (2^-8 relative)


def _p(t: torch.Tensor) -> int:
    return t.data_ptr()


@pytest.mark.parametrize("rows, dim, with_delta", [(1, 576, True), (3, 100, True), (2, 13, False)])
def test_add_rmsnorm_equals_the_reference(rows: int, dim: int, with_delta: bool) -> None:
    residual = torch.randn(rows, dim) * 3
    wide = torch.randn(rows, dim + 5).to(torch.bfloat16)  # the delta's rows are a stride apart
    delta = wide[:, :dim]
    weight = torch.randn(dim)
    want_sum = residual + delta.float() if with_delta else residual.clone()
    want = reference.rmsnorm(want_sum, weight, 1e-5)
    out_bf16, out_f32 = torch.empty(rows, dim, dtype=torch.bfloat16), torch.empty(rows, dim)
    assert lib is not None
    lib.add_rmsnorm(rows, dim, _p(residual), _p(delta) if with_delta else None, wide.stride(0), _p(weight), 1e-5,
                    _p(out_bf16), _p(out_f32))  # fmt: skip
    assert torch.equal(residual, want_sum), "the residual add is one float32 add, as torch's"
    torch.testing.assert_close(out_f32, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_bf16.float(), want.to(torch.bfloat16).float(), **BF16)


@pytest.mark.parametrize("rows, inter", [(1, 1536), (3, 37)])
def test_silu_and_mul_equals_the_reference(rows: int, inter: int) -> None:
    wide = (torch.randn(rows, 2 * inter + 3) * 4).to(torch.bfloat16)
    gate_up = wide[:, : 2 * inter]
    out = torch.empty(rows, inter, dtype=torch.bfloat16)
    assert lib is not None
    lib.silu_and_mul(rows, inter, _p(gate_up), wide.stride(0), _p(out))
    want = reference.silu_and_mul(gate_up.float()).to(torch.bfloat16)
    torch.testing.assert_close(out.float(), want.float(), **BF16)


@pytest.mark.parametrize("seq_lens, page", [([1], 16), ([17, 3, 32], 16), ([40, 1, 9], 8), ([250, 17], 16)])
@pytest.mark.parametrize("kv_heads, group, head_dim", [(1, 1, 64), (2, 3, 24), (3, 3, 64), (2, 4, 128)])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.int8])
def test_rope_store_attend_equals_the_references(
    seq_lens, page, kv_heads, group, head_dim, threads, portable, pool_dtype
) -> None:
    """Rotary on q and k (transformers' arithmetic), this step's K/V stored at each sequence's last position
    (a padded row with slot -1 stores nothing), attention over the context: as `reference.rotate`,
    `reference.store_kv` and `reference.paged_decode_attention`; on 1-3 threads (more than the (row, KV head)
    pairs too), each in its own scratch. A head_dim of whole 16-lane vectors takes the AVX-512 loop where the CPU
    has it (its own exp, 64-position chunks), others the portable one; `portable` runs the portable one for all.
    An int8 pool (codes and a scale a row, NaN scales where nothing may be read) stores the codes and scales the
    references store, and attends over them."""
    case = make_paged(seq_lens, page=page, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.float32)
    scales = want_scales = None
    if pool_dtype == torch.int8:
        poisoned = case.kv_cache.isnan().any(-1)
        codes, scales = quantize_rows(case.kv_cache.nan_to_num(0.0), torch.int8)
        case.kv_cache, scales = codes, scales.masked_fill(poisoned, float("nan"))
        want_scales = scales.clone()
    heads, rows = kv_heads * group, len(seq_lens)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(rows, width + 7).to(torch.bfloat16)[:, :width]
    angles = torch.rand(rows, head_dim // 2) * 6
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    slots = torch.tensor([int(case.block_tables[i, (n - 1) // page]) * page + (n - 1) % page
                          for i, n in enumerate(seq_lens)])  # fmt: skip
    slots[-1] = -1 if rows > 1 else slots[-1]  # the last row is padding: its slot holds the context's own key
    want_cache = case.kv_cache.clone()
    x = qkv.float().unflatten(-1, (-1, head_dim))
    qk = reference.rotate(x[:, : heads + kv_heads], cos, sin)
    reference.store_kv(qk[:, heads:], x[:, heads + kv_heads :], want_cache, case.layer, slots, want_scales)
    want = reference.paged_decode_attention(qk[:, :heads].contiguous(), want_cache, case.layer, case.block_tables,
                                            case.seq_lens, 0.3, kv_scales=want_scales)  # fmt: skip
    pool = case.kv_cache
    scratch = torch.full((threads * group * (max(seq_lens) + 2 * head_dim),), float("nan"))
    out = torch.empty(rows, heads * head_dim, dtype=torch.bfloat16)
    with _attention(portable):
        lib.rope_store_attend(rows, heads, kv_heads, head_dim, _p(qkv), qkv.stride(0), _p(cos), _p(sin), _p(pool),
                              *_pool_args(pool, scales), case.layer, _p(slots), _p(case.block_tables),
                              case.block_tables.shape[1], _p(case.seq_lens), page, 0.3, threads, _p(scratch),
                              _p(out))  # fmt: skip
    assert case.seq_lens.dtype == case.block_tables.dtype == torch.int32
    assert torch.equal(pool.float().nan_to_num(7.0), want_cache.float().nan_to_num(7.0)), "stored as the references"
    if scales is not None:
        assert torch.equal(scales.nan_to_num(7.0), want_scales.nan_to_num(7.0)), "scales stored as the references"
    torch.testing.assert_close(
        out.float().unflatten(-1, (heads, head_dim)), want.to(torch.bfloat16).float(), **ONE_BF16_STEP
    )


def _pool_args(pool: torch.Tensor, scales: torch.Tensor | None) -> tuple:
    """`rope_store_attend`'s pool arguments: the pool's strides, and an 8-bit pool's scales and their strides."""
    strides = (native_cpu.ctypes.c_int64 * 5)(*pool.stride()[:5])
    if scales is None:
        return strides, None, (native_cpu.ctypes.c_int64 * 5)()
    return strides, _p(scales), (native_cpu.ctypes.c_int64 * 5)(*scales.stride())


@contextlib.contextmanager
def _attention(portable: bool) -> Iterator[None]:
    """The attention loop `rope_store_attend` takes: the portable one for all, or the default choice."""
    assert lib is not None
    vector_loop = lib.attention_portable(int(portable))
    assert not (portable and vector_loop), "the switch took the AVX-512 loop out"
    assert portable or vector_loop == ("avx512f" in native_cpu._cpu_flags()), "AVX-512 CPUs take the vector loop"
    try:
        yield
    finally:
        lib.attention_portable(0)


@pytest.mark.parametrize("portable", [False, True])
def test_attention_keeps_a_nan_key_and_gives_zeros_over_no_positions(portable: bool) -> None:
    """A NaN in a context's K row reaches the output of the heads that read it (a corrupt cache shows), as in the
    scalar loop; a row over no positions gives zeros. Both loops, at a head_dim the AVX-512 loop takes."""
    kv_heads, group, head_dim, page = 2, 2, 64, 16
    case = make_paged([40, 1], page=page, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.float32)
    block = int(case.block_tables[0, 5 // page])
    case.kv_cache[block, case.layer, 0, 1, 5 % page, 3] = float("nan")  # sequence 0's position 5, KV head 1's key
    heads, pool = kv_heads * group, case.kv_cache
    qkv = torch.randn(2, (heads + 2 * kv_heads) * head_dim).to(torch.bfloat16)
    cos, sin = torch.ones(2, head_dim), torch.zeros(2, head_dim)
    slots, lens = torch.tensor([-1, -1]), torch.tensor([40, 0], dtype=torch.int32)
    scratch = torch.zeros(group * (40 + 2 * head_dim))
    out = torch.empty(2, heads * head_dim, dtype=torch.bfloat16)
    with _attention(portable):
        lib.rope_store_attend(2, heads, kv_heads, head_dim, _p(qkv), qkv.stride(0), _p(cos), _p(sin), _p(pool),
                              *_pool_args(pool, None), case.layer, _p(slots), _p(case.block_tables),
                              case.block_tables.shape[1], _p(lens), page, 0.125, 1, _p(scratch), _p(out))  # fmt: skip
    first = out[0].float().unflatten(-1, (kv_heads, group * head_dim))
    assert not first[0].isnan().any() and first[1].isnan().all()
    assert torch.equal(out[1].float(), torch.zeros(heads * head_dim))


def test_a_built_library_is_readable_by_every_user(tmp_path) -> None:
    """Built as root at image build time, it is loaded by the image's own user."""
    import stat

    path = native_cpu.build(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044
