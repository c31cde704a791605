"""Building an engine: the model loaded (or its tensor-parallel shards started), the KV pool sized and
allocated, the executor, block manager, scheduler, sampler and the sampling lifecycles wired, the model's
context length and end-of-sequence tokens found. `LLMEngine` gets the parts (`EngineParts`) and only drives
the step; `warm_up` runs throw-away requests through it so that the first user does not wait for Triton.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import PretrainedConfig

from streamd.config import CacheConfig, Config, ConfigError, cache_path
from streamd.engine.core.admission import Admission
from streamd.engine.core.block_manager import BlockManager
from streamd.engine.core.disk_tier import DiskTier
from streamd.engine.core.host_tier import HostCache
from streamd.engine.core.hybrid_blocks import BlockSpace, HybridBlockManager
from streamd.engine.core.scheduler import PreemptionCostModel, Scheduler
from streamd.engine.core.speculation import Speculator
from streamd.engine.output.chat_template import read_chat_template
from streamd.engine.output.output_processor import OutputProcessor
from streamd.engine.sample.beam_search import BeamSearches
from streamd.engine.sample.grammar import Grammars
from streamd.engine.sample.grammar_budget import GrammarBudget
from streamd.engine.sample.sampler import Sampler
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.stats import DEFAULT_TENANT
from streamd.engine.worker.cache_engine import CacheEngine, KVLayout
from streamd.engine.worker.cpu_threads import apply_num_threads, thread_governor
from streamd.engine.worker.cuda_graphs import capture_sizes
from streamd.engine.worker.draft_model import load_draft_model
from streamd.engine.worker.executor import Executor, LocalExecutor
from streamd.engine.worker.kv_groups import WindowGroups, WindowPool, split_blocks, window_groups
from streamd.engine.worker.model_loader import LoadedModel, load_model, resolve_device, resolve_dtype
from streamd.engine.worker.model_runner import ModelRunner, kv_layout_of, profile_num_blocks
from streamd.engine.worker.parallel.executor import TensorParallelExecutor
from streamd.engine.worker.parallel.workers import WorkerPool, start_tensor_parallel
from streamd.engine.worker.preemption_costs import cost_model
from streamd.engine.worker.quantized import dense_from_rows
from streamd.logs import get_logger

log = get_logger(__name__)

_SWAP_RAM_SHARE = 0.4  # the swap pool never takes more than this share of host RAM
_HOST_CACHE_RAM_SHARE = 0.2  # the host tier's default share of the RAM available at start (CUDA)
_HOST_CACHE_MAX_GIB = 32.0
_GRAPH_SLACK_BYTES = 320 << 20  # decode-graph activations (measured < 40 MiB) and swap staging (64 MiB), with room


@dataclass(slots=True)
class EngineParts:
    """Everything an engine steps with, wired."""

    model_name: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    eos_token_ids: set[int]
    runner: ModelRunner
    cache: CacheEngine
    executor: Executor
    block_manager: BlockSpace
    scheduler: Scheduler
    admission: Admission
    sampler: Sampler
    grammars: Grammars
    beams: BeamSearches
    output_processor: OutputProcessor


def load(
    config: Config, model_config: PretrainedConfig | None = None
) -> tuple[LoadedModel, torch.device, WorkerPool | None]:
    """The configured model (or random weights for `model_config`) on its device; with tensor parallelism,
    shard 0 here and the other ranks' workers started."""
    apply_num_threads(config.model.num_threads)
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    if config.parallel.tensor_parallel_size > 1:
        if config.model.quantization in ("int8", "int4", "fp8"):
            raise ValueError(
                f"model.quantization = {config.model.quantization!r} is for one process, not tensor parallelism"
            )
        loaded, workers = start_tensor_parallel(config, model_config, device, dtype)
        return loaded, device, workers
    model = model_config or config.model.name
    model_cfg = config.model
    loaded = load_model(
        model, dtype, device, model_cfg.cache_dir, model_cfg.seed, model_cfg.quantization, model_cfg.low_bit_matmul
    )
    return loaded, device, None


