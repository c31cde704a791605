"""The disk tier in a real engine (a small random-weight model on the CPU): a prefix evicted from the device
by other traffic comes back from disk (cached tokens reported, greedy output identical to an engine without
the tier), an engine restarted on the same directory finds it (the device's and the host tier's cached
blocks are written at close, most recently used first), a tampered or truncated file is skipped and the
output stays the same, and no block leaks in either pool or tier after cancels and preemption."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest

from streamd.engine.core import disk_tier
from streamd.engine.core.kv_tiers import BlockKey
from streamd.engine.core.prefix_cache import ROOT_HASH, hash_block
from streamd.engine.sampling_params import SamplingParams
from tests.helpers import fold_deltas, random_prompt, run_to_completion, tiny_llm

BS = 8
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, detokenize=False)
PROMPT = random_prompt(1, 5 * BS + 3)  # 5 full blocks
TRAFFIC = [random_prompt(10 + i, 6 * BS) for i in range(3)]  # enough to evict PROMPT's cached blocks
FULL_BLOCKS_TOKENS = 5 * BS


def engine(directory: Path | None):
    extra = {} if directory is None else {"cache.disk_cache_dir": str(directory)}
    return tiny_llm(num_kv_blocks=12, num_swap_blocks=0, **extra)


def evict_then_ask(llm) -> tuple[list[int], int]:
    """Generates PROMPT after traffic that evicts its blocks from the device; its tokens and cached tokens."""
    for prompt in TRAFFIC:
        llm.generate([prompt], GREEDY)
    (out,) = llm.generate([PROMPT], GREEDY)
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_evicted_prefix_returns_from_disk_and_after_a_restart(tmp_path: Path) -> None:
    plain = engine(None)
    plain.generate([PROMPT], GREEDY)
    expected, plain_cached = evict_then_ask(plain)
    assert plain_cached == 0  # without the tier the prefix is recomputed

    tiered = engine(tmp_path)
    (first,) = tiered.generate([PROMPT], GREEDY)
    assert first.outputs[0].token_ids == expected
    tokens, cached = evict_then_ask(tiered)
    assert (tokens, cached) == (expected, FULL_BLOCKS_TOKENS)
    (disk,) = tiered.engine.stats().kv.tiers
    assert disk.hit_blocks == 5 and disk.bytes_read > 0 and disk.bytes_written > 0
    tiered.engine.close()  # as at shutdown: the device's cached blocks go to disk too

    restarted = engine(tmp_path)
    (again,) = restarted.generate([PROMPT], GREEDY)
    assert (again.outputs[0].token_ids, again.num_cached_tokens) == (expected, FULL_BLOCKS_TOKENS)
    restarted.engine.close()


def with_host_tier(directory: Path, **extra):
    """`engine(directory)` with a host tier of 64 blocks above the disk tier."""
    probe = tiny_llm(num_kv_blocks=4, num_swap_blocks=0)
    gib = 64 * probe.engine.cache.layout.bytes_per_block / 2**30
    return tiny_llm(num_kv_blocks=12, num_swap_blocks=0, **{"cache.host_cache_gib": gib,
                                                           "cache.disk_cache_dir": str(directory), **extra})


def first_block_key(prompt: list[int]) -> BlockKey:
    return BlockKey(hash_block(ROOT_HASH, prompt[:BS]), ROOT_HASH, tuple(prompt[:BS]))


def restarted_answer(directory: Path) -> tuple[list[int], int]:
    """PROMPT's greedy tokens and cached tokens on a fresh engine over `directory`."""
    restarted = engine(directory)
    (out,) = restarted.generate([PROMPT], GREEDY)
    restarted.engine.close()
    return out.outputs[0].token_ids, out.num_cached_tokens


