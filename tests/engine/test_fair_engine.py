"""The fair share and service tiers in the real engine's overlapped loop (outputs trail the device by a step):
what the scheduler tests' serial fake engine cannot show."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from streamd.engine.core.fairness import FairShare
from streamd.engine.llm_engine import LLMEngine
from streamd.engine.sampling_params import SamplingParams
from tests.helpers import tiny_llm


@contextmanager
def seats(engine: LLMEngine, count: int) -> Iterator[None]:
    """`count` seats (`max_num_seqs`), fresh fair-share counters and no step latency budget (the shared
    engine's step cost is fitted to whatever ran before: on a loaded box not one more prompt fits a step, and
    admission would depend on that), restored afterwards."""
    scheduler = engine.scheduler
    before = scheduler.max_num_seqs, scheduler.fair, scheduler.max_step_s
    scheduler.max_num_seqs, scheduler.fair, scheduler.max_step_s = count, FairShare(True, {}), None
    try:
        yield
    finally:
        scheduler.max_num_seqs, scheduler.fair, scheduler.max_step_s = before


def add(engine: LLMEngine, rid: str, max_tokens: int, tier: str = "default") -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, tenant="t", service_tier=tier)
    engine.add_request(rid, None, params, prompt_token_ids=[100 + i for i in range(8)])


def test_a_priority_request_takes_the_first_seat_that_frees(smol_llm) -> None:
    """At saturation a request that ended by length keeps its place in `running` until its last token is read
    back, a step after its seat freed: the waiting queue must be in tier order then, or the seat goes to the
    oldest default request."""
    engine = smol_llm.engine
    admitted: list[str] = []
    with seats(engine, 2):
        add(engine, "d0", 3)
        add(engine, "d1", 6)
        engine.step()
        for i in range(2, 5):
            add(engine, f"d{i}", 3)
        add(engine, "p0", 3, tier="priority")
        while engine.has_unfinished_requests():
            engine.step()
            admitted += [g.request_id for g in engine.scheduler.running if g.request_id not in admitted]
    assert admitted[0] == "d0" and admitted[2] == "p0", admitted  # the seat d0 freed
    assert engine.block_manager.num_free_blocks() == engine.block_manager.num_blocks


def test_on_the_cpu_auto_catch_ups_hold_decodes_and_run_keeps_them() -> None:
    """The builder tells the scheduler that a step's sequences cost it on the CPU, so "auto" holds the other
    tenants' decodes in an interactive tenant's catch-up steps there (core/scheduler.py); "run" never does."""
    assert tiny_llm().engine.scheduler.hold_decodes
    assert not tiny_llm(catch_up_decodes="run").engine.scheduler.hold_decodes
