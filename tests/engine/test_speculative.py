"""Speculative decoding in the engine: drafts change how fast tokens come, never which tokens.

Greedy output is compared token for token with speculation off: on the real default model (prompt lookup
and a request's `prediction`), and on a random model whose drafts come from an oracle (the output without
speculation, corrupted in places) so that long accepted runs, refusals, stops inside a run, max_tokens,
logprobs, parallel samples, preemption and abort all happen under speculation. The KV pool is whole after
each test (conftest's leak check)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from streamd import LLM, SamplingParams
from streamd.engine.core.step_cost import StepCost
from streamd.engine.sampling_params import StructuredOutputs
from tests.helpers import random_prompt, run_to_completion, sizes, tiny_llm


@pytest.fixture(autouse=True)
def unmeasured_row_price(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft row's price comes from measured step times (`StepCost.row_cost`); these tests check what drafts do,
    not how many pay off (tests/engine/core/test_speculation.py), so the price stays the unmeasured default."""
    monkeypatch.setattr(StepCost, "row_cost", lambda self, tokens: None)

def _speculate(engine, **changes) -> None:
    spec = engine.scheduler.speculator
    spec.config = dataclasses.replace(spec.config, **changes)


def _tokens(outputs) -> list[list[int]]:
    return [choice.token_ids for out in outputs for choice in out.outputs]


EDIT_TEXT = (
    "The meeting is on Tuesday at the main office. Bring the quarterly report, the budget sheet and your "
    "laptop. Lunch will be served at noon in the second floor kitchen. Parking is free for visitors."
)
PROMPTS = [
    f"Copy this text exactly, but change Tuesday to Friday:\n\n{EDIT_TEXT}",
    f"Repeat the following sentence word for word: {EDIT_TEXT}",
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "List three colors of the rainbow, one per line.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Explain in two sentences why the sky is blue.",
]


def _check_identity(llm: LLM, prompts: list, max_tokens: int) -> None:
    """Greedy tokens with speculation off, with prompt lookup, and with the output as `prediction`: the same;
    drafts were kept both ways."""
    engine = llm.engine
    spec = engine.scheduler.speculator
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    off = _tokens(run_to_completion(engine, prompts, params))
    saved = spec.config
    try:
        _speculate(engine, prompt_lookup=True, disable_by_batch_size=len(prompts))
        before = engine.stats().scheduler
        assert _tokens(run_to_completion(engine, prompts, params)) == off
        after = engine.stats().scheduler
        assert after.spec_accepted_tokens > before.spec_accepted_tokens  # the copies were drafted and kept
        _speculate(engine, prompt_lookup=False)
        predicted = [dataclasses.replace(params, prediction=llm.tokenizer.decode(t)) for t in off]
        assert _tokens(run_to_completion(engine, prompts, predicted)) == off
        assert engine.stats().scheduler.spec_accepted_tokens - after.spec_accepted_tokens >= len(prompts) * 5
    finally:
        spec.config = saved


@pytest.mark.parametrize("size", sizes((2, 20), (len(PROMPTS), 40)))
def test_greedy_tokens_are_identical_with_speculation_on_the_default_model(smol_llm: LLM, size) -> None:
    count, max_tokens = size
    _check_identity(smol_llm, PROMPTS[:count], max_tokens=max_tokens)


# ---- a random model with oracle drafts ------------------------------------------------------------


def _params(**changes) -> SamplingParams:
    """Greedy, no EOS stop, token ids only (the random model has no tokenizer), unless `changes` say so."""
    return SamplingParams(**{"temperature": 0, "ignore_eos": True, "detokenize": False, **changes})


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return tiny_llm(num_kv_blocks=200)


def _oracle(engine, drafts: list[int]) -> None:
    """Every request's `prediction` becomes `drafts` (token ids; a random model has no text to tokenize)."""
    engine._prediction_ids = lambda text: list(drafts)


def _corrupted(tokens: list[int], every: int) -> list[int]:
    return [t if i % every != every - 1 else (t + 1) % 300 for i, t in enumerate(tokens)]


def _run_with_oracle(llm: LLM, prompt: list[int], params: SamplingParams, drafts: list[int]):
    engine = llm.engine
    _oracle(engine, drafts)
    try:
        return run_to_completion(engine, [prompt], dataclasses.replace(params, prediction="oracle"))[0]
    finally:
        del engine._prediction_ids


