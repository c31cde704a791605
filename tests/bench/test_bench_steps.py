"""The step-at-a-time helpers the profiling scripts in benchmarks/ share (`bench/offline.py`), on a tiny model on
the CPU: a batch brought to decoding, the schedules recorded, everything aborted with the pool whole again."""

from __future__ import annotations

from streamd import LLM
from streamd.bench.offline import abort_all, all_decoding, fill_decoding, ms_per_call, schedules
from tests.helpers import register_engine, tiny_config


def test_a_batch_decodes_is_recorded_and_aborted() -> None:
    engine = register_engine(LLM(tiny_config(), device="cpu", dtype="float32", num_kv_blocks=64).engine)
    assert all_decoding(engine)  # (nothing waits, nothing prefills)
    fill_decoding(engine, 3, 20, 50, salt=1)
    assert all_decoding(engine) and engine.stats().scheduler.num_running == 3
    prompts = {tuple(r.group.seqs[0].prompt_token_ids) for r in engine.requests}
    assert len(prompts) == 3  # each request its own prompt
    with schedules(engine) as planned:
        assert ms_per_call(engine.step, 2) > 0
    assert [(out.num_decode_tokens, out.num_prefill_tokens) for out in planned] == [(3, 0), (3, 0)]
    assert "schedule" not in vars(engine.scheduler)  # the scheduler's own method again
    abort_all(engine)
    stats = engine.stats()
    assert not engine.has_unfinished_requests() and stats.kv.blocks_free == stats.kv.blocks_total
