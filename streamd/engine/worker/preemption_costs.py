"""The two numbers `preemption_mode = "auto"` weighs: the host link's bandwidth (swap) and the model's
prefill rate (recompute). Measured once per machine, model shape, weight format and streamd release, on the
empty pool before any request, then kept in `<model.cache_dir>/preemption-costs.json`, so later starts skip the
measurement (seconds on a CPU). The format and the release are in the key because they change the prefill rate
(4-bit weights on the CPU prefill at several times float32's rate; a release's kernels at another); delete the
file to measure again after a hardware or driver change."""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch

from streamd.engine.core.block_manager import BlockManager, PagedSeq
from streamd.engine.core.hybrid_blocks import WindowSide
from streamd.engine.core.scheduler import PreemptionCostModel
from streamd.engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from streamd.engine.core.sequence import Sequence, SequenceGroup
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.worker.cache_engine import CacheEngine
from streamd.engine.worker.cpu_threads import cpu_model_name
from streamd.engine.worker.executor import Executor
from streamd.engine.worker.model_runner import ModelRunner
from streamd.logs import get_logger

log = get_logger(__name__)

_PROBE_BLOCKS = 64
_PROBE_TOKENS = 256
COSTS_FILE = "preemption-costs.json"


def cost_model(
    cache: CacheEngine, executor: Executor, runner: ModelRunner, max_model_len: int, cache_dir: Path, low_bit: str
) -> PreemptionCostModel:
    """The cached measurement for this machine, model shape and weight format (`low_bit`: `LoadedModel.low_bit`),
    or a new one (then cached); the prefill is measured through `executor` (so tensor-parallel workers take part)."""
    file = cache_dir / COSTS_FILE
    key = measurement_key(cache, runner, low_bit)
    known = _read(file)
    cached = key in known
    if not cached:
        known[key] = {
            "host_link_bytes_per_s": _link_bytes_per_s(cache),
            "prefill_tokens_per_s": _prefill_tokens_per_s(cache, executor, max_model_len),
        }
        _write(file, known)
    entry = known[key]
    log.info(
        "preemption.cost_model",
        host_link_gib_s=round(entry["host_link_bytes_per_s"] / 2**30, 2),
        prefill_tok_s=round(entry["prefill_tokens_per_s"]),
        cached=cached,
        file=str(file),
    )
    return PreemptionCostModel(
        cache.layout.bytes_per_block, entry["host_link_bytes_per_s"], entry["prefill_tokens_per_s"]
    )


def measurement_key(cache: CacheEngine, runner: ModelRunner, low_bit: str) -> str:
    """Device name, torch threads, model shape, weight format, KV dtype, block size, torch and streamd releases:
    what the two rates depend on."""
    config = runner.model.config.get_text_config()
    layout = cache.layout
    shape = (
        f"{config.model_type}-h{config.hidden_size}-l{layout.num_layers}-kv{layout.num_kv_heads}"
        f"x{layout.head_dim}-i{getattr(config, 'intermediate_size', 0)}-v{config.vocab_size}"
    )
    return "|".join(
        [
            _device_name(cache.device),
            f"threads{torch.get_num_threads()}",
            shape,
            f"weights {low_bit}",
            str(layout.dtype).removeprefix("torch."),
            f"block{layout.block_size}",
            f"torch{torch.__version__}",
            f"streamd{_release()}",
        ]
    )


def _release() -> str:
    try:
        return metadata.version("streamd")
    except metadata.PackageNotFoundError:  # (run from a source tree that was never installed)
        return "-source"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model_name() or platform.processor() or platform.machine()


def _read(file: Path) -> dict[str, dict[str, float]]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):  # missing or damaged: measure again
        return {}
    return data if isinstance(data, dict) else {}


def _write(file: Path, data: dict[str, dict[str, float]]) -> None:
    """Atomic (write a temporary file, rename), so concurrent starts never read half a file."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".costs-", dir=file.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, file)
    except OSError as exc:  # a read-only cache only costs the next start the measurement
        log.warning("preemption.cost_model.not_cached", file=str(file), error=str(exc))


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


def _prefill_tokens_per_s(cache: CacheEngine, executor: Executor, max_model_len: int) -> float:
    pools = [cache] if executor.window is None else [cache, executor.window]
    tokens = min(_PROBE_TOKENS, max_model_len, *(pool.num_blocks * pool.layout.block_size for pool in pools))
    seq = Sequence(prompt_token_ids=[0] * tokens)
    # A throw-away block manager over the (still empty) pool gives the probe its table: blocks 0, 1, ...
    sides: list[PagedSeq] = [seq, WindowSide(seq)]  # (the hybrid layout's sliding layers: their own table)
    for pool, side in zip(pools, sides, strict=False):
        BlockManager(pool.num_blocks, pool.layout.block_size, enable_prefix_caching=False).allocate(side)
    group = SequenceGroup("__probe__", [seq], SamplingParams(max_tokens=1))
    out = SchedulerOutput(scheduled=[ScheduledSeq(seq, group, tokens)])
    executor.execute(out)  # warm-up
    _sync(cache.device)
    start = time.perf_counter()
    executor.execute(out)
    _sync(cache.device)
    return tokens / max(time.perf_counter() - start, 1e-9)
