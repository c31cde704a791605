"""The symmetric-memory all-reduce on two GPUs, as the engine builds it (its own store and bare c10d groups, no
default process group): the sums equal NCCL's for float32 and bfloat16, one-shot and two-shot sizes, eagerly
and replayed from a CUDA graph with new inputs; an output larger than the buffer goes to NCCL. Run by
benchmarks/multi_gpu_device.sh symm."""

from __future__ import annotations

import datetime
import uuid
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from streamd.bench.live import free_port
from streamd.engine.worker.parallel.all_reduce import (
    ONE_SHOT_MAX_BYTES,
    AllReducePlan,
    RankContext,
    SymmMemAllReduce,
    build_all_reduce,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]
WORLD = 2
HIDDEN = 4096
ROWS = 256  # the buffer: 256 x 4096 (2 MiB in bfloat16): the 8B shape's largest decode batch
TIMEOUT = datetime.timedelta(seconds=60)


def _groups(rank: int, port: int) -> tuple[dist.Store, Any, Any]:
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=TIMEOUT)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = TIMEOUT
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("collectives", store), rank, WORLD, options)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, WORLD, TIMEOUT)
    return store, nccl, gloo


def _agree(gloo: Any, ok: bool) -> bool:
    votes = torch.tensor([int(ok)])
    gloo.allreduce(votes).wait()
    return int(votes.item()) == WORLD


def _check(symm: SymmMemAllReduce, nccl: Any, rows: int, dtype: torch.dtype, rank: int) -> None:
    """Eager, then from a graph replayed on new inputs: equal to NCCL's sum of the same inputs."""
    gen = torch.Generator(device="cuda").manual_seed(100 * rows + rank)
    partial = torch.randn(1, rows, HIDDEN, dtype=dtype, device="cuda", generator=gen)
    want = partial.clone()
    nccl.allreduce(want).wait()
    got = symm(partial.clone())
    torch.testing.assert_close(got, want)
    static = torch.empty_like(partial)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        static.copy_(partial)
        symm(static)  # warm-up outside the capture, as the engine's capture does
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        symm(static)
    for _ in range(3):
        fresh = torch.randn(partial.shape, dtype=dtype, device="cuda", generator=gen)
        want = fresh.clone()
        nccl.allreduce(want).wait()
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static, want)


def _rank(rank: int, port: int, name: str, results: Any) -> None:
    torch.cuda.set_device(rank)
    store, nccl, gloo = _groups(rank, port)
    try:
        for dtype in (torch.bfloat16, torch.float32):
            plan = AllReducePlan("symm_mem", f"{name}-{dtype}", ROWS * HIDDEN)
            context = RankContext(rank, WORLD, torch.device("cuda", rank), dtype, store, lambda ok: _agree(gloo, ok))
            symm = build_all_reduce(plan, nccl, context)
            assert isinstance(symm, SymmMemAllReduce)
            one_shot_rows = ONE_SHOT_MAX_BYTES // (HIDDEN * symm.buffer.element_size())
            for rows in (1, 16, one_shot_rows, one_shot_rows + 1, ROWS):
                _check(symm, nccl, rows, dtype, rank)
            assert symm.one_shot_calls > 0 and symm.two_shot_calls > 0
            calls = symm.one_shot_calls + symm.two_shot_calls
            _check(symm, nccl, ROWS + 1, dtype, rank)  # larger than the buffer: NCCL's own sum
            assert symm.one_shot_calls + symm.two_shot_calls == calls
        results.put((rank, "ok"))
    except Exception as exc:  # (reported to the test, which fails with it)
        results.put((rank, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        torch.cuda.synchronize()
        nccl.shutdown()


def test_symm_mem_all_reduce_equals_nccl_eager_and_in_a_graph() -> None:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port, name = free_port(), f"test-{uuid.uuid4().hex}"
    procs = [context.Process(target=_rank, args=(rank, port, name, results)) for rank in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    for p in procs:
        if p.is_alive():
            p.terminate()
    outcomes = {}
    while not results.empty():  # (every process has exited: what it put is there)
        rank, outcome = results.get()
        outcomes[rank] = outcome
    assert outcomes == {0: "ok", 1: "ok"}, outcomes
