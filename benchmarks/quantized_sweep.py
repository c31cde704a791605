"""Issue 28: decode tiles for the 8-bit pools (device call): BLOCK_N x num_warps x num_stages, at the 8B decode
shape (head dim 128) or, given `64`, the 1B's (head dim 64); the bf16 pool at its default tiles beside them.

    python3 benchmarks/quantized_sweep.py [HEAD_DIM]
"""

from __future__ import annotations

import json
import sys

import torch
from quantized_kernels import decode_case  # (this folder: run as `python3 benchmarks/quantized_sweep.py`)
from triton.testing import do_bench

import streamd.kernels as K
from streamd.kernels.layout import quantize_rows

dim = int(sys.argv[1]) if len(sys.argv) > 1 else 128
query, pool, tables, lens = decode_case(dim=dim)
out = {"head_dim": dim, "bf16_default": do_bench(lambda: K.paged_decode_attention(query, pool, 0, tables, lens, 0.088),
                                                 warmup=10, rep=60, return_mode="median")}
for name, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
    codes, scales = quantize_rows(pool, dtype)
    for bn in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (2, 3, 4):
                def call(codes=codes, scales=scales, bn=bn, warps=warps, stages=stages):
                    return K.paged_decode_attention(query, codes, 0, tables, lens, 0.088, kv_scales=scales, block_n=bn,
                                                    num_warps=warps, num_stages=stages)

                try:
                    ms = do_bench(call, warmup=10, rep=60, return_mode="median")
                except Exception:  # out of shared memory etc.
                    ms = float("nan")
                out[f"{name}_n{bn}_w{warps}_s{stages}"] = ms
best = {k: min((v, kk) for kk, v in out.items() if kk.startswith(k + "_")) for k in ("int8", "fp8")}
print(json.dumps({"best": best, "all": out}, indent=1))