def build(config: Config, loaded: LoadedModel, device: torch.device, workers: WorkerPool | None) -> EngineParts:
    """The engine's parts for a loaded model (`workers`: the other tensor-parallel ranks)."""
    max_model_len = _max_model_len(loaded, config.model.max_model_len)
    if config.model.chat_template is not None and loaded.tokenizer is not None:
        loaded.tokenizer.chat_template = read_chat_template(config.model.chat_template)
    vocab = loaded.model.config.get_text_config().vocab_size
    draft = load_draft_model(config, loaded, device, max_model_len) if config.speculative.draft_model else None
    draft_bytes = draft.max_cache_bytes() if draft is not None else 0  # (its weights are in the profile's peak)
    runner, pools = _kv_cache(config, loaded, device, max_model_len, vocab, draft_bytes)
    cache = pools.cache
    executor = _executor(config, runner, pools, workers, max_model_len)
    cache_cfg = config.cache
    costs = None
    if (config.scheduler.preemption_mode != "recompute" and cache.num_swap_blocks) or cache_cfg.disk_cache_dir:
        costs = cost_model(cache, executor, runner, max_model_len, cache_path(config.model.cache_dir), loaded.low_bit)
    block_manager = _block_manager(config, loaded, pools, costs)
    eos = _eos_token_ids(loaded)
    speculator = Speculator(config.speculative, max_model_len, draft)
    named = {*config.server.tenant_map().values(), DEFAULT_TENANT}  # the server's metrics labels (server/tenants.py)
    scheduler = Scheduler(
        config.scheduler,
        block_manager,
        max_model_len,
        costs,
        eos,
        speculator,
        named_tenants=named,
        lone_chunk_tokens=dense_from_rows(loaded.model) or 0,
        sequences_cost=device.type == "cpu",  # (each sequence ~9 ms a step there: benchmarks/NOTES.md, issue 30)
    )
    return EngineParts(
        loaded.name,
        loaded.tokenizer,
        max_model_len,
        vocab,
        eos,
        runner,
        cache,
        executor,
        block_manager,
        scheduler,
        scheduler.admission,
        Sampler(vocab, eos, seed=config.model.seed),
        Grammars(loaded.tokenizer, vocab, eos, GrammarBudget.of(config.grammar), config.grammar.cache_bytes),
        BeamSearches(eos, max_model_len, vocab),
        OutputProcessor(loaded.tokenizer),
    )


def _block_manager(
    config: Config, loaded: LoadedModel, pools: KVPools, costs: PreemptionCostModel | None
) -> BlockSpace:
    """The block manager of the pools: one group, with the prefix cache's lower tiers as configured, or the
    hybrid layout's two (whose tiers are off: `core/hybrid_blocks.py`)."""
    cache_cfg, cache = config.cache, pools.cache
    if pools.window is None or pools.groups is None:
        host_blocks = cache.num_swap_blocks - _num_swap_blocks(cache_cfg, cache.layout)  # the host tier's share
        plain = BlockManager(
            cache.num_blocks,
            cache_cfg.block_size,
            cache.num_swap_blocks,
            cache_cfg.watermark,
            cache_cfg.enable_prefix_caching,
            _disk_tier(config, loaded, cache.layout, costs),
            _host_cache(cache.layout, host_blocks, costs),
        )
        plain.block_bytes = cache.layout.bytes_per_block * config.parallel.tensor_parallel_size  # (every rank's)
        return plain
    if cache_cfg.disk_cache_dir:
        log.warning("disk_tier.off", reason="the hybrid KV layout keeps no lower tiers", key="cache.disk_cache_dir")
    caching = cache_cfg.enable_prefix_caching
    full, window = (
        BlockManager(c.num_blocks, c.layout.block_size, c.num_swap_blocks, cache_cfg.watermark, caching)
        for c in (cache, pools.window)
    )
    full.block_bytes, window.block_bytes = cache.layout.bytes_per_block, pools.window.layout.bytes_per_block
    return HybridBlockManager(full, window, pools.groups.sliding_window, config.scheduler.max_num_batched_tokens)


