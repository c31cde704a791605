"""Issue 28's kernel timings on one GPU (device call): decode attention over bf16, int8 and fp8 pools, and an FP8
Linear (with its activation quantization) against the bf16 one, at the nano-vllm workload's decode shapes (8B)."""

from __future__ import annotations

import json

import torch
from triton.testing import do_bench

import streamd.kernels as K
from streamd.engine.worker import fp8
from streamd.kernels.layout import quantize_rows


def decode_case(seqs: int = 256, ctx: int = 1024, hkv: int = 8, group: int = 4, dim: int = 128, page: int = 16):
    """(query, bf16 pool of one layer, block tables, lengths) of the 8B decode shape (also `quantized_sweep.py`'s)."""
    blocks = seqs * ctx // page
    tables = torch.arange(blocks, dtype=torch.int32, device="cuda").view(seqs, -1)
    lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    query = torch.randn(seqs, hkv * group, dim, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(blocks, 1, 2, hkv, page, dim, device="cuda", dtype=torch.bfloat16)
    return query, pool, tables, lens


def main() -> None:
    out: dict[str, float] = {}
    query, pool, tables, lens = decode_case()
    for name, dtype in (("bf16", None), ("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        codes, scales = (pool, None) if dtype is None else quantize_rows(pool, dtype)
        ms = do_bench(lambda: K.paged_decode_attention(query, codes, 0, tables, lens, 0.088, kv_scales=scales),
                      warmup=25, rep=200, return_mode="median")
        out[f"decode_{name}_ms"] = ms
        out[f"decode_{name}_gbps"] = codes.numel() * codes.element_size() / ms / 1e6
        del codes, scales
    for rows in (1, 64, 256):
        for k, n in ((4096, 6144), (14336, 4096)):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            layer = fp8.Fp8Linear(fp8.quantize_weight(w), None)
            out[f"bf16_linear_{rows}x{k}x{n}_us"] = 1e3 * do_bench(lambda: x @ w.t(), warmup=25, rep=200,
                                                                  return_mode="median")
            out[f"fp8_linear_{rows}x{k}x{n}_us"] = 1e3 * do_bench(lambda: layer(x), warmup=25, rep=200,
                                                                 return_mode="median")
            out[f"fp8_quant_only_{rows}x{k}_us"] = 1e3 * do_bench(lambda: fp8.quantize_rows(x), warmup=25, rep=200,
                                                                 return_mode="median")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
