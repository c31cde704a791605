"""Issue 34: a decode step's wall time against its GPU time, batch by batch: where the host bounds a small model.

Usage (device): python3 benchmarks/step_batches.py --shape smollm2-135m --out OUT [--batches 1,8,...] [--hold S]
For each batch size: that many 512-token prompts, all computed, every sequence decoding; then the engine's
step (wall ms, 30 steps) and a replay of the decode graph that step uses, alone (GPU ms, 30 replays). A
step whose wall time is well above its replay's is bound by the host. `--hold S` then keeps the last batch
decoding for S seconds after writing OUT/steady (for a sampling profiler attached from outside).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from streamd import LLM
from streamd.bench.offline import abort_all, fill_decoding, model_config, ms_per_call

PROMPT = 512


def replay_ms(engine: Any, batch: int) -> float | None:
    """A bare replay of the decode graph that a step of `batch` sequences runs (None: no graphs)."""
    graphs = engine.runner.graphs
    return None if graphs is None else ms_per_call(graphs.graphs[graphs.size_for(batch)].replay)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--out", default=".")
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=400)
    args = parser.parse_args()
    engine = LLM(model_config(args.shape), dtype="bfloat16").engine
    rows: list[dict[str, Any]] = []
    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches:
        fill_decoding(engine, batch, PROMPT, args.max_tokens, salt=batch)
        wall, gpu = ms_per_call(engine.step), replay_ms(engine, batch)
        rows.append({"batch": batch, "wall_ms": wall, "graph_replay_ms": gpu})
        print(f"[{args.shape}] batch {batch:4d}: step {wall:6.3f} ms, graph replay {gpu or 0:6.3f} ms", flush=True)
        if args.hold and batch == batches[-1]:
            Path(args.out, "steady").write_text("steady")
            end = time.perf_counter() + args.hold
            while time.perf_counter() < end:
                engine.step()
        abort_all(engine)
    name = Path(args.out, f"step-batches-{args.shape}.json")
    name.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "shape": args.shape, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