def _disk_tier(
    config: Config, loaded: LoadedModel, layout: KVLayout, costs: PreemptionCostModel | None
) -> DiskTier | None:
    """The prefix cache's disk tier, when `cache.disk_cache_dir` names one; its files are this layout's only."""
    cache_cfg = config.cache
    if not cache_cfg.disk_cache_dir or not cache_cfg.enable_prefix_caching:
        return None
    if config.parallel.tensor_parallel_size > 1:
        raise ConfigError("cache.disk_cache_dir is not supported with tensor parallelism yet (one shard per rank)")
    recompute_s = None if costs is None else costs.recompute_cost_s(layout.block_size)
    return DiskTier(
        Path(cache_cfg.disk_cache_dir).expanduser(),
        int(cache_cfg.disk_cache_gib * 2**30),
        kv_description(config, loaded, layout),
        layout.bytes_per_block,
        recompute_s,
    )


def kv_description(config: Config, loaded: LoadedModel, layout: KVLayout) -> str:
    """Everything a KV block's bytes depend on (the disk tier's directory is its digest): the weights
    themselves (`LoadedModel.weights`: path or Hub commit, size and time, the low-bit plan; the display name
    alone let two models in folders of one name read each other's KV), `model.quantization`, the KV dtype,
    block size, layout and tensor-parallel degree."""
    return (
        f"model={loaded.name}|weights={loaded.weights}|quantization={config.model.quantization}"
        f"|dtype={layout.dtype}|block={layout.block_size}|layers={layout.num_layers}"
        f"|kv_heads={layout.num_kv_heads}|head_dim={layout.head_dim}|layout=block-major"
        f"|tp={config.parallel.tensor_parallel_size}"
    )


def _host_cache(layout: KVLayout, host_blocks: int, costs: PreemptionCostModel | None) -> HostCache | None:
    """The host-RAM tier when `cache.host_cache_gib` gave the swap pool blocks for it; read only where one
    block over the host link beats recomputing it."""
    if host_blocks <= 0:
        return None
    pays = costs is None or costs.swap_cost_s(1) / 2 < costs.recompute_cost_s(layout.block_size)
    log.info("host_tier.enabled", blocks=host_blocks, reading_pays=pays)
    return HostCache(layout.bytes_per_block, pays)


def _host_cache_blocks(cache: CacheConfig, layout: KVLayout, device: torch.device) -> int:
    """`cache.host_cache_gib` in blocks; unset: on CUDA 20% of the RAM available now (at most 32 GiB; in a
    container, of what its cgroup's memory limit leaves), else 0."""
    gib = cache.host_cache_gib
    if gib is None:
        available = min(_ram_bytes("SC_AVPHYS_PAGES"), _cgroup_room())
        gib = min(_HOST_CACHE_MAX_GIB, _HOST_CACHE_RAM_SHARE * available / 2**30) if device.type == "cuda" else 0.0
    return int(gib * 2**30) // layout.bytes_per_block


def _executor(
    config: Config, runner: ModelRunner, pools: KVPools, workers: WorkerPool | None, max_model_len: int
) -> Executor:
    """The executor, its decode graphs captured (on CUDA, unless `model.enforce_eager`; under tensor
    parallelism on every rank together, unless `parallel.cuda_graphs` is off), and on one GPU its prefill graphs
    (`model.prefill_graphs`)."""
    graphs = runner.device.type == "cuda" and not config.model.enforce_eager
    max_rows, max_blocks = config.scheduler.graph_rows(), runner.max_table_width(max_model_len)
    cache = pools.cache
    if workers is None:
        if graphs:
            runner.capture_cuda_graphs(max_rows, max_blocks)
        if _prefill_graphs_on(config, runner.device):
            scheduler = config.scheduler
            if not runner.capture_prefill_graphs(scheduler.max_num_batched_tokens, scheduler.seat_cap(), max_blocks):
                log.warning("prefill_graphs.off", reason="a capture failed; the memory kept for them stays unused")
        threads = thread_governor(config.model.num_threads) if runner.device.type == "cpu" else None
        return LocalExecutor(runner, cache, pools.window, threads)
    executor = TensorParallelExecutor(runner, cache, workers)
    if graphs and config.parallel.cuda_graphs:
        executor.capture_cuda_graphs(max_rows, max_blocks)
    return executor


@dataclass(slots=True)
class KVPools:
    """The KV pools: `cache` holds every layer's, or in the hybrid layout (`groups`) the full-attention
    layers' while `window` holds the sliding layers'."""

    cache: CacheEngine
    window: CacheEngine | None = None
    groups: WindowGroups | None = None


