"""Parallel sampling (`n`) in the engine: one prompt prefill, n samples forked from it on shared blocks,
copy-on-write of the last partly filled block only, seeded samples reproducible whatever shares the batch,
the group preempted and aborted together, and its worst case counted at admission."""

from __future__ import annotations

import pytest

from streamd import LLM, SamplingParams
from streamd.engine.errors import KVCacheCapacityError
from tests.helpers import fold_deltas, random_prompt, run_to_completion, tiny_llm


def _samples(outputs) -> list[list[int]]:
    return [choice.token_ids for choice in outputs.outputs]


def test_seeded_samples_differ_and_repeat_whatever_shares_the_batch(smol_llm: LLM) -> None:
    engine = smol_llm.engine
    params = SamplingParams(n=4, seed=1234, temperature=1.0, max_tokens=8, ignore_eos=True)
    prompt = "Write a short poem about the sea:"
    alone = run_to_completion(engine, [prompt], params)[0]
    assert [c.index for c in alone.outputs] == [0, 1, 2, 3]
    samples = _samples(alone)
    assert all(len(s) == 8 for s in samples)
    assert len({tuple(s) for s in samples}) >= 3, samples
    assert _samples(run_to_completion(engine, [prompt], params)[0]) == samples
    others = [SamplingParams(temperature=0.0, max_tokens=5), SamplingParams(temperature=0.9, max_tokens=12),
              SamplingParams(n=2, temperature=1.0, max_tokens=6)]
    batch = run_to_completion(engine, ["Hello there", prompt, "Once upon a time", "1, 2, 3,"],
                              [others[0], params, others[1], others[2]])
    assert _samples(batch[1]) == samples
    assert len(batch[3].outputs) == 2 and all(len(s) == 6 for s in _samples(batch[3]))


@pytest.mark.parametrize("prompt_len", [37, 48])  # a partly filled last block, and none
def test_the_prompt_is_allocated_once_and_only_its_last_block_is_copied(smol_llm: LLM, prompt_len: int) -> None:
    engine, n, max_tokens = smol_llm.engine, 4, 20
    bs = engine.block_manager.block_size
    copies: list[tuple[int, int]] = []
    copy = engine.cache.copy

    def recording_copy(pairs):
        copies.extend(pairs)
        return copy(pairs)

    engine.cache.copy = recording_copy
    try:
        before = engine.stats().kv
        prompt = random_prompt(prompt_len, prompt_len, engine.vocab_size)
        params = SamplingParams(n=n, seed=7, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        out = run_to_completion(engine, [prompt], params)[0]
    finally:
        del engine.cache.copy
    after = engine.stats().kv
    assert len(out.outputs) == n and all(len(s) == max_tokens for s in _samples(out))
    assert after.prefix_hit_tokens == before.prefix_hit_tokens  # nothing came from the prefix cache
    shared = prompt_len // bs
    written = prompt_len + max_tokens - 1  # the last token's KV is never written
    # The prompt's full blocks once for all samples; each sample's own blocks from its last partly filled one.
    assert after.allocated_blocks - before.allocated_blocks == shared + n * (-(-written // bs) - shared)
    partly_filled = prompt_len % bs != 0
    assert after.copied_blocks - before.copied_blocks == len(copies) == (n - 1 if partly_filled else 0)
    assert len({src for src, _ in copies}) <= 1  # every copy is of the same block: the prompt's last


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempting_a_group_keeps_its_samples(mode: str) -> None:
    prompts = [random_prompt(1, 10), random_prompt(2, 11), random_prompt(3, 20)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False)] * 2 + [
        SamplingParams(n=3, seed=9, temperature=1.0, max_tokens=40, ignore_eos=True, detokenize=False)]
    roomy = run_to_completion(tiny_llm(num_kv_blocks=200, num_swap_blocks=0).engine, prompts, params)
    # 30 blocks of 8: the group's worst case (20 blocks) fits at admission beside the two prompts, but not
    # beside the two single sequences grown to full length: the group, the latest arrival, is preempted.
    llm = tiny_llm(num_kv_blocks=30, num_swap_blocks=64 if mode == "swap" else 0, preemption_mode=mode)
    tight = run_to_completion(llm.engine, prompts, params)
    assert [_samples(o) for o in tight] == [_samples(o) for o in roomy]
    assert len({tuple(s) for s in _samples(tight[2])}) == 3
    stats = llm.engine.stats().scheduler
    assert (stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute) > 0, stats


@pytest.mark.parametrize("steps", [1, 4])  # before the samples are forked, and after
def test_aborting_a_group_frees_every_sample(steps: int) -> None:
    engine = tiny_llm(num_kv_blocks=60, num_swap_blocks=0).engine
    params = SamplingParams(n=4, seed=3, max_tokens=30, ignore_eos=True, detokenize=False)
    engine.add_request("g", random_prompt(4, 21), params)
    folded: dict = {}
    for _ in range(steps):
        fold_deltas(engine.step(), folded)
    engine.abort("g")
    assert engine.stats().kv.blocks_free == engine.stats().kv.blocks_total
    while engine.has_unfinished_requests():
        fold_deltas(engine.step(), folded)
    out = folded["g"].build()
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert {c.finish_reason for c in out.outputs} == {"abort"}


def test_a_group_whose_worst_case_never_fits_is_refused() -> None:
    engine = tiny_llm(num_kv_blocks=30, num_swap_blocks=0).engine
    params = SamplingParams(n=6, max_tokens=60, detokenize=False)
    with pytest.raises(KVCacheCapacityError, match="n=6"):
        engine.add_request("big", random_prompt(5, 20), params)
    engine.add_request("ok", random_prompt(5, 20), SamplingParams(n=2, max_tokens=20, detokenize=False))
    while engine.has_unfinished_requests():
        engine.step()
