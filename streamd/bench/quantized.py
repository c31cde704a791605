"""Quantized serving on one GPU: FP8 weights and an 8-bit KV cache against bfloat16 (issue 28's targets).

Per model shape (random weights, bfloat16; default the 8B and the 1B Llama shapes), the nano-vllm workload (256
requests, 100-1024 tokens in and out, all at once) through one engine per variant, each with its KV pool sized from
the memory left (`cache.gpu_memory_utilization`): bf16 (weights and KV), KV int8, KV fp8, weights fp8, and weights
fp8 + KV fp8. Reported per variant: output tok/s and its ratio to bf16, the KV blocks the pool got and the ratio of
blocks per byte (equal memory: the layouts' bytes per block), the weights' bytes, and the share of the bf16
roofline (the hardware's measured HBM and matmul ceilings, `offline.roofline_tok_s`).
"""

from __future__ import annotations

import argparse
from typing import Any

from streamd.bench.offline import free_cuda, measure_ceilings, model_config, random_workload, roofline_tok_s
from streamd.bench.report import BenchError, add_out_argument, markdown_table, report_header, save_report

VARIANTS: dict[str, dict[str, str]] = {
    "bf16": {},
    "kv-int8": {"kv_cache_dtype": "int8"},
    "kv-fp8": {"kv_cache_dtype": "fp8"},
    "w-fp8": {"quantization": "fp8"},
    "w-fp8+kv-fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default="llama3.1-8b,llama3.2-1b", help="comma-separated model shapes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--num-requests", type=int, default=256)
    add_out_argument(parser)


def run_variant(config: Any, work: Any, overrides: dict[str, str]) -> dict[str, Any]:
    from tqdm import tqdm

    from streamd import LLM
    from streamd.bench.offline import drive
    from streamd.engine.worker.model_loader import weight_bytes

    llm = LLM(config, dtype="bfloat16", **overrides)
    engine = llm.engine
    layout = engine.cache.layout
    held = {
        "num_blocks": engine.cache.num_blocks,
        "bytes_per_block": layout.bytes_per_block,
        "kv_dtype": str(layout.dtype).removeprefix("torch."),
        "weight_bytes": weight_bytes(engine.runner.model),
    }
    with tqdm(total=len(work.prompts), desc=str(overrides or "bf16"), unit="req") as bar:
        result = drive(engine, work, bar)
    del llm, engine
    free_cuda()
    return {**held, **result}


def measure_shape(shape: str, variants: list[str], num_requests: int, ceilings: dict[str, float]) -> dict[str, Any]:
    config = model_config(shape)
    work = random_workload(config.vocab_size, num_requests)
    runs = {name: run_variant(config, work, VARIANTS[name]) for name in variants}
    base = runs.get("bf16")
    roofline = roofline_tok_s(config, work, ceilings)
    for run in runs.values():
        run["of_bf16_roofline"] = run["tok_s"] / roofline
        if base is not None:
            run["tok_s_vs_bf16"] = run["tok_s"] / base["tok_s"]
            run["blocks_per_byte_vs_bf16"] = base["bytes_per_block"] / run["bytes_per_block"]
            run["blocks_vs_bf16"] = run["num_blocks"] / base["num_blocks"]
    return {"model_shape": shape, "workload": work.name, "bf16_roofline_tok_s": roofline, "variants": runs}


def markdown(report: dict[str, Any]) -> str:
    c = report["ceilings"]
    lines = [
        f"# Quantized serving, {report['device']}, {report['date']} (commit {report['git_commit']})",
        "",
        f"`{report['command']}`. Measured ceilings: HBM {c['hbm_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
        f"{c['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s.",
        "",
    ]
    for shape in report["shapes"]:
        lines += [f"## {shape['model_shape']}, {shape['workload']}", ""]
        rows = []
        for name, r in shape["variants"].items():
            rows.append(
                (
                    name,
                    f"{r['tok_s']:.0f}",
                    f"{r.get('tok_s_vs_bf16', float('nan')):.2f}x",
                    r["num_blocks"],
                    f"{r.get('blocks_vs_bf16', float('nan')):.2f}x",
                    f"{r.get('blocks_per_byte_vs_bf16', float('nan')):.2f}x",
                    f"{r['weight_bytes'] / 2**30:.2f}",
                    f"{r['median_ttft_s']:.2f}",
                    r["preemptions"],
                    f"{r['of_bf16_roofline']:.0%}",
                )
            )
        header = (
            "variant",
            "tok/s",
            "vs bf16",
            "KV blocks",
            "blocks vs bf16",
            "blocks at equal memory",
            "weights GiB",
            "median TTFT s",
            "preemptions",
            "of bf16 roofline",
        )
        lines += [*markdown_table(header, rows), ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        raise BenchError("bench quantized measures FP8 on a GPU: no CUDA device here")
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise BenchError(f"unknown variants {unknown} (known: {', '.join(VARIANTS)})")
    ceilings = measure_ceilings()
    report: dict[str, Any] = {
        **report_header(torch.cuda.get_device_name()),
        "command": f"streamd bench quantized --shapes {args.shapes} --variants {args.variants} "
        f"--num-requests {args.num_requests}",
        "ceilings": ceilings,
        "shapes": [],
    }
    for shape in args.shapes.split(","):
        report["shapes"].append(measure_shape(shape, variants, args.num_requests, ceilings))
        save_report(report, args.out, "quantized", markdown(report))
    print(markdown(report))
    return 0
