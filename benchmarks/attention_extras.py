"""GPU timing of the paged-attention kernels with transformers' extras (issue 27): what a sliding window
saves (blocks wholly before it are never read) and what a cap or sinks cost, against the same kernels
without extras and, with ``--baseline DIR`` (a directory holding an earlier ``decode_attention.py`` and
``prefill_attention.py``), against those earlier kernels, so a Llama layer's unchanged cost is measured
in the same run. Every timed call is captured in a CUDA graph over enough input copies that L2 cannot
hold them (``streamd.bench.cuda_timing``). Prints one line per case.

    python benchmarks/attention_extras.py [--baseline DIR] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import streamd.kernels as K
from streamd.bench.cuda_timing import copies_for, time_graph

DEV, PAGE = "cuda", 16
SHAPES = {"mistral-7b": (32, 8, 128), "gpt-oss-20b": (64, 8, 64)}  # q heads, kv heads, head dim


def _load(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pool(lens: list[int], hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bf16 pool with the given contexts in shuffled blocks, its block table and seq_lens."""
    need = [-(-n // PAGE) for n in lens]
    kv = torch.randn(sum(need), 1, 2, hkv, PAGE, d, device=DEV, dtype=torch.bfloat16)
    perm = torch.randperm(sum(need), device=DEV, dtype=torch.int32)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32, device=DEV)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at : at + n]
        at += n
    return kv, table, torch.tensor(lens, dtype=torch.int32, device=DEV)


def _time(call: Callable[[Any], Any], inputs: list[Any]) -> float:
    return time_graph([lambda x=x: call(x) for x in inputs])


def bench_decode(
    shape: str, batch: int, ctx: int, variants: dict[str, dict[str, Any]], base: ModuleType | None
) -> None:
    h, hkv, d = SHAPES[shape]
    n = copies_for(batch * ctx * hkv * d * 4)
    inputs = [
        (*_pool([ctx] * batch, hkv, d), torch.randn(batch, h, d, device=DEV, dtype=torch.bfloat16)) for _ in range(n)
    ]
    sinks = torch.randn(h, device=DEV, dtype=torch.bfloat16)
    scale = d**-0.5
    if base is not None:
        t = _time(lambda x: base.paged_decode_attention(x[3], x[0], 0, x[1], x[2], scale), inputs)
        print(f"decode {shape} batch {batch} ctx {ctx}: baseline (no extras)       {t * 1e6:9.1f} us", flush=True)
    for name, kw in variants.items():
        kw = {**kw, "sinks": sinks} if kw.pop("sinks", False) else kw
        t = _time(lambda x, kw=kw: K.paged_decode_attention(x[3], x[0], 0, x[1], x[2], scale, **kw), inputs)
        print(f"decode {shape} batch {batch} ctx {ctx}: {name:28s} {t * 1e6:9.1f} us", flush=True)


def bench_prefill(
    shape: str, prompts: int, length: int, variants: dict[str, dict[str, Any]], base: ModuleType | None
) -> None:
    h, hkv, d = SHAPES[shape]
    tokens = prompts * length
    qsl = torch.arange(0, tokens + 1, length, dtype=torch.int32, device=DEV)
    n = copies_for(tokens * (h + 2 * hkv) * d * 2, cap=8)
    inputs = [
        (*_pool([length] * prompts, hkv, d), torch.randn(tokens, h, d, device=DEV, dtype=torch.bfloat16))
        for _ in range(n)
    ]
    sinks = torch.randn(h, device=DEV, dtype=torch.bfloat16)
    scale = d**-0.5
    flops = 4 * prompts * h * d * length * (length + 1) / 2  # causal QK^T and PV
    if base is not None:
        t = _time(lambda x: base.paged_prefill_attention(x[3], x[0], 0, x[1], qsl, x[2], scale), inputs)
        print(
            f"prefill {shape} {prompts}x{length}: baseline (no extras)       {t * 1e3:8.3f} ms"
            f"  {flops / t / 1e12:6.1f} causal TFLOP/s",
            flush=True,
        )
    for name, kw in variants.items():
        kw = {**kw, "sinks": sinks} if kw.pop("sinks", False) else kw
        t = _time(lambda x, kw=kw: K.paged_prefill_attention(x[3], x[0], 0, x[1], qsl, x[2], scale, **kw), inputs)
        print(
            f"prefill {shape} {prompts}x{length}: {name:28s} {t * 1e3:8.3f} ms  {flops / t / 1e12:6.1f} causal TFLOP/s",
            flush=True,
        )


def variants(window: int) -> dict[str, dict[str, Any]]:
    return {
        "no extras": {},
        f"window {window}": {"sliding_window": window},
        "window >= context": {"sliding_window": 1 << 20},
        "softcap 50": {"softcap": 50.0},
        "sinks": {"sinks": True},
        f"window {window} + sinks": {"sliding_window": window, "sinks": True},
        f"window {window} + softcap": {"sliding_window": window, "softcap": 50.0},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="directory with earlier decode_attention.py and prefill_attention.py")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    base_dec = base_pre = None
    if args.baseline:
        base_dec = _load(os.path.join(args.baseline, "decode_attention.py"), "baseline_decode_attention")
        base_pre = _load(os.path.join(args.baseline, "prefill_attention.py"), "baseline_prefill_attention")
    print(torch.cuda.get_device_name(0), torch.__version__, flush=True)
    decode_cases = [("mistral-7b", 64, 8192, 4096), ("gpt-oss-20b", 64, 8192, 128), ("mistral-7b", 8, 32768, 4096)]
    prefill_cases = [("mistral-7b", 2, 8192, 4096), ("gpt-oss-20b", 2, 8192, 128)]
    if args.quick:
        decode_cases, prefill_cases = decode_cases[:1], prefill_cases[:1]
    for shape, batch, ctx, window in decode_cases:
        bench_decode(shape, batch, ctx, variants(window), base_dec)
    for shape, prompts, length, window in prefill_cases:
        bench_prefill(shape, prompts, length, variants(window), base_pre)


if __name__ == "__main__":
    main()