def _kv_cache(
    config: Config, loaded: LoadedModel, device: torch.device, max_model_len: int, vocab: int, reserve_bytes: int
) -> tuple[ModelRunner, KVPools]:
    """The model runner (layers fused as configured) bound to KV pools sized for this device, leaving
    `reserve_bytes` (the draft model's caches) beside them."""
    cache_cfg = config.cache
    dtype = next(loaded.model.parameters()).dtype
    runner = ModelRunner(loaded.model, device, cache_cfg.block_size)
    runner.fuse(config.model.fuse_layers)
    tp = config.parallel.tensor_parallel_size
    layout = kv_layout_of(loaded.model, cache_cfg.block_size, dtype, tp, cache_cfg.kv_cache_dtype)
    num_blocks = cache_cfg.num_kv_blocks or _auto_num_blocks(
        config, runner, layout, device, max_model_len, vocab, reserve_bytes
    )
    groups = window_groups(loaded.model, cache_cfg.disable_hybrid_kv_cache_manager, tp)
    if groups is not None:
        return runner, _hybrid_pools(config, runner, layout, groups, num_blocks, device)
    host_blocks = _num_swap_blocks(cache_cfg, layout) + _host_cache_blocks(cache_cfg, layout, device)
    cache = CacheEngine(layout, num_blocks, host_blocks, device, runner.ops)
    runner.bind_kv_cache(cache.pool)
    return runner, KVPools(cache)


def _hybrid_pools(
    config: Config, runner: ModelRunner, layout: KVLayout, groups: WindowGroups, num_blocks: int, device: torch.device
) -> KVPools:
    """The hybrid layout's two pools in the memory `num_blocks` blocks of every layer would take (or, with
    `cache.num_kv_blocks`, that many full-layer blocks), split by `cache.swa_full_tokens_ratio`; the host swap
    pools likewise. No host tier: the lower tiers are off in this layout."""
    cache_cfg = config.cache
    full, window = groups.layouts(layout)
    ratio = cache_cfg.swa_full_tokens_ratio
    if cache_cfg.num_kv_blocks:
        blocks = (num_blocks, max(1, int(ratio * num_blocks)))
    else:
        blocks = split_blocks(num_blocks * layout.bytes_per_block, full, window, ratio)
    swap = _num_swap_blocks(cache_cfg, layout)
    if cache_cfg.num_swap_blocks is not None:
        swaps = (swap, int(ratio * swap))
    else:
        swaps = split_blocks(swap * layout.bytes_per_block, full, window, ratio)
    cache = CacheEngine(full, blocks[0], swaps[0], device, runner.ops)
    window_cache = CacheEngine(window, blocks[1], swaps[1], device, runner.ops)
    runner.bind_kv_cache(cache.pool, WindowPool(window_cache.pool, groups))
    log.info(
        "kv_cache.hybrid",
        sliding_window=groups.sliding_window,
        full_layers=groups.num_full_layers,
        window_layers=groups.num_window_layers,
        full_blocks=blocks[0],
        window_blocks=blocks[1],
        swa_full_tokens_ratio=ratio,
    )
    return KVPools(cache, window_cache, groups)


class Steppable(Protocol):
    """What `warm_up` drives (an LLMEngine)."""

    max_model_len: int
    vocab_size: int
    block_manager: BlockSpace

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> list[int]: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[Any]: ...


def warm_up(engine: Steppable) -> None:
    """Runs a few throw-away requests of awkward lengths through the real step, so that Triton compiles
    its kernel variants (it specializes on sizes divisible by 16) before the first user waits for it. The
    prefix cache's lower tiers stay out of it: its reads would set the disk tier's read estimate."""
    start = time.perf_counter()
    params = SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False, temperature=0.0)
    lengths = [n for n in (1, 15, 16, 17, 40, 255, 256, 300, 1000) if n + 3 <= engine.max_model_len]
    with engine.block_manager.tiers_off():  # (throw-away requests: no tier reads them or their blocks)
        for wave in (lengths, lengths[-1:], lengths):  # batched, alone (chunked), then over cached prefixes
            for i, n in enumerate(wave):
                engine.add_request(f"__warmup_{i}", [(7 * j + n) % engine.vocab_size for j in range(n)], params)
            while engine.has_unfinished_requests():
                engine.step()
    # The throw-away requests are not traffic: the prefix-cache counters start from zero.
    engine.block_manager.prefix_cache_queried_tokens = engine.block_manager.prefix_cache_hit_tokens = 0
    engine.block_manager.device_hit_blocks = 0
    log.info("engine.warmed_up", seconds=round(time.perf_counter() - start, 2))


