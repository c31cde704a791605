"""Issue 26: where a tensor-parallel decode step's time goes, TP = 1 against TP = 2 on one checkpoint.

Usage (a 2-GPU device): python3 benchmarks/tp_profile.py CHECKPOINT OUT
For TP = 1 and TP = 2 in turn: the decode step's wall time at batch 64 and 256 (512-token prompts, every
sequence decoding, no profiler), then for TP = 2 at batch 256 torch's profiler around 10 steps on rank 0 and
(`STREAMD_TP_PROFILE`, workers.py) a window of the worker rank's steps. Writes `tp-profile.json` (step times,
rank 0's GPU busy / idle / NCCL time per step) and the Chrome traces of both ranks under OUT.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from streamd import LLM
from streamd.bench.offline import abort_all, fill_decoding, ms_per_call, sync_cuda

PROMPT = int(os.environ.get("TP_PROFILE_PROMPT", "512"))
BATCHES = tuple(int(b) for b in os.environ.get("TP_PROFILE_BATCHES", "256,64").split(","))


def gpu_timeline(prof: Any) -> dict[str, float]:
    """Rank 0's kernels in the profiled window: span, busy (union of kernel intervals), NCCL and idle time."""
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    busy = nccl = 0.0
    end = None
    for e in kernels:
        s, t = e.time_range.start, e.time_range.end
        nccl += (t - s) if "nccl" in e.name.lower() or "all_reduce" in e.name.lower() else 0
        if end is None or s >= end:
            busy, end = busy + t - s, t
        elif t > end:
            busy, end = busy + t - end, t
    span = kernels[-1].time_range.end - kernels[0].time_range.start if kernels else 0.0
    return {"kernels": len(kernels), "span_us": span, "busy_us": busy, "idle_us": span - busy, "nccl_us": nccl}


def run(tp: int, ckpt: str, out: str, report: dict[str, Any]) -> None:
    llm = LLM(ckpt, dtype="bfloat16", tensor_parallel_size=tp, num_kv_blocks=12000, max_num_seqs=256)
    engine = llm.engine
    sends = [0]
    if tp > 1:
        send = engine.executor._send

        def counted(message: Any) -> None:
            sends[0] += message.command == 1
            send(message)

        engine.executor._send = counted
    for batch in BATCHES:
        fill_decoding(engine, batch, PROMPT, 400, salt=batch)
        if tp > 1 and batch == BATCHES[0] and os.environ.get("STREAMD_TP_PROFILE"):
            report["rank0_profile_first_step"] = sends[0]
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    engine.step()
                sync_cuda()
            prof.export_chrome_trace(f"{out}/tp2-rank0.json")
            report[f"tp2_b{batch}_rank0"] = gpu_timeline(prof) | {"steps": 10}
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        ms = ms_per_call(engine.step)
        report[f"tp{tp}_b{batch}_ms"] = ms
        print(f"tp={tp} batch={batch}: {ms:.3f} ms/step", flush=True)
        abort_all(engine)
    engine.executor.shutdown()
    del llm, engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(ckpt: str, out: str) -> None:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (a dry run)"
    report: dict[str, Any] = {"device": device, "checkpoint": ckpt}
    for tp in (1, 2):
        run(tp, ckpt, out, report)
    for batch in BATCHES:
        report[f"speedup_b{batch}"] = report[f"tp1_b{batch}_ms"] / report[f"tp2_b{batch}_ms"]
    print(json.dumps(report, indent=2))
    with open(f"{out}/tp-profile.json", "w") as fh:
        json.dump(report, fh, indent=2)


if __name__ == "__main__":  # the worker rank imports this file again (spawn)
    os.environ.setdefault("STREAMD_TP_PROFILE", f"20:50:{sys.argv[2]}/tp2-worker")
    main(sys.argv[1], sys.argv[2])
