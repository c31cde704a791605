"""Paused groups (a reader that fell behind): not scheduled, blocks kept, first victims under memory
pressure, never holding back others' admission; outputs unchanged once they run again. Driven through
test_scheduler's model-free `FakeEngine`, which checks every KV slot a sequence reads."""

from __future__ import annotations

import pytest

from tests.engine.core.test_scheduler import FakeEngine, ids, reference


def test_paused_group_is_skipped_and_keeps_its_blocks():
    eng = FakeEngine(64)
    eng.add("a", [1, 2, 3], max_tokens=8)
    eng.add("b", [4, 5, 6], max_tokens=8)
    eng.step()
    eng.sched.set_paused("a", True)
    held = list(eng.sched._groups["a"].seqs[0].block_table)
    for _ in range(3):
        assert ids(eng.step()) == [("b", 1)]
    assert eng.sched._groups["a"].seqs[0].block_table == held and eng.sched.stats().num_paused == 1
    eng.sched.set_paused("a", False)
    assert ("a", 1) in ids(eng.step())
    eng.run()
    assert eng.finished["a"] == [reference([1, 2, 3], 8)] and eng.finished["b"] == [reference([4, 5, 6], 8)]
    assert eng.sched.stats().num_paused == 0


@pytest.mark.parametrize("mode, swap_blocks", [("recompute", 0), ("swap", 64)])
def test_paused_group_is_the_first_victim_and_does_not_block_admission(mode, swap_blocks):
    eng = FakeEngine(5, mode=mode, num_swap_blocks=swap_blocks)
    eng.add("early", [1, 2, 3, 4, 5, 6, 7], max_tokens=12)  # arrived first: never the default victim
    eng.add("late", [5, 6, 7, 8], max_tokens=12)
    eng.step()
    eng.sched.set_paused("early", True)
    eng.add("new", [9, 9, 9, 9], max_tokens=2)
    for _ in range(30):
        if "late" in eng.finished and "new" in eng.finished:
            break
        eng.step()
    assert eng.finished["late"] == [reference([5, 6, 7, 8], 12)]
    assert eng.finished["new"] == [reference([9, 9, 9, 9], 2)]
    assert "early" not in eng.finished
    assert eng.sched.preemptions_swap + eng.sched.preemptions_recompute == 1  # early, and no one else
    assert all(g.request_id != "early" for g in eng.sched.running)
    assert not eng.sched.has_runnable()  # only the paused one is left
    eng.sched.set_paused("early", False)
    eng.run()
    assert eng.finished["early"] == [reference([1, 2, 3, 4, 5, 6, 7], 12)]


def test_pause_of_a_finished_request_is_ignored():
    eng = FakeEngine(16)
    eng.add("a", [1], max_tokens=1)
    eng.run()
    eng.sched.set_paused("a", True)
    assert eng.sched.stats().num_paused == 0
