"""The C attention of the CPU path (`rope_store_attend`) for one decode row and for a verify's rows of one sequence,
SmolLM2-135M's heads (3 KV heads x 3, head dim 64), a float32 pool of 30 layers, one call a layer (each layer's K/V
comes from memory, as in a step); median of repeats.

    python benchmarks/cpu_attention_rows.py [CONTEXT] [THREADS] [float32|int8]

int8: the pool as `cache.kv_cache_dtype = "int8"` keeps it (codes and a float32 scale a row).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

sys.path.insert(0, "tests/kernels")
from paged_testlib import make_paged

from streamd.kernels import native_cpu
from streamd.kernels.layout import quantize_rows

KV_HEADS, GROUP, HEAD_DIM, PAGE, LAYERS = 3, 3, 64, 16, 30


def attend_ms(lib, context: int, rows: int, threads: int, int8: bool) -> float:
    """One layer's call for `rows` rows of one sequence ending at `context` (a verify's rows, or a decode)."""
    lens = list(range(context - rows + 1, context + 1))
    case = make_paged([context], page=PAGE, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                      num_layers=LAYERS, layer=0)
    case.kv_cache.normal_()  # every layer holds keys (make_paged poisons the layers it does not test)
    scales, scale_strides = None, (native_cpu.ctypes.c_int64 * 5)()
    if int8:
        case.kv_cache, scales = quantize_rows(case.kv_cache, torch.int8)
        scale_strides = (native_cpu.ctypes.c_int64 * 5)(*scales.stride())
    tables = case.block_tables.repeat(rows, 1).contiguous()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    heads = KV_HEADS * GROUP
    qkv = torch.randn(rows, (heads + 2 * KV_HEADS) * HEAD_DIM).to(torch.bfloat16)
    cos, sin = torch.ones(rows, HEAD_DIM), torch.zeros(rows, HEAD_DIM)
    slots = torch.full((rows,), -1, dtype=torch.int64)
    scratch = torch.empty(threads * GROUP * (context + 2 * HEAD_DIM))
    out = torch.empty(rows, heads * HEAD_DIM, dtype=torch.bfloat16)
    pool = case.kv_cache
    strides = (native_cpu.ctypes.c_int64 * 5)(*pool.stride()[:5])
    p = lambda t: t.data_ptr()  # noqa: E731

    def call() -> None:
        for layer in range(LAYERS):
            lib.rope_store_attend(rows, heads, KV_HEADS, HEAD_DIM, p(qkv), qkv.stride(0), p(cos), p(sin), p(pool),
                                  strides, None if scales is None else p(scales), scale_strides, layer, p(slots),
                                  p(tables), tables.shape[1], p(seq_lens), PAGE, 0.125, threads, p(scratch),
                                  p(out))  # fmt: skip

    call()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    context = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    int8 = len(sys.argv) > 3 and sys.argv[3] == "int8"
    lib = native_cpu.load()
    assert lib is not None, native_cpu.unavailable_reason()
    for rows in (1, 5, 9):
        ms = attend_ms(lib, context, rows, threads, int8)
        print(f"{'int8' if int8 else 'float32'} pool, context {context}, rows {rows}, threads {threads}: "
              f"{ms:.3f} ms for {LAYERS} layers "
              f"({ms / rows:.3f} ms a row)", flush=True)


if __name__ == "__main__":
    main()
