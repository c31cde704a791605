"""Start-up measurement of the two numbers `preemption_mode = "auto"` weighs: the host link's bandwidth
(swap) and the model's prefill rate (recompute). Runs once, on the empty pool, before any request."""

from __future__ import annotations

import time

import torch

from streamd.engine.cache_engine import CacheEngine
from streamd.engine.executor import Executor
from streamd.engine.scheduler import PreemptionCostModel
from streamd.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.sequence import Sequence, SequenceGroup
from streamd.logs import get_logger

log = get_logger(__name__)

_PROBE_BLOCKS = 64
_PROBE_TOKENS = 256


def measure_cost_model(cache: CacheEngine, runner: Executor, max_model_len: int) -> PreemptionCostModel:
    link = _link_bytes_per_s(cache)
    prefill = _prefill_tokens_per_s(cache, runner, max_model_len)
    log.info("preemption.cost_model", host_link_gib_s=round(link / 2**30, 2), prefill_tok_s=round(prefill))
    return PreemptionCostModel(cache.layout.bytes_per_block, link, prefill)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _link_bytes_per_s(cache: CacheEngine) -> float:
    n = min(_PROBE_BLOCKS, cache.num_blocks, cache.num_swap_blocks)
    pairs = [(i, i) for i in range(n)]
    cache.swap_out(pairs)  # warm-up
    _sync(cache.device)
    start = time.perf_counter()
    cache.swap_out(pairs)
    cache.swap_in(pairs)
    _sync(cache.device)
    elapsed = max(time.perf_counter() - start, 1e-9)
    return 2 * n * cache.layout.bytes_per_block / elapsed


def _prefill_tokens_per_s(cache: CacheEngine, runner: Executor, max_model_len: int) -> float:
    tokens = min(_PROBE_TOKENS, max_model_len, cache.num_blocks * cache.layout.block_size)
    seq = Sequence(prompt_token_ids=[0] * tokens)
    seq.block_table = list(range(-(-tokens // cache.layout.block_size)))
    group = SequenceGroup("__probe__", [seq], SamplingParams(max_tokens=1))
    out = SchedulerOutput(scheduled=[ScheduledSeq(seq, group, tokens)])
    runner.execute(out)  # warm-up
    _sync(cache.device)
    start = time.perf_counter()
    runner.execute(out)
    _sync(cache.device)
    return tokens / max(time.perf_counter() - start, 1e-9)
