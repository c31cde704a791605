"""A draft model proposes the drafts (`speculative.draft_model`, engine/worker/draft_model.py): the tokens are
transformers' greedy `generate` of the target whatever the draft (the target itself: nearly every draft kept;
another random model: few kept), sampled requests end right, requests that read their history never draft,
no draft cache outlives its sequence (finished, preempted, aborted), and a cache rolled back to the kept
tokens proposes the draft's own greedy tokens. A draft with another tokenizer is
refused at load, naming the key. Random-weight tiny Llamas saved as model directories, CPU float32."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamd import LLM, SamplingParams
from streamd.config import ConfigError, SpeculativeConfig
from streamd.engine.core.step_cost import StepCost
from streamd.engine.worker.draft_model import DraftModel
from tests.helpers import (
    hf_greedy,
    random_prompt,
    register_engine,
    run_to_completion,
    save_random_checkpoint,
    sizes,
    tiny_config,
)

VOCAB = 300



@pytest.fixture(autouse=True)
def unmeasured_row_price(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft row's price comes from measured step times (`StepCost.row_cost`); these tests check what drafts do,
    not how many pay off (tests/engine/core/test_speculation.py), so the price stays the unmeasured default."""
    monkeypatch.setattr(StepCost, "row_cost", lambda self, tokens: None)

@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_checkpoint(tiny_config(), tmp_path_factory.mktemp("target"), seed=3)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller random model over the same vocabulary (one layer, hidden 32): it rarely agrees."""
    config = tiny_config(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    return save_random_checkpoint(config, tmp_path_factory.mktemp("draft"), seed=11)


@pytest.fixture(scope="module")
def reference(target: Path):
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    return model


def _llm(target: Path, draft: Path, **overrides) -> LLM:
    base = dict(device="cpu", dtype="float32", block_size=8, num_swap_blocks=0, watermark=0.0, seed=5)
    llm = LLM(str(target), draft_model=str(draft), **{**base, **overrides})
    register_engine(llm.engine)
    return llm


def _greedy(max_tokens: int, **changes) -> SamplingParams:
    fields = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "detokenize": False, **changes}
    return SamplingParams(**fields)


def _draft(llm: LLM) -> DraftModel:
    source = llm.engine.scheduler.speculator.draft_source
    assert isinstance(source, DraftModel)
    return source


def _counts(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.stats().scheduler
    return stats.spec_draft_tokens, stats.spec_accepted_tokens


# (prompt lengths, max_tokens): light in `make test`, full (slow) in `make test-all`.
SHAPES = sizes(([13, 21, 6], 24), ([13, 21, 6, 40], 100))  # (at most disable_by_batch_size: 4)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_target_as_its_own_draft_keeps_nearly_every_draft_and_hf_s_tokens(target, reference, shape) -> None:
    lengths, max_tokens = shape
    llm = _llm(target, target)
    prompts = [random_prompt(i, n) for i, n in enumerate(lengths)]
    outs = run_to_completion(llm.engine, prompts, _greedy(max_tokens))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, max_tokens)
    drafted, accepted = _counts(llm)
    assert accepted >= 0.9 * drafted  # the same model: only float ties could refuse a draft
    assert accepted >= len(prompts) * max_tokens // 2  # most tokens came as accepted drafts
    assert _draft(llm).cached_sequences == []


def test_another_draft_is_mostly_refused_and_changes_no_token(target, other_draft, reference) -> None:
    llm = _llm(target, other_draft)
    prompts = [random_prompt(20 + i, n) for i, n in enumerate([17, 9])]
    outs = run_to_completion(llm.engine, prompts, _greedy(30))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 30)
    drafted, accepted = _counts(llm)
    assert drafted > 0 and accepted < drafted / 2


def test_sampled_and_parallel_requests_draft_and_end_right(target) -> None:
    llm = _llm(target, target)
    # (temperature 0.05: the random model's flat logits, sharpened, so its own greedy drafts are likely kept)
    params = SamplingParams(n=2, temperature=0.05, top_k=20, max_tokens=30, ignore_eos=True, detokenize=False)
    out = run_to_completion(llm.engine, [random_prompt(30, 11)], params)[0]
    assert [len(c.token_ids) for c in out.outputs] == [30, 30]
    drafted, accepted = _counts(llm)
    assert accepted > 0 and drafted > 0
    assert _draft(llm).cached_sequences == []


def test_requests_that_read_their_history_never_ask_the_draft(target) -> None:
    llm = _llm(target, target)
    prompt = random_prompt(31, 10)
    for params in (_greedy(10, repetition_penalty=1.3), _greedy(10, temperature=0.7, seed=3)):
        run_to_completion(llm.engine, [prompt], params)
    assert _counts(llm) == (0, 0)


def test_a_step_above_the_batch_cut_off_does_not_draft(target) -> None:
    llm = _llm(target, target, disable_by_batch_size=2)
    prompts = [random_prompt(40 + i, 9) for i in range(3)]
    run_to_completion(llm.engine, prompts, _greedy(12))
    assert _counts(llm) == (0, 0)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_abort_leave_no_draft_cache_and_no_block(target, other_draft, reference, mode) -> None:
    """A pool too small for three requests: preempted while drafting, tokens still HF's; then a request
    aborted mid-way. Every draft cache is gone (a preempted sequence's at once) and every block is free."""
    llm = _llm(target, other_draft, num_kv_blocks=14, num_swap_blocks=40, preemption_mode=mode)
    engine, draft = llm.engine, _draft(llm)
    preempted = _watch_preemptions(engine, draft)
    prompts = [random_prompt(50 + i, 14) for i in range(3)]
    outs = run_to_completion(engine, prompts, _greedy(24))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 24)
    stats = engine.stats().scheduler
    assert stats.preemptions_swap + stats.preemptions_recompute > 0 and stats.spec_draft_tokens > 0
    assert preempted and not any(seq_id in draft.cached_sequences for seq_id in preempted)
    engine.add_request("cut", random_prompt(60, 12), _greedy(80))
    for _ in range(4):
        engine.step()
    assert draft.cached_sequences  # it drafted
    engine.abort("cut")
    while engine.has_unfinished_requests():
        engine.step()
    assert draft.cached_sequences == []  # (and conftest's leak check: every block free)


