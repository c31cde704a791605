"""Issue 34: where nano-vllm's workload spends its time, step by step (prefill steps, decode steps by batch).

Usage (device): python3 benchmarks/workload_phases.py --shape smollm2-135m --out OUT
The throughput bench's workload (256 random prompts and outputs of 100-1024 tokens, greedy, all at once) after
a warm-up run of the same kind; each step's wall time with what it scheduled (prompt tokens, decoding rows).
Then torch's profiler over three prefill steps of a fresh batch: the kernels and host ops that make them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from streamd import LLM, SamplingParams
from streamd.bench.offline import model_config, random_workload, schedules, sync_cuda


def run(engine: Any, prompts: list[list[int]], outputs: list[int], salt: str) -> list[dict[str, Any]]:
    """Each step's wall time and what it scheduled, the requests all added at once, until every one ends."""
    for i, (prompt, n) in enumerate(zip(prompts, outputs)):
        params = SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, temperature=0.0)
        engine.add_request(f"{salt}{i}", prompt, params)
    steps = []
    sync_cuda()
    last = time.perf_counter()
    with schedules(engine) as planned:
        while engine.has_unfinished_requests():
            engine.step()
            now, out = time.perf_counter(), planned[-1]
            steps.append({"ms": (now - last) * 1e3, "prefill": out.num_prefill_tokens, "decode": out.num_decode_tokens})
            last = now
    return steps


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    prefill = [s for s in steps if s["prefill"]]
    bins: dict[str, list[float]] = {}
    for s in steps:
        if not s["prefill"]:
            b = s["decode"]
            key = next(f"<={edge}" for edge in (1, 8, 32, 64, 128, 256, 1 << 30) if b <= edge)
            bins.setdefault(key, []).append(s["ms"])
    return {
        "total_s": sum(s["ms"] for s in steps) / 1e3,
        "prefill_steps": len(prefill),
        "prefill_s": sum(s["ms"] for s in prefill) / 1e3,
        "prefill_tokens": sum(s["prefill"] for s in prefill),
        "decode_bins": {k: {"steps": len(v), "s": sum(v) / 1e3, "mean_ms": sum(v) / len(v)} for k, v in bins.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    engine = LLM(model_config(args.shape), dtype="bfloat16").engine
    warm = random_workload(engine.vocab_size, 256, seed=1)
    run(engine, warm.prompts, [8] * len(warm.prompts), "warm")
    work = random_workload(engine.vocab_size, 256)
    steps = run(engine, work.prompts, work.output_lens, "run")
    report = {"device": torch.cuda.get_device_name(0), "shape": args.shape, **summary(steps)}
    report["tok_s"] = sum(work.output_lens) / report["total_s"]
    print(json.dumps(report, indent=2), flush=True)
    fresh = random_workload(engine.vocab_size, 256, seed=2)
    for i, prompt in enumerate(fresh.prompts):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
    engine.step()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
    keys = ("cuda_time_total", "self_cpu_time_total")
    tables = [prof.key_averages().table(sort_by=key, row_limit=22) for key in keys]
    print("\n".join(tables))
    Path(args.out, f"phases-{args.shape}.json").write_text(json.dumps(report | {"steps": steps}))


if __name__ == "__main__":
    main()
