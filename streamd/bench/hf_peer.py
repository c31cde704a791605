"""Hugging Face transformers' continuous batching, run as the peer of the throughput benchmarks (CPU and CUDA)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from streamd.bench.workloads import TokenWorkload


def run_continuous_batching(
    model: Any, work: TokenWorkload, on_finished: Callable[[], None] = lambda: None
) -> tuple[float, int]:
    """Greedy, EOS ignored: every request of `work` through `model`'s continuous-batching manager.
    Returns (seconds, output tokens produced); `on_finished` is called once per finished request."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max(work.output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0)
    with model.continuous_batching_context_manager(generation_config=gen) as manager:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
        done = produced = 0
        while done < len(work.prompts):
            result = manager.get_result(timeout=5)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped early")
                continue
            if result.is_finished():
                done += 1
                produced += len(result.generated_tokens)
                on_finished()
        return time.perf_counter() - start, produced
