"""Profile one engine step on the device: where the time of a decode step at a full batch goes.

Usage (device): python3 benchmarks/profile_step.py --shape llama3.2-1b --out $OUT
Prints wall time per phase (schedule, prepare+forward, sample, bookkeeping) and torch.profiler's top ops.
"""

from __future__ import annotations

import argparse
import time

import torch

from streamd import LLM, SamplingParams
from streamd.bench.offline import abort_all, all_decoding
from streamd.bench.throughput import model_config, random_workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    config = model_config(args.shape)
    llm = LLM(config, dtype="bfloat16")
    engine = llm.engine
    work = random_workload(config.vocab_size, args.batch)
    for i, prompt in enumerate(work.prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=2000 - len(prompt), ignore_eos=True,
                                                           detokenize=False))
    torch.cuda.synchronize()
    start = time.perf_counter()
    prefill_steps = 0
    while not all_decoding(engine):
        engine.step()
        prefill_steps += 1
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - start
    prompt_tokens = sum(map(len, work.prompts))
    print(f"[{args.shape}] prefill of {prompt_tokens} tokens: {prefill_steps} steps, {prefill_s:.2f} s, "
          f"{prompt_tokens / prefill_s:.0f} tok/s")
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    n = 50
    start = time.perf_counter()
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / n * 1e3
    print(f"[{args.shape}] batch {engine.stats().scheduler.num_running}: {step_ms:.2f} ms/step "
          f"= {engine.stats().scheduler.num_running / step_ms * 1e3:.0f} tok/s (decode only)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(table)
    gpu = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)
    print(gpu)
    with open(f"{args.out}/profile-{args.shape}.txt", "w") as fh:
        fh.write(f"{step_ms:.3f} ms/step\n{table}\n{gpu}\n")
    abort_all(engine)


if __name__ == "__main__":
    main()