@pytest.mark.parametrize("every", [3, 7, 1000])
def test_accepted_runs_and_refusals_keep_greedy_tokens(tiny: LLM, every: int) -> None:
    prompt = random_prompt(1, 20)
    params = _params(temperature=0, max_tokens=60, ignore_eos=True)
    off = run_to_completion(tiny.engine, [prompt], params)[0].outputs[0].token_ids
    before = tiny.engine.stats().scheduler
    tenant = tiny.engine.scheduler.fair.tenants[params.tenant]
    served = tenant.output_tokens
    on = _run_with_oracle(tiny, prompt, params, _corrupted(off, every)).outputs[0].token_ids
    after = tiny.engine.stats().scheduler
    assert on == off
    assert tenant.output_tokens - served == len(on)  # accepted drafts count as output in the fair share
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    if every < 1000:
        assert 0 < accepted < drafted
    else:  # a perfect prediction: every draft kept; the drafts grow with the rate (from 0.7) to 8 a step
        assert accepted == drafted >= len(off) * 3 // 4


def test_a_stop_token_inside_an_accepted_run_ends_it_there(tiny: LLM) -> None:
    prompt = random_prompt(2, 15)
    free = _params(temperature=0, max_tokens=40, ignore_eos=True)
    off = run_to_completion(tiny.engine, [prompt], free)[0].outputs[0].token_ids
    stop = off[17]
    first = off.index(stop)
    params = dataclasses.replace(free, stop_token_ids=[stop])
    out = _run_with_oracle(tiny, prompt, params, off).outputs[0]
    assert out.token_ids == off[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


@pytest.mark.parametrize("max_tokens", [1, 2, 9, 10, 11])
def test_max_tokens_is_exact_under_speculation(tiny: LLM, max_tokens: int) -> None:
    prompt = random_prompt(3, 12)
    params = _params(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    off = run_to_completion(tiny.engine, [prompt], params)[0].outputs[0].token_ids
    out = _run_with_oracle(tiny, prompt, params, off + off).outputs[0]
    assert out.token_ids == off and out.finish_reason == "length"


def test_logprobs_of_accepted_tokens_are_the_model_s(tiny: LLM) -> None:
    prompt = random_prompt(4, 18)
    params = _params(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    off = run_to_completion(tiny.engine, [prompt], params)[0].outputs[0]
    on = _run_with_oracle(tiny, prompt, params, _corrupted(off.token_ids, 5)).outputs[0]
    assert on.token_ids == off.token_ids
    assert len(on.logprobs) == len(off.logprobs) == 30
    for mine, theirs in zip(on.logprobs, off.logprobs):
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)


def test_parallel_samples_each_verify_their_own_drafts(tiny: LLM) -> None:
    prompt = random_prompt(5, 21)
    params = _params(n=3, temperature=0, max_tokens=25, ignore_eos=True)
    off = _tokens(run_to_completion(tiny.engine, [prompt], params))
    on = _run_with_oracle(tiny, prompt, params, _corrupted(off[0], 4))
    assert _tokens([on]) == off


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_mid_speculation_keeps_greedy_tokens(mode: str) -> None:
    llm = tiny_llm(num_kv_blocks=12, num_swap_blocks=40, preemption_mode=mode)
    engine = llm.engine
    prompts = [random_prompt(10 + i, 14) for i in range(3)]
    params = _params(temperature=0, max_tokens=24, ignore_eos=True)
    off = _tokens(run_to_completion(engine, prompts, params))
    before = engine.stats().scheduler
    _oracle(engine, _corrupted(off[0], 6))  # right for the first prompt, wrong for the others
    try:
        on = _tokens(run_to_completion(engine, prompts, dataclasses.replace(params, prediction="oracle")))
    finally:
        del engine._prediction_ids
    after = engine.stats().scheduler
    assert on == off
    assert after.preemptions_swap + after.preemptions_recompute > before.preemptions_swap + before.preemptions_recompute
    assert after.spec_accepted_tokens > before.spec_accepted_tokens


def test_abort_mid_speculation_frees_every_block(tiny: LLM) -> None:
    engine = tiny.engine
    prompt = random_prompt(6, 16)
    params = _params(temperature=0, max_tokens=200, ignore_eos=True)
    _oracle(engine, random_prompt(7, 200))
    try:
        engine.add_request("spec-abort", prompt, dataclasses.replace(params, prediction="oracle"))
        for _ in range(4):
            engine.step()
        engine.abort("spec-abort")
        deltas = engine.step()
        while engine.has_unfinished_requests():
            deltas += engine.step()
    finally:
        del engine._prediction_ids
    assert any(d.finished and d.outputs and d.outputs[0].finish_reason == "abort" for d in deltas)


def test_beam_search_beside_a_drafting_request_is_unchanged(tiny: LLM) -> None:
    engine = tiny.engine
    beam_prompt, greedy_prompt = random_prompt(13, 11), random_prompt(14, 9)
    beam = _params(n=2, use_beam_search=True, max_tokens=10)
    greedy = _params(max_tokens=20)
    alone = _tokens(run_to_completion(engine, [beam_prompt, greedy_prompt], [beam, greedy]))
    before = engine.stats().scheduler.spec_accepted_tokens
    _oracle(engine, alone[-1])
    try:
        mixed = run_to_completion(engine, [beam_prompt, greedy_prompt], [beam, dataclasses.replace(greedy, prediction="o")])
    finally:
        del engine._prediction_ids
    assert _tokens(mixed) == alone
    assert engine.stats().scheduler.spec_accepted_tokens > before


def test_sampled_requests_with_drafts_end_right(tiny: LLM) -> None:
    prompt = random_prompt(8, 10)
    params = _params(n=2, temperature=0.8, top_k=20, max_tokens=30, ignore_eos=True)
    out = _run_with_oracle(tiny, prompt, params, random_prompt(9, 60))
    assert [len(c.token_ids) for c in out.outputs] == [30, 30]


def test_requests_that_read_their_history_do_not_speculate(tiny: LLM) -> None:
    prompt = random_prompt(11, 10)
    before = tiny.engine.stats().scheduler
    for params in (
        _params(temperature=0, max_tokens=10, repetition_penalty=1.3),
        _params(temperature=0.7, seed=3, max_tokens=10),
    ):
        _run_with_oracle(tiny, prompt, params, random_prompt(12, 20))
    assert tiny.engine.stats().scheduler.spec_draft_tokens == before.spec_draft_tokens


# ---- the rejection rule -------------------------------------------------------------------------------


CHI2_P001 = {4: 18.47, 7: 24.32}  # chi-square statistic exceeded with probability 0.001, by degrees of freedom


@pytest.mark.parametrize(("draft", "top_k"), [(0, -1), (3, -1), (6, 5), (7, 5)])  # likely, unlikely, cut by top-k
def test_tokens_kept_or_drawn_follow_the_sampling_distribution(draft: int, top_k: int) -> None:
    import torch

    from streamd.engine.core.scheduler_output import ScheduledSeq
    from streamd.engine.core.sequence import Sequence, SequenceGroup
    from streamd.engine.core.speculation import Draft
    from streamd.engine.sample.sampler import Sampler
    from streamd.engine.sample.speculative import verify

    rows = 40_000
    sampler = Sampler(vocab_size=8, eos_token_ids=[], seed=11)
    logits_row = torch.tensor([2.0, 1.5, 1.0, 0.2, 0.0, -0.5, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=top_k, max_tokens=4)
    group = SequenceGroup("chi2", [Sequence([1, 2, 3])], params)
    item = ScheduledSeq(group.seqs[0], group, 1, Draft([draft]))
    # Each item has two rows (the draft's and the bonus row); only the first token of each run is counted.
    logits = logits_row.repeat(2 * rows, 1)
    result = verify(sampler, logits, [item] * rows).result()
    first = torch.tensor([run[0] for run in result.token_ids])
    counts = torch.bincount(first, minlength=8).double()
    expected = sampler.distribution(logits_row[None], [params], [params])[0].double() * rows
    support = expected > 0
    assert counts[~support].sum() == 0  # nothing outside top-k, the draft included
    chi2 = ((counts[support] - expected[support]) ** 2 / expected[support]).sum().item()
    assert chi2 < CHI2_P001[int(support.sum()) - 1], (chi2, counts.tolist(), expected.tolist())
    kept = sum(result.accepted) / rows
    p_draft = expected[draft].item() / rows
    assert abs(kept - p_draft) < 0.02  # a draft is kept with its probability


def test_a_stop_string_inside_an_accepted_run_ends_the_output_at_its_token(smol_llm: LLM) -> None:
    engine = smol_llm.engine
    prompt = engine.apply_chat_template([{"role": "user", "content": PROMPTS[1]}])
    free = SamplingParams(temperature=0, max_tokens=24)
    off = run_to_completion(engine, [prompt], free)[0].outputs[0]
    stop = off.text[30:36]
    params = dataclasses.replace(free, stop=[stop])
    expected = run_to_completion(engine, [prompt], params)[0].outputs[0]
    before = engine.stats().scheduler.spec_accepted_tokens
    out = run_to_completion(engine, [prompt], dataclasses.replace(params, prediction=off.text))[0].outputs[0]
    assert engine.stats().scheduler.spec_accepted_tokens > before
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (
        expected.text, expected.token_ids, "stop", stop)
    assert len(out.token_ids) < len(off.token_ids)


# ---- structured outputs: drafts checked against the grammar ------------------------------------------

CARD = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CARD_PROMPT = "Give a JSON object with a city name and a number of days for a trip to Paris."


def _constrained(engine, spec: StructuredOutputs, prediction: str | None = None, **changes):
    prompt = engine.apply_chat_template([{"role": "user", "content": CARD_PROMPT}])
    fields = {"temperature": 0, "max_tokens": 40, "structured_outputs": spec, "prediction": prediction, **changes}
    params = SamplingParams(**fields)
    return run_to_completion(engine, [prompt], params)[0].outputs[0]


def test_a_structured_output_speculates_and_keeps_its_greedy_tokens(smol_llm: LLM) -> None:
    """Its own output as the prediction is drafted and kept; a prediction broken in places (characters no
    JSON allows there) is refused where broken; both give the tokens decoding alone gives."""
    engine, spec = smol_llm.engine, StructuredOutputs(json=CARD)
    off = _constrained(engine, spec)
    json.loads(off.text)
    before = engine.stats().scheduler.spec_accepted_tokens
    same = _constrained(engine, spec, prediction=off.text)
    assert (same.token_ids, same.finish_reason) == (off.token_ids, off.finish_reason)
    assert engine.stats().scheduler.spec_accepted_tokens - before >= len(off.token_ids) // 2
    broken = off.text.replace('"', "<").replace(":", "=")
    assert _constrained(engine, spec, prediction=broken).token_ids == off.token_ids


def test_drafts_the_grammar_refuses_are_never_kept(smol_llm: LLM) -> None:
    """The model's unconstrained reply as the prediction of a request whose grammar allows the reply's
    start and then only digits: the model agrees with the later drafts, the grammar does not, and the
    verify rows' masks refuse them (without the masks a kept draft would leave the grammar: a dead end,
    and the request would fail)."""
    engine = smol_llm.engine
    free = _constrained(engine, None)  # type: ignore[arg-type]
    start = smol_llm.tokenizer.decode(free.token_ids[:12])  # past the first step's 8 drafts and own token
    spec = StructuredOutputs(regex="".join("\\" + c if c in "\\^$.|?*+()[]{}/" else c for c in start) + "[0-9]{3}")
    off = _constrained(engine, spec)
    before = engine.stats().scheduler
    out = _constrained(engine, spec, prediction=free.text)
    after = engine.stats().scheduler
    assert after.spec_accepted_tokens > before.spec_accepted_tokens  # the reply's start was drafted and kept
    assert after.spec_draft_tokens - before.spec_draft_tokens > after.spec_accepted_tokens - before.spec_accepted_tokens
    assert (out.token_ids, out.finish_reason) == (off.token_ids, off.finish_reason)
    assert re.fullmatch(spec.regex, out.text)


def test_sampled_structured_outputs_with_drafts_stay_in_the_grammar(smol_llm: LLM) -> None:
    engine = smol_llm.engine
    spec = StructuredOutputs(regex=r"[A-Z][a-z]{2,8}, [0-9]{1,2} days")
    before = engine.stats().scheduler.spec_draft_tokens
    for _ in range(4):  # (a prediction the grammar allows: its drafts are verified by the rejection rule)
        out = _constrained(engine, spec, prediction="Paris, 12 days", temperature=0.9)
        assert re.fullmatch(spec.regex, out.text), out.text
    assert engine.stats().scheduler.spec_draft_tokens > before


def test_a_drafting_step_s_lost_overlap_is_measured_and_priced(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the overlap on, the engine times overlapped decode steps and drafting (serial) ones, and every draft is
    priced with what the scheduler's `StepPeriods` says a serial step loses; the greedy tokens stay the same."""
    llm = tiny_llm(num_kv_blocks=200, overlap_steps=True)
    engine = llm.engine
    prompt = random_prompt(7, 16)
    params = _params(max_tokens=48)
    off = run_to_completion(engine, [prompt], params)[0].outputs[0].token_ids
    on = _run_with_oracle(llm, prompt, params, _corrupted(off, 4)).outputs[0].token_ids
    periods = engine.scheduler.step_periods
    assert on == off and periods.overlapped and periods.serial  # both kinds of decode step were timed
    monkeypatch.setattr(periods, "serial_overhead", lambda: 0.625)
    spec = engine.scheduler.speculator
    prices = []
    propose = spec.propose
    monkeypatch.setattr(spec, "propose", lambda *a, **k: prices.append(a[3]) or propose(*a, **k))
    assert _run_with_oracle(llm, prompt, params, off).outputs[0].token_ids == off
    assert prices and all(price.serial == 0.625 for price in prices)


def test_a_prediction_given_as_token_ids_drafts_them(tiny: LLM) -> None:
    prompt = random_prompt(9, 12)
    params = _params(max_tokens=24)
    off = run_to_completion(tiny.engine, [prompt], params)[0].outputs[0].token_ids
    before = tiny.engine.stats().scheduler
    on = run_to_completion(tiny.engine, [prompt], dataclasses.replace(params, prediction=list(off)))[0]
    after = tiny.engine.stats().scheduler
    assert on.outputs[0].token_ids == off and after.spec_accepted_tokens - before.spec_accepted_tokens >= len(off) // 2
    with pytest.raises(ValueError, match="prediction"):
        _params(prediction=[1, "2"])
