"""The step latency budget (issue 35 D9): `StepCost` fits a step's seconds from measured steps, and the
scheduler cuts prompt chunks so that the predicted step stays under `scheduler.max_step_ms`, while every
prompt still progresses (a block per step at least) and outputs stay those of an unconstrained run.

The device is simulated: a step's seconds are a function of its shape that the scheduler does not know
(base + per token + per attention pair, the pairs making long contexts expensive), fed back after each step
as LLMEngine feeds back what it measured. Nothing here reads a clock."""

from __future__ import annotations

import random

import pytest

from streamd.engine.core.step_cost import StepCost, StepShape, chunk_pairs
from tests.engine.core.test_scheduler import FakeEngine, _run, _workload, reference

BUDGET_S = 0.5


def quadratic_device(base: float = 0.01, per_token: float = 2e-3, per_pair: float = 1e-5):
    """A device on which a 2,000-token context makes a chunk's every token cost 10x more."""
    return lambda shape: base + per_token * shape.tokens + per_pair * shape.pairs


def shape_of(chunks: list[tuple[int, int]], decodes: int = 0) -> StepShape:
    shape = StepShape(decodes)
    for tokens, context in chunks:
        shape.add_chunk(tokens, context)
    return shape


def test_fit_recovers_the_device_and_sizes_the_largest_chunk_that_fits():
    device, rng = quadratic_device(), random.Random(0)
    cost = StepCost(seconds_per_token=1e-4)
    for _ in range(40):
        cost.observe(shape := shape_of([(rng.randrange(1, 300), rng.randrange(0, 3000))], rng.randrange(8)),
                     device(shape))
        cost.observe(shape := StepShape(rng.randrange(1, 8)), device(shape))
    for shape in (StepShape(3), shape_of([(100, 0)]), shape_of([(20, 2500)], 5)):
        assert cost.predict(shape) == pytest.approx(device(shape), rel=1e-3)
    for context in (0, 100, 1000, 3000):
        base = StepShape(4)
        n = cost.max_chunk(base, context, BUDGET_S)
        assert device(shape_of([(n, context)], 4)) <= BUDGET_S * 1.001
        assert device(shape_of([(n + 1, context)], 4)) > BUDGET_S * 0.999


def test_costs_never_come_out_negative_and_the_prior_stands_until_measured():
    cost = StepCost(seconds_per_token=1e-3)
    assert cost.predict(StepShape(1000)) == pytest.approx(1.0)
    for tokens in range(1, 50):  # a device whose time does not grow with attention pairs
        shape = shape_of([(tokens, 0)])
        cost.observe(shape, 0.05 + 1e-3 * tokens)
    assert all(c >= 0 for c in cost.coefficients)
    assert cost.max_chunk(StepShape(), 0, 0.05) == 0  # the base alone fills the budget


def run_long_prompt_beside_a_stream(device, prompt_len: int = 2000, budget_ms: float = BUDGET_S * 1e3,
                                    lone_chunk_tokens: int = 16) -> FakeEngine:
    eng = FakeEngine(300, block_size=16, max_step_ms=budget_ms, device=device)
    eng.sched.lone_chunk_tokens = lone_chunk_tokens
    eng.add("stream", [1, 2, 3, 4], max_tokens=400)
    eng.step()
    prompt = [(i * 7) % 50 for i in range(prompt_len)]
    eng.add("long", prompt, max_tokens=2)
    arrived = eng.steps
    while "long" not in eng.finished:
        out = eng.step()
        assert ("stream", 1) in [(i.group.request_id, i.num_new_tokens) for i in out.scheduled], "stream starved"
        assert eng.steps < 2000
    eng.long_steps = eng.steps - arrived
    eng.run()
    assert eng.finished["long"] == [reference(prompt, 2)]
    assert eng.finished["stream"] == [reference([1, 2, 3, 4], 400)]
    return eng


def test_a_long_prompt_is_cut_so_no_step_passes_the_budget():
    device = quadratic_device()
    eng = run_long_prompt_beside_a_stream(device)
    chunked = [s for s in eng.step_seconds if s > device(StepShape(1)) + 1e-9]  # the stream's prompt, then long's
    assert len(chunked) > 5
    # The long prompt's first chunk runs on the prior (1 ms a token, no attention cost), its second on a fit
    # of one chunk (attention underestimated, ~1.6x the budget); from then on every step is within it.
    assert max(chunked[2:]) <= BUDGET_S * 1.6, chunked
    assert max(chunked[3:]) <= BUDGET_S * 1.05, chunked
    unbounded = device(shape_of([(2000, 0)], 1))
    assert unbounded > 10 * BUDGET_S  # what the stream would have waited in one step without the budget