@pytest.mark.parametrize("where", ["host", "device"])
def test_a_restart_finds_the_prompt_cached_at_close_wherever_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Issue 31's H200 run, scaled down: at close the device and the host tier cached more blocks than the
    disk tier's background writer holds in memory (there 256 MiB: ~700 of ~5,000 blocks; here none), and
    the prompt had been sent before the other traffic (its blocks in the host tier) or after it (on the
    device, as the system prompt was there). Close writes them itself, so a restart finds them."""
    expected, _ = evict_then_ask(engine(None))
    monkeypatch.setattr(disk_tier, "_MAX_PENDING_BYTES", 0)  # the writer takes no spill
    tiered = with_host_tier(tmp_path)
    for prompt in [PROMPT, *TRAFFIC] if where == "host" else [*TRAFFIC, PROMPT]:
        tiered.generate([prompt], GREEDY)
    bm, key = tiered.engine.block_manager, first_block_key(PROMPT)
    assert bm.host_cache.contains(key) == (where == "host")
    assert (key.block_hash in bm.findable_blocks()) == (where == "device")
    tiered.engine.close()
    assert restarted_answer(tmp_path) == (expected, FULL_BLOCKS_TOKENS)


def test_close_keeps_the_most_recent_prefixes_the_disk_bound_holds(tmp_path: Path) -> None:
    """The disk tier holds 8 blocks; at close the host tier caches older traffic (18 blocks) and the device
    the prompt just answered: the prompt's blocks are kept, the oldest traffic is not."""
    expected, _ = evict_then_ask(engine(None))
    probe = tiny_llm(num_kv_blocks=4, num_swap_blocks=0)
    file_gib = (probe.engine.cache.layout.bytes_per_block + 48 + 8 * BS) / 2**30
    tiered = with_host_tier(tmp_path, **{"cache.disk_cache_gib": 8 * file_gib})
    for prompt in [*TRAFFIC, PROMPT]:
        tiered.generate([prompt], GREEDY)
    tiered.engine.close()
    assert len(list(tmp_path.glob("*/*.kv"))) == 8
    assert restarted_answer(tmp_path) == (expected, FULL_BLOCKS_TOKENS)


def roomy_tiered(directory: Path):
    """An engine with a host tier above the disk tier and room for the warm-up's requests (up to 300 tokens)."""
    probe = tiny_llm(num_kv_blocks=4, num_swap_blocks=0)
    gib = 64 * probe.engine.cache.layout.bytes_per_block / 2**30
    return tiny_llm(num_kv_blocks=48, num_swap_blocks=0, **{"cache.host_cache_gib": gib,
                                                           "cache.disk_cache_dir": str(directory)})


def test_a_restarted_engines_warm_up_leaves_the_tiers_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31's second H200 run: the system prompt was on disk, yet no restarted engine reused any of it.
    Its warm-up (`LLMEngine.from_config` runs it on CUDA only) read the previous engine's warm-up blocks back
    from disk, those reads took longer than the start-up probe's, and their measured time shut the tier
    (reading lost to recomputing) before the first real request. Here every read after the start measures
    1 s: the warm-up must read nothing, so the tier decides on its probe and the prompt is restored."""
    expected, _ = evict_then_ask(engine(None))
    first = roomy_tiered(tmp_path)
    first.engine.warm_up()
    first.generate([PROMPT], GREEDY)
    first.engine.close()
    restarted = roomy_tiered(tmp_path)
    tier = restarted.engine.block_manager.tier
    warm_up_block = [(7 * j + 300) % 300 for j in range(BS)]  # (builder.warm_up's longest prompt here)
    assert tier.contains(BlockKey(hash_block(ROOT_HASH, warm_up_block), ROOT_HASH, tuple(warm_up_block)))
    slow_reads = itertools.count(0.0, 1.0)
    monkeypatch.setattr(disk_tier, "_timer", lambda: next(slow_reads))
    restarted.engine.warm_up()
    assert tier.hit_blocks == 0 and tier.worth_reading()
    (out,) = restarted.generate([PROMPT], GREEDY)
    assert (out.outputs[0].token_ids, out.num_cached_tokens) == (expected, FULL_BLOCKS_TOKENS)
    assert tier.hit_blocks == 5 and not tier.worth_reading()  # (those reads measured 1 s each)
    restarted.engine.close()


def tamper(file: Path) -> None:
    """Flips the last byte of the block's payload: found by the checksum when the block is read."""
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x55
    file.write_bytes(bytes(data))


def truncate(file: Path) -> None:
    """Cuts the block's last 100 bytes (a crash mid-copy): found by the size when the directory is indexed."""
    file.write_bytes(file.read_bytes()[:-100])


@pytest.mark.parametrize(("corrupt", "skipped"), [(tamper, 1), (truncate, None)])
def test_a_corrupt_file_is_skipped_and_the_output_unchanged(tmp_path: Path, corrupt, skipped: int | None) -> None:
    """`skipped`: files skipped (tampered: the chain stops at its first block; truncated: every file, at start)."""
    writer = engine(tmp_path)
    (first,) = writer.generate([PROMPT], GREEDY)
    writer.engine.close()
    files = sorted(tmp_path.glob("*/*.kv"))
    assert files
    for file in files:
        corrupt(file)
    reader = engine(tmp_path)
    (again,) = reader.generate([PROMPT], GREEDY)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == 0
    assert reader.engine.stats().kv.tiers[0].skipped_files == (skipped or len(files))
    reader.engine.close()


