"""LLMEngine: the synchronous engine; one `step()` is one iteration of the paper's iteration-level loop.

It validates and admits requests, and in each step runs schedule -> cache orders (swap/copy) -> forward
-> sample -> append, token-level stops -> free. What a step produced is, per sequence, only the new token
ids (`RequestUpdate`); the output processor turns those into the step's `RequestDelta`s (text, stop
strings) and names the sequences a stop string ended, which are finished here. It owns the wiring of its
parts (scheduler, block manager, cache engine, model runner, sampler, output processor) and nothing of
HTTP, WebSocket or threads (see AsyncEngine).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from streamd.config import Config
from streamd.engine.core.block_manager import BlockManager
from streamd.engine.core.deadlines import Deadline, Deadlines
from streamd.engine.core.scheduler import Scheduler
from streamd.engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from streamd.engine.core.sequence import PLACEHOLDER, Sequence, SequenceGroup, SequenceStatus
from streamd.engine.core.stop_checker import StopChecker
from streamd.engine.errors import ContextLengthError, KVCacheCapacityError, RequestError
from streamd.engine.output.chat_template import chat_template_ids
from streamd.engine.output.output_processor import OutputProcessor
from streamd.engine.outputs import FinishReason, RequestDelta, RequestUpdate, SeqUpdate
from streamd.engine.sample.beam_search import BeamRows, BeamSearch, Candidate, PendingCandidates, select_candidates
from streamd.engine.sample.grammar import GrammarCompiler, GrammarMatchers
from streamd.engine.sample.sampler import PendingSample, Sampler
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.stats import EngineStats
from streamd.engine.worker.cache_engine import CacheEngine, KVLayout
from streamd.engine.worker.cpu_threads import apply_num_threads
from streamd.engine.worker.cuda_graphs import capture_sizes
from streamd.engine.worker.executor import Executor, LocalExecutor
from streamd.engine.worker.fusion import fuse_layers
from streamd.engine.worker.model_loader import LoadedModel, load_model, resolve_device, resolve_dtype
from streamd.engine.worker.model_runner import ModelRunner, kv_layout_of, profile_num_blocks
from streamd.engine.worker.parallel.executor import TensorParallelExecutor
from streamd.engine.worker.parallel.workers import WorkerPool, start_tensor_parallel
from streamd.engine.worker.preemption_costs import cost_model
from streamd.logs import get_logger

log = get_logger(__name__)

_SWAP_RAM_SHARE = 0.4  # the swap pool never takes more than this share of host RAM
_GRAPH_SLACK_BYTES = 320 << 20  # decode-graph activations (measured < 40 MiB) and swap staging (64 MiB), with room


@dataclass(slots=True)
class _Forward:
    """A step whose forward is queued: its plan, the rows that sample (forked samples appended) and their
    logits (on CUDA still being computed while the host prepares the grammar masks)."""

    out: SchedulerOutput
    sampling: list[ScheduledSeq]
    logits: torch.Tensor
    forks: list[tuple[ScheduledSeq, list[Sequence]]]
    beams: PendingCandidates | None  # beam search requests' candidates (their rows are not in `sampling`)


@dataclass(slots=True)
class _InFlight:
    """A launched step: its plan, the rows that sample, and their tokens on the way to the host."""

    out: SchedulerOutput
    sampling: list[ScheduledSeq]
    pending: PendingSample
    rows: dict[int, int]  # seq_id -> row of `pending.tokens`
    # Prompts that completed in this step and the samples forked from them once their KV is written:
    # each sample drew its first token from the prompt's logits in this step.
    forks: list[tuple[ScheduledSeq, list[Sequence]]]
    beams: PendingCandidates | None = None  # beam search requests' candidates (their rows are not in `sampling`)


class LLMEngine:
    def __init__(
        self, config: Config, loaded: LoadedModel, device: torch.device, workers: WorkerPool | None = None
    ) -> None:
        """`workers`: the other tensor-parallel ranks (then `loaded` is shard 0 of the model)."""
        self.config = config
        self.device = device
        self.model_name = config.server.served_model_name or loaded.name
        self.tokenizer = loaded.tokenizer
        self.max_model_len = _max_model_len(loaded, config.model.max_model_len)
        self.vocab_size = vocab = loaded.model.config.get_text_config().vocab_size
        cache_cfg = config.cache
        dtype = next(loaded.model.parameters()).dtype
        self.runner = ModelRunner(loaded.model, device, cache_cfg.block_size)
        fuse_layers(loaded.model, config.model.fuse_layers, device)
        layout = kv_layout_of(loaded.model, cache_cfg.block_size, dtype, config.parallel.tensor_parallel_size)
        num_blocks = cache_cfg.num_kv_blocks or self._auto_num_blocks(layout)
        self.cache = CacheEngine(layout, num_blocks, _num_swap_blocks(cache_cfg, layout), device, self.runner.ops)
        self.runner.bind_kv_cache(self.cache.kv_cache)
        if device.type == "cuda" and not config.model.enforce_eager and workers is None:
            self.runner.capture_cuda_graphs(config.scheduler.max_num_seqs, self.max_model_len)
        self.executor: Executor = (
            LocalExecutor(self.runner, self.cache)
            if workers is None
            else TensorParallelExecutor(self.runner, self.cache, workers)
        )
        self.block_manager = BlockManager(
            num_blocks,
            cache_cfg.block_size,
            self.cache.num_swap_blocks,
            cache_cfg.watermark,
            cache_cfg.enable_prefix_caching,
        )
        self.eos_token_ids = _eos_token_ids(loaded)
        self.sampler = Sampler(vocab, self.eos_token_ids, seed=config.model.seed)
        self.grammars: GrammarMatchers | None = None  # made by the first constrained request (costs ~1 s)
        self._grammars_lock = threading.Lock()
        self.stop_checker = StopChecker(self.eos_token_ids, self.max_model_len)
        costs = None
        if config.scheduler.preemption_mode != "recompute" and self.cache.num_swap_blocks:
            costs = cost_model(
                self.cache, self.executor, self.runner, self.max_model_len, Path(config.model.cache_dir).expanduser()
            )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len, costs)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._groups: dict[str, SequenceGroup] = {}
        self._beams: dict[str, BeamSearch] = {}  # the live beam search requests' search states
        self._generated_tokens = 0  # cumulative tokens sampled and kept (EngineStats.generated_tokens)
        # Live requests whose sampling needs their token history on the host (penalties, beam search):
        # while any is live, each step reads the previous step's tokens back before it launches (no overlap).
        self._num_serial = 0
        self._pending: list[RequestUpdate] = []  # requests ended outside a step (aborts), reported next step
        self._inflight: _InFlight | None = None  # the launched step whose tokens are not read back yet
        self.deadlines = Deadlines()  # requests' timeout_s / queue_timeout_s, checked at each step

    @classmethod
    def from_config(cls, config: Config, model_config: PretrainedConfig | None = None) -> LLMEngine:
        """Loads the configured model (or random weights for `model_config`) and builds the engine."""
        apply_num_threads(config.model.num_threads)
        device = resolve_device(config.model.device)
        dtype = resolve_dtype(config.model.dtype, device)
        workers = None
        if config.parallel.tensor_parallel_size > 1:
            loaded, workers = start_tensor_parallel(config, model_config, device, dtype)
        else:
            loaded = load_model(
                model_config or config.model.name, dtype, device, config.model.cache_dir, config.model.seed
            )
        engine = cls(config, loaded, device, workers)
        if device.type == "cuda":
            engine.warm_up()
        return engine

    def warm_up(self) -> None:
        """Runs a few throw-away requests of awkward lengths through the real step, so that Triton compiles
        its kernel variants (it specializes on sizes divisible by 16) before the first user waits for it."""
        start = time.perf_counter()
        params = SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False, temperature=0.0)
        lengths = [n for n in (1, 15, 16, 17, 40, 255, 256, 300, 1000) if n + 3 <= self.max_model_len]
        for wave in (lengths, lengths[-1:], lengths):  # batched, alone (chunked), then over cached prefixes
            for i, n in enumerate(wave):
                self.add_request(f"__warmup_{i}", [(7 * j + n) % self.vocab_size for j in range(n)], params)
            while self.has_unfinished_requests():
                self.step()
        # The throw-away requests are not traffic: the prefix-cache counters start from zero.
        self.block_manager.prefix_cache_queried_tokens = self.block_manager.prefix_cache_hit_tokens = 0
        log.info("engine.warmed_up", seconds=round(time.perf_counter() - start, 2))

    # ---- requests -------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return chat_template_ids(self.tokenizer, messages)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams,
        *,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> list[int]:
        """Admits a request (or raises a RequestError saying why not); returns its prompt token ids."""
        if request_id in self._groups:
            raise RequestError(f"request_id {request_id!r} is already in flight")
        if not isinstance(params, SamplingParams):
            raise RequestError("params must be a SamplingParams")
        text, ids = self._tokenize(prompt, prompt_token_ids)
        if params.detokenize and self.tokenizer is None:
            raise RequestError("this model has no tokenizer: set detokenize=False and send token ids")
        self._check_lengths(ids, params)
        group = SequenceGroup(
            request_id,
            [Sequence(prompt_token_ids=ids)],
            params,
            prompt=text,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        )
        self._add_matchers(group)
        try:
            self.scheduler.add_seq_group(group)
        except ValueError as exc:
            self._remove_matchers(group)
            raise KVCacheCapacityError(str(exc)) from exc
        self._groups[request_id] = group
        self.deadlines.add(request_id, group.arrival_time, params)
        if params.use_beam_search:
            room = self.max_model_len - len(ids)
            self._beams[request_id] = BeamSearch.create(
                params, self.eos_token_ids, min(params.max_tokens or room, room)
            )
        self.output_processor.add_request(request_id, ids, params, group.arrival_time)
        self._num_serial += params.needs_host_tokens
        return ids

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compiles (and caches) the request's grammar, if any; raises GrammarError naming what is wrong.
        Thread-safe: the server calls it off its event loop before submitting."""
        if params.structured_outputs is not None:
            self._grammar_matchers().compiler.compile(params.structured_outputs)

    def _grammar_matchers(self) -> GrammarMatchers:
        with self._grammars_lock:
            if self.grammars is None:
                if self.tokenizer is None or not self.eos_token_ids:
                    raise RequestError(
                        "structured_outputs needs a tokenizer and an end-of-sequence token; this model lacks one"
                    )
                self.grammars = GrammarMatchers(GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids))
            return self.grammars

    def _add_matchers(self, group: SequenceGroup) -> None:
        spec = group.sampling_params.structured_outputs
        if spec is not None:
            self.compile_grammar(group.sampling_params)
            assert self.grammars is not None
            for seq in group.seqs:
                self.grammars.add(seq, spec)

    def _remove_matchers(self, group: SequenceGroup) -> None:
        if self.grammars is not None and group.sampling_params.structured_outputs is not None:
            for seq in group.seqs:
                self.grammars.remove(seq)

    def abort(self, request_id: str) -> None:
        """Frees the request's blocks now; its final delta (finish_reason "abort") comes with the next step."""
        group = self._groups.get(request_id)
        if group is not None:
            self._end(group, "abort")

    def _end(self, group: SequenceGroup, reason: FinishReason) -> None:
        self._forget(group)
        self.scheduler.abort_seq_group(group.request_id)
        self._pending.append(_ended(group, reason=reason))

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Stops or restarts scheduling a request (its reader fell behind / caught up); it keeps its blocks
        and is the first to be preempted under memory pressure."""
        self.scheduler.set_paused(request_id, paused)

    def _expire(self) -> None:
        """Ends the requests whose deadline passed: finish reason "timeout", output so far delivered."""
        for deadline in self.deadlines.expired(time.monotonic()):
            group = self._deadline_group(deadline)
            if group is not None:
                self._end(group, "timeout")

    def _deadline_group(self, deadline: Deadline) -> SequenceGroup | None:
        """The live request a deadline still applies to, if any."""
        group = self._groups.get(deadline.request_id)
        if group is None or (deadline.queue_only and group.first_scheduled_time is not None):
            return None
        return group

    def abort_all(self, error: str) -> list[RequestDelta]:
        """Fails every live request (after an exception inside a step); returns their final deltas."""
        self._inflight = None  # its results are void; its blocks go back with their requests
        if self.grammars is not None:  # (also the matchers of samples not forked yet)
            self.grammars.clear()
        updates, self._pending = self._pending, []
        for request_id, group in list(self._groups.items()):
            for seq in group.seqs:  # a token the host never received is not part of any output
                if seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
                    seq.token_ids.pop()
            self._forget(group)
            self.scheduler.abort_seq_group(request_id)
            updates.append(_ended(group, error))
        return self._process(updates)

    def has_unfinished_requests(self) -> bool:
        # A launched step whose requests have all finished is void: it needs no more steps. A failed
        # executor keeps the loop stepping (each step fails at once) until the AsyncEngine declares it dead.
        return bool(self._groups) or bool(self._pending) or self.executor.failed

    def has_runnable_work(self) -> bool:
        """Whether a step now can make progress (False while every live request is paused)."""
        return (
            bool(self._pending) or self._inflight is not None or self.executor.failed or self.scheduler.has_runnable()
        )

    @property
    def next_deadline(self) -> float | None:
        """The monotonic time of the earliest deadline that still applies (a step at or after it expires
        it); entries of requests that ended or were scheduled in time are dropped here."""
        while (head := self.deadlines.head) is not None and self._deadline_group(head) is None:
            self.deadlines.pop()
        return head.at if head is not None else None

    def stats(self) -> EngineStats:
        return EngineStats(
            self.block_manager.stats(), self.scheduler.stats(), len(self._groups), self._generated_tokens
        )

    # ---- the iteration --------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """One iteration; returns the deltas of the requests that progressed or ended. The forward of this
        step is queued on the device before the previous step's sampled tokens are read back, so the host's
        bookkeeping of step n overlaps the device's step n+1 (its inputs take those tokens on the device).
        Outputs therefore trail the device by one step. A batch with grammar-constrained rows keeps the
        overlap: its forward is queued first, then the previous step's tokens are read back and advance
        the matchers, and the masks are filled while the device runs the forward."""
        head = self.deadlines.head
        if head is not None and head.at <= time.monotonic():
            self._expire()
        updates, self._pending = self._pending, []
        deltas: list[RequestDelta] = []
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self.scheduler.on_step_done(prev.out)
            self._fork(prev)
            if self._num_serial:  # penalties and beam search need the tokens on the host: no overlap
                deltas = self._process(updates + self._read_back(prev, pipelined=False))
                updates, prev = [], None
            else:
                self._append_placeholders(prev)
        out = self.scheduler.schedule()
        for group, reason in out.rejected:
            self._forget(group)
            group.set_status(SequenceStatus.FINISHED_ABORTED)
            updates.append(_ended(group, reason))
        self.executor.swap_out(out.blocks_to_swap_out)
        self.executor.swap_in(out.blocks_to_swap_in)
        self.executor.copy(out.blocks_to_copy)
        if out.scheduled:
            forward = self._forward(out, prev)
            constrained = self._constrained_rows([item.seq for item in forward.sampling])
            if prev is not None and constrained:
                # The masks of this step follow the previous step's tokens: take them first.
                updates += self._read_back(prev, pipelined=True)
                prev = None
            self._inflight = self._sample(forward, constrained)
        if prev is not None:
            updates += self._read_back(prev, pipelined=True)
        return deltas + self._process(updates)

    def _append_placeholders(self, prev: _InFlight) -> None:
        for item in prev.sampling:
            seq = item.seq
            # A token in flight that ends its sequence by length gets no placeholder, so nothing is
            # scheduled for it (a decode of a finished sequence could take a block, preempting a live one).
            if not seq.status.finished and not self.stop_checker.at_length_limit(
                seq, item.group.sampling_params, pending=1
            ):
                seq.append_token(PLACEHOLDER)

    def _forward(self, out: SchedulerOutput, prev: _InFlight | None) -> _Forward:
        """Queues the step's forward (its inputs take `prev`'s tokens on the device); makes the samples
        of prompts that complete in it, each with its prompt's logits row and grammar state."""
        sampling = out.sampling()
        if prev is not None:
            logits = self.executor.execute(out, prev.pending.tokens, prev.rows)
        else:
            logits = self.executor.execute(out)
        beams = None
        if self._beams:  # beam rows leave the sampler's batch for one batched candidate selection
            logits, sampling, beams = self._select_beam_candidates(logits, sampling)
        forks = [(item, _children(item.group)) for item in sampling if item.group.needs_fork]
        if forks:  # each sample draws from its prompt's logits row
            logits, sampling = self._with_samples(logits, sampling, forks)
            if self.grammars is not None:
                for item, children in forks:
                    for child in children:
                        self.grammars.fork(item.seq, child)
        return _Forward(out, sampling, logits, forks, beams)

    def _constrained_rows(self, seqs: list[Sequence]) -> list[int]:
        return self.grammars.constrained_rows(seqs) if self.grammars is not None else []

    def _sample(self, step: _Forward, constrained: list[int]) -> _InFlight:
        """Fills the grammar masks of the `constrained` rows (their matchers are up to date) and queues the
        sampling."""
        sampling, logits = step.sampling, step.logits
        seqs = [item.seq for item in sampling]
        bitmask = None
        if constrained:
            assert self.grammars is not None
            bitmask = self.grammars.bitmask(seqs, constrained, logits.device)
        pending = self.sampler.sample_async(
            logits, seqs, [item.group.sampling_params for item in sampling], bitmask, owns_logits=True
        )
        return _InFlight(
            step.out, sampling, pending, {item.seq.seq_id: i for i, item in enumerate(sampling)}, step.forks, step.beams
        )

    def _select_beam_candidates(
        self,
        logits: torch.Tensor,
        sampling: list[ScheduledSeq],
    ) -> tuple[torch.Tensor, list[ScheduledSeq], PendingCandidates | None]:
        """Splits the beam search rows off the sampling rows and starts their candidate selection (one
        device operation for all beam requests); returns the other rows' logits and items."""
        rows: dict[str, list[int]] = {}
        keep: list[int] = []
        for i, item in enumerate(sampling):
            if item.group.request_id in self._beams:
                rows.setdefault(item.group.request_id, []).append(i)
            else:
                keep.append(i)
        if not rows:
            return logits, sampling, None
        groups: list[BeamRows] = []
        for request_id, group_rows in rows.items():
            group = self._groups[request_id]
            place = {id(seq): j for j, seq in enumerate(group.seqs)}
            group_rows.sort(key=lambda i: place[id(sampling[i].seq)])
            # The scheduler runs a beam group's beams together: one row per beam (its prompt at first).
            assert len(group_rows) == len(group.seqs), "a beam group sampled only some of its beams"
            groups.append(self._beams[request_id].rows(request_id, group_rows, group.seqs[0].num_output_tokens))
        bitmask = None
        if self.grammars is not None:  # constrained beams: rows in the order select_candidates stacks them
            seqs = [sampling[i].seq for g in groups for i in g.rows]
            bitmask = self.grammars.bitmask(seqs, self.grammars.constrained_rows(seqs), logits.device, own_buffer=True)
        beams = select_candidates(logits, groups, self.vocab_size, bitmask)
        index = torch.tensor(keep, dtype=torch.int64).to(logits.device, non_blocking=True)
        return logits.index_select(0, index), [sampling[i] for i in keep], beams

    @staticmethod
    def _with_samples(
        logits: torch.Tensor, sampling: list[ScheduledSeq], forks: list[tuple[ScheduledSeq, list[Sequence]]]
    ) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """The sampling rows with every forked sample's row appended (a copy of its prompt's logits)."""
        row_of = {id(item): i for i, item in enumerate(sampling)}
        rows = list(range(len(sampling)))
        sampling = list(sampling)
        for item, children in forks:
            for child in children:
                rows.append(row_of[id(item)])
                sampling.append(ScheduledSeq(child, item.group, 0))
        index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
        return logits.index_select(0, index), sampling

    def _fork(self, step: _InFlight) -> None:
        """The prompts that completed in `step` have their KV written: their samples now share its blocks
        (copy-on-write will copy only the last, partly filled block). A request that ended meanwhile drops
        them."""
        for item, children in step.forks:
            parent, group = item.seq, item.group
            for child in children:
                if parent.status is SequenceStatus.RUNNING and group.request_id in self._groups:
                    self.scheduler.fork_seq(group, parent, child)
                else:
                    child.status = SequenceStatus.FINISHED_ABORTED
                    if self.grammars is not None:
                        self.grammars.remove(child)

    def _read_back(self, step: _InFlight, pipelined: bool) -> list[RequestUpdate]:
        """Reads a launched step's tokens back and does the engine's bookkeeping: append (or fill the
        placeholder), token-level stops, free; returns what is new for each request that progressed."""
        result = step.pending.result()
        token_ids, logprobs = result.token_ids, result.logprobs
        check, grammars = self.stop_checker.check, self.grammars
        updates: dict[str, RequestUpdate] = {}
        ended: list[SequenceGroup] = []
        for i, item in enumerate(step.sampling):
            seq = item.seq
            if seq.status >= _FINISHED:  # aborted, or stopped a step earlier: this token is void
                continue
            token, group = token_ids[i], item.group
            if pipelined and seq.token_ids[-1] == PLACEHOLDER:
                seq.token_ids[-1] = token
            else:
                seq.token_ids.append(token)
            params = group.sampling_params
            update = updates.get(group.request_id)
            if update is None:
                update = updates[group.request_id] = RequestUpdate(
                    group.request_id, [], group.num_cached_tokens, group.first_scheduled_time
                )
            if grammars is not None and not grammars.accept(seq, token):
                update.seqs.append(self._dead_end(seq, update))
                ended.append(group)
                continue
            self._generated_tokens += 1
            reason, stop_token_id = check(seq, params)
            update.seqs.append(
                SeqUpdate(
                    seq.sample_index,
                    [token],
                    [logprobs[i]] if logprobs is not None and params.logprobs is not None else None,
                    reason,
                    stop_token_id,
                )
            )
            if reason is not None:
                ended.append(group)
        if step.beams is not None:
            for request_id, candidates in step.beams.result():
                group = self._groups.get(request_id)
                if group is not None:  # else aborted meanwhile
                    self._advance_beams(group, candidates, updates, ended)
        # Free what ended (also sequences preempted since this step launched: their blocks may be on the host).
        self.scheduler.free_finished(ended)
        for group in ended:
            if group.finished:
                self._forget(group)
        return list(updates.values())

    def _advance_beams(
        self,
        group: SequenceGroup,
        candidates: list[Candidate],
        updates: dict[str, RequestUpdate],
        ended: list[SequenceGroup],
    ) -> None:
        """One beam search step of `group`: the next beams (forked from their parents, dropped beams freed
        at once) get their tokens; or the search is over and the best beams are the request's choices."""
        search = self._beams[group.request_id]
        step = search.step(candidates, group.seqs)
        if step.done:
            group.set_status(SequenceStatus.FINISHED_STOPPED)
            ended.append(group)
            updates[group.request_id] = RequestUpdate(
                group.request_id, search.final_updates(), group.num_cached_tokens, group.first_scheduled_time
            )
            return
        parents = [group.seqs[c.beam] for c in step.beams]
        previous = list(group.seqs)
        beams = self.scheduler.replace_beams(group, parents)
        for beam, candidate in zip(beams, step.beams):
            beam.append_token(candidate.token_id)
        if self.grammars is not None and group.sampling_params.structured_outputs is not None:
            # replace_beams marks the beams no next beam continues aborted (and frees them)
            dropped = [beam for beam in previous if beam.status == SequenceStatus.FINISHED_ABORTED]
            self._advance_beam_matchers(beams, parents, dropped, step.beams)
        self._generated_tokens += len(beams)  # the engine's work: every beam's token

    def _advance_beam_matchers(
        self, beams: list[Sequence], parents: list[Sequence], dropped: list[Sequence], candidates: list[Candidate]
    ) -> None:
        """A beam forked from its parent continues a copy of the parent's grammar state (taken before the
        parent accepts its own token); every next beam accepts its token; a dropped beam's matcher goes.
        The candidates were drawn from masked logits, so every token is one the grammar allows."""
        grammars = self.grammars
        assert grammars is not None
        for beam, parent in zip(beams, parents):
            if beam is not parent:
                grammars.fork(parent, beam)
        for beam, candidate in zip(beams, candidates):
            accepted = grammars.accept(beam, candidate.token_id)
            assert accepted, "a beam candidate outside its grammar"
        for beam in dropped:
            grammars.remove(beam)

    @staticmethod
    def _dead_end(seq: Sequence, update: RequestUpdate) -> SeqUpdate:
        """A constrained sequence whose grammar allowed no token (e.g. min_tokens masked the only one
        left): it ends, without the token sampled from nothing, and the request says why."""
        seq.token_ids.pop()
        seq.status = SequenceStatus.FINISHED_ABORTED
        update.error = (
            f"structured output reached a dead end after {seq.num_output_tokens} tokens: the grammar "
            "allows no token here (check min_tokens, stop settings and the schema)"
        )
        return SeqUpdate(seq.sample_index, [], finish_reason="abort")

    def _process(self, updates: list[RequestUpdate]) -> list[RequestDelta]:
        """Updates -> deltas; sequences a stop string ended are finished here (blocks freed at once)."""
        if not updates:
            return []
        processed = self.output_processor.process(updates)
        for hit in processed.stop_hits:
            self.finish_choice(hit.request_id, hit.index)
        return processed.deltas

    def finish_choice(self, request_id: str, index: int) -> None:
        """Ends one choice that a stop string ended (its blocks are freed at once); its later tokens, if any
        are in flight, are void to the output processor."""
        group = self._groups.get(request_id)
        if group is None:
            return
        for seq in group.seqs:
            if seq.sample_index == index and not seq.status.finished:
                seq.status = SequenceStatus.FINISHED_STOPPED
        self.scheduler.free_finished([group])
        if group.finished:
            self._forget(group)

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
            self._num_serial -= group.sampling_params.needs_host_tokens
            self._beams.pop(group.request_id, None)
            self._remove_matchers(group)

    def _tokenize(
        self, prompt: str | list[int] | None, prompt_token_ids: list[int] | None
    ) -> tuple[str | None, list[int]]:
        if prompt_token_ids is None and isinstance(prompt, list):
            prompt, prompt_token_ids = None, prompt
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
            # C-speed checks (a per-token generator cost ~1.5 us a token: most of a long prompt's admission)
            if ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= self.vocab_size):
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
                f"length ({self.max_model_len} tokens)"
            )
        if not self.block_manager.can_ever_fit(wanted):  # else it would fail mid-generation, not here
            raise KVCacheCapacityError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) needs more KV cache blocks "
                f"than the pool can ever hold ({self.block_manager.num_blocks} blocks of "
                f"{self.block_manager.block_size} tokens)"
            )

    def _auto_num_blocks(self, layout: KVLayout) -> int:
        if self.device.type == "cuda":
            return profile_num_blocks(
                self.runner,
                layout,
                self.config.scheduler.max_num_batched_tokens,
                self.max_model_len,
                self.config.cache.gpu_memory_utilization,
                self._graph_reserve_bytes(layout),
            )
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


_FINISHED = SequenceStatus.FINISHED_STOPPED  # statuses from here on are finished


def _children(group: SequenceGroup) -> list[Sequence]:
    """The samples to fork from a request's prompt (the prompt's own sequence is sample 0)."""
    prompt = group.prompt_token_ids
    return [Sequence(prompt_token_ids=prompt, sample_index=i) for i in range(len(group.seqs), group.width)]


def _ended(group: SequenceGroup, error: str | None = None, reason: FinishReason = "abort") -> RequestUpdate:
    """The update of a request the engine ended outside a step (abort, timeout, rejection, failure): every
    choice, forked or not yet (the output processor skips those already finished)."""
    seqs = [SeqUpdate(index, [], finish_reason=reason) for index in range(group.sampling_params.n)]
    return RequestUpdate(group.request_id, seqs, group.num_cached_tokens, group.first_scheduled_time, error)
