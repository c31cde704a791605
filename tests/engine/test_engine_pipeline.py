"""The overlapped step loop: step n+1 is launched before step n's tokens reach the host. Whatever mixes in a
batch (penalties that force the synchronous path, requests finishing at different steps, aborts while a
step is in flight), every request's tokens equal those of the same request run alone. The CPU's default is no
overlap (`engine.overlap_steps`): these tests ask for it; without it a step's tokens come with the step."""

from __future__ import annotations

import pytest
import torch

from streamd import LLM, SamplingParams
from streamd.engine.core.sequence import PLACEHOLDER
from tests.helpers import fold_deltas, register_engine, run_to_completion, sizes, step_until_idle, tiny_config

CONFIG = tiny_config(vocab_size=200)


@pytest.fixture(scope="module")
def engine():
    llm = LLM(CONFIG, device="cpu", dtype="float32", block_size=8, num_kv_blocks=300, num_swap_blocks=0,
              max_num_batched_tokens=64, seed=3, overlap_steps=True)
    return register_engine(llm.engine)


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CONFIG.vocab_size, (int(k),), generator=gen).tolist()
            for k in torch.randint(3, 40, (n,), generator=gen)]


def _alone(engine, prompt, params) -> list[int]:
    return run_to_completion(engine, [prompt], params)[0].outputs[0].token_ids


def test_mixed_batch_equals_requests_run_alone(engine) -> None:
    prompts = _prompts(6, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=5 + 7 * i, ignore_eos=True, detokenize=False,
                             repetition_penalty=1.5 if i == 2 else 1.0,
                             presence_penalty=0.5 if i == 4 else 0.0) for i in range(6)]
    want = [_alone(engine, p, sp) for p, sp in zip(prompts, params)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"mix{i}", p, sp)
    builders: dict = {}
    while engine.has_unfinished_requests():
        deltas = engine.step()
        assert all(PLACEHOLDER not in c.token_ids for d in deltas for c in d.outputs)
        fold_deltas(deltas, builders)
    got = {rid: b.build().outputs[0].token_ids for rid, b in builders.items()}
    assert [got[f"mix{i}"] for i in range(6)] == want
    assert [len(w) for w in want] == [5 + 7 * i for i in range(6)]


def test_abort_while_a_step_is_in_flight(engine) -> None:
    prompts = _prompts(3, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, detokenize=False)
    want = [_alone(engine, p, params) for p in prompts]
    for i, p in enumerate(prompts):
        engine.add_request(f"ab{i}", p, params)
    builders: dict = {}
    for _ in range(4):
        fold_deltas(engine.step(), builders)
    assert engine._inflight is not None, "a step should be in flight between two step() calls"
    engine.abort("ab1")
    final = step_until_idle(engine, builders)
    assert final["ab1"].outputs[0].finish_reason == "abort"
    assert final["ab0"].outputs[0].token_ids == want[0]
    assert final["ab2"].outputs[0].token_ids == want[2]
    assert final["ab1"].outputs[0].token_ids == want[1][:len(final["ab1"].outputs[0].token_ids)]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_finished_sequence_takes_no_extra_block(overlap: bool) -> None:
    # A (7 prompt tokens, 2 outputs) fits in 1 block: its last token is never computed. B (24 prompt tokens)
    # holds 4 blocks from its first decode on. A pool of 5 fits both exactly, unless the engine schedules a
    # decode for A's last token: that would take a 6th block and preempt B.
    llm = LLM(CONFIG, device="cpu", dtype="float32", block_size=8, num_kv_blocks=5, num_swap_blocks=0,
              watermark=0.0, enable_prefix_caching=False, overlap_steps=overlap)
    engine = register_engine(llm.engine)
    a, b = _prompts(2, seed=4)
    a, b = (a * 8)[:7], (b * 8)[:24]
    outs = run_to_completion(engine, [a, b], [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                                             detokenize=False),
                                              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True,
                                                             detokenize=False)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 9]
    stats = engine.stats()
    assert stats.scheduler.preemptions_recompute == 0 and stats.scheduler.preemptions_swap == 0, stats


def test_a_failed_step_reports_no_pending_token(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, detokenize=False)
    for i, p in enumerate(_prompts(3, seed=5)):
        engine.add_request(f"fail{i}", p, params)
    for _ in range(3):
        engine.step()

    def broken(*args, **kwargs):
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()  # placeholders were appended before the launch failed
    deltas = engine.abort_all("injected device fault")
    assert {d.request_id for d in deltas} == {"fail0", "fail1", "fail2"}
    for delta in deltas:
        assert delta.finished and delta.error and all(PLACEHOLDER not in c.token_ids for c in delta.outputs)


def test_without_the_overlap_a_steps_tokens_come_with_it(engine) -> None:
    """`overlap_steps` off (the CPU's default): the step that computes a prompt's first token returns it, each
    later step returns the token it computed, nothing is left in flight between steps, and the tokens equal
    the overlapped engine's."""
    plain = register_engine(LLM(CONFIG, device="cpu", dtype="float32", block_size=8, num_kv_blocks=300,
                                num_swap_blocks=0, max_num_batched_tokens=64, seed=3).engine)  # fmt: skip
    prompt = _prompts(1, seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
    plain.add_request("r", prompt, params)
    got = []
    while plain.has_unfinished_requests():
        deltas = plain.step()
        got.append(sum(len(c.token_ids) for d in deltas if d.request_id == "r" for c in d.outputs))
    assert got == [1] * 6, "each step's token came with it (the overlap would give 0 on the first step)"
    assert run_to_completion(plain, [prompt], params)[0].outputs[0].token_ids == _alone(engine, prompt, params)


def test_warm_up_leaves_the_engine_idle_and_its_counters_at_zero() -> None:
    llm = LLM(CONFIG, device="cpu", dtype="float32", block_size=8, num_kv_blocks=300, num_swap_blocks=0)
    engine = register_engine(llm.engine)
    engine.warm_up()  # runs on CUDA at start-up; the same code on CPU here
    stats = engine.stats()
    assert stats.kv.prefix_queried_tokens == 0 and stats.kv.prefix_hit_tokens == 0
    assert not engine.has_unfinished_requests() and stats.kv.blocks_free == stats.kv.blocks_total


@pytest.mark.parametrize("num_tokens", sizes(40, 120))
def test_step_output_does_not_grow_with_the_tokens_already_generated(smol_llm, num_tokens: int) -> None:
    """The engine step hands out only what is new: one token (and its logprobs, and at most a few
    characters) per sequence per step, at the last token as at token 1. Cumulative outputs would grow."""
    engine = smol_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, logprobs=2)
    engine.add_request("grow", "Count from one to a hundred:", params)
    step_sizes = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            (choice,) = delta.outputs
            step_sizes.append((len(choice.token_ids), len(choice.logprobs or []), len(choice.text)))
    assert len(step_sizes) >= num_tokens and sum(s[0] for s in step_sizes) == num_tokens
    assert max(s[0] for s in step_sizes) == 1 and max(s[1] for s in step_sizes) == 1
    assert max(s[2] for s in step_sizes) <= 32
