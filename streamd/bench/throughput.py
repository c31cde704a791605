"""`streamd bench throughput`: offline throughput of streamd against Hugging Face transformers (continuous
batching and static batching) on the same device in the same process, with the device's measured
ceilings and the workload's roofline. Writes `<--out>/throughput-<date>-<gpu>.json` and `.md`. With
`--device cpu` (the default without CUDA) it runs the default model instead (see throughput_cpu.py).

Workload (nano-vllm's): 256 requests, seed 0, random-token prompts and output lengths uniform in
[100, 1024], EOS ignored, random bf16 weights of a named shape (or a real model directory).
`--tp 1,2` measures tensor-parallel sizes instead, on the first shape (`tensor_parallel.py`).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from streamd.bench.hf_peer import run_continuous_batching
from streamd.bench.offline import (  # (re-exported: other benchmarks and device scripts import them from here)
    SHAPES,
    drive,
    free_cuda,
    measure_ceilings,
    model_config,
    random_workload,
    roofline_tok_s,
)
from streamd.bench.report import BenchError, add_out_argument, report_header, save_report
from streamd.bench.tensor_parallel import tp_main
from streamd.bench.workloads import TokenWorkload


def shared_prefix_workload(vocab: int, num_requests: int = 256, prefix: int = 500, seed: int = 0) -> TokenWorkload:
    """Chat requests behind one system prompt of `prefix` tokens (2048 is SGLang's generated-shared-prefix
    default), each with 50-150 tokens of its own and 128 output tokens, all arriving at once."""
    rng = random.Random(seed + 1)
    system = [rng.randrange(vocab) for _ in range(prefix)]
    prompts = [system + [rng.randrange(vocab) for _ in range(rng.randint(50, 150))] for _ in range(num_requests)]
    return TokenWorkload(f"shared-prefix-{num_requests}x{prefix}+[50,150]", prompts, [128] * num_requests)


# ---- the three engines ------------------------------------------------------------------------------


def run_streamd(config: Any, work: TokenWorkload, progress: Any, **overrides: Any) -> dict[str, float]:
    from streamd import LLM

    llm = LLM(config, dtype="bfloat16", **overrides)
    engine = llm.engine
    result = drive(engine, work, progress)
    del llm, engine
    free_cuda()
    return result


def run_hf_continuous(config: Any, work: TokenWorkload, progress: Any) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="paged|sdpa")
    model = model.eval()
    seconds, produced = run_continuous_batching(model, work, lambda: progress.update(1))
    del model
    free_cuda()
    return {"tok_s": produced / seconds, "seconds": seconds, "tokens": produced}


def run_hf_static(config: Any, work: TokenWorkload, progress: Any, batch: int = 64) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch):
        prompts, lens = work.prompts[i : i + batch], work.output_lens[i : i + batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
        with torch.inference_mode():  # a static batch runs until its longest request is done
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                do_sample=False,
                pad_token_id=0,
            )
        progress.update(len(prompts))
    seconds = time.perf_counter() - start
    del model
    free_cuda()
    return {"tok_s": work.output_tokens / seconds, "seconds": seconds}


# ---- entry point ------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="cuda: random weights of named shapes; cpu: the default model, CPU-sized workload "
        "(auto: cuda when available)",
    )
    parser.add_argument("--shapes", default="llama3.2-1b,smollm2-135m", help="CUDA: comma-separated model shapes")
    parser.add_argument(
        "--tp",
        default=None,
        metavar="N[,N...]",
        help="CUDA: tensor-parallel sizes to measure on the first shape, from one saved checkpoint, with the "
        "4k-prompt TTFT, an NCCL probe and the N-GPU roofline (e.g. --tp 1,2 --shapes llama3.1-8b)",
    )
    parser.add_argument(
        "--num-kv-blocks", type=int, default=20000, help="CUDA with --tp: the KV pool of each rank, in blocks"
    )
    parser.add_argument(
        "--all-reduce",
        default="auto",
        metavar="MODE[,MODE...]",
        help="CUDA with --tp: parallel.all_reduce for the sizes > 1 (auto, nccl, symm_mem); several, "
        "comma-separated, measure each (e.g. auto,nccl)",
    )
    parser.add_argument("--num-requests", type=int, default=None, help="default: 256 on CUDA, 32 on CPU")
    parser.add_argument("--peers", default="hf_cb,hf_static", help="CUDA: comma-separated: hf_cb, hf_static (or none)")
    parser.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA: also run the shared-prefix workload with caching on and off",
    )
    parser.add_argument(
        "--prefix-lens",
        default="500,2048",
        help="CUDA: system-prompt lengths of the shared-prefix runs (comma-separated)",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="CPU: weights' dtype")
    parser.add_argument("--repeats", type=int, default=3, help="CPU: alternating rounds (the median is reported)")
    parser.add_argument(
        "--contention",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU: also run while a process this benchmark starts keeps one core busy",
    )
    parser.add_argument("--threads", type=int, default=0, help="CPU: torch threads (0: one per usable core)")
    add_out_argument(parser)
    parser.add_argument(
        "--merge",
        metavar="JSON",
        help="CUDA: an earlier report of the same device and day whose "
        "runs of other shapes (and prefix-cache entry) are kept, for results gathered over several runs",
    )


def main(args: argparse.Namespace) -> int:
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        from streamd.bench.throughput_cpu import main as cpu_main

        return cpu_main(args)
    if not torch.cuda.is_available():
        raise BenchError("--device cuda needs a CUDA device (use --device cpu)")
    if args.tp:
        sizes = [int(n) for n in args.tp.split(",")]
        modes = tuple(args.all_reduce.split(","))
        shape = args.shapes.split(",")[0]
        report = tp_main(shape, sizes, args.num_requests or 256, args.num_kv_blocks, args.out, modes)
        print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
        return 0
    return _cuda_main(args)


def _cuda_main(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    num_requests = args.num_requests or 256
    ceilings = measure_ceilings()
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    report: dict[str, Any] = {
        **report_header(torch.cuda.get_device_name()),
        "ceilings": ceilings,
        "runs": [],
    }
    if args.merge and Path(args.merge).is_file():
        earlier = json.loads(Path(args.merge).read_text())
        shapes = set(args.shapes.split(","))
        report["runs"] = [r for r in earlier.get("runs", []) if r["model_shape"] not in shapes]
        if "prefix_cache" in earlier and not args.prefix_cache:
            report["prefix_cache"] = earlier["prefix_cache"]
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise BenchError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
        config = model_config(shape)
        work = random_workload(config.vocab_size, num_requests)
        run: dict[str, Any] = {
            "model_shape": shape,
            "workload": work.name,
            "output_tokens": work.output_tokens,
            "roofline_tok_s": roofline_tok_s(config, work, ceilings),
        }
        total = len(work.prompts) * (1 + len(peers))
        with tqdm(total=total, desc=f"{shape}", unit="req") as bar:
            run["streamd"] = run_streamd(config, work, bar)
            if "hf_cb" in peers:
                run["hf_cb"] = run_hf_continuous(config, work, bar)
            if "hf_static" in peers:
                run["hf_static"] = run_hf_static(config, work, bar)
        run["streamd_tok_s"] = run["streamd"]["tok_s"]
        run["hf_cb_tok_s"] = run.get("hf_cb", {}).get("tok_s")
        run["hf_static_tok_s"] = run.get("hf_static", {}).get("tok_s")
        report["runs"].append(run)
        save_report(report, args.out, "throughput", summary_markdown(report))
    if args.prefix_cache:
        shape = args.shapes.split(",")[0]
        report["prefix_cache"] = [prefix_cache_run(shape, num_requests, int(n)) for n in args.prefix_lens.split(",")]
        save_report(report, args.out, "throughput", summary_markdown(report))
    print(summary_markdown(report))
    return 0


def prefix_cache_run(shape: str, num_requests: int, prefix: int) -> dict[str, Any]:
    from tqdm import tqdm

    config = model_config(shape)
    work = shared_prefix_workload(config.vocab_size, num_requests, prefix)
    with tqdm(total=2 * num_requests, desc=f"prefix {prefix} cache on/off", unit="req") as bar:
        on = run_streamd(config, work, bar, enable_prefix_caching=True)
        off = run_streamd(config, work, bar, enable_prefix_caching=False)
    return {
        "model_shape": shape,
        "workload": work.name,
        "tok_s_on": on["tok_s"],
        "tok_s_off": off["tok_s"],
        "median_ttft_on_s": on["median_ttft_s"],
        "median_ttft_off_s": off["median_ttft_s"],
        "hit_tokens_on": on["prefix_cache_hit_tokens"],
        "tok_s_ratio": on["tok_s"] / off["tok_s"],
        "median_ttft_ratio": off["median_ttft_s"] / on["median_ttft_s"],
    }


def summary_markdown(report: dict[str, Any]) -> str:
    c = report["ceilings"]
    lines = [
        f"# Throughput, {report['device']}, {report['date']} (commit {report['git_commit']})",
        "",
        f"Measured ceilings: HBM {c['hbm_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
        f"{c['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s.",
        "",
        "| shape | streamd tok/s | HF CB tok/s | HF static tok/s | roofline tok/s | vs HF CB | of roofline |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        cb = run.get("hf_cb_tok_s")
        lines.append(
            f"| {run['model_shape']} | {run['streamd_tok_s']:.0f} | {cb or float('nan'):.0f} | "
            f"{run.get('hf_static_tok_s') or float('nan'):.0f} | {run['roofline_tok_s']:.0f} | "
            f"{(run['streamd_tok_s'] / cb) if cb else float('nan'):.1f}x | "
            f"{100 * run['streamd_tok_s'] / run['roofline_tok_s']:.0f}% |"
        )
    if report.get("prefix_cache"):
        lines += [
            "",
            "| prefix caching, workload | tok/s on | tok/s off | throughput | median TTFT on s | "
            "median TTFT off s | TTFT lower by |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in report["prefix_cache"]:
            lines.append(
                f"| {p['workload']} | {p['tok_s_on']:.0f} | {p['tok_s_off']:.0f} | "
                f"{p['tok_s_on'] / p['tok_s_off']:.2f}x | {p['median_ttft_on_s']:.3f} | "
                f"{p['median_ttft_off_s']:.3f} | {p['median_ttft_off_s'] / p['median_ttft_on_s']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
