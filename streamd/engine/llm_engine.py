"""LLMEngine: the synchronous engine; one `step()` is one iteration of the paper's iteration-level loop.

It validates and admits requests, and in each step runs schedule -> cache orders (swap/copy) -> forward
-> sample -> append, detokenize, stop -> free, returning one RequestOutput per request that progressed.
It owns the wiring of its parts (scheduler, block manager, cache engine, model runner, sampler) and
nothing of HTTP, WebSocket or threads (see AsyncEngine).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from streamd.config import Config
from streamd.engine.block_manager import BlockManager
from streamd.engine.cache_engine import CacheEngine, KVLayout
from streamd.engine.chat_template import chat_template_ids
from streamd.engine.cpu_threads import apply_num_threads
from streamd.engine.detokenizer import IncrementalDetokenizer
from streamd.engine.errors import ContextLengthError, KVCacheCapacityError, RequestError
from streamd.engine.model_loader import LoadedModel, load_model, resolve_device, resolve_dtype
from streamd.engine.cuda_graphs import capture_sizes
from streamd.engine.model_runner import ModelRunner, kv_layout_of, profile_num_blocks
from streamd.engine.outputs import CompletionOutput, RequestOutput
from streamd.engine.preemption_costs import cost_model
from streamd.engine.sampler import PendingSample, Sampler
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.scheduler import Scheduler
from streamd.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from streamd.engine.sequence import FINISH_REASONS, PLACEHOLDER, Sequence, SequenceGroup, SequenceStatus
from streamd.engine.stop_checker import StopChecker, visible_text
from streamd.logs import get_logger

log = get_logger(__name__)

_SWAP_RAM_SHARE = 0.4  # the swap pool never takes more than this share of host RAM
_GRAPH_SLACK_BYTES = 320 << 20  # decode-graph activations (measured < 40 MiB) and swap staging (64 MiB), with room


@dataclass(slots=True)
class _InFlight:
    """A launched step: its plan, the rows that sample, and their tokens on the way to the host."""

    out: SchedulerOutput
    sampling: list[ScheduledSeq]
    pending: PendingSample
    rows: dict[int, int]  # seq_id -> row of `pending.tokens`


class LLMEngine:
    def __init__(self, config: Config, loaded: LoadedModel, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.model_name = config.server.served_model_name or loaded.name
        self.tokenizer = loaded.tokenizer
        self.max_model_len = _max_model_len(loaded, config.model.max_model_len)
        self.vocab_size = vocab = loaded.model.config.get_text_config().vocab_size
        cache_cfg = config.cache
        dtype = next(loaded.model.parameters()).dtype
        self.runner = ModelRunner(loaded.model, device, cache_cfg.block_size)
        layout = kv_layout_of(loaded.model, cache_cfg.block_size, dtype)
        num_blocks = cache_cfg.num_kv_blocks or self._auto_num_blocks(layout)
        self.cache = CacheEngine(layout, num_blocks, _num_swap_blocks(cache_cfg, layout), device, self.runner.ops)
        self.runner.bind_kv_cache(self.cache.kv_cache)
        if device.type == "cuda" and not config.model.enforce_eager:
            self.runner.capture_cuda_graphs(config.scheduler.max_num_seqs, self.max_model_len)
        self.block_manager = BlockManager(num_blocks, cache_cfg.block_size, self.cache.num_swap_blocks,
                                          cache_cfg.watermark, cache_cfg.enable_prefix_caching)
        self.eos_token_ids = _eos_token_ids(loaded)
        self.sampler = Sampler(vocab, self.eos_token_ids, seed=config.model.seed)
        self.stop_checker = StopChecker(self.eos_token_ids, self.max_model_len)
        costs = None
        if config.scheduler.preemption_mode != "recompute" and self.cache.num_swap_blocks:
            costs = cost_model(self.cache, self.runner, self.max_model_len, Path(config.model.cache_dir).expanduser())
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len, costs)
        self._groups: dict[str, SequenceGroup] = {}
        self._num_penalized = 0  # live requests whose sampling reads their token history on the host
        self._pending: list[RequestOutput] = []  # outputs of requests finished outside a step (aborts)
        self._inflight: _InFlight | None = None  # the launched step whose tokens are not read back yet
        # False: step() reports only finished requests (offline use), sparing the per-step output objects.
        self.stream_outputs = True

    @classmethod
    def from_config(cls, config: Config, model_config: PretrainedConfig | None = None) -> LLMEngine:
        """Loads the configured model (or random weights for `model_config`) and builds the engine."""
        apply_num_threads(config.model.num_threads)
        device = resolve_device(config.model.device)
        dtype = resolve_dtype(config.model.dtype, device)
        loaded = load_model(model_config or config.model.name, dtype, device, config.model.cache_dir,
                            config.model.seed)
        engine = cls(config, loaded, device)
        if device.type == "cuda":
            engine.warm_up()
        return engine

    def warm_up(self) -> None:
        """Runs a few throw-away requests of awkward lengths through the real step, so that Triton compiles
        its kernel variants (it specializes on sizes divisible by 16) before the first user waits for it."""
        start = time.perf_counter()
        stream, self.stream_outputs = self.stream_outputs, False
        params = SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False, temperature=0.0)
        lengths = [n for n in (1, 15, 16, 17, 40, 255, 256, 300, 1000) if n + 3 <= self.max_model_len]
        for wave in (lengths, lengths[-1:], lengths):  # batched, alone (chunked), then over cached prefixes
            for i, n in enumerate(wave):
                self.add_request(f"__warmup_{i}", [(7 * j + n) % self.vocab_size for j in range(n)], params)
            while self.has_unfinished_requests():
                self.step()
        self.stream_outputs = stream
        # The throw-away requests are not traffic: the prefix-cache counters start from zero.
        self.block_manager.prefix_cache_queried_tokens = self.block_manager.prefix_cache_hit_tokens = 0
        log.info("engine.warmed_up", seconds=round(time.perf_counter() - start, 2))

    # ---- requests -------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return chat_template_ids(self.tokenizer, messages)

    def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams, *,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None) -> None:
        if request_id in self._groups:
            raise RequestError(f"request_id {request_id!r} is already in flight")
        if not isinstance(params, SamplingParams):
            raise RequestError("params must be a SamplingParams")
        if params.n != 1:
            raise RequestError("n > 1 (parallel sampling) is not supported yet")
        text, ids = self._tokenize(prompt, prompt_token_ids)
        if params.detokenize and self.tokenizer is None:
            raise RequestError("this model has no tokenizer: set detokenize=False and send token ids")
        self._check_lengths(ids, params)
        seq = Sequence(prompt_token_ids=ids)
        if params.detokenize:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        group = SequenceGroup(request_id, [seq], params, prompt=text,
                              arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        try:
            self.scheduler.add_seq_group(group)
        except ValueError as exc:
            raise KVCacheCapacityError(str(exc)) from exc
        self._groups[request_id] = group
        self._num_penalized += params.uses_penalties

    def abort(self, request_id: str) -> None:
        """Frees the request's blocks now; its final output (finish_reason "abort") comes with the next step."""
        group = self._groups.get(request_id)
        if group is None:
            return
        self._forget(group)
        self.scheduler.abort_seq_group(request_id)
        group.set_status(SequenceStatus.FINISHED_ABORTED)
        self._pending.append(self._output(group))

    def abort_all(self, error: str) -> list[RequestOutput]:
        """Fails every live request (after an exception inside a step); returns their final outputs."""
        outputs = []
        self._inflight = None  # its results are void; its blocks go back with their requests
        for request_id, group in list(self._groups.items()):
            for seq in group.seqs:  # a token the host never received is not part of any output
                if seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
                    seq.token_ids.pop()
            self._forget(group)
            self.scheduler.abort_seq_group(request_id)
            group.set_status(SequenceStatus.FINISHED_ABORTED)
            outputs.append(self._output(group, error=error))
        return outputs

    def has_unfinished_requests(self) -> bool:
        # A launched step whose requests have all finished is void: it needs no more steps.
        return bool(self._groups) or bool(self._pending)

    def stats(self) -> dict[str, int | float]:
        stats: dict[str, int | float] = dict(self.scheduler.stats())
        stats.update(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                     num_swapped=self.scheduler.num_swapped, num_requests=len(self._groups))
        return stats

    # ---- the iteration --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. The forward of this step is queued on the device before the previous step's
        sampled tokens are read back, so the host's bookkeeping of step n overlaps the device's step n+1
        (its inputs take those tokens on the device). Outputs therefore trail the device by one step."""
        outputs, self._pending = self._pending, []
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self.scheduler.on_step_done(prev.out)
            if self._num_penalized:  # penalties read every past token on the host: no overlap
                outputs += self._finish(prev, pipelined=False)
                prev = None
            else:
                for item in prev.sampling:
                    seq = item.seq
                    # A token in flight that ends its sequence by length gets no placeholder, so nothing is
                    # scheduled for it (a decode of a finished sequence could take a block, preempting a live one).
                    if not seq.status.finished and not self.stop_checker.at_length_limit(
                            seq, item.group.sampling_params, pending=1):
                        seq.append_token(PLACEHOLDER)
        out = self.scheduler.schedule()
        for group, reason in out.rejected:
            self._forget(group)
            group.set_status(SequenceStatus.FINISHED_ABORTED)
            outputs.append(self._output(group, error=reason))
        self.cache.swap_out(out.blocks_to_swap_out)
        self.cache.swap_in(out.blocks_to_swap_in)
        self.cache.copy(out.blocks_to_copy)
        if out.scheduled:
            self._inflight = self._launch(out, prev)
        if prev is not None:
            outputs += self._finish(prev, pipelined=True)
        return outputs

    def _launch(self, out: SchedulerOutput, prev: _InFlight | None) -> _InFlight:
        now = time.monotonic()
        for item in out.scheduled:
            group = item.group
            if group.first_scheduled_time is None:  # (the scheduler recorded num_cached_tokens)
                group.first_scheduled_time = now
        sampling = [item for item in out.scheduled if item.samples]
        if prev is not None:
            logits = self.runner.execute(out, prev.pending.tokens, prev.rows)
        else:
            logits = self.runner.execute(out)
        pending = self.sampler.sample_async(logits, [item.seq for item in sampling],
                                            [item.group.sampling_params for item in sampling])
        return _InFlight(out, sampling, pending, {item.seq.seq_id: i for i, item in enumerate(sampling)})

    def _finish(self, step: _InFlight, pipelined: bool) -> list[RequestOutput]:
        """Reads a launched step's tokens back and does its bookkeeping: append (or fill the placeholder),
        detokenize, stop, free; returns the outputs of the requests that progressed."""
        result = step.pending.result()
        now = time.monotonic()
        touched: dict[int, SequenceGroup] = {}
        for i, (item, token) in enumerate(zip(step.sampling, result.token_ids)):
            seq, group = item.seq, item.group
            if seq.status.finished:  # aborted, or stopped a step earlier: this token is void
                continue
            if pipelined and seq.token_ids[-1] == PLACEHOLDER:
                seq.token_ids[-1] = token
            else:
                seq.append_token(token)
            if result.logprobs is not None and group.sampling_params.logprobs is not None:
                seq.output_logprobs.append(result.logprobs[i])
            new_text = seq.detokenizer.step(seq.token_ids) if seq.detokenizer is not None else ""
            seq.output_text += new_text
            self.stop_checker.check(seq, group.sampling_params, new_text)
            if group.first_token_time is None:
                group.first_token_time = now
            touched[id(group)] = group
        self.scheduler.free_finished(touched.values())  # also those preempted since this step launched
        outputs = []
        for group in touched.values():
            if group.finished:
                self._forget(group)
                outputs.append(self._output(group))
            elif self.stream_outputs:
                outputs.append(self._output(group))
        return outputs

    # ---- helpers --------------------------------------------------------------------------------

    def _graph_reserve_bytes(self, layout: KVLayout) -> int:
        """GPU memory the decode graphs will hold once captured (captured after the pool is allocated):
        one logits buffer per captured size plus the largest graph's activations and the swap staging."""
        if self.config.model.enforce_eager:
            return _GRAPH_SLACK_BYTES
        elem = torch.empty((), dtype=layout.dtype).element_size()
        return sum(capture_sizes(self.config.scheduler.max_num_seqs)) * self.vocab_size * elem + _GRAPH_SLACK_BYTES

    def _forget(self, group: SequenceGroup) -> None:
        if self._groups.pop(group.request_id, None) is not None:
            self._num_penalized -= group.sampling_params.uses_penalties

    def _output(self, group: SequenceGroup, error: str | None = None) -> RequestOutput:
        params = group.sampling_params
        completions = [
            CompletionOutput(index=i, text=visible_text(seq, params), token_ids=seq.output_token_ids,
                             finish_reason=FINISH_REASONS.get(seq.status),
                             logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
                             stop_reason=seq.stop_reason)
            for i, seq in enumerate(group.seqs)]
        output = RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                               finished=group.finished, num_cached_tokens=group.num_cached_tokens, error=error)
        if output.finished:  # monotonic-clock timings, for latency accounting
            output.metrics = {"arrival_time": group.arrival_time,
                              "first_scheduled_time": group.first_scheduled_time or -1.0,
                              "first_token_time": group.first_token_time or -1.0}
        return output

    def _tokenize(self, prompt: str | list[int] | None, prompt_token_ids: list[int] | None) -> tuple[str | None, list[int]]:
        if prompt_token_ids is None and isinstance(prompt, list):
            prompt, prompt_token_ids = None, prompt
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
                raise RequestError(f"prompt_token_ids must be integers in [0, {self.vocab_size})")
            text = prompt if isinstance(prompt, str) else None
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send prompt token ids")
            ids, text = list(self.tokenizer(prompt).input_ids), prompt
        else:
            raise RequestError("prompt must be a string or a list of token ids")
        if not ids:
            raise RequestError("prompt must not be empty")
        return text, ids

    def _check_lengths(self, ids: list[int], params: SamplingParams) -> None:
        wanted = len(ids) + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise ContextLengthError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's context "
                f"length ({self.max_model_len} tokens)")
        if not self.block_manager.can_ever_fit(len(ids)):
            raise KVCacheCapacityError(
                f"prompt ({len(ids)} tokens) needs more KV cache blocks than the pool can ever hold "
                f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size} tokens)")

    def _auto_num_blocks(self, layout: KVLayout) -> int:
        if self.device.type == "cuda":
            return profile_num_blocks(self.runner, layout, self.config.scheduler.max_num_batched_tokens,
                                      self.max_model_len, self.config.cache.gpu_memory_utilization,
                                      self._graph_reserve_bytes(layout))
        return max(1, int(self.config.cache.cpu_kv_cache_gib * 2**30) // layout.bytes_per_block)


def _max_model_len(loaded: LoadedModel, configured: int | None) -> int:
    text_config = loaded.model.config.get_text_config()
    native = getattr(text_config, "max_position_embeddings", None) or 2048
    if configured is not None and configured > native:
        raise ValueError(f"model.max_model_len {configured} exceeds the model's context ({native})")
    return configured or native


def _num_swap_blocks(cache: Any, layout: KVLayout) -> int:
    if cache.num_swap_blocks is not None:
        return cache.num_swap_blocks
    ram = _host_ram_bytes()
    budget = min(cache.swap_space_gib * 2**30, _SWAP_RAM_SHARE * ram) if ram else cache.swap_space_gib * 2**30
    return int(budget // layout.bytes_per_block)


def _host_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _eos_token_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(loaded.model, "generation_config", None), loaded.model.config, loaded.tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids
