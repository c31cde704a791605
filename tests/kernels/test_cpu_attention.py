"""The CPU's planned paged attention (`kernels/cpu_attention.py`) against the float64 spec and the reference, on
pools where everything it must not read is NaN (`paged_testlib.make_paged`): sequences of unequal lengths (a
padded batch), lengths one past a block and exactly a block, GQA groups, and a K/V store that skips slot -1."""

from __future__ import annotations

import pytest
import torch

from streamd.kernels import cpu_attention, reference
from tests.kernels.paged_testlib import assert_close, make_paged, naive_attention


@pytest.mark.parametrize("seq_lens, page", [([1], 16), ([17, 3, 32], 16), ([5, 5], 8), ([40, 1, 9, 16], 8)])
@pytest.mark.parametrize("num_kv_heads, group", [(1, 1), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planned_decode_equals_the_spec(seq_lens, page, num_kv_heads, group, dtype) -> None:
    case = make_paged(seq_lens, page=page, num_kv_heads=num_kv_heads, head_dim=32, dtype=dtype)
    query = torch.randn(len(seq_lens), num_kv_heads * group, 32).to(dtype)
    plan = cpu_attention.plan_decode(case.block_tables, case.seq_lens, cpu_attention.pool_rows(case.kv_cache))
    out = cpu_attention.decode_attention(query, case.layer, plan, 0.3)
    assert not out.isnan().any()  # padded positions read a written slot, never a stale NaN
    spec = naive_attention(query, case, [[n - 1] for n in seq_lens], 0.3)
    assert_close(out, spec.to(dtype), dtype)
    ref = reference.paged_decode_attention(query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, 0.3)
    assert_close(out, ref, dtype)


def test_a_batch_of_equal_lengths_needs_no_mask() -> None:
    tables = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    rows = cpu_attention.pool_rows(torch.zeros(4, 1, 2, 1, 16, 8))
    assert cpu_attention.plan_decode(tables, torch.tensor([20, 20], dtype=torch.int32), rows).mask is None
    assert cpu_attention.plan_decode(tables, torch.tensor([20, 19], dtype=torch.int32), rows).mask is not None


@pytest.mark.parametrize("slots", [[5, 17, 0, 31], [-1, 9, -1, 30]])
def test_planned_store_equals_the_reference(slots: list[int]) -> None:
    cache = torch.zeros(4, 2, 2, 3, 8, 4)  # [blocks, layers, k|v, kv_heads, page, head_dim]
    expected = cache.clone()
    key, value = torch.randn(4, 3, 4), torch.randn(4, 3, 4)
    slot_mapping = torch.tensor(slots)
    reference.store_kv(key, value, expected, 1, slot_mapping)
    cpu_attention.store_kv(key, value, 1, cpu_attention.plan_store(slot_mapping, cpu_attention.pool_rows(cache)))
    assert torch.equal(cache, expected)
