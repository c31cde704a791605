"""The CPU fresh-prefill path (`AttentionMetadata.fresh_query_starts`): a step of fresh prompts attends over
the K/V it just computed instead of reading them back from the pool. It must give what the paged path gives
and still write the pool (later decodes read it)."""

from __future__ import annotations

import itertools

import pytest
import torch

import streamd.kernels.reference as ref
from streamd.engine.attention import AttentionMetadata, paged_attention_forward

PAGE, KV_HEADS, GROUP, HEAD_DIM, LAYERS = 8, 2, 3, 16, 2


class _Layer(torch.nn.Module):
    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx


def _metadata(lens: list[int], dtype: torch.dtype, fresh: bool) -> AttentionMetadata:
    tables, slots, next_block = [], [], 1  # block 0 stays unused: a wrong read shows as zeros
    for n in lens:
        blocks = list(range(next_block, next_block + -(-n // PAGE)))[::-1]  # reversed: not contiguous
        next_block += len(blocks)
        tables.append(blocks + [0] * (4 - len(blocks)))
        slots += [blocks[p // PAGE] * PAGE + p % PAGE for p in range(n)]
    starts = [0, *itertools.accumulate(lens)]
    pool = torch.zeros(next_block, LAYERS, 2, KV_HEADS, PAGE, HEAD_DIM, dtype=dtype)
    return AttentionMetadata(kv_cache=pool, slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables,
                             dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
                             query_start_loc=torch.tensor(starts, dtype=torch.int32), decode_only=False, ops=ref,
                             fresh_query_starts=starts if fresh else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prefill_equals_paged_and_writes_the_pool(dtype, monkeypatch):
    lens = [5, 19, 1, 16]
    num_tokens = sum(lens)
    torch.manual_seed(0)
    query = torch.randn(1, KV_HEADS * GROUP, num_tokens, HEAD_DIM).to(dtype)
    key = torch.randn(1, KV_HEADS, num_tokens, HEAD_DIM).to(dtype)
    value = torch.randn(1, KV_HEADS, num_tokens, HEAD_DIM).to(dtype)
    outs, pools = [], []
    for fresh in (True, False):
        md = _metadata(lens, dtype, fresh)
        monkeypatch.setattr("streamd.engine.attention._context", md)
        out, _ = paged_attention_forward(_Layer(1), query, key, value, None, scaling=0.3)
        outs.append(out)
        pools.append(md.kv_cache)
    assert outs[0].shape == (1, num_tokens, KV_HEADS * GROUP, HEAD_DIM)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
    assert torch.equal(pools[0], pools[1]) and pools[0][:, 1].abs().sum() > 0, "the fresh path must store K/V"
