"""`streamd bench throughput --tp 1,2`: offline throughput of one model shape at several tensor-parallel
sizes in one invocation, with what bounds the multi-GPU number.

The weights are random (bf16) but saved once as a checkpoint that every run loads, as a deployment would
(the tensor-parallel ranks each load it and keep their shard). Each size runs nano-vllm's workload
(`offline.random_workload`), then the time to first token of a lone 4k-token prompt (fresh tokens each
time: no prefix-cache hits). Beside them:

- an NCCL probe: all-reduces of a few sizes over the GPUs, reported as bus bandwidth
  (busbw = 2 (n - 1) / n * bytes / time, nccl-tests' definition) and the smallest size's latency;
- the N-GPU roofline (`offline.roofline_tok_s`), which charges the all-reduces at the probe's numbers
  (NCCL's, also for a run whose layers sum through symmetric memory: `--all-reduce auto,nccl` measures both).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from streamd.bench.live import free_port
from streamd.bench.offline import (
    SHAPES,
    drive,
    free_cuda,
    measure_ceilings,
    model_config,
    random_workload,
    roofline_tok_s,
)
from streamd.bench.report import BenchError, markdown_table, report_header, save_report
from streamd.bench.workloads import TokenWorkload

TTFT_PROMPT = 4096
TTFT_REPEATS = 5
_PROBE_SIZES = (1 << 16, 1 << 21, 1 << 24, 1 << 27)  # bytes: 64 KiB (latency) .. 128 MiB (bandwidth)


def save_checkpoint(config: Any, path: Path, dtype: str = "bfloat16") -> Path:
    """Random weights of `config` in `dtype` (made on the GPU: seconds) and a word-level tokenizer, as a
    directory `LLM` loads; kept if already there. (The CUDA tensor-parallel test saves its model so too.)"""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    words = WordLevel({f"w{i}": i for i in range(config.vocab_size)}, unk_token="w0")
    tokenizer = Tokenizer(words)
    tokenizer.pre_tokenizer = WhitespaceSplit()  # (a served prompt of N words is N tokens: `bench replicas`)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(path)
    return path


# ---- NCCL -------------------------------------------------------------------------------------------


def nccl_probe(world: int) -> dict[str, Any]:
    """All-reduce bus bandwidth (bytes/s, the largest size) and latency (s, the smallest) over `world` GPUs."""
    import torch.multiprocessing as mp

    port = free_port()
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    procs = [context.Process(target=_probe_rank, args=(rank, world, port, results)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    times: dict[int, float] = results.get()
    top = max(times)
    return {
        "nccl_bus_bytes_per_s": 2 * (world - 1) / world * top / times[top],
        "nccl_latency_s": times[min(times)],
        "nccl_times_s": {str(k): v for k, v in times.items()},
    }


def _probe_rank(rank: int, world: int, port: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    times = {}
    for size in _PROBE_SIZES:
        x = torch.ones(size // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        reps = 50
        start = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        times[size] = (time.perf_counter() - start) / reps
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


# ---- runs -------------------------------------------------------------------------------------------


def run_tp(
    path: Path, tp: int, work: TokenWorkload, num_kv_blocks: int, progress: Any, all_reduce: str = "auto"
) -> dict[str, Any]:
    """Throughput of the workload, then the 4k-prompt TTFT, on one engine of `tp` ranks (`all_reduce`:
    `parallel.all_reduce`; the result names the kind the ranks chose)."""
    from streamd import LLM

    llm = LLM(str(path), dtype="bfloat16", tensor_parallel_size=tp, num_kv_blocks=num_kv_blocks, all_reduce=all_reduce)
    engine = llm.engine
    result: dict[str, Any] = dict(drive(engine, work, progress))
    result["ttft_4k_s"] = ttft_s(engine, engine.vocab_size)
    result["tp"] = tp
    workers = getattr(engine.executor, "workers", None)
    result["all_reduce"] = workers.all_reduce if workers is not None else "-"
    engine.executor.shutdown()
    del llm, engine
    free_cuda()
    return result


def ttft_s(engine: Any, vocab: int, length: int = TTFT_PROMPT, repeats: int = TTFT_REPEATS) -> float:
    """Median time to the first token of a lone `length`-token prompt (new random tokens each time)."""
    from streamd import SamplingParams

    rng = random.Random(7)
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False, temperature=0.0)
    times = []
    for i in range(repeats + 1):  # the first one warms the prefill kernels' long-prompt variants
        prompt = [rng.randrange(vocab) for _ in range(length)]
        start = time.perf_counter()
        engine.add_request(f"ttft-{i}", prompt, params)
        while not any(d.num_new_tokens for d in engine.step()):
            pass
        times.append(time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times[1:])


def tp_main(
    shape: str,
    sizes: list[int],
    num_requests: int,
    num_kv_blocks: int,
    out: str | None,
    all_reduce_modes: tuple[str, ...] = ("auto",),
) -> dict[str, Any]:
    """Each size once; a size > 1 once per `all_reduce_modes` (`parallel.all_reduce`), the first one's numbers
    reported as `tp{N}_...`, the others' as `tp{N}_{mode}_...`."""
    import torch
    from tqdm import tqdm

    if shape not in SHAPES:
        raise BenchError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    if max(sizes) > torch.cuda.device_count():
        raise BenchError(f"--tp {max(sizes)} needs that many GPUs ({torch.cuda.device_count()} visible)")
    config = model_config(shape, max_len=2 * TTFT_PROMPT)
    ceilings = measure_ceilings()
    probe = nccl_probe(max(sizes)) if max(sizes) > 1 else {}
    ceilings.update({k: v for k, v in probe.items() if k != "nccl_times_s"})
    work = random_workload(config.vocab_size, num_requests)
    path = save_checkpoint(config, Path(os.environ.get("STREAMD_BENCH_CKPT", "/tmp/streamd-ckpt")) / shape)
    report: dict[str, Any] = {
        **report_header(f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}"),
        "model_shape": shape,
        "workload": work.name,
        "num_kv_blocks": num_kv_blocks,
        "ceilings": ceilings,
        "nccl_bus_gb_s": ceilings.get("nccl_bus_bytes_per_s", 0.0) / 1e9,
        "nccl_all_reduce_s": probe.get("nccl_times_s", {}),
        "runs": [],
    }
    for tp, mode in _runs(sizes, all_reduce_modes):
        with tqdm(total=len(work.prompts), desc=f"{shape} tp={tp} {mode}", unit="req") as bar:
            run = run_tp(path, tp, work, num_kv_blocks, bar, mode)
        run["roofline_tok_s"] = roofline_tok_s(config, work, ceilings, tp)
        report["runs"].append(run)
        label = f"tp{tp}" if tp == 1 or mode == all_reduce_modes[0] else f"tp{tp}_{mode}"
        report[f"{label}_tok_s"] = run["tok_s"]
        report[f"{label}_ttft_4k_s"] = run["ttft_4k_s"]
        report[f"{label}_all_reduce"] = run["all_reduce"]
        report[f"roofline_tp{tp}_tok_s"] = run["roofline_tok_s"]
    top = max(sizes)
    report["roofline_tok_s"] = report[f"roofline_tp{top}_tok_s"]
    report[f"tp{top}_share_of_roofline"] = report[f"tp{top}_tok_s"] / report["roofline_tok_s"]
    if 1 in sizes and top > 1:
        report[f"tp{top}_speedup"] = report[f"tp{top}_tok_s"] / report["tp1_tok_s"]
        report[f"tp{top}_ttft_ratio"] = report[f"tp{top}_ttft_4k_s"] / report["tp1_ttft_4k_s"]
    save_report(report, out, "throughput-tp", summary_markdown(report))
    return report


def _runs(sizes: list[int], all_reduce_modes: tuple[str, ...]) -> list[tuple[int, str]]:
    """(size, parallel.all_reduce) of each run: one size 1 run (no all-reduce), each mode for the others."""
    return [(size, mode) for size in sizes for mode in (all_reduce_modes if size > 1 else ("auto",))]


def summary_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Tensor-parallel throughput, {report['device']}, {report['date']} (commit {report['git_commit']})",
        "",
        f"{report['model_shape']}, {report['workload']}, {report['num_kv_blocks']} KV blocks; "
        f"NCCL bus bandwidth {report['nccl_bus_gb_s']:.0f} GB/s.",
        "",
        *markdown_table(
            ["TP", "all-reduce", "tok/s", "roofline tok/s", "of roofline", "4k-prompt TTFT s"],
            (
                [
                    run["tp"],
                    run.get("all_reduce", "-"),
                    f"{run['tok_s']:.0f}",
                    f"{run['roofline_tok_s']:.0f}",
                    f"{100 * run['tok_s'] / run['roofline_tok_s']:.0f}%",
                    f"{run['ttft_4k_s']:.3f}",
                ]
                for run in report["runs"]
            ),
        ),
    ]
    return "\n".join(lines) + "\n"
