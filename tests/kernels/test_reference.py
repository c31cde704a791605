"""The plain-torch references (streamd.kernels.reference) against the spec: dense float64 attention
and explicit per-token loops. No Triton here; these run in well under a second each."""

from __future__ import annotations

import time

import pytest
import torch
from paged_testlib import assert_close, make_paged, naive_attention

from streamd.kernels import reference as ref


@pytest.mark.parametrize(
    "dtype,page,num_kv_heads,group,head_dim",
    [
        (torch.float32, 16, 2, 1, 64),
        (torch.bfloat16, 8, 1, 3, 80),
        (torch.float16, 32, 2, 7, 96),
        (torch.float32, 128, 1, 4, 256),
    ],
)
def test_decode_reference_matches_dense_float64(dtype, page, num_kv_heads, group, head_dim):
    lens = [1, page - 1, page, page + 1, 3 * page + 5, 0]
    case = make_paged(lens, page=page, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, extra_cols=2)
    # The reference must not dereference padded entries, whatever they hold.
    need = [-(-n // page) for n in lens]
    for i, n in enumerate(need):
        case.block_tables[i, n:] = torch.tensor([-7, 10**6] * 8, dtype=torch.int32)[: case.block_tables.shape[1] - n]
    h = num_kv_heads * group
    query = torch.randn(len(lens), h, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = ref.paged_decode_attention(query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, scale)
    assert out.dtype == dtype and out.shape == query.shape
    expect = naive_attention(query, case, [[n - 1] for n in lens], scale)
    assert_close(out, expect, dtype, "decode reference")
    assert torch.all(out[-1] == 0), "seq_len 0 must give zeros"


@pytest.mark.parametrize("step_kv", [False, True])
@pytest.mark.parametrize("dtype,page,group,head_dim", [(torch.float32, 16, 3, 64), (torch.bfloat16, 8, 7, 80),
                                                       (torch.float16, 8, 2, 64)])
def test_prefill_reference_matches_dense_float64(dtype, page, group, head_dim, step_kv):
    """With `step_kv` the step's K/V (what it stored) are handed over too: fresh sequences attend over them."""
    lens = [1, page - 1, page + 1, 40, 70, 9]
    q_lens = [1, page - 1, 5, 40, 1, 3]  # fresh prompts, a prefix-cached chunk, decode-like rows
    case = make_paged(lens, page=page, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), 2 * group, head_dim).to(dtype)
    scale = 0.7 * head_dim**-0.5
    kv = case.kv_cache[:, case.layer]
    slots = [(int(case.block_tables[i, p // page]), p % page) for i, (n, q) in enumerate(zip(lens, q_lens))
             for p in range(n - q, n)]
    step = {"key": torch.stack([kv[b, 0, :, o] for b, o in slots]),
            "value": torch.stack([kv[b, 1, :, o] for b, o in slots])} if step_kv else {}
    out = ref.paged_prefill_attention(query, case.kv_cache, case.layer, case.block_tables, qsl, case.seq_lens, scale,
                                      **step)
    positions = [list(range(n - q, n)) for n, q in zip(lens, q_lens)]
    assert_close(out, naive_attention(query, case, positions, scale), dtype, "prefill reference")


def test_store_kv_reference_matches_loop():
    kv = torch.randn(6, 3, 2, 2, 8, 64)
    expect = kv.clone()
    key, value = torch.randn(10, 2, 64), torch.randn(10, 2, 64)
    slots = torch.randperm(48)[:10]
    slots[[2, 5]] = -1
    ref.store_kv(key, value, kv, 2, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect[slot // 8, 2, 0, :, slot % 8] = key[t]
            expect[slot // 8, 2, 1, :, slot % 8] = value[t]
    assert torch.equal(kv, expect)


def test_copy_blocks_reference_matches_loop():
    kv = torch.randn(8, 2, 2, 3, 16, 64)
    expect = kv.clone()
    src, dst = torch.tensor([1, 1, 4]), torch.tensor([0, 6, 7])
    ref.copy_blocks(kv, src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        expect[d] = expect[s]
    assert torch.equal(kv, expect)


def test_decode_reference_is_fast_enough_on_cpu():
    """~100 sequences of ~500 tokens (SmolLM2-135M attention shapes), one layer, on CPU."""
    lens = torch.randint(400, 600, (100,)).tolist()
    case = make_paged(lens, page=16, num_kv_heads=3, head_dim=64, dtype=torch.float32, num_layers=1, layer=0)
    case.kv_cache.nan_to_num_(0.0)  # timing only
    query = torch.randn(100, 9, 64)
    args = (query, case.kv_cache, 0, case.block_tables, case.seq_lens, 0.125)
    ref.paged_decode_attention(*args)
    start = time.perf_counter()
    ref.paged_decode_attention(*args)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"decode reference took {elapsed:.3f} s per layer"


def test_prefill_reference_wants_the_steps_key_and_value_together():
    case = make_paged([4], page=8, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    query, qsl = torch.randn(4, 1, 16), torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="key and value together"):
        ref.paged_prefill_attention(query, case.kv_cache, case.layer, case.block_tables, qsl, case.seq_lens, 0.1,
                                    key=torch.randn(4, 1, 16))
