"""The transformers hook takes a layer's extras as transformers passes them and means what transformers
means: a Gemma 2 sliding-window layer (window, logit soft-capping, query_pre_attn_scalar scaling) and a
gpt-oss sliding-window layer (window, sinks), run through streamd's paged attention in two prompt chunks and
a decode step, equal the same modules run by transformers' eager attention over the whole sequence with
the mask transformers' masking_utils builds (`sliding_window_causal_mask_function`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import Gemma2Config, GptOssConfig
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2RotaryEmbedding
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

import streamd.kernels.reference as ref
from streamd.engine.worker.attention import (
    ATTN_IMPLEMENTATION,
    AttentionMetadata,
    LayerExtras,
    register_paged_attention,
    set_attention_metadata,
)

PAGE, WINDOW, TOKENS = 8, 7, 31
STEPS = [(0, 13), (13, 30), (30, 31)]  # a chunk, a chunk over earlier context, a decode
SHAPE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_hidden_layers": 1, "layer_types": ["sliding_attention"], "sliding_window": WINDOW}


def _gemma2() -> tuple[torch.nn.Module, torch.nn.Module]:
    config = Gemma2Config(**SHAPE, query_pre_attn_scalar=24, attn_logit_softcapping=2.0)
    return Gemma2Attention(config, layer_idx=0), Gemma2RotaryEmbedding(config)


def _gpt_oss() -> tuple[torch.nn.Module, torch.nn.Module]:
    attn = GptOssAttention(GptOssConfig(**SHAPE), layer_idx=0)
    torch.nn.init.normal_(attn.sinks, std=2.0)
    return attn, GptOssRotaryEmbedding(attn.config)


def _eager(attn: torch.nn.Module, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    attn.config._attn_implementation = "eager"
    idx = torch.arange(TOKENS)
    allowed = sliding_window_causal_mask_function(WINDOW)(0, 0, idx[:, None], idx[None, :])
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    return attn(hidden, cos_sin, mask)[0]


def _paged(attn: torch.nn.Module, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    register_paged_attention()
    attn.config._attn_implementation = ATTN_IMPLEMENTATION
    blocks = list(range(-(-TOKENS // PAGE), 0, -1))  # block 0 unused, the table reversed
    pool = torch.zeros(len(blocks) + 1, 1, 2, 2, PAGE, 16)
    rows = []
    for lo, hi in STEPS:
        set_attention_metadata(AttentionMetadata(
            kv_cache=pool, slot_mapping=torch.tensor([blocks[p // PAGE] * PAGE + p % PAGE for p in range(lo, hi)]),
            block_tables=torch.tensor([blocks], dtype=torch.int32), seq_lens=torch.tensor([hi], dtype=torch.int32),
            query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32), decode_only=hi - lo == 1, ops=ref))
        try:
            rows.append(attn(hidden[:, lo:hi], (cos_sin[0][:, lo:hi], cos_sin[1][:, lo:hi]), None)[0])
        finally:
            set_attention_metadata(None)
    return torch.cat(rows, dim=1)


def _eager_without_window(attn: torch.nn.Module, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, ...]) -> torch.Tensor:
    attn.config._attn_implementation = "eager"
    causal = torch.ones(TOKENS, TOKENS, dtype=torch.bool).tril()
    mask = torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)[None, None]
    return attn(hidden, cos_sin, mask)[0]


@pytest.mark.parametrize("family", [_gemma2, _gpt_oss], ids=["gemma2", "gpt_oss"])
@torch.no_grad()
def test_hook_equals_transformers_eager_on_windowed_layers(family: Callable[[], tuple[torch.nn.Module, ...]]):
    torch.manual_seed(0)
    attn, rotary = family()
    hidden = 3 * torch.randn(1, TOKENS, 64)
    cos_sin = rotary(hidden, torch.arange(TOKENS)[None])
    expect = _eager(attn, hidden, cos_sin)
    out = _paged(attn, hidden, cos_sin)
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)
    full = _eager_without_window(attn, hidden, cos_sin)
    assert (full - expect)[:, WINDOW:].abs().max() > 0.05, "the window changes nothing here: the test proves nothing"


def test_extras_from_transformers_keywords():
    sinks = torch.zeros(4)
    extras = LayerExtras.from_kwargs({"sliding_window": 4096, "softcap": 50.0, "s_aux": sinks, "position_ids": None})
    assert (extras.sliding_window, extras.softcap) == (4096, 50.0) and extras.sinks is sinks
    assert LayerExtras.from_kwargs({"sliding_window": None, "softcap": None}) == LayerExtras()
    assert LayerExtras.from_kwargs({}) == LayerExtras()
