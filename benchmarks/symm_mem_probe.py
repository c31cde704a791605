"""Device probe (issue 26): is torch's symmetric-memory one-shot all-reduce cheaper than NCCL inside a CUDA
graph, at the sizes a TP=2 decode step all-reduces (batch x hidden bf16: 8 KiB .. 2 MiB)?

Run on a 2+-GPU machine: `python3 benchmarks/symm_mem_probe.py OUT_DIR [WORLD]`. Each rank captures 64
all-reduces of one size into a CUDA graph (as a decode step of a 32-layer model does) and times replays;
NCCL (`dist.all_reduce`) against `torch.ops.symm_mem.one_shot_all_reduce` / `two_shot_all_reduce_` over a
symmetric buffer (P2P over NVLink; no multicast). Prints and writes microseconds per all-reduce.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (16 * 4096, 128 * 4096, 256 * 4096)  # elements: batch 16 / 128 / 256 of a 4096-wide model
OPS_PER_GRAPH = 64
REPLAYS = 50


def _time_graph(fn, x: torch.Tensor) -> float:
    """Microseconds per op of `fn(x)` captured OPS_PER_GRAPH times in one graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(OPS_PER_GRAPH):
            fn(x)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (REPLAYS * OPS_PER_GRAPH) * 1e6


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    symm_mem.enable_symm_mem_for_group(group)
    results: dict[str, dict[str, float | str]] = {}
    for n in SIZES:
        row: dict[str, float | str] = {"bytes": n * 2}
        x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        row["nccl_us"] = _time_graph(dist.all_reduce, x)
        buf = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buf, group)
        buf.copy_(x)
        for name, op in (
            ("one_shot_us", lambda t: torch.ops.symm_mem.one_shot_all_reduce(t, "sum", group)),
            ("two_shot_us", lambda t: torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", group)),
            ("copy_in_one_shot_out_us", lambda t: torch.ops.symm_mem.one_shot_all_reduce_out(
                buf.copy_(t), "sum", group, out=t)),  # noqa: B023
        ):
            try:
                row[name] = _time_graph(op, buf if name != "copy_in_one_shot_out_us" else x)
            except Exception as e:  # (report what does not work, keep probing)
                row[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
        # correctness of the one-shot sum against NCCL's
        ref = x.clone()
        dist.all_reduce(ref)
        buf.copy_(x)
        got = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group)
        row["one_shot_max_abs_err"] = float((got.float() - ref.float()).abs().max())
        results[str(n)] = row
    if rank == 0:
        print(json.dumps(results, indent=2))
        with open(os.path.join(out, f"symm-mem-probe-world{world}.json"), "w") as f:
            json.dump({"world": world, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "ops_per_graph": OPS_PER_GRAPH, "results": results}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    mp.spawn(_rank, args=(world, 29533, out), nprocs=world)