def test_host_tier_on_the_cpu_then_disk_below_it(tmp_path: Path) -> None:
    """The host tier's logic on the CPU (a device pool and a separate host pool, as swap preemption is
    tested): evicted blocks come back from host memory; with a host pool of 2 blocks the rest of the chain
    continues on disk."""
    plain = engine(None)
    plain.generate([PROMPT], GREEDY)
    expected, _ = evict_then_ask(plain)
    block_gib = plain.engine.cache.layout.bytes_per_block / 2**30

    host_only = tiny_llm(num_kv_blocks=12, num_swap_blocks=0, **{"cache.host_cache_gib": 64 * block_gib})
    host_only.generate([PROMPT], GREEDY)
    assert evict_then_ask(host_only) == (expected, FULL_BLOCKS_TOKENS)
    (host,) = host_only.engine.stats().kv.tiers
    assert (host.name, host.hit_blocks) == ("host", 5)

    both = tiny_llm(num_kv_blocks=12, num_swap_blocks=0, **{"cache.host_cache_gib": 2.5 * block_gib,
                                                           "cache.disk_cache_dir": str(tmp_path)})
    both.generate([PROMPT], GREEDY)
    assert evict_then_ask(both) == (expected, FULL_BLOCKS_TOKENS)
    host, disk = both.engine.stats().kv.tiers
    assert host.hit_blocks + disk.hit_blocks == 5 and disk.hit_blocks > 0
    both.engine.close()


def tight_tiered(mode: str, directory: Path):
    """A pool that holds about two of LEAK_PROMPTS' requests, a host tier of 3 blocks and a disk tier bounded
    to 12 blocks (so both tiers evict too), preempting by `mode`."""
    probe = tiny_llm(num_kv_blocks=4, num_swap_blocks=0)
    block_gib = probe.engine.cache.layout.bytes_per_block / 2**30
    file_gib = (probe.engine.cache.layout.bytes_per_block + 48 + 8 * BS) / 2**30
    return tiny_llm(num_kv_blocks=14, num_swap_blocks=16 if mode == "swap" else 0, preemption_mode=mode,
                    **{"cache.host_cache_gib": 3 * block_gib, "cache.disk_cache_dir": str(directory),
                       "cache.disk_cache_gib": 12 * file_gib})


SHARED = random_prompt(30, 3 * BS)
LEAK_PROMPTS = [SHARED + random_prompt(31 + i, 5) for i in range(7)]