def _watch_preemptions(engine, draft: DraftModel) -> list[int]:
    """The sequences preempted from now on, each checked to hold no draft cache right after its preemption."""
    preempted: list[int] = []
    scheduler, original = engine.scheduler, engine.scheduler._preempt

    def preempt(group, out, recompute=False):
        original(group, out, recompute)
        for seq in group.seqs:
            assert seq.seq_id not in draft.cached_sequences
            preempted.append(seq.seq_id)

    scheduler._preempt = preempt
    return preempted


def test_the_kv_pool_reserves_what_full_draft_caches_hold(target) -> None:
    """`max_cache_bytes` (left beside the KV pool on CUDA) covers `max_sequences` caches filled to the draft's
    context: a full one holds `max_len` - 1 tokens (the last draft is never fed), the bound `max_len`."""
    model = _draft(_llm(target, target)).model
    draft = DraftModel(model, VOCAB, 24, 2)
    for seq_id in (1, 2):
        draft.propose(seq_id, random_prompt(80 + seq_id, 20), 8)  # 20 + 4 drafts = the context of 24 tokens
    held = sum(
        t.numel() * t.element_size()
        for kv in draft._caches.values()
        for layer in kv.cache.layers
        for t in (layer.keys, layer.values)
    )
    assert held == draft.max_cache_bytes() * 23 // 24 > 0