def test_every_step_still_runs_a_block_of_the_prompt_when_decodes_alone_pass_the_budget():
    slow = quadratic_device(base=2 * BUDGET_S)  # every step costs more than the budget
    eng = run_long_prompt_beside_a_stream(slow, prompt_len=200)
    assert eng.long_steps <= -(-200 // 16) + 2  # a block a step (the last chunk samples, one more decodes)


def test_a_lone_prompt_gets_the_models_least_chunk_and_one_beside_a_stream_gets_a_block():
    """`lone_chunk_tokens` (a low-bit CPU model's dense-path rows): a prompt with nothing else in its steps
    takes chunks of at least that many tokens on a device where every step passes the budget; the same
    prompt beside a decoding stream still gets a block a step (the stream's latency is what the budget keeps)."""
    slow = quadratic_device(base=2 * BUDGET_S)
    alone = FakeEngine(300, block_size=16, max_step_ms=BUDGET_S * 1e3, device=slow)
    alone.sched.lone_chunk_tokens = 96
    prompt = [(i * 7) % 50 for i in range(1200)]
    alone.add("long", prompt, max_tokens=2)
    chunks = []
    while "long" not in alone.finished:
        chunks += [i.num_new_tokens for i in alone.step().scheduled if i.group.request_id == "long"]
    assert alone.finished["long"] == [reference(prompt, 2)]
    # The first chunk runs on the prior (1 ms a token); once a step is measured, each later chunk is the least.
    middle = chunks[1:-2]  # (the last chunk is what remains, then the prompt's one decode)
    assert sum(chunks[:-1]) == 1200 and len(middle) > 3 and set(middle) == {96}, chunks
    beside = run_long_prompt_beside_a_stream(slow, prompt_len=200, lone_chunk_tokens=96)
    assert beside.long_steps >= -(-200 // 16)  # a block a step: the lone chunk did not apply


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("num_blocks", "mode", "swap_blocks"), [(400, "recompute", 0), (24, "recompute", 0),
                                                                 (24, "swap", 40)])
def test_budgeted_runs_reproduce_unconstrained_outputs(seed, num_blocks, mode, swap_blocks):
    """Random arrivals, shared prefixes, forks, preemption on a small pool: with the budget on and a
    simulated device, the outputs are those of a run without it, and the pool ends whole."""
    requests = _workload(seed)
    free = _run(requests, num_blocks=400, max_step_ms=0.0, device=quadratic_device())
    budgeted = _run(requests, num_blocks=num_blocks, max_step_ms=30.0, mode=mode, num_swap_blocks=swap_blocks,
                    watermark=0.05, device=quadratic_device())
    assert budgeted.rejected == {} and budgeted.finished == free.finished
    assert budgeted.steps > free.steps  # the budget did cut chunks
    # Without a budget nothing reads the fit, so measured steps are not even kept: the prior stands.
    assert free.step_seconds and free.sched.step_cost.coefficients == free.sched.step_cost.prior


def test_chunk_pairs_counts_causal_attention():
    assert chunk_pairs(1, 0) == 1  # a token attends to itself
    assert chunk_pairs(3, 0) == 6  # 1 + 2 + 3
    assert chunk_pairs(2, 10) == 23  # 11 + 12


def test_a_prompt_the_step_has_no_room_for_stays_in_the_queue():
    """The first prompt's chunk leaves less than a token's time of the budget (the prior: 1 ms a token):
    the others wait in the queue, holding no blocks, rather than being admitted with no chunk this step."""
    eng = FakeEngine(300, block_size=16, max_step_ms=500.5)
    for name in "abc":
        eng.add(name, [(i * 7 + ord(name)) % 50 for i in range(600)], max_tokens=2)
    out = eng.step()
    assert [(i.group.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 500)]
    assert [g.request_id for g in eng.sched.waiting] == ["b", "c"]
    assert eng.bm.num_free_blocks() == 300 - 600 // 16 - 1
    eng.run()
    assert sorted(eng.finished) == ["a", "b", "c"]
