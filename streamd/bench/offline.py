"""What the offline benchmarks share: the model shapes (random weights), nano-vllm's workload, the device's
measured ceilings, the workload's roofline over one or more GPUs, and the loop that drives an engine through
a workload. `throughput` (streamd against transformers) and `tensor_parallel` (streamd at several
tensor-parallel sizes) both build on it; the profiling scripts in benchmarks/ take its step-at-a-time helpers
(a batch brought to decoding, a call timed with the GPU waited for, the schedules a block plans).

The roofline: every decode step reads each card's share of the layers' weights and of the live KV once (in
parallel on the cards), rank 0 also the replicated head; prefill and decode FLOPs at the measured matrix
rate, the step costing the larger of the two; over N GPUs add the two all-reduces of every layer (the
probe's latency + bytes at its bus bandwidth). Requests run `max_num_seqs` at a time, FCFS.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from streamd.bench.workloads import TokenWorkload

if TYPE_CHECKING:
    from transformers import LlamaConfig

SHAPES: dict[str, dict[str, Any]] = {
    "llama3.1-8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "llama3.2-3b": dict(
        hidden_size=3072,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "llama3.2-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "llama-tiny": dict(  # the CPU light forms of the benches that take a shape (seconds, not a measurement)
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
}


def random_workload(vocab: int, num_requests: int = 256, lo: int = 100, hi: int = 1024, seed: int = 0) -> TokenWorkload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num_requests)]
    return TokenWorkload(
        f"random-{num_requests}x[{lo},{hi}]", prompts, [rng.randint(lo, hi) for _ in range(num_requests)]
    )


def model_config(shape: str, max_len: int = 4096) -> LlamaConfig:
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": 500000.0}
    return LlamaConfig(**SHAPES[shape], max_position_embeddings=max_len, rope_parameters=rope)


# ---- measured ceilings and roofline ------------------------------------------------------------------------------


def measure_ceilings() -> dict[str, float]:
    import torch
    from triton.testing import do_bench

    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return {"hbm_bytes_per_s": 2 * n / (ms * 1e-3), "bf16_flop_per_s": 2 * 8192**3 / (mm * 1e-3)}


def roofline_tok_s(
    config: Any, work: TokenWorkload, ceilings: dict[str, float], tp: int = 1, max_num_seqs: int = 256
) -> float:
    """The workload's roofline over `tp` GPUs (module docstring); `ceilings` are one card's, plus the NCCL
    probe's `nccl_bus_bytes_per_s` and `nccl_latency_s` when tp > 1."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    layer_params = layers * (
        2 * h * config.num_attention_heads * head_dim + 2 * h * kv_heads * head_dim + 3 * h * config.intermediate_size
    )
    card_params = layer_params / tp + vocab * h  # rank 0: its share of the layers and the whole head
    kv_bytes_per_token = 2 * layers * 2 * kv_heads * head_dim / tp
    bw, rate = ceilings["hbm_bytes_per_s"], ceilings["bf16_flop_per_s"]

    def all_reduces(tokens: int) -> float:
        if tp == 1:
            return 0.0
        size = 2 * tokens * h * 2 * (tp - 1) / tp
        return 2 * layers * (ceilings["nccl_latency_s"] + size / ceilings["nccl_bus_bytes_per_s"])

    prefill_tokens = sum(len(p) for p in work.prompts)
    seconds = 2 * card_params * prefill_tokens / rate + all_reduces(prefill_tokens)
    live = sorted(zip((len(p) for p in work.prompts), work.output_lens), key=lambda x: x[1])
    for start in range(0, len(live), max_num_seqs):
        wave = live[start : start + max_num_seqs]
        for step in range(max(o for _, o in wave)):
            running = [(p, o) for p, o in wave if o > step]
            kv = sum(p + step for p, _ in running) * kv_bytes_per_token
            flops = 2 * card_params * len(running)
            seconds += max((2 * card_params + kv) / bw, flops / rate) + all_reduces(len(running))
    return work.output_tokens / seconds


