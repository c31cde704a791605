"""Memory management end to end in the engine: preemption by swap and by recompute under a pool too small
for the batch, prefix caching, never-fit rejection, chunked prefill. Outputs must equal an unconstrained run."""

from __future__ import annotations

import pytest
import torch

from streamd import LLM, SamplingParams
from streamd.engine.errors import KVCacheCapacityError
from tests.helpers import fold_deltas, register_engine, run_to_completion, step_until_idle, tiny_config

CONFIG = tiny_config()
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False)


def _llm(**overrides) -> LLM:
    base = dict(device="cpu", dtype="float32", block_size=8, max_num_batched_tokens=64, seed=5)
    return LLM(CONFIG, **{**base, **overrides})


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, CONFIG.vocab_size, (int(n),), generator=gen).tolist()
            for n in torch.randint(5, 50, (10,), generator=gen)]


@pytest.fixture(scope="module")
def unconstrained(prompts) -> list[list[int]]:
    engine = register_engine(_llm(num_kv_blocks=400, num_swap_blocks=0).engine)
    return [o.outputs[0].token_ids for o in run_to_completion(engine, prompts, GREEDY)]


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_preemption_keeps_outputs_identical(mode: str, prompts, unconstrained) -> None:
    # 24 blocks of 8 tokens hold ~2 of these sequences at full length: most of the batch gets preempted.
    llm = _llm(num_kv_blocks=24, num_swap_blocks=64 if mode != "recompute" else 0, preemption_mode=mode,
               watermark=0.0)
    register_engine(llm.engine)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == unconstrained
    stats = llm.engine.stats()
    if mode == "swap":
        assert stats.scheduler.preemptions_swap > 0 and stats.scheduler.preemptions_recompute == 0, stats
        assert stats.kv.swapped_out_blocks > 0 and stats.kv.swapped_in_blocks > 0
    elif mode == "recompute":
        assert stats.scheduler.preemptions_recompute > 0 and stats.scheduler.preemptions_swap == 0, stats
        assert stats.scheduler.recomputed_tokens > 0
    else:
        assert stats.scheduler.preemptions_swap + stats.scheduler.preemptions_recompute > 0, stats


def test_prefix_cache_serves_a_shared_prefix(smol_llm: LLM) -> None:
    engine = smol_llm.engine
    block = engine.block_manager.block_size
    system = "You are a careful assistant. Answer briefly and precisely. " * 8
    smol_llm.generate(system + "What is 2+2?", SamplingParams(temperature=0.0, max_tokens=8))
    before = engine.stats()
    second = smol_llm.generate(system + "Name a colour.", SamplingParams(temperature=0.0, max_tokens=8))[0]
    after = engine.stats()
    assert second.num_cached_tokens >= 3 * block, second.num_cached_tokens
    assert after.kv.prefix_hit_tokens - before.kv.prefix_hit_tokens >= 3 * block
    uncached = LLM(device="cpu", dtype="float32", num_kv_blocks=128, enable_prefix_caching=False, num_swap_blocks=0)
    register_engine(uncached.engine)
    plain = uncached.generate(system + "Name a colour.", SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert plain.num_cached_tokens == 0
    assert plain.outputs[0].token_ids == second.outputs[0].token_ids


def test_fully_cached_prompt_still_computes_its_last_token(prompts) -> None:
    engine = register_engine(_llm(num_kv_blocks=64, num_swap_blocks=0).engine)
    prompt = prompts[0][:8] * 3  # exactly three full blocks
    (a,) = run_to_completion(engine, [prompt], GREEDY)
    (b,) = run_to_completion(engine, [prompt], GREEDY)
    # Everything but the last token may come from the cache (whole blocks, so 16 of 24 here).
    assert 16 <= b.num_cached_tokens <= len(prompt) - 1
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_never_fit_is_rejected_while_others_complete(prompts, unconstrained) -> None:
    llm = _llm(num_kv_blocks=24, num_swap_blocks=0)
    register_engine(llm.engine)
    engine = llm.engine
    engine.add_request("ok", prompts[0], GREEDY)
    with pytest.raises(KVCacheCapacityError, match="KV cache"):
        engine.add_request("huge", list(range(1, 250)), GREEDY)
    done = {rid: out.outputs[0].token_ids for rid, out in step_until_idle(engine).items()}
    assert done == {"ok": unconstrained[0]}


def test_prompt_plus_max_tokens_beyond_the_pool_is_refused_at_admission(prompts) -> None:
    # issue 10: the prompt alone fits 24 blocks of 8, but with max_tokens it never can; it used to be admitted
    # and fail mid-generation with internal_error.
    engine = register_engine(_llm(num_kv_blocks=24, num_swap_blocks=0).engine)
    long_run = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True, detokenize=False)
    with pytest.raises(KVCacheCapacityError, match="plus max_tokens"):
        engine.add_request("outgrows", prompts[0], long_run)
    assert not engine.has_unfinished_requests()


def test_chunked_prefill_runs_beside_decodes(prompts) -> None:
    llm = _llm(num_kv_blocks=200, num_swap_blocks=0, max_num_batched_tokens=16)
    engine = register_engine(llm.engine)
    engine.add_request("short", prompts[0][:4], GREEDY)
    engine.step()  # "short" is prefilled and decoding
    engine.add_request("long", list(range(1, 120)), GREEDY)
    steps_with_both = 0
    long_seq = engine.requests.get("long").group.seqs[0]
    while engine.has_unfinished_requests():
        prefilling = long_seq.num_computed_tokens < long_seq.num_prompt_tokens
        progressed = {o.request_id for o in engine.step()}
        if prefilling and "short" in progressed:
            steps_with_both += 1
    assert steps_with_both >= 3, "the long prompt should prefill in chunks while 'short' keeps decoding"


def test_requests_arriving_together_share_a_prefix_in_the_same_step(prompts) -> None:
    # Both are admitted in one step: the second reads the prefix blocks the first writes in that very
    # forward (each layer stores the batch's K/V before attending) instead of computing them again.
    engine = register_engine(_llm(num_kv_blocks=200, num_swap_blocks=0, max_num_batched_tokens=256).engine)
    shared = (prompts[1] * 3)[:40]  # five full blocks of 8
    engine.add_request("first", shared + [1, 2, 3], GREEDY)
    engine.add_request("second", shared + [4, 5], GREEDY)
    folded: dict = {}
    fold_deltas(engine.step(), folded)  # (on the CPU the step's first tokens come with it)
    assert all(g.first_scheduled_time is not None for g in (r.group for r in engine.requests)), "one step admits both"
    final = step_until_idle(engine, folded)
    assert final["first"].num_cached_tokens == 0
    assert final["second"].num_cached_tokens == 40
    plain = register_engine(_llm(num_kv_blocks=200, num_swap_blocks=0, enable_prefix_caching=False).engine)
    alone = run_to_completion(plain, [shared + [4, 5], shared + [1, 2, 3]], GREEDY)
    assert final["second"].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert final["first"].outputs[0].token_ids == alone[1].outputs[0].token_ids