def _auto_num_blocks(
    config: Config,
    runner: ModelRunner,
    layout: KVLayout,
    device: torch.device,
    max_model_len: int,
    vocab: int,
    reserve_bytes: int,
) -> int:
    if device.type == "cuda":
        return profile_num_blocks(
            runner,
            layout,
            config.scheduler.max_num_batched_tokens,
            max_model_len,
            config.cache.gpu_memory_utilization,
            _graph_reserve_bytes(config, runner, vocab) + reserve_bytes,
            activation_copies=2 if _prefill_graphs_on(config, device) else 1,
        )
    return max(1, int(config.cache.cpu_kv_cache_gib * 2**30) // layout.bytes_per_block)


def _prefill_graphs_on(config: Config, device: torch.device) -> bool:
    """Whether prefill graphs are captured: on one CUDA GPU, graphs on, `model.prefill_graphs`."""
    model = config.model
    one_gpu = device.type == "cuda" and config.parallel.tensor_parallel_size == 1
    return one_gpu and model.prefill_graphs and not model.enforce_eager


def _graph_reserve_bytes(config: Config, runner: ModelRunner, vocab: int) -> int:
    """GPU memory the graphs will hold once captured (captured after the pool is allocated): one logits buffer
    per decode size, and for the prefill graphs one every size shares plus the head's output inside a graph and a
    step's float32 copy of it (rows for every seat); the largest decode graph's activations and the swap staging.
    The prefill graphs' activations are the profiled step's, counted again (`profile_num_blocks`'
    `activation_copies`): if their capture fails, that memory stays unused (logged)."""
    if config.model.enforce_eager:
        return _GRAPH_SLACK_BYTES
    elem = next(runner.model.parameters()).element_size()
    decode = sum(capture_sizes(config.scheduler.graph_rows())) * vocab * elem
    # Prefill graphs: the shared logits buffer, the head's output inside a graph, the float32 copy of a step's rows
    prefill = config.scheduler.seat_cap() * vocab * (2 * elem + 4) if _prefill_graphs_on(config, runner.device) else 0
    return decode + prefill + _GRAPH_SLACK_BYTES


def _max_model_len(loaded: LoadedModel, configured: int | None) -> int:
    text_config = loaded.model.config.get_text_config()
    native = getattr(text_config, "max_position_embeddings", None) or 2048
    if configured is not None and configured > native:
        raise ValueError(f"model.max_model_len {configured} exceeds the model's context ({native})")
    return configured or native


def _num_swap_blocks(cache: CacheConfig, layout: KVLayout) -> int:
    if cache.num_swap_blocks is not None:
        return cache.num_swap_blocks
    ram = _ram_bytes("SC_PHYS_PAGES")
    budget = min(cache.swap_space_gib * 2**30, _SWAP_RAM_SHARE * ram) if ram else cache.swap_space_gib * 2**30
    return int(budget // layout.bytes_per_block)


def _ram_bytes(pages: str) -> int:
    """Host RAM in bytes: all of it ("SC_PHYS_PAGES") or what is available now ("SC_AVPHYS_PAGES"); 0 where
    the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf(pages)
    except (ValueError, OSError, AttributeError):
        return 0


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes the cgroup (v2) memory limit still leaves this container (its limit less its usage); unbounded
    where there is no limit or no cgroup v2: the host's free RAM would overstate a container's."""
    try:
        limit = (root / "memory.max").read_text().strip()
        return int(limit) - int((root / "memory.current").read_text()) if limit != "max" else 1 << 62
    except (OSError, ValueError):
        return 1 << 62


def _eos_token_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(loaded.model, "generation_config", None), loaded.model.config, loaded.tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids
