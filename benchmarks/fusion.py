"""Fused decoder layers on the device: decode-step time per `model.fuse_layers` mode, and each fused kernel
against the torch sequence it replaces (see streamd/engine/worker/fusion.py; predictions in benchmarks/NOTES.md).

    python benchmarks/fusion.py --out DIR [--shapes smollm2-135m,llama3.2-1b] [--modes off,triton,compile]
    python benchmarks/fusion.py --dry-run --out DIR    # CPU: tiny shape, interpreted kernels; times mean nothing

Macro, per shape and mode (random bf16 weights, `--batch` sequences of `--context` tokens):
- graph: `DecodeGraphs.run` of a synthetic decode batch (the batch copied in, one graph replay), timed over
  back-to-back steps (GPU time, or host time where the launch is slower), the host time of the launch alone,
  and the CUDA kernels per step (profiler);
- engine: `LLMEngine.step` with `--batch` running requests (sampling and bookkeeping included);
- tokens: greedy tokens of a few prompts, compared with mode "off" (bf16: a late divergence is rounding).
Micro, per shape: Triton kernel vs the unfused torch sequence (what the unfused engine runs: transformers'
ops, streamd's `store_kv`) vs torch.compile of that sequence, each in a CUDA graph with inputs rotated out
of L2, at `--batch` rows (decode) and 8192 rows (a prefill chunk): time per call and bytes moved per second.
Writes `fusion-<shape>-<date>-<gpu>.json` and `.md` per shape to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import streamd.kernels as K  # noqa: E402
from streamd import LLM, SamplingParams  # noqa: E402
from streamd.bench import cuda_timing  # noqa: E402
from streamd.bench.report import add_out_argument, git_commit, save_report  # noqa: E402
from streamd.bench.throughput import SHAPES, measure_ceilings  # noqa: E402
from streamd.engine.worker.attention import AttentionMetadata, set_attention_metadata  # noqa: E402
from streamd.engine.llm_engine import LLMEngine  # noqa: E402
from streamd.engine.worker.model_runner import ModelInput  # noqa: E402
from streamd.kernels import reference as R  # noqa: E402

DRY_SHAPE = dict(hidden_size=72, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=24,
                 intermediate_size=100, vocab_size=256, tie_word_embeddings=True)
PREFILL_ROWS = 8192


def log(*parts: Any) -> None:
    print(*parts, flush=True)


@dataclass(slots=True)
class Setup:
    device: torch.device
    dtype: torch.dtype
    batch: int
    context: int
    steps: int
    dry_run: bool


# ---- timing -----------------------------------------------------------------------------------------

def time_calls(fns: list[Callable[[], Any]], setup: Setup, min_calls: int = 24) -> float:
    """Median seconds per call of `fns` (rotated): on CUDA all captured in one graph and replayed (`time_graph`)."""
    if setup.device.type != "cuda":
        for f in fns:  # compile outside the timing
            f()
        start = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - start) / len(fns)
    return cuda_timing.time_graph(fns, min_calls)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch._dynamo.reset()  # compiled stretches of one shape are no use to the next


# ---- macro: one engine per shape and mode -----------------------------------------------------------

def model_config(shape: str, dry_run: bool, max_len: int):
    from transformers import LlamaConfig

    fields = DRY_SHAPE if dry_run else SHAPES[shape]
    return LlamaConfig(**fields, max_position_embeddings=max_len, rope_theta=500000.0)


def build_engine(config: Any, mode: str, setup: Setup) -> LLMEngine:
    overrides: dict[str, Any] = dict(device=setup.device.type, fuse_layers=mode, max_num_seqs=setup.batch,
                                     max_model_len=config.max_position_embeddings, num_swap_blocks=0,
                                     preemption_mode="recompute", enable_prefix_caching=False, seed=0)
    if setup.dry_run:
        overrides.update(dtype="float32", num_kv_blocks=4 * setup.batch * (-(-config.max_position_embeddings // 16)))
    else:
        overrides.update(dtype="bfloat16")
    llm = LLM(config, **overrides)
    llm.engine.stream_outputs = True
    return llm.engine


def synthetic_step(engine: LLMEngine, setup: Setup) -> Callable[[], torch.Tensor]:
    """One decode step of `batch` sequences of `context` tokens in distinct blocks, as the runner would run
    it: the decode graph on CUDA, the eager forward elsewhere."""
    runner, dev, bs = engine.runner, setup.device, engine.config.cache.block_size
    per_seq = -(-setup.context // bs)
    assert runner.pool is not None, "bind_kv_cache first"
    kv = runner.pool.kv_cache
    assert kv.shape[0] >= setup.batch * per_seq, "pool too small for the synthetic batch"
    kv[:setup.batch * per_seq].normal_(0, 0.5)  # the pool starts uninitialised
    tables = torch.arange(setup.batch * per_seq, dtype=torch.int32, device=dev).view(setup.batch, per_seq)
    last = setup.context - 1
    ids = torch.randint(0, engine.vocab_size, (setup.batch,), device=dev)
    positions = torch.full((setup.batch,), last, dtype=torch.int64, device=dev)
    slots = tables[:, last // bs].long() * bs + last % bs
    lens = torch.full((setup.batch,), setup.context, dtype=torch.int32, device=dev)
    graphs = runner.graphs
    starts = torch.arange(setup.batch + 1, dtype=torch.int32, device=dev)
    if graphs is not None:
        step = ModelInput(ids, positions, slots, tables, lens, starts, starts[:-1].long(), decode_only=True)
        return lambda: graphs.run(step)
    metadata = AttentionMetadata(kv, slots, tables, lens, starts, True, runner.ops)

    def eager() -> torch.Tensor:
        set_attention_metadata(metadata)
        try:
            return runner.model(input_ids=ids[None], position_ids=positions[None], logits_to_keep=0,
                                use_cache=False).logits[0]
        finally:
            set_attention_metadata(None)

    return eager


@torch.inference_mode()
def measure_graph_step(engine: LLMEngine, setup: Setup) -> dict[str, Any]:
    step = synthetic_step(engine, setup)
    for _ in range(3):
        step()
    sync(setup.device)
    start = time.perf_counter()
    for _ in range(setup.steps):
        step()
    sync(setup.device)
    step_s = (time.perf_counter() - start) / setup.steps
    launches = []
    for _ in range(min(setup.steps, 20)):  # the host's share: launch alone, the device idle before each
        sync(setup.device)
        t0 = time.perf_counter()
        step()
        launches.append(time.perf_counter() - t0)
    sync(setup.device)
    result: dict[str, Any] = {"step_s": step_s, "host_launch_s": statistics.median(launches), "kernels_per_step": None,
                              "kernel_time_per_step_s": None}
    if setup.device.type == "cuda":
        result.update(count_kernels(step, setup.device))
    return result


def count_kernels(step: Callable[[], Any], device: torch.device, reps: int = 5) -> dict[str, Any]:
    """CUDA kernels (and their summed device time) per step, from the profiler's trace of `reps` steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    return {"kernels_per_step": len(kernels) / reps,
            "kernel_time_per_step_s": sum(e.time_range.elapsed_us() for e in kernels) * 1e-6 / reps}


