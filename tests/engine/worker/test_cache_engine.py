"""CacheEngine swap and copy orders on CPU tensors (the device pool and the swap pool are two host tensors
here, and the same code runs as on CUDA): round trips equal the expected blocks for scattered pairs, many
short runs, long runs, host blocks in any order, chunked staging; `plan_swap` picks staging only where it
saves copies. Also the pure parts of benchmarks/swap.py (block-manager layouts, cost rows, markdown). A
CUDA variant of the round trip runs on the device machine (marked cuda)."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import streamd.kernels.reference as reference_ops
from streamd.engine.core.scheduler import PreemptionCostModel
from streamd.engine.worker.cache_engine import (
    DIRECT_RUN_BYTES,
    STAGING_BYTES,
    CacheEngine,
    KVLayout,
    _rows,
    contiguous_runs,
    plan_swap,
    staged_chunks,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)  # 512 B/block


def _engine(num_blocks: int = 64, num_swap_blocks: int = 48, layout: KVLayout = LAYOUT,
            device: str = "cpu") -> CacheEngine:
    cache = CacheEngine(layout, num_blocks, num_swap_blocks, torch.device(device), reference_ops)
    cache.direct_run_bytes = DIRECT_RUN_BYTES  # the CUDA default, so the staged path runs on CPU too
    gen = torch.Generator().manual_seed(0)
    cache.kv_cache.copy_(torch.randn(cache.kv_cache.shape, generator=gen).to(layout.dtype))
    cache.swap_cache.copy_(torch.randn(cache.swap_cache.shape, generator=gen).to(layout.dtype))
    return cache


def _scattered(num_blocks: int, num_swap_blocks: int, n: int, seed: int, host_order: str) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    device = rng.sample(range(num_blocks), n)
    host = {"ascending": list(range(n)), "descending": list(range(n - 1, -1, -1)),
            "random": rng.sample(range(num_swap_blocks), n)}[host_order]
    return list(zip(device, host))


def _round_trip(cache: CacheEngine, out: list[tuple[int, int]], dest: list[int]) -> None:
    """Swaps `out` to the host, checks the host blocks, clobbers the sources, swaps back into `dest`
    (the device block for each pair, in order) and checks those; untouched blocks must stay as they were."""
    before_kv = cache.kv_cache.clone()
    before_swap = cache.swap_cache.clone()
    cache.swap_out(out)
    touched_host = {h for _, h in out}
    for d, h in out:
        assert torch.equal(cache.swap_cache[h], before_kv[d])
    for h in range(cache.num_swap_blocks):
        if h not in touched_host:
            assert torch.equal(cache.swap_cache[h], before_swap[h])
    for d, _ in out:
        cache.kv_cache[d].fill_(-7.0)
    cache.swap_in([(h, d2) for (_, h), d2 in zip(out, dest)])
    for (d, _), d2 in zip(out, dest):
        assert torch.equal(cache.kv_cache[d2], before_kv[d])
    untouched = set(range(cache.num_blocks)) - {d for d, _ in out} - set(dest)
    for b in untouched:
        assert torch.equal(cache.kv_cache[b], before_kv[b])


# ---- plan_swap ----------------------------------------------------------------------------------------

def test_contiguous_pairs_are_one_direct_copy() -> None:
    plan = plan_swap([(i + 3, i) for i in range(40)], bytes_per_block=512)
    assert plan.chunks is None and plan.runs == [(3, 0, 40)] and plan.num_host_copies == 1


def test_scattered_device_blocks_are_staged_with_one_copy_per_host_run() -> None:
    pairs = [(2 * i, i) for i in range(40)]  # every other device block, host blocks contiguous
    plan = plan_swap(pairs, bytes_per_block=512)
    assert len(plan.runs) == 40 and plan.chunks is not None
    assert plan.num_host_copies == 1
    assert plan.chunks[0].device_blocks == [2 * i for i in range(40)]
    assert plan.chunks[0].host_runs == [(0, 0, 40)]


def test_descending_host_blocks_sort_into_one_run() -> None:
    pairs = [(i, 39 - i) for i in range(40)]  # what the block manager hands out after a round trip
    plan = plan_swap(pairs, bytes_per_block=512)
    assert plan.chunks is not None and plan.num_host_copies == 1
    assert plan.chunks[0].device_blocks == list(range(39, -1, -1))


def test_long_runs_stay_direct() -> None:
    bpb = 1 << 20  # 1 MiB blocks, runs of 16 = 16 MiB each: issuing them directly costs nothing
    pairs = [(d, h) for r in range(4) for d, h in zip(range(100 * r, 100 * r + 16), range(16 * r, 16 * r + 16))]
    plan = plan_swap(pairs, bpb)
    assert plan.chunks is None and len(plan.runs) == 4


def test_host_as_scattered_as_device_stays_direct() -> None:
    pairs = [(3 * i, 5 * i) for i in range(30)]
    assert plan_swap(pairs, 512).chunks is None


def test_direct_run_bytes_zero_forces_direct() -> None:
    assert plan_swap([(2 * i, i) for i in range(40)], 512, direct_run_bytes=0).chunks is None


def test_staged_chunks_are_bounded_and_cover_every_pair_once() -> None:
    pairs = _scattered(1000, 1000, 300, seed=1, host_order="random")
    chunks = staged_chunks(pairs, max_blocks=7)
    assert all(len(c.device_blocks) <= 7 for c in chunks)
    rebuilt = []
    for c in chunks:
        for offset, h, n in c.host_runs:
            rebuilt += [(c.device_blocks[offset + k], h + k) for k in range(n)]
        assert sum(n for _, _, n in c.host_runs) == len(c.device_blocks)
    assert sorted(rebuilt) == sorted(pairs)


def test_defaults_are_sane() -> None:
    assert STAGING_BYTES >= DIRECT_RUN_BYTES > 0
    # Without CUDA a copy is a memcpy with nothing to amortize: direct by default.
    assert CacheEngine(LAYOUT, 4, 4, torch.device("cpu"), reference_ops).direct_run_bytes == 0


# ---- CacheEngine round trips on CPU ---------------------------------------------------------------------

@pytest.mark.parametrize("host_order", ["ascending", "descending", "random"])
@pytest.mark.parametrize("staging_blocks", [1, 5, 1000])
def test_scattered_round_trip(host_order: str, staging_blocks: int) -> None:
    cache = _engine()
    cache.staging_bytes = staging_blocks * LAYOUT.bytes_per_block
    pairs = _scattered(cache.num_blocks, cache.num_swap_blocks, 30, seed=2, host_order=host_order)
    _round_trip(cache, pairs, [d for d, _ in pairs])


def test_round_trip_into_other_device_blocks() -> None:
    cache = _engine()
    pairs = _scattered(cache.num_blocks, cache.num_swap_blocks, 20, seed=3, host_order="descending")
    used = {d for d, _ in pairs}
    dest = random.Random(4).sample([b for b in range(cache.num_blocks) if b not in used], 20)
    _round_trip(cache, pairs, dest)


def test_many_short_runs_mixed_with_long_ones() -> None:
    cache = _engine(num_blocks=128, num_swap_blocks=96)
    cache.staging_bytes = 9 * LAYOUT.bytes_per_block  # chunk boundaries fall inside runs
    pairs = [(d, h) for d, h in zip(range(10, 40), range(30))]  # one long run
    pairs += [(50 + 3 * i, 30 + i) for i in range(20)]  # many one-block runs
    pairs += [(120 - 2 * i, 90 - i) for i in range(5)]  # descending, scattered
    random.Random(5).shuffle(pairs)
    assert plan_swap(pairs, LAYOUT.bytes_per_block, cache.staging_bytes).chunks is not None
    _round_trip(cache, pairs, [d for d, _ in pairs])


@pytest.mark.parametrize("direct_run_bytes", [0, DIRECT_RUN_BYTES])
def test_contiguous_and_forced_direct_round_trips(direct_run_bytes: int) -> None:
    cache = _engine()
    cache.direct_run_bytes = direct_run_bytes
    _round_trip(cache, [(i, i) for i in range(32)], list(range(32)))
    _round_trip(cache, _scattered(64, 48, 25, seed=6, host_order="ascending"), list(range(25)))


def test_empty_orders_are_no_ops() -> None:
    cache = _engine()
    before = cache.kv_cache.clone()
    cache.swap_out([])
    cache.swap_in([])
    cache.copy([])
    assert torch.equal(cache.kv_cache, before)


def test_bfloat16_blocks_round_trip_bit_exact_through_word_rows() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.bfloat16)
    cache = _engine(layout=layout)
    assert cache._kv_rows.dtype == torch.int64  # 128 B per block: moved as 16 words
    _round_trip(cache, _scattered(64, 48, 30, seed=7, host_order="descending"), list(range(30, 60)))


def test_rows_fall_back_to_bytes_and_handle_an_empty_pool() -> None:
    odd = torch.zeros((5, 12), dtype=torch.uint8)  # 12 bytes per block: no 8-byte words
    assert _rows(odd).dtype == torch.uint8 and _rows(odd).shape == (5, 12)
    empty = torch.zeros((0, 512), dtype=torch.uint8)
    assert _rows(empty).shape == (0, 64)  # 512 B = 64 words
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=3, block_size=1, dtype=torch.bfloat16)
    cache = _engine(num_blocks=16, num_swap_blocks=16, layout=layout)
    _round_trip(cache, [(2 * i, 15 - i) for i in range(8)], [2 * i for i in range(8)])
    assert CacheEngine(LAYOUT, 4, 0, torch.device("cpu"), reference_ops).num_swap_blocks == 0


def test_copy_on_write_orders() -> None:
    cache = _engine()
    before = cache.kv_cache.clone()
    pairs = [(1, 9), (3, 4), (20, 2)]
    cache.copy(pairs)
    for s, d in pairs:
        assert torch.equal(cache.kv_cache[d], before[s])


def test_contiguous_runs() -> None:
    assert contiguous_runs([(5, 1), (3, 8), (4, 9), (6, 2), (7, 7)]) == [(3, 8, 2), (5, 1, 2), (7, 7, 1)]


def test_engine_swap_preemption_through_the_staged_path(monkeypatch) -> None:
    """Greedy outputs under swap preemption with every swap staged equal an unconstrained run."""
    from streamd import LLM, SamplingParams
    from tests.helpers import register_engine, tiny_config

    config = tiny_config()
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 300, (int(n),), generator=gen).tolist()
               for n in torch.randint(5, 50, (10,), generator=gen)]
    base = dict(device="cpu", dtype="float32", block_size=8, max_num_batched_tokens=64, seed=5)
    free = LLM(config, **base, num_kv_blocks=400, num_swap_blocks=0)
    register_engine(free.engine)
    expected = [o.outputs[0].token_ids for o in free.generate(prompts, greedy)]
    tight = LLM(config, **base, num_kv_blocks=24, num_swap_blocks=64, preemption_mode="swap", watermark=0.0)
    register_engine(tight.engine)
    cache = tight.engine.cache
    cache.direct_run_bytes = 1 << 40  # stage whenever it saves a copy
    staged = []
    original = CacheEngine._copy_staged
    monkeypatch.setattr(CacheEngine, "_copy_staged",
                        lambda self, chunks, to_host: (staged.append(to_host), original(self, chunks, to_host)))
    outs = tight.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert tight.engine.stats().scheduler.preemptions_swap > 0
    assert True in staged and False in staged  # both directions went through staging


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("host_order", ["ascending", "descending", "random"])
def test_cuda_round_trip_staged_and_direct(host_order: str) -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    for direct_run_bytes in (0, DIRECT_RUN_BYTES):
        cache = CacheEngine(layout, 256, 192, torch.device("cuda"), reference_ops)
        cache.kv_cache.normal_()
        cache.swap_cache.normal_()
        cache.direct_run_bytes = direct_run_bytes
        cache.staging_bytes = 7 * layout.bytes_per_block
        pairs = _scattered(256, 192, 100, seed=8, host_order=host_order)
        before = cache.kv_cache.clone()
        cache.swap_out(pairs)
        cache.kv_cache.fill_(0)
        cache.swap_in([(h, d) for d, h in pairs])
        torch.cuda.synchronize()
        index = torch.tensor([d for d, _ in pairs], device="cuda")
        assert torch.equal(cache.kv_cache[index], before[index])


def test_swap_in_ahead_copies_and_join_is_a_no_op_on_the_cpu() -> None:
    cache = _engine()
    pairs = [(3, 10), (4, 11), (9, 40)]  # (host, device)
    cache.swap_in_ahead(pairs)
    cache.join_swaps()
    for h, d in pairs:
        assert torch.equal(cache.kv_cache[d], cache.swap_cache[h])


def test_swap_ins_are_clocked_and_swap_outs_are_not() -> None:
    """`restores` counts every swap-in's bytes (plain and ahead, direct and staged) with its copy time."""
    cache = _engine()
    cache.swap_out([(1, 2), (5, 6)])
    assert cache.restores.settle() == (0, 0.0)
    staged = [(10, 1), (11, 5), (12, 9), (13, 13)]  # (host, device): device blocks scattered, host ones adjacent
    plan = plan_swap([(d, h) for h, d in staged], cache.layout.bytes_per_block, cache.staging_bytes,
                     cache.direct_run_bytes)
    assert plan.chunks is not None  # (the staged path)
    cache.swap_in(staged)
    cache.swap_in([(20, 30), (21, 31)])  # (direct)
    cache.swap_in_ahead([(3, 40)])
    moved, seconds = cache.restores.settle()
    assert moved == 7 * cache.layout.bytes_per_block and seconds > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_swap_ins_are_timed_on_the_swap_stream_once_done() -> None:
    """A swap-in still copying is not counted; once its end event completed, its bytes and the copy stream's
    time between its events are (the sleep queued before it on the swap stream is not part of it)."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    cache = CacheEngine(layout, 64, 32, torch.device("cuda"), reference_ops)
    pairs = [(h, h) for h in range(16)]
    with torch.cuda.stream(cache._swap_stream):
        torch.cuda._sleep(500_000_000)
    cache.swap_in_ahead(pairs)
    assert cache.restores.settle() == (0, 0.0)
    torch.cuda.synchronize()
    moved, seconds = cache.restores.settle()
    assert moved == 16 * layout.bytes_per_block and 0 < seconds < 0.05


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_swap_in_ahead_overlaps_until_joined() -> None:
    """A host restore issued ahead runs after the compute work queued before it (a block the previous forward
    still writes), the compute stream does not wait for it (held up here by a long sleep queued on the swap
    stream: work queued on the compute stream after it completes first), and once joined the compute stream
    reads the restored blocks."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    cache = CacheEngine(layout, 64, 32, torch.device("cuda"), reference_ops)
    cache.swap_cache.normal_()
    pairs = [(h, 2 * h + 1) for h in range(8)]  # (host, device): scattered device blocks, staged
    index = torch.tensor([d for _, d in pairs], device="cuda")
    cache.swap_in_ahead(pairs)  # warm-up: a first staged swap's allocations (seen on an H200) synchronize
    cache.join_swaps()
    torch.cuda.synchronize()
    compute = torch.cuda.current_stream()
    torch.cuda._sleep(50_000_000)  # the previous step's forward, still running ...
    cache.kv_cache[index] = 5.0  # ... writes blocks freed since: the restore must land after it
    with torch.cuda.stream(cache._swap_stream):
        torch.cuda._sleep(2_000_000_000)  # hold the swap stream (about a second)
    cache.swap_in_ahead(pairs)
    forward_done = torch.cuda.Event()
    forward_done.record(compute)  # this step's forward, queued after the restore
    forward_done.synchronize()
    assert cache._ahead_done is not None and not cache._ahead_done.query()  # the forward did not wait
    cache.join_swaps()
    restored = cache.kv_cache[index].clone()  # the next step's forward reads them
    torch.cuda.synchronize()
    assert torch.equal(restored, cache.swap_cache[[h for h, _ in pairs]].to("cuda"))


