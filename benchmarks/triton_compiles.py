"""Runs a Python module (`python3 benchmarks/triton_compiles.py MODULE ARGS...`) with every Triton compile it
triggers printed to stderr (seconds since start, the kernel and its specialization), so a benchmark's log shows
whether kernels compiled inside its measured part rather than at the engine's warm-up."""

from __future__ import annotations

import runpy
import sys
import time
from typing import Any

from triton import knobs

START = time.perf_counter()


def log_compile(*, key: Any, repr: str, fn: Any, compile: Any, is_manual_warmup: bool, already_compiled: bool) -> bool:
    print(f"[triton compile] +{time.perf_counter() - START:.2f}s {repr[:400]}", file=sys.stderr, flush=True)
    return False  # (compile as usual)


if __name__ == "__main__":
    knobs.runtime.jit_cache_hook = log_compile
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
