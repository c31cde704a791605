"""The compiled Triton kernels on a CUDA GPU: agreement with the references at realistic sizes,
exact cache operations, and CUDA-graph capture (which fails on any host synchronisation)."""

from __future__ import annotations

import pytest
import torch
from paged_testlib import assert_close, make_paged

import streamd.kernels as K
from streamd.kernels import reference as ref

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEV = "cuda"


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.parametrize(
    "dtype,page,num_kv_heads,group,head_dim",
    [
        (torch.bfloat16, 16, 8, 4, 128),
        (torch.bfloat16, 16, 8, 4, 64),
        (torch.float16, 32, 2, 7, 80),
        (torch.bfloat16, 8, 3, 3, 96),
        (torch.float32, 128, 2, 1, 256),
        (torch.bfloat16, 64, 1, 8, 256),
    ],
)
def test_decode_cuda_matches_reference(dtype, page, num_kv_heads, group, head_dim, num_splits):
    lens = [1, page - 1, page, page + 1, 1000, 3000, 0, 257] + torch.randint(1, 2000, (8,)).tolist()
    case = make_paged(lens, page=page, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=DEV,
                      extra_cols=3)
    query = torch.randn(len(lens), num_kv_heads * group, head_dim, device=DEV).to(dtype)
    args = (query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, head_dim**-0.5)
    out = K.paged_decode_attention(*args, out=_poisoned(query), num_splits=num_splits)
    torch.cuda.synchronize()
    assert_close(out, ref.paged_decode_attention(*args), dtype, f"cuda decode splits={num_splits}")
    assert torch.all(out[6] == 0)


@pytest.mark.parametrize(
    "dtype,page,num_kv_heads,group,head_dim",
    [
        (torch.bfloat16, 16, 8, 4, 128),
        (torch.bfloat16, 16, 8, 4, 64),
        (torch.float16, 32, 2, 7, 80),
        (torch.bfloat16, 8, 3, 3, 96),
        (torch.float32, 128, 2, 1, 256),
        (torch.bfloat16, 64, 1, 8, 256),
    ],
)
def test_prefill_cuda_matches_reference(dtype, page, num_kv_heads, group, head_dim):
    lens = [1, page - 1, page + 1, 700, 1500, 300, 90, 1024]
    q_lens = [1, page - 1, page + 1, 700, 200, 1, 90, 513]  # prompts, prefix-cached chunks, single rows
    case = make_paged(lens, page=page, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=DEV)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    query = torch.randn(int(qsl[-1]), num_kv_heads * group, head_dim, device=DEV).to(dtype)
    args = (query, case.kv_cache, case.layer, case.block_tables, qsl, case.seq_lens, head_dim**-0.5)
    out = K.paged_prefill_attention(*args, out=_poisoned(query))
    torch.cuda.synchronize()
    assert_close(out, ref.paged_prefill_attention(*args), dtype, "cuda prefill")


def test_cache_ops_cuda_exact():
    kv = torch.randn(50, 4, 2, 8, 16, 128, device=DEV, dtype=torch.bfloat16)
    expect = kv.clone()
    qkv = torch.randn(300, 48, 128, device=DEV, dtype=torch.bfloat16)
    key, value = qkv[:, 32:40], qkv[:, 40:]
    slots = torch.randperm(50 * 16, device=DEV)[:300]
    slots[::7] = -1
    K.store_kv(key, value, kv, 2, slots)
    ref.store_kv(key, value, expect, 2, slots)
    src = torch.tensor([3, 3, 9, 11], device=DEV)
    dst = torch.tensor([0, 1, 40, 49], device=DEV)
    K.copy_blocks(kv, src, dst)
    ref.copy_blocks(expect, src, dst)
    torch.cuda.synchronize()
    assert torch.equal(kv, expect)
    # float32 -> bf16 store rounds like torch on the GPU.
    k32, v32 = torch.randn(20, 8, 128, device=DEV), torch.randn(20, 8, 128, device=DEV)
    s = torch.arange(20, device=DEV) * 3
    K.store_kv(k32, v32, kv, 0, s)
    ref.store_kv(k32, v32, expect, 0, s)
    assert torch.equal(kv, expect)


def test_decode_and_prefill_capture_in_cuda_graphs():
    """Capture with one batch, replay with other lengths and tables: no host sync, no stale shapes."""
    page, hkv, group, d = 16, 8, 4, 128
    lens_a = [5, 300, 17, 1]
    lens_b = [290, 2, 0, 64]
    case = make_paged([320] * 4, page=page, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, device=DEV)
    case.kv_cache.nan_to_num_(0.0)
    tables, seq_lens = case.block_tables.clone(), torch.tensor(lens_a, dtype=torch.int32, device=DEV)
    query = torch.randn(4, hkv * group, d, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    qsl = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32, device=DEV)
    out_p = torch.empty_like(query)

    def step() -> None:
        K.paged_decode_attention(query, case.kv_cache, case.layer, tables, seq_lens, d**-0.5, out=out)
        K.paged_prefill_attention(query, case.kv_cache, case.layer, tables, qsl, seq_lens, d**-0.5, out=out_p)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in (lens_a, lens_b):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        tables.copy_(tables[torch.randperm(4, device=DEV)])
        query.normal_()
        out.fill_(float("nan"))
        out_p.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expect = ref.paged_decode_attention(query, case.kv_cache, case.layer, tables, seq_lens, d**-0.5)
        assert_close(out, expect, torch.bfloat16, f"graph decode {lens}")
        assert_close(out_p, expect, torch.bfloat16, f"graph prefill {lens}")