# ---- driving an engine ------------------------------------------------------------------------------


def drive(engine: Any, work: TokenWorkload, progress: Any) -> dict[str, float]:
    """The workload through `engine` after one warm-up request: tok/s, median TTFT, cache and preemptions."""
    from streamd import SamplingParams

    warm = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
    engine.add_request("warm", work.prompts[0][:64], warm)
    while engine.has_unfinished_requests():
        engine.step()
    start = time.perf_counter()
    arrival: dict[str, float] = {}
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
        arrival[str(i)] = time.monotonic()
        engine.add_request(
            str(i),
            prompt,
            SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, temperature=0.0),
            arrival_time=arrival[str(i)],
        )
    ttft: list[float] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id in arrival and delta.num_new_tokens:  # its first tokens
                ttft.append(time.monotonic() - arrival.pop(delta.request_id))
            if delta.finished:
                progress.update(1)
    seconds = time.perf_counter() - start
    stats = engine.stats()
    return {
        "tok_s": work.output_tokens / seconds,
        "seconds": seconds,
        "median_ttft_s": statistics.median(ttft),
        "prefix_cache_hit_tokens": stats.kv.prefix_hit_tokens,
        "preemptions": stats.scheduler.preemptions_swap + stats.scheduler.preemptions_recompute,
    }


# ---- a step at a time (the profiling scripts in benchmarks/) ---------------------------------------------------


def all_decoding(engine: Any) -> bool:
    """No request waits and every sequence's prompt is computed: each step from here on decodes only."""
    if engine.stats().scheduler.num_waiting:
        return False
    return all(s.num_computed_tokens >= s.num_prompt_tokens for r in engine.requests for s in r.group.seqs)


def fill_decoding(engine: Any, batch: int, prompt_len: int, max_tokens: int, salt: int = 0) -> None:
    """`batch` greedy requests of `prompt_len` tokens (differing per request and per `salt`), stepped until all
    decode, then 10 steps more (past the last prompt's first token)."""
    from streamd import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, temperature=0.0)
    vocab = engine.vocab_size
    for i in range(batch):
        prompt = [(7 * i + 13 * salt + j) % (vocab - 1) + 1 for j in range(prompt_len)]
        engine.add_request(f"{salt}-{i}", prompt, params)
    while not all_decoding(engine):
        engine.step()
    for _ in range(10):
        engine.step()


def abort_all(engine: Any) -> None:
    """Aborts every live request; the step after it frees their blocks."""
    for request_id in [r.group.request_id for r in engine.requests]:
        engine.abort(request_id)
    engine.step()


def sync_cuda() -> None:
    """Waits for the GPU where there is one (the scripts also dry-run on the CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ms_per_call(call: Callable[[], Any], times: int = 30) -> float:
    """Wall milliseconds per call of `call` over `times` calls, the GPU waited for before and after."""
    sync_cuda()
    start = time.perf_counter()
    for _ in range(times):
        call()
    sync_cuda()
    return (time.perf_counter() - start) / times * 1e3


@contextmanager
def schedules(engine: Any) -> Iterator[list[Any]]:
    """Every `SchedulerOutput` the engine's scheduler plans inside the block, in order."""
    planned: list[Any] = []
    schedule = engine.scheduler.schedule

    def recorded() -> Any:
        planned.append(schedule())
        return planned[-1]

    engine.scheduler.schedule = recorded
    try:
        yield planned
    finally:
        del engine.scheduler.schedule  # (the class's method again)


def free_cuda() -> None:
    """Frees the engines nothing refers to any more, and the GPU memory they held. `heap.settle` froze each
    engine out of the collector when it loaded, and an engine holds reference cycles: without the unfreeze a
    bench that opens engine after engine keeps every one's weights and KV pool (the next `settle` freezes the
    live ones again)."""
    import gc

    import torch

    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()
