"""The fresh-prefill shortcut: a sequence without earlier context (a fresh prompt's single chunk) attends over
the K/V its step just computed (`paged_attend` hands them to the prefill reference) instead of gathering them
back out of the pool. It must give what the gather gives, still write the pool (later decodes read it), and
be taken for every fresh sequence of any batch, decodes beside it included, on every layer path."""

from __future__ import annotations

import itertools

import pytest
import torch

import streamd.kernels.reference as ref
from streamd import SamplingParams
from streamd.engine.worker.attention import AttentionMetadata, paged_attention_forward
from streamd.engine.worker.fusion import fuse_layers
from tests.helpers import fold_deltas, hf_greedy, random_engine_and_hf_twin, step_until_idle, tiny_arch_config

PAGE, KV_HEADS, GROUP, HEAD_DIM, LAYERS = 8, 2, 3, 16, 2


class _Layer(torch.nn.Module):
    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx


def _metadata(lens: list[int], q_lens: list[int], dtype: torch.dtype) -> AttentionMetadata:
    """Reversed (non-contiguous) block tables; the pool holds random earlier context, block 0 stays unused."""
    tables, slots, next_block = [], [], 1
    for n, q in zip(lens, q_lens):
        blocks = list(range(next_block, next_block + -(-n // PAGE)))[::-1]
        next_block += len(blocks)
        tables.append(blocks + [0] * (4 - len(blocks)))
        slots += [blocks[p // PAGE] * PAGE + p % PAGE for p in range(n - q, n)]
    starts = [0, *itertools.accumulate(q_lens)]
    pool = torch.randn(next_block, LAYERS, 2, KV_HEADS, PAGE, HEAD_DIM).to(dtype)
    pool[0] = 0
    return AttentionMetadata(kv_cache=pool, slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables,
                             dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
                             query_start_loc=torch.tensor(starts, dtype=torch.int32), decode_only=False, ops=ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fresh_prefill_equals_the_gather_and_writes_the_pool(dtype, monkeypatch):
    lens, q_lens = [5, 19, 1, 16, 12], [5, 19, 1, 16, 3]  # four fresh prompts and a chunk after 9 cached tokens
    num_tokens = sum(q_lens)
    torch.manual_seed(0)
    query = torch.randn(1, KV_HEADS * GROUP, num_tokens, HEAD_DIM).to(dtype)
    key = torch.randn(1, KV_HEADS, num_tokens, HEAD_DIM).to(dtype)
    value = torch.randn(1, KV_HEADS, num_tokens, HEAD_DIM).to(dtype)
    md = _metadata(lens, q_lens, dtype)
    before = md.kv_cache.clone()
    monkeypatch.setattr("streamd.engine.worker.attention._context", md)
    out, _ = paged_attention_forward(_Layer(1), query, key, value, None, scaling=0.3)
    assert out.shape == (1, num_tokens, KV_HEADS * GROUP, HEAD_DIM) and out.dtype == dtype
    # The stored step's K/V, read back from the pool by the gather (no key/value given).
    gathered = ref.paged_prefill_attention(query[0].transpose(0, 1), md.kv_cache, 1, md.block_tables,
                                           md.query_start_loc, md.seq_lens, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[0], gathered, atol=tol, rtol=tol)
    written = (md.kv_cache != before).any(dim=(1, 2, 3, 4, 5))
    assert written[md.slot_mapping // PAGE].all(), "the fresh path must store K/V"


def _poisoning_spy(monkeypatch) -> list[int]:
    """Wraps the prefill reference: while it runs, the blocks of every fresh sequence hold NaN in the
    attended layer, so a fresh sequence that gathers from the pool yields NaN; its output must equal the
    gather of the untouched pool. Returns the per-call counts of fresh sequences with more than one query
    token in calls that also hold a sequence with earlier context (mixed batches)."""
    original = ref.paged_prefill_attention
    mixed: list[int] = []

    def spy(query, kv_cache, layer, block_tables, query_start_loc, seq_lens, scale, **kwargs):
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        q_lens = [b - a for a, b in zip(starts, starts[1:])]
        fresh = [i for i, (n, q) in enumerate(zip(lens, q_lens)) if n == q > 0]
        if fresh and len(fresh) < len(lens) and any(q_lens[i] > 1 for i in fresh):
            mixed.append(len(fresh))
        expect = original(query, kv_cache, layer, block_tables, query_start_loc, seq_lens, scale)
        saved = kv_cache[:, layer].clone()
        page = kv_cache.shape[4]
        for i in fresh:
            kv_cache[block_tables[i, :-(-lens[i] // page)].long(), layer] = float("nan")
        try:
            got = original(query, kv_cache, layer, block_tables, query_start_loc, seq_lens, scale, **kwargs)
        finally:
            kv_cache[:, layer] = saved
        torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5, msg="a fresh sequence gathered from the pool")
        return got

    monkeypatch.setattr(ref, "paged_prefill_attention", spy)
    return mixed


@pytest.mark.parametrize("mode", ["off", "compile"])  # (the fused kernel path stores the rotated key itself)
def test_a_fresh_prompt_beside_a_decode_attends_over_its_own_kv(mode, monkeypatch):
    """A prompt that arrives while another request decodes shares its batch: the fresh path is taken for it
    on the transformers hook ("off") and on both fused layer paths, and the tokens stay HF's."""
    config = tiny_arch_config("llama", hidden_size=96, intermediate_size=200, num_attention_heads=6,
                              qwen3_head_dim=24)
    llm, reference, _ = random_engine_and_hf_twin(config, perturb_seed=3, num_prompts=0, max_prompt_len=2,
                                                  num_kv_blocks=40, block_size=8, max_num_batched_tokens=64,
                                                  fuse_layers="off")
    engine = llm.engine
    torch._dynamo.reset()
    fuse_layers(engine.runner.model, mode, torch.device("cpu"), compile_backend="aot_eager")
    mixed = _poisoning_spy(monkeypatch)
    gen = torch.Generator().manual_seed(9)
    first, second = (torch.randint(10, config.vocab_size, (n,), generator=gen).tolist() for n in (11, 21))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
    engine.add_request("decoding", first, params)
    folded: dict = {}
    fold_deltas(engine.step(), folded)  # the first prompt's prefill; it decodes from the next step on
    engine.add_request("fresh", second, params)
    outs = step_until_idle(engine, folded)
    assert mixed, "no step held a fresh prompt beside a sequence with earlier context"
    for rid, ids in (("decoding", first), ("fresh", second)):
        assert outs[rid].outputs[0].token_ids == hf_greedy(reference, ids, 6), rid
