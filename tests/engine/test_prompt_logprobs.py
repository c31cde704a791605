"""Prompt logprobs (`SamplingParams.prompt_logprobs`, vLLM's name): for every prompt position p >= 1 the
logprob of prompt token p given the tokens before it, and the top k alternatives, delivered with the first
output. Checked against an independent reference: a plain Hugging Face float32 forward over the prompt
(log_softmax of the logits at position p - 1, gathered at token p)."""

from __future__ import annotations

import pytest
import torch

from streamd import LLM, SamplingParams
from streamd.engine.errors import RequestError

# Both sides run the same float32 weights on the CPU; the paged attention sums in another order.
TOLERANCE = 1e-3


@torch.inference_mode()
def reference(hf_model, ids: list[int], k: int) -> tuple[list[float], list[list[int]]]:
    """Per prompt position 1..: the prompt token's logprob and the ids of the top k."""
    logits = hf_model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[:-1]
    targets = torch.tensor(ids[1:])
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    return chosen, logprobs.topk(k, dim=-1).indices.tolist()


def prompt_of(llm: LLM, num_tokens: int, seed: int) -> list[int]:
    text = " ".join(f"word{(seed * 7919 + i * 104729) % 1000}" for i in range(num_tokens))
    return list(llm.engine.tokenizer(text).input_ids[:num_tokens])


def check(out, hf_model, ids: list[int], k: int) -> None:
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids)
    assert entries[0] is None
    chosen, top_ids = reference(hf_model, ids, k)
    for p in range(1, len(ids)):
        entry = entries[p]
        assert entry is not None and ids[p] in entry
        assert entry[ids[p]] == pytest.approx(chosen[p - 1], abs=TOLERANCE), p
        ranked = list(entry)[:k]
        assert ranked == top_ids[p - 1][:len(ranked)] and len(ranked) >= k - (ids[p] in top_ids[p - 1][:k]), p


@pytest.mark.parametrize("num_tokens", [1, 2, 40])
def test_prompt_logprobs_match_a_plain_forward(smol_llm: LLM, hf_smol, num_tokens: int) -> None:
    ids = prompt_of(smol_llm, num_tokens, seed=num_tokens)
    out = smol_llm.generate([ids], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3))[0]
    check(out, hf_smol, ids, 3)
    assert len(out.outputs[0].token_ids) == 3


def test_chunked_prefill_gives_the_same_prompt_logprobs(smol_llm: LLM, hf_smol) -> None:
    """The shared engine runs at most 256 tokens a step: this prompt spans two chunks."""
    assert smol_llm.engine.config.scheduler.max_num_batched_tokens == 256
    ids = prompt_of(smol_llm, 300, seed=3)
    assert len(ids) == 300
    out = smol_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    check(out, hf_smol, ids, 2)


def test_a_prompt_behind_another_in_its_step_gets_its_own_rows(smol_llm: LLM, hf_smol) -> None:
    """Both prompts are prefilled in one step, the one that asks second: its rows start after the first's."""
    first, second = prompt_of(smol_llm, 30, seed=8), prompt_of(smol_llm, 40, seed=9)
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, prompt_logprobs=2)]
    plain, asked = smol_llm.generate([first, second], params)
    assert plain.prompt_logprobs is None
    check(asked, hf_smol, second, 2)


def test_small_chunks_agree_with_one_chunk(smol_llm: LLM) -> None:
    small = LLM(device="cpu", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, num_swap_blocks=0,
                quantization="none")
    ids = prompt_of(smol_llm, 50, seed=5)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=4)
    chunked = small.generate([ids], params)[0].prompt_logprobs
    whole = smol_llm.generate([ids], params)[0].prompt_logprobs
    assert chunked is not None and whole is not None and chunked[0] is None
    for a, b in zip(chunked[1:], whole[1:]):
        assert a is not None and b is not None and list(a)[:4] == list(b)[:4]
        assert all(a[t] == pytest.approx(b[t], abs=TOLERANCE) for t in b)


def test_a_prefix_cached_prompt_still_gets_every_position(smol_llm: LLM, hf_smol) -> None:
    ids = prompt_of(smol_llm, 70, seed=11)
    smol_llm.generate([ids], SamplingParams(max_tokens=1))  # caches the prompt's full blocks
    out = smol_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert out.num_cached_tokens == 0  # it took no prefix hit: every position was computed
    check(out, hf_smol, ids, 1)
    again = smol_llm.generate([ids], SamplingParams(max_tokens=1))[0]
    assert again.num_cached_tokens >= 64  # and its blocks serve later requests


def test_zero_gives_the_prompt_token_only(smol_llm: LLM) -> None:
    ids = prompt_of(smol_llm, 8, seed=2)
    out = smol_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs is not None
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in ids[1:]]


def test_without_it_there_are_none(smol_llm: LLM) -> None:
    assert smol_llm.generate("Hello there", SamplingParams(max_tokens=1))[0].prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 2.5, True])
def test_admission_bounds_it_as_logprobs(smol_llm: LLM, value) -> None:
    with pytest.raises(RequestError, match="prompt_logprobs"):
        smol_llm.generate("Hello", SamplingParams(max_tokens=1, prompt_logprobs=value))


def test_beam_search_refuses_it() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(use_beam_search=True, beam_width=2, prompt_logprobs=1)


def test_they_cross_the_process_wire() -> None:
    """The process layout carries them (the codec derives from the records' fields)."""
    from streamd.engine.client.loop import STEP_BATCH_WIRE, StepBatch
    from streamd.engine.outputs import CompletionDelta, RequestDelta, RequestUpdate, SeqUpdate

    entries = [None, {5: -0.25, 9: -1.5}]
    batch = StepBatch(
        deltas=[RequestDelta("a", 2, [CompletionDelta(0, "x", [3])], prompt_logprobs=entries)],
        updates=[RequestUpdate("b", [SeqUpdate(0, [3])], prompt_logprobs=entries)],
    )
    back = STEP_BATCH_WIRE.decode(STEP_BATCH_WIRE.encode(batch))
    assert back.deltas[0].prompt_logprobs == entries and back.updates[0].prompt_logprobs == entries


def test_parallel_samples_share_one_prompt_logprobs(smol_llm: LLM) -> None:
    ids = prompt_of(smol_llm, 12, seed=4)
    out = smol_llm.generate([ids], SamplingParams(n=2, max_tokens=2, seed=1, prompt_logprobs=1))[0]
    assert len(out.outputs) == 2 and out.prompt_logprobs is not None and len(out.prompt_logprobs) == 12