def test_a_draft_cache_rolled_back_proposes_as_a_fresh_one(target) -> None:
    """After refused drafts the cache is cropped to the kept tokens: the next proposal is what a draft with
    no cache proposes for the same tokens; the least recently used cache goes past the bound."""
    llm = _llm(target, target)
    model = _draft(llm).model
    warm = DraftModel(model, VOCAB, 512, 2)
    tokens = random_prompt(70, 15)
    drafts = warm.propose(1, tokens, 6)
    assert len(drafts) == 6
    for kept in (tokens + drafts[:2] + [(drafts[2] + 1) % VOCAB], tokens[:9]):  # two kept and one refused; rolled back
        assert warm.propose(1, kept, 5) == DraftModel(model, VOCAB, 512, 2).propose(1, kept, 5)
    warm.propose(3, tokens, 2)
    warm.propose(4, tokens, 2)
    assert warm.cached_sequences == [3, 4]
    assert warm.propose(1, tokens, 1) == drafts[:1]  # rebuilt from the tokens
    for seq_id in (1, 3, 4):
        warm.forget(seq_id)
    assert warm.cached_sequences == []


@pytest.mark.parametrize("family", ["llama", "mistral-window", "gemma2"])
def test_proposals_are_the_draft_s_own_greedy_tokens_across_rollbacks(family: str) -> None:
    """Whatever the sequence did to the last drafts (kept, refused, a longer run), the next proposal is what
    transformers' `generate` of the draft gives (sliding windows and soft caps included)."""
    from tests.engine.test_model_families import family_config

    config = tiny_config() if family == "llama" else family_config(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    draft = DraftModel(model, config.vocab_size, 256, 1)
    tokens = random_prompt(72, 30)
    for sequence in (tokens, tokens + [5, 6], tokens[:25] + [9], tokens + [5, 6, 7, 8, 9, 10, 11]):
        assert draft.propose(1, sequence, 6) == hf_greedy(model, sequence, 6)
    draft.forget(1)


def test_a_draft_never_proposes_past_its_context_or_the_target_s_vocabulary(target) -> None:
    model = _draft(_llm(target, target)).model
    tokens = random_prompt(71, 20)
    assert len(DraftModel(model, VOCAB, 22, 1).propose(1, tokens, 8)) == 2
    assert DraftModel(model, VOCAB, 20, 1).propose(1, tokens, 8) == []
    assert DraftModel(model, 0, 512, 1).propose(1, tokens, 8) == []  # every id past a vocabulary of 0


def test_a_draft_with_another_vocabulary_is_refused_at_load(target, tmp_path: Path) -> None:
    smaller = save_random_checkpoint(tiny_config(vocab_size=200), tmp_path / "other", seed=1)
    with pytest.raises(ConfigError, match=r"speculative\.draft_model .*tokenizer"):
        LLM(str(target), draft_model=str(smaller), device="cpu", dtype="float32", num_swap_blocks=0)


def test_draft_model_is_validated() -> None:
    SpeculativeConfig(draft_model="").validate()
    with pytest.raises(ConfigError, match=r"speculative\.draft_model"):
        dataclasses.replace(SpeculativeConfig(), draft_model=" ./draft").validate()


def test_the_default_model_drafting_for_itself_keeps_chat_and_structured_tokens(smol_llm: LLM, hf_smol) -> None:
    """A real model and a structured output, whose verify rows its grammar masks: the tokens of speculation
    off; the chat's drafts nearly all kept (the structured one's fewer: the draft does not know the grammar).
    The draft is transformers' copy of the engine's weights, put in the shared engine's speculator a while."""
    from streamd.engine.sampling_params import StructuredOutputs

    engine = smol_llm.engine
    speculator = engine.scheduler.speculator
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    cases = [("Write a short poem about the sea.", None), ("Give a JSON object naming a city in France.", schema)]
    draft = DraftModel(hf_smol, engine.vocab_size, engine.max_model_len, 8)
    for question, spec in cases:
        prompt = engine.apply_chat_template([{"role": "user", "content": question}])
        params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=spec and StructuredOutputs(json=spec))
        off = run_to_completion(engine, [prompt], params)[0].outputs[0]
        before = _counts(smol_llm)
        speculator.draft_source = draft
        try:
            on = run_to_completion(engine, [prompt], params)[0].outputs[0]
        finally:
            speculator.draft_source = None
        assert (on.token_ids, on.finish_reason) == (off.token_ids, off.finish_reason)
        drafted, accepted = (now - then for now, then in zip(_counts(smol_llm), before))
        assert drafted > 0 and accepted >= (0.9 * drafted if spec is None else 1)
        assert draft.cached_sequences == []
