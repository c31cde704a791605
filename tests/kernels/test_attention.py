"""Triton paged attention (decode and prefill) against the references, on CPU through Triton's
interpreter: awkward context lengths, GQA ratios 1/3/7, every head dim, shuffled block tables, NaN in
every byte the kernels must not read, NaN-poisoned outputs so unwritten elements show."""

from __future__ import annotations

import pytest
import torch
from paged_testlib import assert_close, interpreter_runs_dynamic_loops, make_paged, naive_attention
from triton.runtime.interpreter import InterpretedFunction

import streamd.kernels as K
from streamd.kernels import reference as ref

pytestmark = pytest.mark.skipif(
    not interpreter_runs_dynamic_loops(), reason="this triton's interpreter cannot run data-dependent loops"
)

DECODE_CASES = [
    # dtype, page, num_kv_heads, group, head_dim
    (torch.float32, 16, 2, 1, 64),
    (torch.bfloat16, 8, 2, 3, 128),
    (torch.float16, 32, 1, 7, 80),
    (torch.bfloat16, 16, 2, 4, 96),
    (torch.float32, 128, 1, 2, 256),
    (torch.bfloat16, 64, 1, 7, 64),
]


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("dtype,page,num_kv_heads,group,head_dim", DECODE_CASES)
def test_decode_matches_reference(dtype, page, num_kv_heads, group, head_dim, num_splits):
    lens = [1, page - 1, page, page + 1, 2 * page + 3, 0]
    case = make_paged(lens, page=page, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, extra_cols=2)
    query = torch.randn(len(lens), num_kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    args = (query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, scale)
    out = K.paged_decode_attention(*args, out=_poisoned(query), num_splits=num_splits, block_n=16)
    assert out.dtype == dtype
    assert_close(out, ref.paged_decode_attention(*args), dtype, f"decode splits={num_splits}")
    assert torch.all(out[-1] == 0), "seq_len 0 must give zeros"


def test_decode_long_context_default_config_matches_dense():
    """Default tiles and the automatic split count (several partitions, partial last tiles)."""
    lens = [700, 3, 129, 0, 64]
    case = make_paged(lens, page=16, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    query = torch.randn(len(lens), 8, 128).to(torch.bfloat16)
    args = (query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, 128**-0.5)
    out = K.paged_decode_attention(*args, out=_poisoned(query))
    expect = naive_attention(query, case, [[n - 1] for n in lens], 128**-0.5)
    assert_close(out, expect, torch.bfloat16, "long decode")


@pytest.mark.parametrize("num_splits", [5, 16])
def test_decode_over_tables_far_wider_than_the_contexts_equals_the_reference(num_splits):
    """A decode graph captured for `max_model_len`: the split count follows the table's width and each sequence
    cuts its own context into the splits (partitions of at least 4 tiles), so the reduction must merge exactly the
    partitions each sequence wrote, short and long ones alike. (That the work spreads is a speed, measured in
    benchmarks/NOTES.md, not asserted here.)"""
    lens = [1, 15, 16, 17, 64, 65, 130, 333, 0]
    case = make_paged(lens, page=16, num_kv_heads=2, head_dim=64, dtype=torch.float32, extra_cols=60)
    query = torch.randn(len(lens), 6, 64)
    args = (query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, 64**-0.5)
    out = K.paged_decode_attention(*args, out=_poisoned(query), num_splits=num_splits, block_n=16)
    assert_close(out, ref.paged_decode_attention(*args), torch.float32, f"wide tables, splits={num_splits}")


def test_decode_over_wide_tables_with_a_window_equals_the_reference():
    lens = [1, 17, 40, 64, 65, 130, 333, 0]
    case = make_paged(lens, page=16, num_kv_heads=2, head_dim=64, dtype=torch.float32, extra_cols=60)
    query = torch.randn(len(lens), 6, 64)
    args = (query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, 64**-0.5)
    out = K.paged_decode_attention(*args, out=_poisoned(query), num_splits=6, block_n=16, sliding_window=100)
    assert_close(out, ref.paged_decode_attention(*args, sliding_window=100), torch.float32, "wide tables, window")


def test_decode_uses_strides_of_views():
    """A pool that is a slice of a wider tensor, a query sliced out of a fused QKV projection."""
    lens = [5, 33, 17]
    case = make_paged(lens, page=16, num_kv_heads=2, head_dim=80, dtype=torch.float32, head_dim_pad=48)
    assert not case.kv_cache.is_contiguous()
    qkv = torch.randn(3, 6 + 2 + 2, 80)
    query = qkv[:, :6]
    args = (query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, 0.1)
    out = K.paged_decode_attention(*args, out=_poisoned(query), num_splits=2, block_n=16)
    assert_close(out, ref.paged_decode_attention(*args), torch.float32, "strided decode")


PREFILL_CASES = [
    # dtype, page, num_kv_heads, group, head_dim, block_m, block_n
    (torch.float32, 16, 2, 1, 64, 16, 16),
    (torch.bfloat16, 8, 1, 3, 128, 32, 16),
    (torch.float16, 32, 1, 7, 80, 16, 32),
    (torch.bfloat16, 16, 2, 4, 96, None, None),
    (torch.float32, 128, 1, 2, 256, 16, 16),
]


@pytest.mark.parametrize("dtype,page,num_kv_heads,group,head_dim,block_m,block_n", PREFILL_CASES)
def test_prefill_matches_reference(dtype, page, num_kv_heads, group, head_dim, block_m, block_n):
    # Fresh prompts of awkward lengths, chunks over a cached prefix, single-token rows, an empty chunk.
    lens = [1, page - 1, page, page + 1, 70, 45, 20, 9]
    q_lens = [1, page - 1, page, page + 1, 70, 11, 1, 0]
    case = make_paged(lens, page=page, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), num_kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    args = (query, case.kv_cache, case.layer, case.block_tables, qsl, case.seq_lens, scale)
    out = K.paged_prefill_attention(*args, out=_poisoned(query), block_m=block_m, block_n=block_n)
    assert out.dtype == dtype
    assert_close(out, ref.paged_prefill_attention(*args), dtype, "prefill")


def test_prefill_takes_the_steps_kv_and_matches_the_reference_that_attends_over_it():
    """Given the step's stored K/V, the reference attends fresh sequences over them and the Triton kernel
    ignores them (it reads the pool): both still agree, beside a chunk over a cached prefix."""
    lens, q_lens, page = [9, 20, 17], [9, 20, 5], 8
    case = make_paged(lens, page=page, num_kv_heads=1, head_dim=32, dtype=torch.bfloat16)
    kv = case.kv_cache[:, case.layer]
    slots = [(int(case.block_tables[i, p // page]), p % page) for i, (n, q) in enumerate(zip(lens, q_lens))
             for p in range(n - q, n)]
    key = torch.stack([kv[b, 0, :, o] for b, o in slots])  # what a step would have stored there
    value = torch.stack([kv[b, 1, :, o] for b, o in slots])
    qsl = torch.tensor([0, 9, 29, 34], dtype=torch.int32)
    query = torch.randn(34, 3, 32).to(torch.bfloat16)
    args = (query, case.kv_cache, case.layer, case.block_tables, qsl, case.seq_lens, 0.2)
    out = K.paged_prefill_attention(*args, key=key, value=value, out=_poisoned(query), block_m=16, block_n=16)
    assert_close(out, ref.paged_prefill_attention(*args, key=key, value=value), torch.bfloat16, "prefill, step K/V")


def test_prefill_chunk_matches_dense_float64():
    """A long chunk after a long prefix: the unmasked and the causal phase both span many tiles."""
    lens, q_lens = [150, 37], [90, 37]
    case = make_paged(lens, page=16, num_kv_heads=1, head_dim=64, dtype=torch.float32)
    qsl = torch.tensor([0, 90, 127], dtype=torch.int32)
    query = torch.randn(127, 3, 64)
    args = (query, case.kv_cache, case.layer, case.block_tables, qsl, case.seq_lens, 0.125)
    out = K.paged_prefill_attention(*args, out=_poisoned(query), block_m=32, block_n=16)
    positions = [list(range(n - q, n)) for n, q in zip(lens, q_lens)]
    assert_close(out, naive_attention(query, case, positions, 0.125), torch.float32, "prefill chunk")


def test_prefill_padded_as_a_prefill_graph_pads_it_equals_the_unpadded_step():
    """The padding `cuda_graphs.PrefillGraphs` adds: tokens no sequence owns past the last start, and sequences
    without query tokens (`query_start_loc` repeating its last value, `seq_len` 0, a stale table row). The real
    rows come out as the unpadded step's, bit for bit (same tiles), and the kernel writes no padding row."""
    lens, q_lens, page = [40, 23, 5], [17, 23, 1], 16
    case = make_paged(lens, page=page, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
    n, pad_tokens, pad_seqs = sum(q_lens), 13, 4
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(n + pad_tokens, 4, 32).to(torch.bfloat16)
    padded_qsl = torch.cat([qsl, torch.full((pad_seqs,), n, dtype=torch.int32)])
    padded_lens = torch.cat([case.seq_lens, torch.zeros(pad_seqs, dtype=torch.int32)])
    padded_tables = torch.cat([case.block_tables, case.block_tables[:1].expand(pad_seqs, -1)])
    for ops in (K, ref):
        kwargs = {"block_m": 16, "block_n": 16} if ops is K else {}
        plain = ops.paged_prefill_attention(query[:n], case.kv_cache, case.layer, case.block_tables, qsl,
                                            case.seq_lens, 0.2, out=_poisoned(query[:n]), **kwargs)
        poisoned = _poisoned(query)
        padded = ops.paged_prefill_attention(query, case.kv_cache, case.layer, padded_tables, padded_qsl,
                                             padded_lens, 0.2, out=poisoned.clone(), **kwargs)
        assert torch.equal(padded[:n], plain), ops.__name__
        assert torch.equal(padded[n:].view(torch.int16), poisoned[n:].view(torch.int16)), ops.__name__


def test_prefill_of_one_token_equals_decode():
    lens = [1, 16, 40]
    case = make_paged(lens, page=16, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    query = torch.randn(3, 6, 64)
    qsl = torch.arange(4, dtype=torch.int32)
    pre = K.paged_prefill_attention(query, case.kv_cache, case.layer, case.block_tables, qsl, case.seq_lens, 0.1,
                                    out=_poisoned(query), block_m=16, block_n=16)
    dec = K.paged_decode_attention(query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, 0.1,
                                   out=_poisoned(query), num_splits=2, block_n=16)
    torch.testing.assert_close(pre, dec, atol=1e-5, rtol=1e-5)


def test_cpu_launches_go_through_the_interpreter(monkeypatch):
    import os

    launched: list[str] = []
    original = InterpretedFunction.run

    def spy(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", spy)
    case = make_paged([3, 20], page=16, num_kv_heads=1, head_dim=64, dtype=torch.float32)
    query = torch.randn(2, 2, 64)
    K.paged_decode_attention(query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, 0.1,
                             num_splits=2, block_n=16)
    assert launched == ["_decode_kernel", "_reduce_kernel"]
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