def run_with_aborts(engine, which: range, params: SamplingParams, aborts: dict[int, str], folded: dict) -> None:
    """Adds LEAK_PROMPTS[which] (as "r<i>") and steps until idle, aborting `aborts[k]` before step k."""
    for i in which:
        engine.add_request(f"r{i}", LEAK_PROMPTS[i], params)
    step = 0
    while engine.has_unfinished_requests():
        if step in aborts:
            engine.abort(aborts[step])
        fold_deltas(engine.step(), folded)
        step += 1


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_no_block_leaks_in_either_tier_after_cancels_and_preemption(tmp_path: Path, mode: str) -> None:
    """Requests sharing a prefix through a pool too small for them: preempted, some cancelled while running
    or waiting; then traffic evicts the prefix to the tiers, and two more requests restore it, one cancelled
    just after. The rest finish with the greedy output of a roomy engine without tiers; afterwards every
    device and host block is free, the block manager is consistent, and the disk tier's index matches its
    files."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, detokenize=False)
    roomy = tiny_llm(num_kv_blocks=200, num_swap_blocks=0, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in run_to_completion(roomy.engine, LEAK_PROMPTS, params)]
    engine = tight_tiered(mode, tmp_path).engine
    folded: dict = {}
    run_with_aborts(engine, range(5), params, {6: "r1", 12: "r4"}, folded)  # r1 running, r4 queued or preempted
    run_to_completion(engine, TRAFFIC, params)
    run_with_aborts(engine, range(5, 7), params, {2: "r6"}, folded)
    outputs = {rid: builder.build().outputs[0] for rid, builder in folded.items()}
    assert {outputs[r].finish_reason for r in ("r1", "r4", "r6")} == {"abort"}
    assert [outputs[f"r{i}"].token_ids for i in (0, 2, 3, 5)] == [expected[i] for i in (0, 2, 3, 5)]
    stats = engine.stats()
    preempted = stats.scheduler.preemptions_swap if mode == "swap" else stats.scheduler.preemptions_recompute
    host, disk = stats.kv.tiers
    assert preempted > 0 and host.hit_blocks + disk.hit_blocks > 0, stats
    assert stats.pool_whole, stats.kv
    engine.block_manager.check_invariants([])
    engine.block_manager.tier.check_invariants()
    engine.close()
    engine.block_manager.tier.check_invariants()


def test_the_files_are_keyed_by_the_weights_and_quantization_not_the_models_name(tmp_path: Path) -> None:
    """Through the real builder: engines whose models share a name ("random-llama") but not their weights
    (another seed) or their quantization write to different directories; the same model finds its own."""
    def digest(**extra) -> int:
        llm = tiny_llm(num_kv_blocks=12, num_swap_blocks=0, **{"cache.disk_cache_dir": str(tmp_path), **extra})
        assert llm.engine.model_name == "random-llama"
        llm.engine.close()
        return llm.engine.block_manager.tier.digest

    base = digest()
    assert digest() == base
    assert digest(seed=6) != base
    assert digest(**{"model.quantization": "int8"}) != base


class GatedDisk:
    """A slow disk as a test double: the reader thread's reads wait for `gate`; reads on the engine's thread
    (inside a step) are counted."""

    def __init__(self, tier, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate, self.in_step_reads = threading.Event(), 0
        verified = tier._verified

        def slow(path, key):
            if threading.current_thread() is threading.main_thread():
                self.in_step_reads += 1
            else:
                self.gate.wait()
            return verified(path, key)

        monkeypatch.setattr(tier, "_verified", slow)


def test_a_prefix_on_a_slow_disk_is_read_ahead_not_inside_a_step_others_run_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31's stall target: restores never stretch a step. While another request decodes, the request
    whose prefix is on disk waits for the disk tier's reader (blocked here until released) instead of reading
    its chain inside the step; once read, it is admitted with every full block cached, from memory (no read
    in any step), and both outputs equal an engine's without the tier."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False)
    other = random_prompt(40, 5)
    plain = engine(None).engine
    expected = [o.outputs[0].token_ids for o in run_to_completion(plain, [other, PROMPT], params)]
    tiered = engine(tmp_path)
    tiered.generate([PROMPT], GREEDY)
    for prompt in TRAFFIC:  # evicts PROMPT's blocks to disk
        tiered.generate([prompt], GREEDY)
    eng, tier = tiered.engine, tiered.engine.block_manager.tier
    tier.flush()
    disk = GatedDisk(tier, monkeypatch)
    folded: dict = {}
    eng.add_request("other", other, params)
    fold_deltas(eng.step(), folded)
    eng.add_request("prompt", PROMPT, params)
    for _ in range(3):  # the reader is stuck: "prompt" waits, "other" decodes, no step reads a file
        fold_deltas(eng.step(), folded)
        assert [g.request_id for g in eng.scheduler.waiting] == ["prompt"]
    assert disk.in_step_reads == 0 and tier.hit_blocks == 0
    disk.gate.set()
    tier.wait_read_ahead()
    while eng.has_unfinished_requests():
        fold_deltas(eng.step(), folded)
    outputs = {rid: b.build() for rid, b in folded.items()}
    assert [outputs[r].outputs[0].token_ids for r in ("other", "prompt")] == expected
    assert outputs["prompt"].num_cached_tokens == FULL_BLOCKS_TOKENS
    assert disk.in_step_reads == 0 and tier.hit_blocks == 5
    eng.close()


class StepSpy:
    """Records, step by step, the host restores the engine issues ahead and the requests each forward computes."""

    def __init__(self, eng, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ahead: list[list[tuple[int, int]]] = []
        self.computed: list[set[str]] = []
        executor = eng.executor
        swap_in_ahead, execute = executor.swap_in_ahead, executor.execute

        def ahead(pairs):
            self.ahead[-1] += pairs
            swap_in_ahead(pairs)

        def forward(out, *args):
            self.computed[-1] |= {item.group.request_id for item in out.scheduled}
            return execute(out, *args)

        monkeypatch.setattr(executor, "swap_in_ahead", ahead)
        monkeypatch.setattr(executor, "execute", forward)

    def step(self, eng, folded: dict) -> None:
        self.ahead.append([])
        self.computed.append(set())
        fold_deltas(eng.step(), folded)


def host_tiered_with_prompt_evicted():
    """An engine with a host tier of 64 blocks (on the CPU, as swap is tested) whose device evicted PROMPT's
    cached blocks to it."""
    probe = tiny_llm(num_kv_blocks=4, num_swap_blocks=0)
    gib = 64 * probe.engine.cache.layout.bytes_per_block / 2**30
    llm = tiny_llm(num_kv_blocks=12, num_swap_blocks=0, **{"cache.host_cache_gib": gib})
    llm.generate([PROMPT], GREEDY)
    for prompt in TRAFFIC:
        llm.generate([prompt], GREEDY)
    return llm.engine


AHEAD_PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False)
OTHER = random_prompt(40, 5)


def start_restoring_beside_other(eng, spy: StepSpy, folded: dict) -> None:
    """"other" runs; then "prompt", whose prefix is in the host tier, is admitted beside it."""
    eng.add_request("other", OTHER, AHEAD_PARAMS)
    spy.step(eng, folded)
    eng.add_request("prompt", PROMPT, AHEAD_PARAMS)
    spy.step(eng, folded)


def test_a_host_hit_beside_other_work_is_swapped_in_a_step_before_it_computes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 31: matched host blocks are swapped in before the step that needs them, overlapped with the step
    before. The step that admits "prompt" beside a decoding request issues its 5 host blocks' swap-in ahead
    and computes only "other"; the next step computes "prompt" with every full block cached. Both outputs
    equal an engine's without tiers, and no block is left held. A request alone in its step swaps in and
    computes at once (nothing to overlap with)."""
    expected = [o.outputs[0].token_ids for o in run_to_completion(engine(None).engine, [OTHER, PROMPT], AHEAD_PARAMS)]
    eng = host_tiered_with_prompt_evicted()
    spy, folded = StepSpy(eng, monkeypatch), {}
    start_restoring_beside_other(eng, spy, folded)
    assert len(spy.ahead[-1]) == 5 and spy.computed[-1] == {"other"}
    assert [g.request_id for g in eng.scheduler.running] == ["other", "prompt"]
    spy.step(eng, folded)
    assert spy.ahead[-1] == [] and "prompt" in spy.computed[-1]
    while eng.has_unfinished_requests():
        spy.step(eng, folded)
    outputs = {rid: b.build() for rid, b in folded.items()}
    assert [outputs[r].outputs[0].token_ids for r in ("other", "prompt")] == expected
    assert outputs["prompt"].num_cached_tokens == FULL_BLOCKS_TOKENS
    assert eng.stats().kv.tiers[0].hit_blocks == 5
    assert eng.stats().pool_whole
    eng.block_manager.check_invariants([])

    alone = host_tiered_with_prompt_evicted()
    spy, folded = StepSpy(alone, monkeypatch), {}
    alone.add_request("prompt", PROMPT, AHEAD_PARAMS)
    spy.step(alone, folded)
    assert spy.ahead == [[]] and spy.computed == [{"prompt"}]
    while alone.has_unfinished_requests():
        spy.step(alone, folded)
    assert folded["prompt"].build().outputs[0].token_ids == expected[1]
    assert alone.stats().kv.tiers[0].hit_blocks == 5