# ---- benchmarks/swap.py, pure parts ---------------------------------------------------------------------

def _bench():
    """benchmarks/ is not a package: load the script by path (registered first, dataclasses need it)."""
    if "bench_swap" not in sys.modules:
        path = Path(__file__).resolve().parents[3] / "benchmarks" / "swap.py"
        spec = importlib.util.spec_from_file_location("bench_swap", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_swap"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_swap"]


def test_bench_interleaved_trace_is_what_the_block_manager_hands_out() -> None:
    bench = _bench()
    trace = bench.interleaved_trace(pool_blocks=200, swap_blocks=60, block_size=16, num_blocks=40, reps=3)
    first_out, first_in = trace[0]
    assert [d for d, _ in first_out] == list(range(0, 160, 4))  # every 4th device block
    assert [h for _, h in first_out] == list(range(40))  # a fresh host pool: ascending
    second_out, _ = trace[1]
    assert [h for _, h in second_out] == list(range(39, -1, -1))  # after a round trip: descending
    for out, back in trace:
        assert sorted((d, h) for h, d in back) == sorted(out)  # swapped back into the same blocks
        assert len(contiguous_runs(out)) == 40  # the old way: one copy per block
        assert plan_swap(out, 1 << 19).num_host_copies == 1  # staged: one copy
    with pytest.raises(ValueError):
        bench.interleaved_trace(pool_blocks=100, swap_blocks=60, block_size=16, num_blocks=40, reps=1)


