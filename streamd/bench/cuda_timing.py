"""CUDA-graph timing shared by the device benchmarks (`benchmarks/kernels.py`, `benchmarks/fusion.py`).

`time_graph` captures a rotation of calls in one CUDA graph (as the engine replays decode) and times its
replays, so launch overhead and the Python between calls are out of the measurement. The calls rotate over
`copies_for` copies of their inputs, enough that L2 cannot hold them, so times are HBM times.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

ROTATE_BYTES = 256 << 20  # working set of one timed graph: ~5x an H100/H200 L2


def copies_for(nbytes: int, cap: int = 256) -> int:
    """Input copies to rotate over so that one graph's working set is about `ROTATE_BYTES`."""
    return max(1, min(cap, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


def time_graph(fns: list[Callable[[], Any]], min_calls: int = 24) -> float:
    """Median seconds per call of `fns` (rotated), all captured in one CUDA graph."""
    import torch
    import triton

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:  # compile / autotune / allocate outside the capture
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    reps = max(1, math.ceil(min_calls / len(fns)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for f in fns:
                f()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=80, return_mode="median")
    del graph
    return ms * 1e-3 / (reps * len(fns))