def test_a_request_aborted_while_its_host_blocks_arrive_frees_every_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled between the step that issued its swap-in ahead and the one it would compute in: its blocks
    (the restored prefix stays cached, as a computed one would) all go back; "other" is unaffected."""
    expected = run_to_completion(engine(None).engine, [OTHER], AHEAD_PARAMS)[0].outputs[0].token_ids
    eng = host_tiered_with_prompt_evicted()
    spy, folded = StepSpy(eng, monkeypatch), {}
    start_restoring_beside_other(eng, spy, folded)
    assert len(spy.ahead[-1]) == 5 and spy.computed[-1] == {"other"}
    eng.abort("prompt")
    live = [seq for group in eng.scheduler.running for seq in group.seqs]
    assert [s.seq_id for s in live] == [eng.scheduler.running[0].seqs[0].seq_id]
    eng.block_manager.check_invariants(live)
    assert eng.block_manager.num_free_blocks() == eng.block_manager.num_blocks - len(live[0].block_table)
    while eng.has_unfinished_requests():
        spy.step(eng, folded)
    assert all("prompt" not in computed for computed in spy.computed)
    outputs = {rid: b.build() for rid, b in folded.items()}
    assert outputs["prompt"].outputs[0].finish_reason == "abort"
    assert outputs["other"].outputs[0].token_ids == expected
    assert eng.stats().pool_whole
    eng.block_manager.check_invariants([])