def test_bench_cost_rows_mirror_the_scheduler() -> None:
    bench = _bench()
    model = PreemptionCostModel(bytes_per_block=1 << 19, host_link_bytes_per_s=50e9, prefill_tokens_per_s=100e3)
    row = bench.cost_row(1024, 16, swap_s=0.002, recompute_s=0.01, model=model)
    assert row.blocks == 64 and row.auto == "swap" and row.measured_best == "swap" and row.agrees
    assert row.est_swap_s == pytest.approx(2 * 64 * (1 << 19) / 50e9)
    slow_link = PreemptionCostModel(1 << 19, 1e6, 100e3)
    row = bench.cost_row(128, 16, swap_s=0.001, recompute_s=0.01, model=slow_link)
    assert row.auto == "recompute" and row.agrees is False
    assert bench.cost_row(100, 16, 0.1, 0.01, None).auto == "n/a"


def test_bench_markdown_and_files(tmp_path: Path) -> None:
    bench = _bench()
    model = PreemptionCostModel(1 << 19, 40e9, 80e3)
    report = {
        "date": "2026-11-23", "git_commit": "abc", "device": "NVIDIA H200", "model_shape": "llama3.2-1b",
        "dtype": "bfloat16", "block_size": 16, "bytes_per_block": 1 << 19,
        "pinned": {"bytes": 1 << 30, "reps": 5, "h2d_gbps": 55.0, "d2h_gbps": 54.0, "round_trip_gbps": 54.5},
        "swaps": [{"layout": "decode-interleaved", "strategy": "engine", "plan": "staged", "blocks": 2048,
                   "bytes": 1 << 30, "direct_runs": 2048, "host_copies": 16, "out_gbps": 50.0, "in_gbps": 51.0,
                   "round_trip_gbps": 50.5, "of_pinned": 50.5 / 54.5, "exact": True}],
        "verdict": {"worst_layout": "decode-interleaved", "worst_of_pinned": 50.5 / 54.5, "met": True},
        "cost_model": {"bytes_per_block": 1 << 19, "host_link_bytes_per_s": 40e9, "prefill_tokens_per_s": 80e3},
        "costs": [asdict(bench.cost_row(t, 16, 1e-3, 2e-3, model)) for t in (128, 4096)],
    }
    text = bench.summary_markdown(report)
    assert "| decode-interleaved | engine (staged) | 2048 |" in text and "93%" in text and "met" in text
    assert text.rstrip().splitlines()[-1].startswith("| 4096 | 256 |")  # the cost table comes last
    stem = bench.save(report, str(tmp_path))
    assert stem.name == "swap-2026-11-23-h200"
    assert json.loads(stem.with_suffix(".json").read_text())["costs"][0]["tokens"] == 128
    assert stem.with_suffix(".md").read_text() == text



@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_an_8bit_pool_moves_codes_and_scales_as_one_block(dtype) -> None:
    """Swap out and in, copy-on-write, and the prefix cache's byte round trip of an 8-bit pool: every block's codes
    and its scales arrive bit for bit, and the scales live inside the block's bytes."""
    layout = KVLayout(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, dtype=dtype)
    assert layout.bytes_per_block == 2 * 2 * 3 * 4 * 8 + 2 * 2 * 3 * 4 * 4
    cache = CacheEngine(layout, 16, 8, torch.device("cpu"), reference_ops)
    gen = torch.Generator().manual_seed(1)
    cache.pool.blocks.copy_(torch.randint(0, 256, cache.pool.blocks.shape, generator=gen, dtype=torch.uint8))
    assert cache.kv_scales is not None and cache.kv_scales.shape == (16, 2, 2, 3, 4)
    assert cache.kv_scales.untyped_storage().data_ptr() == cache.kv_cache.untyped_storage().data_ptr()
    before = cache.pool.blocks.clone()
    scales_before = cache.kv_scales.clone()
    cache.swap_out([(3, 0), (7, 5)])
    cache.pool.blocks[[3, 7]] = 0
    cache.swap_in([(0, 10), (5, 11)])
    assert torch.equal(cache.pool.blocks[10], before[3]) and torch.equal(cache.pool.blocks[11], before[7])
    assert torch.equal(cache.kv_scales[10].view(torch.int32), scales_before[3].view(torch.int32))
    cache.copy([(1, 12)])
    assert torch.equal(cache.pool.blocks[12], before[1])
    cache.write_blocks(list(zip([13, 14], cache.read_blocks([2, 4]), strict=True)))
    assert torch.equal(cache.pool.blocks[13], before[2]) and torch.equal(cache.pool.blocks[14], before[4])


def test_8bit_blocks_hold_about_twice_the_tokens_at_equal_memory() -> None:
    """The 8B shape (32 layers, 8 KV heads of 128): bfloat16 blocks against int8 codes + a float32 scale per row."""
    shape = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
    bf16 = KVLayout(**shape, dtype=torch.bfloat16).bytes_per_block
    int8 = KVLayout(**shape, dtype=torch.int8).bytes_per_block
    assert bf16 / int8 == pytest.approx(2 * 128 / (128 + 4))
    assert bf16 / int8 >= 1.9
