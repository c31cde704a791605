"""The hybrid KV layout on CUDA (issue 27): the Triton kernels read the sliding layers' own pool through its
block tables (holes before the window read as block 0, never used), so Gemma 3 and gpt-oss give the same
greedy tokens with the layout as without it and as transformers, with prompts and outputs longer than the
window, chunked prefill, a prefix hit, n = 2 and a recompute preemption (the light scenario of
`test_model_families.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamd import LLM, SamplingParams
from tests.engine.test_model_families import BLOCK, _run, _saved, assert_hf_greedy, choice_tokens, scenario
from tests.helpers import register_engine

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _tokens(path: Path, disabled: bool, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    llm = LLM(str(path), device="cuda", dtype="float32", block_size=BLOCK, max_num_batched_tokens=16,
              num_kv_blocks=12, num_swap_blocks=0, watermark=0.0,
              disable_hybrid_kv_cache_manager=disabled)
    register_engine(llm.engine)
    assert (llm.engine.stats().kv.window_blocks_total > 0) == (not disabled)
    tokens = choice_tokens(_run(llm, prompts, params))
    sched = llm.engine.stats().scheduler  # (on CUDA the host tier's blocks let preemption swap)
    assert sched.preemptions_recompute + sched.preemptions_swap > 0, "the pool was never short"
    return tokens


@pytest.mark.parametrize("family", ["gemma3", "gpt-oss"])
def test_hybrid_layout_on_cuda_matches_the_plain_layout_and_hf(family: str, tmp_path: Path) -> None:
    path = _saved(family, tmp_path)
    distinct, prompts, params = scenario([37, 9, 26], 20)
    hybrid = _tokens(path, False, prompts, params)
    assert hybrid == _tokens(path, True, prompts, params)
    assert_hf_greedy(path, family, hybrid, distinct, 20)
