"""Issue 34: what a step with a prompt chunk beside decodes costs eagerly, as a decode-graph replay (each query
token a decode row, `model_runner.decode_rows`), to set `MAX_PROMPT_ROW_ATTENTION`, and as a prefill-graph replay
(`cuda_graphs.PrefillGraphs`). Random bf16 weights of each
shape on one GPU; the step's batch is built by hand (decodes at a fixed context, one chunk of `q` tokens continuing
`c` cached ones, blocks of their own), timed wall-clock with a sync after each run, median of 20 after 3 warm-ups.

    python benchmarks/mixed_rows_device.py OUT.json [shape,...]

Environment: ROWS_DECODES, ROWS_CHUNKS and ROWS_CONTEXTS (comma-separated) replace the defaults below.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from functools import partial

import numpy as np
import torch

from streamd import LLM
from streamd.bench.offline import SHAPES, free_cuda, model_config
from streamd.engine.worker import model_runner
from streamd.engine.worker.host_to_device import to_device
from streamd.engine.worker.model_runner import ModelInput, ModelRunner


def _ints(name: str, default: str) -> tuple[int, ...]:
    return tuple(int(x) for x in os.environ.get(name, default).split(","))


DECODES, DECODE_CONTEXT = _ints("ROWS_DECODES", "32")[0], 512
CHUNKS = _ints("ROWS_CHUNKS", "16,64,128,256")
CONTEXTS = _ints("ROWS_CONTEXTS", "0,1024,4096")


def batch_of(runner: ModelRunner, chunk: int, context: int) -> ModelInput:
    """DECODES decodes at DECODE_CONTEXT, then one chunk of `chunk` tokens after `context` cached ones."""
    bs, dev = runner.block_size, runner.device
    lens = [DECODE_CONTEXT + 1] * DECODES + [context + chunk]
    queries = [1] * DECODES + [chunk]
    width = -(-max(lens) // bs)
    tables = np.zeros((len(lens), width), dtype=np.int32)
    tokens, positions, slots, next_block = [], [], [], 1
    for i, (length, q) in enumerate(zip(lens, queries)):
        blocks = -(-length // bs)
        tables[i, :blocks] = range(next_block, next_block + blocks)
        next_block += blocks
        for p in range(length - q, length):
            tokens.append(1000 + p)
            positions.append(p)
            slots.append(int(tables[i, p // bs]) * bs + p % bs)
    starts = np.concatenate([[0], np.cumsum(queries)]).astype(np.int32)
    return ModelInput(
        input_ids=to_device(tokens, torch.int64, dev),
        positions=to_device(positions, torch.int64, dev),
        slot_mapping=to_device(slots, torch.int64, dev),
        block_tables=to_device(tables, torch.int32, dev),
        seq_lens=to_device(lens, torch.int32, dev),
        query_start_loc=to_device(starts, torch.int32, dev),
        sample_idx=to_device((starts[1:] - 1).tolist(), torch.int64, dev),
        decode_only=False,
        prompt_pairs=chunk * (2 * context + chunk + 1) // 2,
    )


def timed(run) -> float:
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(shape: str) -> list[dict]:
    llm = LLM(model_config(shape, 8192), device="cuda", dtype="bfloat16", max_model_len=8192,
              gpu_memory_utilization=0.5, num_swap_blocks=0)
    runner = llm.engine.runner
    graphs = runner.graphs
    assert graphs is not None
    rows = []
    for chunk in CHUNKS:
        for context in CONTEXTS:
            batch = batch_of(runner, chunk, context)
            n = len(batch.input_ids)
            eager = timed(partial(runner.run, batch, 0))
            size = graphs.size_for(n) if graphs.can_run(n, batch.block_tables.shape[1]) else 0
            replay = timed(partial(runner.run, batch, size)) if size else None
            prefill = timed(partial(runner.prefill_graphs.run, batch)) if runner.prefill_graph_fits(batch) else None
            work = batch.prompt_pairs * runner.query_width
            rows.append({"shape": shape, "decodes": DECODES, "chunk": chunk, "context": context, "rows": n,
                         "eager_ms": round(eager, 3), "graph_ms": None if replay is None else round(replay, 3),
                         "prefill_graph_ms": None if prefill is None else round(prefill, 3),
                         "row_attention": work, "under_cap": work <= model_runner.MAX_PROMPT_ROW_ATTENTION})
            print(json.dumps(rows[-1]), flush=True)
    # the decode-only step at the same decodes, for scale
    only = batch_of(runner, 1, DECODE_CONTEXT)
    only_ms = timed(partial(runner.run, only, graphs.size_for(DECODES + 1)))
    rows.append({"shape": shape, "decode_only_graph_ms": round(only_ms, 3)})
    print(json.dumps(rows[-1]), flush=True)
    del llm
    free_cuda()
    return rows


def main() -> None:
    shapes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["smollm2-135m", "llama3.2-1b", "llama3.1-8b"]
    assert all(s in SHAPES for s in shapes)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cap": model_runner.MAX_PROMPT_ROW_ATTENTION, "rows": [r for s in shapes for r in measure(s)]}
    with open(sys.argv[1], "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
