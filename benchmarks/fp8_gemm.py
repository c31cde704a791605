"""Issue 28 on one GPU: which FP8 GEMM, and what the one-launch activation quantization costs (device call).

For the Llama-3.1-8B and 3.2-1B Linears at decode and prefill row counts, each timed inside a CUDA graph (the
engine's decode steps replay graphs, so launch overhead is not what is compared):
- bf16 `x @ w.T` (cuBLAS), the baseline;
- `torch._scaled_mm` with rowwise scales (what `Fp8Linear` used), and with per-tensor scales (cuBLASLt);
- `streamd.kernels.fp8_matmul`: the per-tensor one with unit scales, then the row and channel scales in one pass;
and the quantization: torch's `layout.quantize_rows` against `quantize_fp8`, the norms and SiLU-and-mul with and
without FP8 output. Writes one JSON to argv[1] and prints a table.

    python benchmarks/fp8_gemm.py OUT.json
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import torch

import streamd.kernels as K
from streamd.kernels import reference as R
from streamd.kernels.layout import FP8, quantize_rows

SHAPES = {  # name: (k, n)
    "8b.qkv": (4096, 6144),
    "8b.o": (4096, 4096),
    "8b.gate_up": (4096, 28672),
    "8b.down": (14336, 4096),
    "1b.qkv": (2048, 3072),
    "1b.gate_up": (2048, 16384),
    "1b.down": (8192, 2048),
}
ROWS = (1, 16, 64, 128, 256, 512, 2048)


def graph_us(fn, reps: int = 20, replays: int = 10) -> float:
    """Mean microseconds of one `fn()` inside a CUDA graph of `reps` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (replays * reps))
    return best


def gemm_case(name: str, rows: int) -> dict:
    k, n = SHAPES[name]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    xq, wq = R.quantize_fp8(x), R.quantize_fp8(w)
    row: dict = {"shape": name, "rows": rows, "k": k, "n": n}
    row["bf16_us"] = graph_us(lambda: x @ w.t())
    wt = wq.codes.t()
    sa, sb = xq.scales[:, None].contiguous(), wq.scales[None, :].contiguous()
    row["scaled_mm_rowwise_us"] = graph_us(
        lambda: torch._scaled_mm(xq.codes, wt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    )
    one = torch.ones((), device="cuda")
    row["scaled_mm_tensor_us"] = graph_us(
        lambda: torch._scaled_mm(xq.codes, wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    )
    want = R.fp8_matmul(xq, wq.codes, wq.scales, torch.float32)
    got = K.fp8_matmul(xq, wq.codes, wq.scales, torch.bfloat16)
    row["fp8_matmul_rel_err"] = ((got.float() - want).abs().max() / want.abs().max()).item()
    row["fp8_matmul_us"] = graph_us(lambda: K.fp8_matmul(xq, wq.codes, wq.scales, torch.bfloat16))
    return row


def quant_case(rows: int, hidden: int, inter: int) -> dict:
    h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    wn = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
    out = {"rows": rows, "hidden": hidden, "inter": inter}
    out["torch_quantize_rows_us"] = graph_us(lambda: quantize_rows(h, FP8))
    out["quantize_fp8_us"] = graph_us(lambda: K.quantize_fp8(h))
    out["fused_add_rmsnorm_us"] = graph_us(lambda: K.fused_add_rmsnorm(h, r, wn, 1e-5))
    out["fused_add_rmsnorm_fp8_us"] = graph_us(lambda: K.fused_add_rmsnorm_fp8(h, r, wn, 1e-5))
    out["silu_and_mul_us"] = graph_us(lambda: K.silu_and_mul(g))
    out["silu_and_mul_fp8_us"] = graph_us(lambda: K.silu_and_mul_fp8(g))
    got, want = K.quantize_fp8(h), R.quantize_fp8(h)
    out["quantize_codes_equal"] = bool(torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8)))
    a, b = K.silu_and_mul_fp8(g), R.silu_and_mul_fp8(g)
    out["silu_fp8_codes_max_diff"] = int(
        (a.codes.view(torch.uint8).int() - b.codes.view(torch.uint8).int()).abs().max()
    )
    return out


def main() -> None:
    start = time.time()
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gemm": [], "quant": []}
    for rows, (hidden, inter) in itertools.product((1, 64, 256, 2048), ((4096, 14336), (2048, 8192))):
        result["quant"].append(quant_case(rows, hidden, inter))
        print(json.dumps(result["quant"][-1]), flush=True)
    for name, rows in itertools.product(SHAPES, ROWS):
        row = gemm_case(name, rows)
        result["gemm"].append(row)
        print(json.dumps(row), flush=True)
    result["seconds"] = time.time() - start
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
