"""Greedy tokens equal Hugging Face `generate` on the same weights, with continuous batching mixing
chunked prefills and decodes: the default model (float32) and random-weight models of real architectures."""

from __future__ import annotations

import pytest

from streamd import LLM, SamplingParams
from tests.helpers import fold_deltas, hf_greedy, random_engine_and_hf_twin, sizes, tiny_arch_config

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain PagedAttention in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish, French and German, and explain the differences in tone.",
    "Hi",
    "Tell me a story about a robot who learns to paint. Make it short but include a twist at the end, "
    "and give the robot a name that starts with Z.",
    "2+2=?",
]


def _run_staggered(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    """Adds half the requests, steps a little, adds the rest: prefills land while others decode."""
    engine = llm.engine
    builders: dict = {}
    half = len(prompts) // 2
    for i, ids in enumerate(prompts[:half]):
        engine.add_request(f"r{i}", ids, params)
    mixed_steps = 0
    for _ in range(3):
        fold_deltas(engine.step(), builders)
    for i, ids in enumerate(prompts[half:], start=half):
        engine.add_request(f"r{i}", ids, params)
    while engine.has_unfinished_requests():
        before = engine.stats()
        fold_deltas(engine.step(), builders)
        mixed_steps += before.scheduler.num_running > 0 and before.scheduler.num_waiting > 0
    assert mixed_steps > 0, "no step mixed waiting prefills with running decodes"
    return {rid: b.build().outputs[0].token_ids for rid, b in builders.items()}


# Light: every other chat (short and long prompts both); full (slow): all eight.
@pytest.mark.parametrize("chats", sizes(CHATS[::2], CHATS))
def test_default_model_matches_hf_generate(smol_llm: LLM, hf_smol, chats: list[str]) -> None:
    prompts = [smol_llm.engine.apply_chat_template([{"role": "user", "content": c}]) for c in chats]
    eos = smol_llm.tokenizer.eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=32)
    got = _run_staggered(smol_llm, prompts, params)
    for i, ids in enumerate(prompts):
        want = hf_greedy(hf_smol, ids, 32, eos)
        assert got[f"r{i}"] == want, f"prompt {i} ({chats[i]!r}) diverged from transformers"
    assert any(len(got[f"r{i}"]) == 32 for i in range(len(prompts)))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])  # GQA, QKV bias, q/k norm
def test_random_architectures_match_hf_generate(kind: str) -> None:
    config = tiny_arch_config(kind, hidden_size=128, intermediate_size=256, num_attention_heads=8, qwen3_head_dim=32)
    llm, reference, prompts = random_engine_and_hf_twin(config, perturb_seed=3, num_prompts=8, max_prompt_len=60,
                                                        num_kv_blocks=160, block_size=8, max_num_batched_tokens=48,
                                                        seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    got = _run_staggered(llm, prompts, params)
    for i, ids in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(reference, ids, 24, None), f"{kind}: prompt {i} diverged"
