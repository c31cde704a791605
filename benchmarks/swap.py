"""Swap on the GPU (issue 3, item 8): one device run that owns the numbers behind swap preemption.

It measures, in one process on one GPU:
1. the pinned host<->device copy bandwidth: one contiguous 1 GiB copy each way between a pinned host tensor
   and a device tensor (median of several, CUDA events);
2. swapping ~1 GiB of KV blocks out and back in through `CacheEngine.swap_out / swap_in` of a random-weight
   Llama-3.2-1B-shaped engine (bf16), for block layouts a running engine produces:
   - `contiguous`: device 0..n-1 <-> host 0..n-1, the best case (one copy each way);
   - `decode-interleaved`: the victim's blocks as the real `BlockManager` hands them out when 4 sequences
     decode side by side (every 4th device block) and its host blocks as the block manager gives them
     back after a round trip (its LIFO free list returns them in descending order);
   - `random`: device blocks a random sample of the pool in random order, host blocks ascending;
   each with the engine's own copy plan (`plan_swap`: staged when runs are short) and, for the scattered
   layouts, with direct per-run copies (`direct_run_bytes = 0`, what the engine did before staging);
   reported as GB/s against the pinned bandwidth (target >= 80 %), every layout checked bit-exact;
3. swap cost against recompute cost by sequence length (128 ... 4096 tokens): measured out+in time of that
   many tokens' blocks (decode-interleaved layout) against the measured prefill of that many tokens
   (`ModelRunner.execute`, as `preemption_costs` does), with the choice `preemption_mode = "auto"` makes
   from the engine's start-up `PreemptionCostModel` (`engine.scheduler.cost_model`) and whether it agrees
   with the measurements.

Writes `swap-<date>-<gpu>.json` and `.md` to `--out` and prints the markdown, cost table last.

    python3 benchmarks/swap.py --out $OUT                  # device, ~1 min on an H200
    python3 benchmarks/swap.py --device cpu --dtype float32 --shape smollm2-135m --swap-gib 0.02 \\
        --lengths 16,32 --out /tmp/swap                     # CPU smoke run of the same code

The pure parts (block layouts from the block manager, the cost rows, the markdown) import no CUDA and are
unit-tested in tests/engine/worker/test_cache_engine.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from streamd.bench.report import git_commit, save_report  # noqa: E402
from streamd.engine.core.block_manager import BlockManager  # noqa: E402
from streamd.engine.worker.cache_engine import CacheEngine, KVLayout, plan_swap  # noqa: E402
from streamd.engine.core.scheduler import PreemptionCostModel  # noqa: E402
from streamd.engine.core.sequence import Sequence  # noqa: E402

Pairs = list[tuple[int, int]]
# One round trip: (device, host) pairs for swap_out, then (host, device) pairs for swap_in.
RoundTrip = tuple[Pairs, Pairs]

LENGTHS = (128, 256, 512, 1024, 2048, 4096)
TARGET = 0.80  # share of the pinned bandwidth a swap must reach
DECODE_NEIGHBOURS = 4  # sequences decoding side by side in the interleaved layout


# ---- block layouts (pure Python) --------------------------------------------------------------------

def contiguous_trace(num_blocks: int, reps: int) -> list[RoundTrip]:
    pairs = [(i, i) for i in range(num_blocks)]
    return [(pairs, pairs)] * reps


def random_trace(pool_blocks: int, num_blocks: int, reps: int, seed: int = 0) -> list[RoundTrip]:
    """A random sample of the device pool in random order; host blocks ascending (a fresh host pool)."""
    device = random.Random(seed).sample(range(pool_blocks), num_blocks)
    out = [(d, h) for h, d in enumerate(device)]
    return [(out, [(h, d) for d, h in out])] * reps


def interleaved_trace(pool_blocks: int, swap_blocks: int, block_size: int, num_blocks: int, reps: int,
                      neighbours: int = DECODE_NEIGHBOURS) -> list[RoundTrip]:
    """What the real BlockManager hands out: `neighbours` sequences grow a block at a time side by side
    (decoding), so each one's table is every `neighbours`-th block; then the first one is swapped out and
    back in `reps` times. Host blocks come from the block manager's free list, which returns a sequence's
    host blocks in the opposite order on each following round trip."""
    if neighbours * num_blocks > pool_blocks or num_blocks > swap_blocks:
        raise ValueError(f"{neighbours} x {num_blocks} blocks do not fit a pool of {pool_blocks} "
                         f"(swap pool {swap_blocks})")
    bm = BlockManager(pool_blocks, block_size, swap_blocks, watermark=0.0, enable_prefix_caching=False)
    seqs = [Sequence(prompt_token_ids=[0] * block_size) for _ in range(neighbours)]
    for seq in seqs:
        bm.allocate(seq)
    while len(seqs[0].block_table) < num_blocks:
        for seq in seqs:  # one more block each, in turn, as decoding sequences cross block boundaries
            seq.num_computed_tokens = len(seq.block_table) * block_size
            bm.append_slots(seq, block_size)
    victim = seqs[0]
    trace = []
    for _ in range(reps):
        out = bm.swap_out([victim])
        trace.append((out, bm.swap_in([victim])))
    return trace


# ---- cost rows (pure Python) ------------------------------------------------------------------------

@dataclass(slots=True)
class CostRow:
    tokens: int
    blocks: int
    swap_s: float  # measured: out and back in
    recompute_s: float  # measured: prefill of `tokens`
    est_swap_s: float | None  # the engine's cost model
    est_recompute_s: float | None
    auto: str  # what preemption_mode = "auto" picks: "swap" | "recompute" | "n/a" (no cost model)
    measured_best: str
    agrees: bool | None


def cost_row(tokens: int, block_size: int, swap_s: float, recompute_s: float,
             model: PreemptionCostModel | None) -> CostRow:
    """Mirrors `Scheduler._use_swap` for a victim with `tokens` computed tokens and no shared blocks:
    swap when the estimated swap cost is strictly lower."""
    blocks = -(-tokens // block_size)
    best = "swap" if swap_s < recompute_s else "recompute"
    if model is None:
        return CostRow(tokens, blocks, swap_s, recompute_s, None, None, "n/a", best, None)
    est_swap, est_recompute = model.swap_cost_s(blocks), model.recompute_cost_s(tokens)
    auto = "swap" if est_swap < est_recompute else "recompute"
    return CostRow(tokens, blocks, swap_s, recompute_s, est_swap, est_recompute, auto, best, auto == best)


# ---- report (pure Python) ---------------------------------------------------------------------------

def summary_markdown(report: dict[str, Any]) -> str:
    p = report["pinned"]
    lines = [f"# Swap, {report['device']}, {report['date']} (commit {report['git_commit']})", "",
             f"Model: random-weight {report['model_shape']} ({report['dtype']}), "
             f"{report['bytes_per_block'] / 2**10:.0f} KiB per block of {report['block_size']} tokens. "
             f"Pinned host<->device, one contiguous {p['bytes'] / 2**30:.2f} GiB copy (median of {p['reps']}): "
             f"H2D {p['h2d_gbps']:.1f} GB/s, D2H {p['d2h_gbps']:.1f} GB/s, round trip "
             f"{p['round_trip_gbps']:.1f} GB/s.", "",
             "| layout | copies | blocks | GiB | runs | host copies | out GB/s | in GB/s | round trip GB/s "
             "| of pinned | exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["swaps"]:
        lines.append(f"| {s['layout']} | {s['strategy']} ({s['plan']}) | {s['blocks']} | {s['bytes'] / 2**30:.2f} | "
                     f"{s['direct_runs']} | {s['host_copies']} | {s['out_gbps']:.1f} | {s['in_gbps']:.1f} | "
                     f"{s['round_trip_gbps']:.1f} | {100 * s['of_pinned']:.0f}% | {'yes' if s['exact'] else 'NO'} |")
    verdict = report.get("verdict")
    if verdict:
        lines += ["", f"Target: swapping ~1 GiB out and back in at >= {100 * TARGET:.0f}% of the pinned round trip "
                  f"with the engine's copy plan. Worst layout: {verdict['worst_layout']} at "
                  f"{100 * verdict['worst_of_pinned']:.0f}% -> {'met' if verdict['met'] else 'NOT met'}."]
    model = report.get("cost_model")
    lines += ["", "## Swap vs recompute by sequence length", ""]
    if model:
        lines.append(f"The engine's start-up cost model: host link {model['host_link_bytes_per_s'] / 1e9:.1f} GB/s, "
                     f"prefill {model['prefill_tokens_per_s']:.0f} tok/s.")
    else:
        lines.append("The engine has no cost model (preemption_mode or swap pool): auto is n/a.")
    lines += ["Measured swap = out + back in of the sequence's blocks (decode-interleaved layout); measured "
              "recompute = one prefill of that many tokens.", "",
              "| tokens | blocks | swap ms | recompute ms | est. swap ms | est. recompute ms | auto | cheaper (measured) "
              "| agrees |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in report["costs"]:
        est_swap = f"{1e3 * r['est_swap_s']:.2f}" if r["est_swap_s"] is not None else "-"
        est_rec = f"{1e3 * r['est_recompute_s']:.2f}" if r["est_recompute_s"] is not None else "-"
        agrees = "-" if r["agrees"] is None else ("yes" if r["agrees"] else "NO")
        lines.append(f"| {r['tokens']} | {r['blocks']} | {1e3 * r['swap_s']:.2f} | {1e3 * r['recompute_s']:.2f} | "
                     f"{est_swap} | {est_rec} | {r['auto']} | {r['measured_best']} | {agrees} |")
    return "\n".join(lines) + "\n"


def save(report: dict[str, Any], out: str) -> Path:
    return save_report(report, out, "swap", summary_markdown(report))


# ---- device measurements ----------------------------------------------------------------------------

class Timer:
    """Seconds between two marks: CUDA events on the current stream (they bracket everything queued
    between them, including the host time to issue it, since the GPU is idle at the first mark) or the
    wall clock on CPU, where every operation is synchronous."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        import time
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

    def idle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def measure_pinned(device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    """One contiguous copy of `nbytes` each way between a pinned host tensor and a device tensor."""
    timer = Timer(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.fill_(1)
    times: dict[str, list[float]] = {"h2d": [], "d2h": []}
    for i in range(reps + 1):  # the first of each is a warm-up
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            timer.idle()
            start = timer.mark()
            dst.copy_(src, non_blocking=True)
            end = timer.mark()
            if i:
                times[name].append(timer.seconds(start, end))
    timer.idle()
    h2d, d2h = statistics.median(times["h2d"]), statistics.median(times["d2h"])
    del host, dev
    return {"bytes": nbytes, "reps": reps, "h2d_s": h2d, "d2h_s": d2h, "h2d_gbps": nbytes / h2d / 1e9,
            "d2h_gbps": nbytes / d2h / 1e9, "round_trip_gbps": 2 * nbytes / (h2d + d2h) / 1e9}


def check_round_trip(cache: CacheEngine, trip: RoundTrip) -> bool:
    """Swaps out, clobbers the device blocks, swaps in (possibly into other blocks) and compares bits."""
    out, back = trip
    host_of = {d: h for d, h in out}
    src = torch.tensor([d for d, _ in out], dtype=torch.int64, device=cache.device)
    expected = cache.kv_cache.index_select(0, src)
    cache.swap_out(out)
    cache.kv_cache.index_fill_(0, src, 0)  # queued after the swap: swap_out makes the compute stream wait
    cache.swap_in(back)
    device_of = {h: d for h, d in back}
    dst = torch.tensor([device_of[host_of[d]] for d, _ in out], dtype=torch.int64, device=cache.device)
    got = cache.kv_cache.index_select(0, dst)
    return _bits_equal(got, expected)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality whatever the dtype (NaN payloads and -0.0 included)."""
    a, b = a.contiguous().view(-1), b.contiguous().view(-1)
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def time_round_trips(cache: CacheEngine, trace: list[RoundTrip]) -> tuple[float, float, bool]:
    """Median seconds of swap_out and of swap_in over trace[1:]; trace[0] is the warm-up and the bit check."""
    timer = Timer(cache.device)
    exact = check_round_trip(cache, trace[0])
    outs, ins = [], []
    for out, back in trace[1:]:
        timer.idle()
        t0 = timer.mark()
        cache.swap_out(out)
        t1 = timer.mark()
        cache.swap_in(back)
        t2 = timer.mark()
        outs.append(timer.seconds(t0, t1))
        ins.append(timer.seconds(t1, t2))
    timer.idle()
    return statistics.median(outs), statistics.median(ins), exact


def swap_entry(cache: CacheEngine, layout: str, strategy: str, trace: list[RoundTrip],
               pinned: dict[str, float]) -> dict[str, Any]:
    """Times one layout with the engine's plan ("engine") or with direct copies only ("direct")."""
    default = cache.direct_run_bytes
    if strategy == "direct":
        cache.direct_run_bytes = 0  # every plan goes direct: one copy per run adjacent on both sides
    try:
        out_s, in_s, exact = time_round_trips(cache, trace)
        out_pairs = trace[-1][0]
        plan = plan_swap(out_pairs, cache.layout.bytes_per_block, cache.staging_bytes, cache.direct_run_bytes)
    finally:
        cache.direct_run_bytes = default
    nbytes = len(out_pairs) * cache.layout.bytes_per_block
    round_trip = 2 * nbytes / (out_s + in_s) / 1e9
    return {"layout": layout, "strategy": strategy, "plan": "staged" if plan.chunks is not None else "direct",
            "blocks": len(out_pairs), "bytes": nbytes, "direct_runs": len(plan.runs),
            "host_copies": plan.num_host_copies, "out_s": out_s, "in_s": in_s,
            "out_gbps": nbytes / out_s / 1e9, "in_gbps": nbytes / in_s / 1e9, "round_trip_gbps": round_trip,
            "of_pinned": round_trip / pinned["round_trip_gbps"],
            "out_of_d2h": nbytes / out_s / 1e9 / pinned["d2h_gbps"],
            "in_of_h2d": nbytes / in_s / 1e9 / pinned["h2d_gbps"], "exact": exact}


def prefill_seconds(engine: Any, tokens: int, reps: int, seed: int = 0) -> float:
    """Median time of one forward over a fresh `tokens`-token prompt (what recomputing costs), written
    into the pool's first blocks."""
    from streamd.engine.sampling_params import SamplingParams
    from streamd.engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
    from streamd.engine.core.sequence import SequenceGroup

    rng = random.Random(seed + tokens)
    seq = Sequence(prompt_token_ids=[rng.randrange(engine.vocab_size) for _ in range(tokens)])
    seq.block_table = list(range(-(-tokens // engine.cache.layout.block_size)))
    group = SequenceGroup("__bench_swap__", [seq], SamplingParams(max_tokens=1))
    out = SchedulerOutput(scheduled=[ScheduledSeq(seq, group, tokens)])
    timer = Timer(engine.device)
    times = []
    for i in range(reps + 1):  # the first is a warm-up (kernel compilation, allocator growth)
        timer.idle()
        start = timer.mark()
        engine.runner.execute(out)
        end = timer.mark()
        if i:
            times.append(timer.seconds(start, end))
    timer.idle()
    return statistics.median(times)


# ---- entry point ------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON and markdown")
    parser.add_argument("--shape", default="llama3.2-1b", help="model shape from streamd.bench.throughput")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--swap-gib", type=float, default=1.0, help="size of the swapped set")
    parser.add_argument("--pinned-gib", type=float, default=1.0, help="size of the pinned bandwidth probe")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="sequence lengths of the cost table")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (medians)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from streamd import LLM
    from streamd.bench.throughput import model_config

    device = torch.device(args.device)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    config = model_config(args.shape, max_len=max(4096, *lengths))
    # Size both pools from the layout before building: the device pool holds the interleaved victim and
    # its neighbours (4x the swapped set, or of the longest row); the host pool holds one swapped set.
    text = config.get_text_config()
    block_size = 16
    layout = KVLayout(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, block_size,
                      getattr(torch, args.dtype))
    swap_blocks = max(1, int(args.swap_gib * 2**30) // layout.bytes_per_block)
    max_len_blocks = -(-max(lengths) // block_size)
    pool_blocks = DECODE_NEIGHBOURS * max(swap_blocks, max_len_blocks) + 64
    llm = LLM(config, device=args.device, dtype=args.dtype, block_size=block_size, num_kv_blocks=pool_blocks,
              num_swap_blocks=swap_blocks + 64, enforce_eager=True, preemption_mode="auto")
    engine = llm.engine
    cache: CacheEngine = engine.cache
    assert cache.layout.bytes_per_block == layout.bytes_per_block
    # Real numbers in every block: a prefill never reads garbage, and the bit check compares data.
    cache.kv_cache.uniform_(-1.0, 1.0)
    cost_model: PreemptionCostModel | None = engine.scheduler.cost_model

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report: dict[str, Any] = {
        "date": dt.date.today().isoformat(), "git_commit": git_commit(), "device": name,
        "torch": torch.__version__, "model_shape": args.shape, "dtype": args.dtype, "block_size": block_size,
        "bytes_per_block": layout.bytes_per_block, "num_kv_blocks": cache.num_blocks,
        "num_swap_blocks": cache.num_swap_blocks, "staging_bytes": cache.staging_bytes,
        "direct_run_bytes": cache.direct_run_bytes,
        "cost_model": asdict(cost_model) if cost_model is not None else None}
    print(f"[swap] {name}: {cache.num_blocks} device blocks, {cache.num_swap_blocks} host blocks of "
          f"{layout.bytes_per_block / 2**10:.0f} KiB", flush=True)

    report["pinned"] = pinned = measure_pinned(device, int(args.pinned_gib * 2**30), args.reps)
    print(f"[swap] pinned H2D {pinned['h2d_gbps']:.1f} GB/s, D2H {pinned['d2h_gbps']:.1f} GB/s", flush=True)

    reps = args.reps + 1
    layouts = {
        "contiguous": contiguous_trace(swap_blocks, reps),
        "decode-interleaved": interleaved_trace(pool_blocks, cache.num_swap_blocks, block_size, swap_blocks, reps),
        "random": random_trace(pool_blocks, swap_blocks, reps),
    }
    report["swaps"] = []
    for layout_name, trace in layouts.items():
        for strategy in ("engine",) if layout_name == "contiguous" else ("engine", "direct"):
            entry = swap_entry(cache, layout_name, strategy, trace, pinned)
            report["swaps"].append(entry)
            print(f"[swap] {layout_name} {strategy} ({entry['plan']}): {entry['round_trip_gbps']:.1f} GB/s "
                  f"= {100 * entry['of_pinned']:.0f}% of pinned, exact={entry['exact']}", flush=True)
    engine_entries = [s for s in report["swaps"] if s["strategy"] == "engine"]
    worst = min(engine_entries, key=lambda s: s["of_pinned"])
    report["verdict"] = {"worst_layout": worst["layout"], "worst_of_pinned": worst["of_pinned"],
                         "met": worst["of_pinned"] >= TARGET and all(s["exact"] for s in report["swaps"])}

    rows = []
    for tokens in lengths:
        blocks = -(-tokens // block_size)
        trace = interleaved_trace(pool_blocks, cache.num_swap_blocks, block_size, blocks, reps + 4)
        out_s, in_s, exact = time_round_trips(cache, trace)
        assert exact, f"swap of {blocks} blocks changed the data"
        recompute_s = prefill_seconds(engine, tokens, args.reps)
        row = cost_row(tokens, block_size, out_s + in_s, recompute_s, cost_model)
        rows.append(asdict(row))
        print(f"[swap] {tokens} tokens: swap {1e3 * row.swap_s:.2f} ms, recompute {1e3 * row.recompute_s:.2f} ms, "
              f"auto {row.auto}", flush=True)
    report["costs"] = rows
    return report


def main(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("benchmarks/swap.py needs a CUDA device (or --device cpu for a smoke run)")
        return 2
    report = run(args)
    stem = save(report, args.out)
    print(f"[swap] wrote {stem}.json and .md", flush=True)
    print(summary_markdown(report))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