EXTRAS = [
    # window, softcap, sinks: Mistral's window, Gemma 2's (window 4096 and cap 50 with a narrower window
    # here), gpt-oss's window 128 with sinks, sinks alone
    (4096, None, False),
    (1000, 50.0, False),
    (128, None, True),
    (None, 30.0, True),
]


@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.parametrize("window,softcap,sinks_on", EXTRAS)
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(8, 4, 128), (8, 8, 64)])
def test_decode_cuda_with_extras_matches_reference(num_kv_heads, group, head_dim, window, softcap, sinks_on,
                                                   num_splits):
    dtype, page = torch.bfloat16, 16
    lens = [1, 127, 128, 129, 1000, 3000, 0, 5000] + torch.randint(1, 6000, (8,)).tolist()
    case = make_paged(lens, page=page, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=DEV)
    query = (3 * torch.randn(len(lens), num_kv_heads * group, head_dim, device=DEV)).to(dtype)
    kw = {"sliding_window": window, "softcap": softcap,
          "sinks": torch.randn(num_kv_heads * group, device=DEV).to(dtype) if sinks_on else None}
    args = (query, case.kv_cache, case.layer, case.block_tables, case.seq_lens, head_dim**-0.5)
    out = K.paged_decode_attention(*args, **kw, out=_poisoned(query), num_splits=num_splits)
    torch.cuda.synchronize()
    assert_close(out, ref.paged_decode_attention(*args, **kw), dtype, f"cuda decode {window} {softcap} {sinks_on}")
    assert torch.all(out[6] == 0)


@pytest.mark.parametrize("window,softcap,sinks_on", EXTRAS)
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(8, 4, 128), (8, 8, 64)])
def test_prefill_cuda_with_extras_matches_reference(num_kv_heads, group, head_dim, window, softcap, sinks_on):
    dtype, page = torch.bfloat16, 16
    lens = [1, 15, 17, 700, 1500, 300, 90, 5000, 4500]
    q_lens = [1, 15, 17, 700, 200, 1, 90, 513, 4500]  # prompts, chunks over earlier context, single rows
    case = make_paged(lens, page=page, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=DEV)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    query = (3 * torch.randn(int(qsl[-1]), num_kv_heads * group, head_dim, device=DEV)).to(dtype)
    kw = {"sliding_window": window, "softcap": softcap,
          "sinks": torch.randn(num_kv_heads * group, device=DEV).to(dtype) if sinks_on else None}
    args = (query, case.kv_cache, case.layer, case.block_tables, qsl, case.seq_lens, head_dim**-0.5)
    out = K.paged_prefill_attention(*args, **kw, out=_poisoned(query))
    torch.cuda.synchronize()
    assert_close(out, ref.paged_prefill_attention(*args, **kw), dtype, f"cuda prefill {window} {softcap} {sinks_on}")


def test_extras_capture_in_cuda_graphs():
    """A windowed, capped layer with sinks replays in a graph with other lengths (the window's start moves)."""
    page, hkv, group, d = 16, 8, 8, 64
    case = make_paged([3000] * 4, page=page, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, device=DEV)
    case.kv_cache.nan_to_num_(0.0)
    seq_lens = torch.tensor([5, 3000, 129, 1], dtype=torch.int32, device=DEV)
    query = torch.randn(4, hkv * group, d, device=DEV, dtype=torch.bfloat16)
    kw = {"sliding_window": 128, "softcap": 30.0, "sinks": torch.randn(hkv * group, device=DEV)}
    out, out_p = torch.empty_like(query), torch.empty_like(query)
    qsl = torch.arange(5, dtype=torch.int32, device=DEV)

    def step() -> None:
        K.paged_decode_attention(query, case.kv_cache, case.layer, case.block_tables, seq_lens, 0.125, **kw, out=out)
        K.paged_prefill_attention(query, case.kv_cache, case.layer, case.block_tables, qsl, seq_lens, 0.125, **kw,
                                  out=out_p)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([5, 3000, 129, 1], [2999, 0, 128, 1500]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        query.normal_()
        out.fill_(float("nan"))
        out_p.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expect = ref.paged_decode_attention(query, case.kv_cache, case.layer, case.block_tables, seq_lens, 0.125, **kw)
        assert_close(out, expect, torch.bfloat16, f"graph decode {lens}")
        assert_close(out_p, expect, torch.bfloat16, f"graph prefill {lens}")
