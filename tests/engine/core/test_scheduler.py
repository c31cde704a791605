"""Scheduler: FCFS, budgets, chunked prefill, preemption (swap / recompute / auto), watermark, never-fit
rejection, abort, prefix caching and copy-on-write, driven through a model-free engine loop.

`FakeEngine` is LLMEngine's step without a model: it executes the swap and copy orders on a shadow KV
cache whose slots hold the token prefix that produced them, "attends" by checking every slot a sequence
reads, and samples a token that is a function of the prefix. So any lost, stale or misplaced KV fails
the run, outputs are deterministic, and a memory-starved run must reproduce an unconstrained one.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from streamd.config import SchedulerConfig
from streamd.engine.core.block_manager import BlockManager
from streamd.engine.core.scheduler import PreemptionCostModel, Scheduler
from streamd.engine.core.scheduler_output import SchedulerOutput
from streamd.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from streamd.engine.core.step_cost import StepShape, chunk_pairs
from streamd.engine.errors import ContextLengthError, KVCacheCapacityError
from streamd.engine.sampling_params import SamplingParams

CHEAP_SWAP = PreemptionCostModel(bytes_per_block=1, host_link_bytes_per_s=1e12, prefill_tokens_per_s=1.0)
CHEAP_RECOMPUTE = PreemptionCostModel(bytes_per_block=1 << 30, host_link_bytes_per_s=1.0,
                                      prefill_tokens_per_s=1e12)


def next_token(prefix: list[int], sibling: int) -> int:
    return (sum(prefix[-4:]) * 7 + len(prefix) + 13 * sibling) % 50


class FakeEngine:
    def __init__(self, num_blocks: int, block_size: int = 4, num_swap_blocks: int = 0, watermark: float = 0.0,
                 mode: str = "recompute", max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 cost_model: PreemptionCostModel | None = None, prefix_caching: bool = True,
                 max_step_ms: float = 0.0, device: Callable[[StepShape], float] | None = None) -> None:
        """`device`: the simulated seconds of a step of that shape, fed back as LLMEngine measures steps."""
        self.bs = block_size
        self.bm = BlockManager(num_blocks, block_size, num_swap_blocks, watermark, prefix_caching)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, mode, max_step_ms), self.bm,
                               4096, cost_model)
        self.device = device
        self.step_seconds: list[float] = []
        self.kv: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.forks: dict[str, int] = {}  # request -> children to fork after its first token
        self.finished: dict[str, list[list[int]]] = {}
        self.rejected: dict[str, str] = {}
        self.steps = 0

    def add(self, rid: str, prompt: list[int], max_tokens: int, forks: int = 0, admit: bool = False) -> SequenceGroup:
        """`admit`: check the request first, as LLMEngine.add_request does (otherwise a request may outgrow
        the pool, to test what the scheduler does when one does)."""
        params = SamplingParams(max_tokens=max_tokens)
        if admit:
            self.sched.admission.check(len(prompt), params)
        group = SequenceGroup(rid, [Sequence(list(prompt))], params)
        self.sched.add_seq_group(group)
        if forks:
            self.forks[rid] = forks
        return group

    def step(self) -> SchedulerOutput:
        before = self.sched.preemptions_swap + self.sched.preemptions_recompute
        out = self.sched.schedule()
        preempted = self.sched.preemptions_swap + self.sched.preemptions_recompute > before
        assert not (preempted and out.blocks_to_swap_in), "swapped in on a step that preempted (thrashing)"
        self.steps += 1
        for group, reason in out.rejected:
            self.rejected[group.request_id] = reason
        # The CacheEngine's order: swap out, swap in, copy-on-write, then the forward.
        empty = [None] * self.bs  # a block allocated for a prompt chunk not computed yet
        for src, dst in out.blocks_to_swap_out:
            self.host[dst] = list(self.kv.get(src, empty))
        for src, dst in out.blocks_to_swap_in:
            self.kv[dst] = list(self.host[src])
        for src, dst in out.blocks_to_copy:
            self.kv[dst] = list(self.kv[src])
        assert sum(i.num_new_tokens for i in out.scheduled) <= self.sched.max_num_batched_tokens
        self._check_shape(out)
        assert len({id(i.seq) for i in out.scheduled}) == len(out.scheduled)
        sampling = [item for item in out.scheduled if item.samples]
        assert out.sampling() == sampling, "SchedulerOutput.sampling: every decode samples, after the prompts"
        for item in out.scheduled:
            self._forward(item.seq, item.num_new_tokens)
        if self.device is not None and out.scheduled:
            self.step_seconds.append(self.device(out.shape))
            self.sched.observe_step(out, self.step_seconds[-1])
        self.sched.on_step_done(out)
        for item in sampling:
            self._sample(item.seq, item.group)
        for group in self.sched.free_finished([item.group for item in sampling]):
            self.finished[group.request_id] = [s.output_token_ids for s in group.seqs]
        self.check()
        return out

    @staticmethod
    def _check_shape(out: SchedulerOutput) -> None:
        """The step's shape (what the step cost model reads) counts exactly what it runs."""
        prompts = out.scheduled[:len(out.scheduled) - out.num_decode_tokens]
        assert out.shape.tokens == out.num_prefill_tokens + out.num_decode_tokens
        assert out.shape.pairs == pytest.approx(sum(chunk_pairs(i.num_new_tokens, i.seq.num_computed_tokens)
                                                    for i in prompts))

    def _forward(self, seq: Sequence, n: int) -> None:
        assert seq.status == SequenceStatus.RUNNING
        start, bs = seq.num_computed_tokens, self.bs
        assert len(seq.block_table) * bs >= start + n, "scheduled without slots"
        for pos in range(start):  # attention reads every earlier position through the page table
            slots = self.kv.get(seq.block_table[pos // bs])
            assert slots is not None and slots[pos % bs] == tuple(seq.token_ids[:pos + 1]), \
                f"seq {seq.seq_id} reads wrong KV at position {pos}"
        for pos in range(start, start + n):
            self.kv.setdefault(seq.block_table[pos // bs], [None] * bs)[pos % bs] = \
                tuple(seq.token_ids[:pos + 1])

    def _sample(self, seq: Sequence, group: SequenceGroup) -> None:
        seq.append_token(next_token(seq.token_ids, group.seqs.index(seq)))
        if seq.num_output_tokens >= group.sampling_params.max_tokens:
            self.sched.finish_seqs([seq], SequenceStatus.FINISHED_LENGTH)
        elif seq.num_output_tokens == 1 and self.forks.pop(group.request_id, 0):
            for _ in range(len(group.seqs), 3):
                self.sched.fork_seq(group, seq)

    def live_seqs(self) -> list[Sequence]:
        s = self.sched
        return [seq for g in [*s.running, *s.waiting, *s.swapped] for seq in g.seqs]

    def check(self) -> None:
        self.bm.check_invariants(self.live_seqs())

    def run(self, max_steps: int = 20_000) -> None:
        while self.sched.has_unfinished_seqs():
            self.step()
            assert self.steps < max_steps, "no progress"
        self.assert_pool_whole()

    def assert_pool_whole(self) -> None:
        self.bm.check_invariants([])
        assert self.bm.num_free_blocks() == self.bm.num_blocks
        assert self.bm.num_free_swap_blocks() == self.bm.num_swap_blocks


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, 0))
    return tokens[len(prompt):]


def ids(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(item.group.request_id, item.num_new_tokens) for item in out.scheduled]


# ---- admission and budgets ----------------------------------------------------------------------

def test_fcfs_under_max_num_seqs():
    eng = FakeEngine(64, max_num_seqs=2)
    for rid in "abc":
        eng.add(rid, [1, 2, 3], max_tokens=3)
    assert ids(eng.step()) == [("a", 3), ("b", 3)]
    assert eng.sched.num_running == 2 and eng.sched.num_waiting == 1
    eng.step()
    out = eng.step()  # a and b finish here
    assert ids(out) == [("a", 1), ("b", 1)]
    assert ids(eng.step()) == [("c", 3)]
    eng.run()
    assert eng.finished == {rid: [reference([1, 2, 3], 3)] for rid in "abc"}


def test_chunked_prefill_runs_alongside_decodes():
    eng = FakeEngine(64, max_num_batched_tokens=16)
    eng.add("short", [1, 2, 3, 4], max_tokens=10)
    eng.step()
    long_prompt = list(range(40))
    eng.add("long", long_prompt, max_tokens=2)
    chunks = []
    for _ in range(3):
        out = eng.step()
        assert ("short", 1) in ids(out), "a running decode was starved by the prefill"
        assert out.scheduled[-1].group.request_id == "short"  # prefill chunks first, then decodes
        chunks += [n for rid, n in ids(out) if rid == "long"]
        assert out.num_prefill_tokens + out.num_decode_tokens <= 16
    assert chunks == [15, 15, 10]
    eng.run()
    assert eng.finished["long"] == [reference(long_prompt, 2)]
    assert eng.finished["short"] == [reference([1, 2, 3, 4], 10)]


def test_watermark_holds_back_admission_until_memory_frees():
    eng = FakeEngine(20, watermark=0.25)  # 5 blocks must stay free
    eng.add("a", list(range(40)), max_tokens=2)  # 10 blocks (11 with its second token): admitted
    eng.step()
    eng.add("b", list(range(100, 124)), max_tokens=1)  # 6 blocks: 10 - 6 < 5
    out = eng.step()  # a's last token; it finishes
    assert ids(out) == [("a", 1)] and eng.sched.num_waiting == 1
    assert ids(eng.step()) == [("b", 24)]
    eng.run()


def test_never_fit_prompt_is_rejected_and_others_continue():
    eng = FakeEngine(10, watermark=0.1)  # 1 block of watermark: at most 9 blocks = 36 tokens
    eng.add("ok", [5, 6, 7], max_tokens=4, admit=True)
    with pytest.raises(KVCacheCapacityError, match="KV cache"):
        eng.add("huge", list(range(36)), max_tokens=1, admit=True)  # admission counts its output token too
    eng.add("fits", list(range(35)), max_tokens=1, admit=True)
    eng.run()
    assert set(eng.finished) == {"ok", "fits"}
    with pytest.raises(ContextLengthError, match="max_model_len"):
        eng.add("too-long", list(range(5000)), max_tokens=1, admit=True)
    assert "huge" not in eng.sched._groups and "too-long" not in eng.sched._groups


# ---- preemption -----------------------------------------------------------------------------------

def _three_growing(eng: FakeEngine) -> None:
    for rid in "abc":
        eng.add(rid, list(range(10 * ord(rid), 10 * ord(rid) + 8)), max_tokens=6)
    eng.step()  # prefill: 3 x 2 blocks of the 7


def test_recompute_preempts_latest_arrival_and_reprefills_it():
    eng = FakeEngine(7, mode="recompute")
    _three_growing(eng)
    out = eng.step()  # each needs a third block: only a and b get one
    assert [rid for rid, _ in ids(out)] == ["a", "b"]
    victim = eng.sched.waiting[0]
    assert victim.request_id == "c" and victim.seqs[0].num_computed_tokens == 0
    assert victim.seqs[0].status == SequenceStatus.WAITING and victim.seqs[0].block_table == []
    assert eng.sched.stats().preemptions_recompute == 1
    eng.run()
    assert eng.finished == {rid: [reference(list(range(10 * ord(rid), 10 * ord(rid) + 8)), 6)] for rid in "abc"}
    stats = eng.sched.stats()
    assert stats.recomputed_tokens > 0 and stats.preemptions_swap == 0


def test_swap_preempts_and_swapped_come_back_before_new_requests():
    eng = FakeEngine(7, num_swap_blocks=8, mode="swap")
    _three_growing(eng)
    out = eng.step()
    assert len(out.blocks_to_swap_out) == 2 and eng.sched.num_swapped == 1
    assert eng.sched.swapped[0].request_id == "c"
    eng.add("d", [1], max_tokens=1)  # would fit right now, but c is swapped out
    admitted_d = swapped_in_c = None
    while eng.sched.has_unfinished_seqs():
        out = eng.step()
        if out.blocks_to_swap_in and swapped_in_c is None:
            swapped_in_c = eng.steps
        if any(rid == "d" for rid, _ in ids(out)) and admitted_d is None:
            admitted_d = eng.steps
            assert eng.sched.num_swapped == 0
    assert swapped_in_c is not None and admitted_d > swapped_in_c
    eng.assert_pool_whole()
    stats, stats_kv = eng.sched.stats(), eng.sched.block_manager.stats()
    assert stats.preemptions_swap >= 1 and stats_kv.swapped_out_blocks >= 2 and stats_kv.swapped_in_blocks >= 1
    assert eng.finished["c"] == [reference(list(range(990, 998)), 6)]


def test_swapped_groups_come_back_in_arrival_order():
    eng = FakeEngine(6, num_swap_blocks=16, mode="swap")
    eng.add("a", [1, 2, 3, 4], max_tokens=8)  # 1 block, its second token needs another
    eng.add("l", list(range(100, 116)), max_tokens=8)  # 4 blocks, same
    eng.add("s", [7, 8, 9], max_tokens=8)  # 1 block with room
    eng.step()
    eng.step()  # a takes s's block (s swapped); l cannot grow and swaps itself out
    assert [g.request_id for g in eng.sched.swapped] == ["l", "s"]
    back = []
    while eng.sched.num_swapped:
        before = {g.request_id for g in eng.sched.swapped}
        eng.step()
        back += sorted(before - {g.request_id for g in eng.sched.swapped})
    assert back == ["l", "s"]  # s alone fits sooner, but l arrived first
    eng.run()
    assert eng.finished["s"] == [reference([7, 8, 9], 8)]


def test_swapped_mid_prompt_resumes_its_prefill_on_swap_in():
    eng = FakeEngine(10, num_swap_blocks=16, mode="swap", max_num_batched_tokens=8)
    eng.add("a", [1, 2, 3, 4], max_tokens=20)
    eng.step()
    eng.add("b", list(range(100, 132)), max_tokens=3)
    b = eng.sched.waiting[0].seqs[0]
    swapped_mid_prompt = resumed_with_chunk = False
    while eng.sched.has_unfinished_seqs():
        out = eng.step()
        if out.blocks_to_swap_out:
            swapped_mid_prompt = 0 < b.num_computed_tokens < 32
        if out.blocks_to_swap_in:
            resumed_with_chunk = any(rid == "b" and n > 1 for rid, n in ids(out))
    assert swapped_mid_prompt and resumed_with_chunk
    eng.assert_pool_whole()
    assert eng.finished["b"] == [reference(list(range(100, 132)), 3)]


def test_swap_in_keeps_the_watermark_while_others_run():
    eng = FakeEngine(6, num_swap_blocks=8, mode="swap", watermark=0.1)  # keep 1 block free
    eng.add("a", [1, 2, 3], max_tokens=20)
    eng.add("f", list(range(200, 204)), max_tokens=40)
    eng.add("c", list(range(100, 104)), max_tokens=8)
    while not eng.sched.num_swapped:
        eng.step()
    assert [g.request_id for g in eng.sched.swapped] == ["c"]
    eng.sched.abort_seq_group("f")
    assert eng.bm.num_free_blocks() == 4 and eng.bm.blocks_to_swap_in(eng.sched.swapped[0].seqs) == 3
    out = eng.step()  # a grows first; then c would leave 0 blocks free while a runs
    assert out.blocks_to_swap_in == [] and eng.bm.num_free_blocks() == 3
    eng.run()
    assert eng.finished["c"] == [reference(list(range(100, 104)), 8)]


def test_running_sequences_never_outnumber_the_token_budget():
    eng = FakeEngine(64, max_num_batched_tokens=2)
    for rid in "abc":
        eng.add(rid, [1], max_tokens=3)
    eng.step()
    assert eng.sched.num_running == 2  # so every running decode fits in each step
    eng.run()
    assert len(eng.finished) == 3


@pytest.mark.parametrize(("mode", "swap_blocks", "cost", "expect_swap"), [
    ("auto", 8, CHEAP_SWAP, True),
    ("auto", 8, CHEAP_RECOMPUTE, False),
    ("auto", 8, None, False),  # no measurements: recompute
    ("swap", 0, None, False),  # no host pool
    ("swap", 1, None, False),  # host pool too small for the victim: fall back to recompute
    ("recompute", 8, CHEAP_SWAP, False),
])
def test_preemption_mode_choice(mode, swap_blocks, cost, expect_swap):
    eng = FakeEngine(7, num_swap_blocks=swap_blocks, mode=mode, cost_model=cost)
    _three_growing(eng)
    eng.step()
    stats = eng.sched.stats()
    assert (stats.preemptions_swap, stats.preemptions_recompute) == ((1, 0) if expect_swap else (0, 1))
    eng.run()


@pytest.mark.parametrize(("mode", "swap_blocks", "counter"),
                         [("recompute", 0, "preemptions_recompute"), ("swap", 8, "preemptions_swap")])
def test_lone_group_that_outgrows_the_pool_is_preempted_then_rejected(mode, swap_blocks, counter):
    eng = FakeEngine(4, mode=mode, num_swap_blocks=swap_blocks)
    eng.add("grows", [1, 2, 3, 4], max_tokens=100)
    eng.add("small", [9], max_tokens=2)
    eng.run()  # no deadlock: it preempts itself, then cannot come back and is rejected
    assert "KV cache" in eng.rejected["grows"] and "grows" not in eng.finished
    assert eng.finished["small"] == [reference([9], 2)]
    assert getattr(eng.sched.stats(), counter) == 1


# ---- abort ----------------------------------------------------------------------------------------

def test_abort_frees_blocks_in_every_queue():
    eng = FakeEngine(7, num_swap_blocks=8, mode="swap")
    _three_growing(eng)
    eng.step()  # c swapped out
    eng.add("w", [1, 2], max_tokens=3)  # waits: c is swapped
    free_swap = eng.bm.num_free_swap_blocks()
    swapped = eng.sched.abort_seq_group("c")
    assert swapped is not None and swapped.seqs[0].status == SequenceStatus.FINISHED_ABORTED
    assert eng.bm.num_free_swap_blocks() == free_swap + 2
    free = eng.bm.num_free_blocks()
    assert eng.sched.abort_seq_group("a") is not None and eng.bm.num_free_blocks() == free + 3
    assert eng.sched.abort_seq_group("w") is not None and eng.sched.num_waiting == 0
    assert eng.sched.abort_seq_group("a") is None and eng.sched.abort_seq_group("nope") is None
    eng.check()
    eng.run()
    assert set(eng.finished) == {"b"}


# ---- prefix caching and copy-on-write --------------------------------------------------------------

def test_shared_three_block_prefix_is_served_from_cache():
    prefix = list(range(100, 148))  # 3 blocks of 16
    eng = FakeEngine(64, block_size=16)
    eng.add("first", prefix + [1, 2, 3], max_tokens=4)
    eng.step()
    second = eng.add("second", prefix + [7, 8], max_tokens=4)
    assert ids(eng.step())[0] == ("second", 2)
    assert second.num_cached_tokens == 48
    eng.run()
    assert eng.finished["second"] == [reference(prefix + [7, 8], 4)]
    stats_kv = eng.sched.block_manager.stats()
    assert stats_kv.prefix_hit_tokens == 48 and stats_kv.prefix_queried_tokens == 51 + 50

    plain = FakeEngine(64, block_size=16, prefix_caching=False)
    plain.add("second", prefix + [7, 8], max_tokens=4)
    plain.run()
    assert plain.finished["second"] == eng.finished["second"]


def test_fully_cached_prompt_still_computes_its_last_token():
    eng = FakeEngine(64, block_size=16)
    prompt = list(range(32))
    eng.add("a", prompt, max_tokens=1)
    eng.run()
    twin = eng.add("b", prompt, max_tokens=1)
    assert ids(eng.step()) == [("b", 16)] and twin.num_cached_tokens == 16
    eng.run()
    assert eng.finished["b"] == eng.finished["a"]


def test_fork_copies_the_shared_last_block_once():
    eng = FakeEngine(16)
    eng.add("n3", [1, 2, 3, 4, 5, 6], max_tokens=5, forks=2)
    eng.step()  # prefill + first token, then two children share every block
    group = eng.sched.running[0]
    assert len(group.seqs) == 3
    out = eng.step()
    assert len(out.blocks_to_copy) == 2 and len(out.scheduled) == 3  # 3 writers, the last keeps the block
    eng.run()
    outs = eng.finished["n3"]
    assert len({tuple(o) for o in outs}) == 3 and all(len(o) == 5 for o in outs)


@pytest.mark.parametrize(("mode", "swap_blocks"), [("recompute", 0), ("swap", 16)])
def test_group_that_forked_past_the_limits_still_comes_back(mode, swap_blocks):
    eng = FakeEngine(6, max_num_seqs=2, max_num_batched_tokens=2, mode=mode, num_swap_blocks=swap_blocks)
    eng.add("b", [7, 8], max_tokens=12)
    eng.add("n3", [1, 2, 3, 4, 5], max_tokens=6, forks=2)  # 3 sequences: more than either limit
    while getattr(eng.sched.stats(), "preemptions_" + mode) == 0:
        eng.step()
    assert [g.request_id for g in [*eng.sched.waiting, *eng.sched.swapped]] == ["n3"]
    eng.run()  # n3 comes back once it is alone, though it alone exceeds max_num_seqs
    assert getattr(eng.sched.stats(), "preemptions_" + mode) == 1
    assert len(eng.finished["n3"]) == 3 and all(len(o) == 6 for o in eng.finished["n3"])


# ---- whole runs under memory pressure ---------------------------------------------------------------

def _workload(seed: int) -> list[tuple[str, list[int], int, int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(50) for _ in range(12)]
    requests = []
    for i in range(24):
        prompt = (shared[:rng.choice([0, 4, 8, 12])] + [rng.randrange(50) for _ in range(rng.randrange(1, 20))])
        requests.append((f"r{i}", prompt, rng.randrange(1, 24), 2 if rng.random() < 0.2 else 0))
    return requests


def _run(requests, **kwargs) -> FakeEngine:
    eng = FakeEngine(max_num_seqs=12, max_num_batched_tokens=24, **kwargs)
    pending = list(requests)
    while pending or eng.sched.has_unfinished_seqs():
        for _ in range(min(3, len(pending))):  # requests keep arriving while others run
            rid, prompt, max_tokens, forks = pending.pop(0)
            eng.add(rid, prompt, max_tokens, forks)
        eng.step()
        assert eng.steps < 5000
    eng.assert_pool_whole()
    return eng


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("mode", "swap_blocks", "cost"), [
    ("recompute", 0, None), ("swap", 40, None), ("auto", 40, CHEAP_SWAP), ("auto", 6, CHEAP_SWAP)])
def test_starved_pool_reproduces_unconstrained_outputs(seed, mode, swap_blocks, cost):
    requests = _workload(seed)
    free = _run(requests, num_blocks=400)
    assert free.sched.stats().preemptions_swap + free.sched.stats().preemptions_recompute == 0
    tight = _run(requests, num_blocks=24, num_swap_blocks=swap_blocks, mode=mode, cost_model=cost,
                 watermark=0.05)
    assert tight.rejected == {} and tight.finished == free.finished
    stats, stats_kv = tight.sched.stats(), tight.sched.block_manager.stats()
    if mode == "recompute" or swap_blocks < 10:  # a small host pool fills up: recompute takes over
        assert stats.preemptions_recompute > 0 and stats.recomputed_tokens > 0
    if mode != "recompute":
        assert stats.preemptions_swap > 0 and stats_kv.swapped_in_blocks > 0
    assert stats_kv.prefix_hit_tokens > 0