def measure_engine_step(engine: LLMEngine, setup: Setup) -> dict[str, Any]:
    """ms per `LLMEngine.step` with `batch` requests decoding (prompts of `context` tokens)."""
    room = engine.max_model_len - setup.context
    params = SamplingParams(max_tokens=room, ignore_eos=True, detokenize=False, temperature=0.0)
    gen = torch.Generator().manual_seed(0)
    ids = [f"bench-{i}" for i in range(setup.batch)]
    for request_id in ids:
        engine.add_request(request_id, torch.randint(0, engine.vocab_size, (setup.context,), generator=gen).tolist(),
                           params)
    decoding: set[str] = set()
    while len(decoding) < setup.batch:  # until every request has its first token (prefill done)
        decoding.update(out.request_id for out in engine.step())
    for _ in range(3):
        engine.step()
    sync(setup.device)
    start = time.perf_counter()
    for _ in range(setup.steps):
        engine.step()
    sync(setup.device)
    step_s = (time.perf_counter() - start) / setup.steps
    running = engine.stats().scheduler.num_running
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return {"step_s": step_s, "running": running, "tok_s": running / step_s}


def greedy_tokens(engine: LLMEngine, n: int, max_tokens: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, temperature=0.0)
    for i in range(n):
        prompt = torch.randint(0, engine.vocab_size, (int(torch.randint(5, 60, (1,), generator=gen)),),
                               generator=gen).tolist()
        engine.add_request(f"check-{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for choice in delta.outputs:
                tokens.setdefault(delta.request_id, []).extend(choice.token_ids)
    return [tokens[f"check-{i}"] for i in range(n)]


def agreement(tokens: list[list[int]], base: list[list[int]]) -> float:
    """Share of positions equal to the base up to each sequence's first divergence (1.0: identical)."""
    same = 0
    for got, want in zip(tokens, base):
        for a, b in zip(got, want):
            if a != b:
                break
            same += 1
    return same / max(1, sum(map(len, base)))


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def macro(shape: str, mode: str, setup: Setup) -> dict[str, Any]:
    config = model_config(shape, setup.dry_run, max_len=setup.context + setup.steps + 64)
    free_device()
    graphs_before = _dynamo_graphs()
    engine = build_engine(config, mode, setup)
    try:
        row: dict[str, Any] = {"kind": "macro", "shape": shape, "mode": mode,
                               "layers": config.num_hidden_layers,
                               "graph": measure_graph_step(engine, setup),
                               "engine": measure_engine_step(engine, setup),
                               "tokens": greedy_tokens(engine, *((2, 6) if setup.dry_run else (4, 16))),
                               "dynamo_graphs": _dynamo_graphs() - graphs_before}  # compile: recompiles show here
    finally:
        del engine
        free_device()
    return row


# ---- micro: each fused kernel against the sequence it replaces --------------------------------------

@dataclass(slots=True)
class MicroCase:
    kernel: str
    rows: int
    nbytes: int  # the fused kernel's own traffic: every input read once, every output written once
    variants: dict[str, list[Callable[[], Any]]]
    check: Callable[[], float]  # max abs difference, Triton vs the torch sequence (first copy)


def copies_for(nbytes: int, setup: Setup) -> int:
    return 1 if setup.dry_run else cuda_timing.copies_for(nbytes, cap=64)


def _max_diff(a: Any, b: Any) -> float:
    pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
    return max((x.float() - y.float()).abs().max().item() for x, y in pairs)


def case_add_rmsnorm(shape: dict[str, Any], rows: int, setup: Setup, compiled: bool) -> MicroCase:
    h, e, dev, dt_ = shape["hidden_size"], setup.dtype.itemsize, setup.device, setup.dtype
    nbytes = 4 * rows * h * e + h * e
    inputs = [(torch.randn(rows, h, device=dev, dtype=dt_), torch.randn(rows, h, device=dev, dtype=dt_))
              for _ in range(copies_for(nbytes, setup))]
    w = torch.randn(h, device=dev, dtype=dt_)
    variants = {"triton": [lambda x=x, r=r: K.fused_add_rmsnorm(x, r, w, 1e-5) for x, r in inputs],
                "torch": [lambda x=x, r=r: R.fused_add_rmsnorm(x, r, w, 1e-5) for x, r in inputs]}
    if compiled:
        fn = torch.compile(R.fused_add_rmsnorm, dynamic=False)
        variants["compile"] = [lambda x=x, r=r: fn(x, r, w, 1e-5) for x, r in inputs]
    x, r = inputs[0]
    return MicroCase("add+rmsnorm", rows, nbytes, variants,
                     lambda: _max_diff(K.fused_add_rmsnorm(x, r, w, 1e-5), R.fused_add_rmsnorm(x, r, w, 1e-5)))


def case_silu_and_mul(shape: dict[str, Any], rows: int, setup: Setup, compiled: bool) -> MicroCase:
    inter, e, dev = shape["intermediate_size"], setup.dtype.itemsize, setup.device
    nbytes = 3 * rows * inter * e
    inputs = [torch.randn(rows, 2 * inter, device=dev, dtype=setup.dtype) for _ in range(copies_for(nbytes, setup))]
    variants = {"triton": [lambda x=x: K.silu_and_mul(x) for x in inputs],
                "torch": [lambda x=x: R.silu_and_mul(x) for x in inputs]}
    if compiled:
        fn = torch.compile(R.silu_and_mul, dynamic=False)
        variants["compile"] = [lambda x=x: fn(x) for x in inputs]
    return MicroCase("silu_and_mul", rows, nbytes, variants,
                     lambda: _max_diff(K.silu_and_mul(inputs[0]), R.silu_and_mul(inputs[0])))


def case_rotary_store(shape: dict[str, Any], rows: int, setup: Setup, compiled: bool) -> MicroCase:
    h, hkv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    e, dev, dt_, page = setup.dtype.itemsize, setup.device, setup.dtype, 16
    nbytes = rows * (2 * h + 4 * hkv) * d * e + 2 * rows * d * e + rows * 8
    blocks = -(-rows // page) + 1

    def make() -> tuple[Any, ...]:
        qkv = torch.randn(rows, (h + 2 * hkv) * d, device=dev, dtype=dt_)
        q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv.split([h * d, hkv * d, hkv * d], dim=-1))
        kv = torch.zeros(blocks, 1, 2, hkv, page, d, device=dev, dtype=dt_)
        slots = torch.randperm(blocks * page, device=dev)[:rows]
        return q, k, v, kv, slots

    inputs = [make() for _ in range(copies_for(nbytes, setup))]
    angles = torch.rand(rows, d // 2, device=dev) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dt_), torch.cat([angles.sin()] * 2, -1).to(dt_)

    def unfused(q: Any, k: Any, v: Any, kv: Any, slots: Any, rotate: Callable[..., Any] = R.rotary) -> Any:
        q, k = rotate(q, k, cos, sin)
        K.store_kv(k, v, kv, 0, slots)  # the unfused engine's store: Triton already
        return q

    variants = {"triton": [lambda a=a: K.rotary_store_kv(a[0], a[1], a[2], cos, sin, a[3], 0, a[4]) for a in inputs],
                "torch": [lambda a=a: unfused(*a) for a in inputs]}
    if compiled:
        fn = torch.compile(R.rotary, dynamic=False)
        variants["compile"] = [lambda a=a: unfused(*a, rotate=fn) for a in inputs]
    a = inputs[0]
    return MicroCase("rotary+store_kv", rows, nbytes, variants,
                     lambda: _max_diff(K.rotary_store_kv(a[0], a[1], a[2], cos, sin, a[3], 0, a[4]), unfused(*a)))


def micro(shape_name: str, setup: Setup, compiled: bool) -> list[dict[str, Any]]:
    shape = DRY_SHAPE if setup.dry_run else SHAPES[shape_name]
    rows_list = [33] if setup.dry_run else [setup.batch, PREFILL_ROWS]
    out = []
    for rows in rows_list:
        for make in (case_add_rmsnorm, case_silu_and_mul, case_rotary_store):
            free_device()
            case = make(shape, rows, setup, compiled)
            times = {name: time_calls(fns, setup) for name, fns in case.variants.items()}
            row = {"kind": "micro", "shape": shape_name, "kernel": case.kernel, "rows": rows, "bytes": case.nbytes,
                   "copies": len(case.variants["triton"]), "t_s": times,
                   "bytes_per_s": {k: case.nbytes / t for k, t in times.items()},
                   "max_abs_diff_vs_torch": case.check()}
            log(f"micro {shape_name} {case.kernel} rows={rows}: "
                + ", ".join(f"{k} {t * 1e6:.1f} us" for k, t in times.items()))
            out.append(row)
    return out


# ---- report -----------------------------------------------------------------------------------------

def us(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e6:.1f}"


def markdown(report: dict[str, Any]) -> str:
    s = report["setup"]
    hbm = report["ceilings"].get("hbm_bytes_per_s")
    lines = [f"# Fused decoder layers, {report['shape']}, {report['device']}, {report['date']} "
             f"(commit {report['git_commit']})", "",
             f"Random weights, {s['dtype']}, decode batch {s['batch']} at context {s['context']}, "
             f"{s['steps']} timed steps." + (" DRY RUN (CPU, interpreted kernels): times mean nothing."
                                              if s["dry_run"] else ""), "",
             "## Decode step", "",
             "| shape | fuse_layers | graph step ms | host launch ms | kernels/step | kernels/layer | kernel time ms "
             "| engine step ms | engine tok/s | tokens = off |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if r["kind"] != "macro":
            continue
        g, e = r["graph"], r["engine"]
        k, kt = g["kernels_per_step"], g["kernel_time_per_step_s"]
        counts = "- | -" if k is None else f"{k:.0f} | {k / r['layers']:.1f}"
        lines.append(f"| {r['shape']} | {r['mode']} | {g['step_s'] * 1e3:.3f} | {g['host_launch_s'] * 1e3:.3f} | "
                     f"{counts} | {'-' if kt is None else f'{kt * 1e3:.3f}'} | "
                     f"{e['step_s'] * 1e3:.3f} | {e['tok_s']:.0f} | {r['agreement_with_off'] * 100:.0f}% |")
    lines += ["", "## Kernels (fused Triton vs the unfused torch sequence vs torch.compile of it)", "",
              "| shape | kernel | rows | triton us | torch us | compile us | torch/triton | triton GB/s "
              + ("| triton %HBM " if hbm else "") + "| max diff |",
              "|---|---|---|---|---|---|---|---|" + ("---|" if hbm else "") + "---|"]
    for r in report["rows"]:
        if r["kind"] != "micro":
            continue
        t = r["t_s"]
        lines.append(f"| {r['shape']} | {r['kernel']} | {r['rows']} | {us(t['triton'])} | {us(t['torch'])} | "
                     f"{us(t.get('compile'))} | {t['torch'] / t['triton']:.2f}x | {r['bytes_per_s']['triton'] / 1e9:.0f} | "
                     + (f"{r['bytes_per_s']['triton'] / hbm * 100:.0f}% | " if hbm else "")
                     + f"{r['max_abs_diff_vs_torch']:.2g} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/fusion.py needs a CUDA device (or --dry-run)")
    setup = Setup(device, torch.float32 if args.dry_run else torch.bfloat16,
                  batch=4 if args.dry_run else args.batch, context=20 if args.dry_run else args.context,
                  steps=2 if args.dry_run else args.steps, dry_run=args.dry_run)
    modes = args.modes.split(",")
    ceilings = measure_ceilings() if device.type == "cuda" else {}
    return [shape_report(shape, modes, setup, ceilings, args.out, not args.no_micro)
            for shape in (["dry"] if args.dry_run else args.shapes.split(","))]


def shape_report(shape: str, modes: list[str], setup: Setup, ceilings: dict[str, float], out: str,
                 with_micro: bool) -> dict[str, Any]:
    """One shape's rows, saved as `fusion-<shape>-<date>-<gpu>` after each (a later shape never overwrites it)."""
    report: dict[str, Any] = {
        "date": dt.date.today().isoformat(), "git_commit": git_commit(),
        "device": torch.cuda.get_device_name() if setup.device.type == "cuda" else "cpu", "shape": shape,
        "torch": torch.__version__, "ceilings": ceilings,
        "setup": {**asdict(setup), "device": str(setup.device), "dtype": str(setup.dtype)}, "rows": []}

    def save() -> None:
        save_report(report, out, f"fusion-{shape}", markdown(report))

    base: list[list[int]] | None = None
    for mode in modes:
        row = macro(shape, mode, setup)
        base = row["tokens"] if base is None else base  # the first mode listed is the baseline ("off")
        row["agreement_with_off"] = agreement(row["tokens"], base)
        report["rows"].append(row)
        save()
        log(f"macro {shape} {mode}: graph {row['graph']['step_s'] * 1e3:.3f} ms, engine "
            f"{row['engine']['step_s'] * 1e3:.3f} ms/step, kernels/step {row['graph']['kernels_per_step']}")
    if with_micro:
        report["rows"] += micro(shape, setup, compiled="compile" in modes)
        save()
    log(markdown(report))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(parser)
    parser.add_argument("--shapes", default="smollm2-135m,llama3.2-1b")
    parser.add_argument("--modes", default="off,triton,compile", help="first = the baseline for the token check")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--no-micro", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="CPU, a tiny shape, interpreted kernels")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
