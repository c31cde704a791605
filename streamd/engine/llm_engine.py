"""LLMEngine: the synchronous engine; one `step()` is one iteration of the paper's iteration-level loop.

It only drives the step: schedule -> cache orders (swap/copy) -> forward -> sample -> read back. Its parts
own the rest: the builder builds them (`builder.py`); admission checks a request (`Admission`); the request
registry keeps what the engine holds per request and tears it down in one call; the scheduler writes every
sequence's status and applies what a step sampled (`Scheduler.update_from_output`: tokens appended,
token-level stops, finished sequences freed); the beam search and grammar lifecycles (`BeamSearches`,
`Grammars`) each have a hook per moment of a request; the output processor turns the step's new token ids
(`RequestUpdate`) into `RequestDelta`s (text, stop strings) and names the choices a stop string ended,
which are finished here. Nothing of HTTP, WebSocket or threads (see `streamd.engine.client.loop.EngineLoop`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from streamd.engine import builder
from streamd.engine.core.prefix_cache import prefix_root
from streamd.engine.core.progress import ProgressReports
from streamd.engine.core.requests import Request, RequestRegistry
from streamd.engine.core.sequence import Sequence, SequenceGroup
from streamd.engine.output.chat_template import chat_template_ids
from streamd.engine.output.output_processor import OutputStage
from streamd.engine.outputs import FinishReason, RequestDelta, RequestUpdate, SeqUpdate
from streamd.engine.sample.beam_search import BeamSearch
from streamd.engine.sample.rows import InFlight, SampleRows, fork_rows, launch, split_drafts
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.stats import EngineStats

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from streamd.config import Config
    from streamd.engine.core.kv_tiers import CachedBlock, Persisted, TierOrders
    from streamd.engine.core.scheduler_output import SchedulerOutput
    from streamd.engine.worker.model_loader import LoadedModel
    from streamd.engine.worker.parallel.workers import WorkerPool


class LLMEngine:
    def __init__(
        self, config: Config, loaded: LoadedModel, device: torch.device, workers: WorkerPool | None = None
    ) -> None:
        """`workers`: the other tensor-parallel ranks (then `loaded` is shard 0 of the model)."""
        parts = builder.build(config, loaded, device, workers)
        self.config, self.device = config, device
        self.model_name, self.tokenizer, self.vocab_size = parts.model_name, parts.tokenizer, parts.vocab_size
        self.max_model_len, self.eos_token_ids = parts.max_model_len, parts.eos_token_ids
        self.runner, self.cache, self.executor = parts.runner, parts.cache, parts.executor
        self.block_manager, self.scheduler, self.admission = parts.block_manager, parts.scheduler, parts.admission
        self.sampler, self.grammars, self.beams = parts.sampler, parts.grammars, parts.beams
        self.output_processor: OutputStage = parts.output_processor
        self.requests: RequestRegistry[BeamSearch] = RequestRegistry()
        self.requests.on_remove(self.grammars.remove)
        # Prompt logprobs of the requests that asked, filled chunk by chunk (by position: a recomputed chunk
        # overwrites), until their first update with tokens carries them.
        self._prompt_logprobs: dict[str, list[dict[int, float] | None]] = {}
        self.requests.on_remove(self._drop_prompt_logprobs)
        self._generated_tokens = 0  # cumulative tokens sampled and kept (EngineStats.generated_tokens)
        self._pending: list[RequestUpdate] = []  # requests ended outside a step (aborts), reported next step
        self._inflight: InFlight | None = None  # the launched step whose tokens are not read back yet
        # Without the overlap (`engine.overlap_steps`; the CPU's default: its forward has run when `launch`
        # returns) a step's tokens are read back in the step itself; the next step's progress reports take its
        # output from `_settled`.
        self._settles_at_once = not config.engine.overlaps_steps(device.type)
        self._settled: SchedulerOutput | None = None
        # (start, plan, overlapped, the plan of the step before it) of the last step that followed a launched one: its
        # period, start to next start, is measured when the next step finds it launched (`Scheduler.observe_period`)
        self._period: tuple[float, SchedulerOutput, bool, SchedulerOutput] | None = None
        self._progress = ProgressReports()  # queue places and prompt chunks done, before the first token

    @classmethod
    def from_config(cls, config: Config, model_config: PretrainedConfig | None = None) -> LLMEngine:
        """Loads the configured model (or random weights for `model_config`) and builds the engine."""
        loaded, device, workers = builder.load(config, model_config)
        engine = cls(config, loaded, device, workers)
        if device.type == "cuda":
            engine.warm_up()
        return engine

    def warm_up(self) -> None:
        """Compiles the kernels' variants through throw-away requests (`builder.warm_up`)."""
        builder.warm_up(self)

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
        self.requests.check_new(request_id)
        self.admission.check_params(params, self.tokenizer)
        text, ids = self.admission.prompt_ids(prompt, prompt_token_ids, self.tokenizer, self.vocab_size)
        self.admission.check(len(ids), params)
        self.admission.check_logit_bias(params, self.vocab_size)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        isolated = params.tenant if self.config.cache.prefix_isolation == "tenant" else None
        seq = Sequence(prompt_token_ids=ids, prefix_root=prefix_root(params.cache_salt, isolated))
        group = SequenceGroup(request_id, [seq], params, prompt=text, arrival_time=arrival)
        if params.prediction:
            group.prediction_token_ids = self._prediction_ids(params.prediction)
        self.grammars.add(group)  # (a grammar that does not compile raises before anything else is kept)
        self.requests.add(group, self.beams.create(params, len(ids)))
        self.scheduler.add_seq_group(group)
        self.output_processor.add_request(request_id, ids, params, arrival)
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = [None] * len(ids)
        return ids

    def _prediction_ids(self, prediction: str | list[int]) -> list[int]:
        """A request's `prediction` as draft tokens (ids the model has, up to the first it has not)."""
        ids: list[int] = (
            self.tokenizer.encode(prediction, add_special_tokens=False) if isinstance(prediction, str) else prediction
        )
        bad = next((i for i, token in enumerate(ids) if not 0 <= token < self.vocab_size), len(ids))
        return list(ids[:bad])

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compiles (and caches) the request's grammar, if any; raises GrammarError naming what is wrong.
        Thread-safe: the server calls it off its event loop before submitting."""
        self.grammars.compile(params)

    def abort(self, request_id: str) -> None:
        """Frees the request's blocks now; its final delta (finish_reason "abort") comes with the next step."""
        request = self.requests.get(request_id)
        if request is not None:
            self._pending.append(self._end(request.group, "abort"))

    def _end(self, group: SequenceGroup, reason: FinishReason, error: str | None = None) -> RequestUpdate:
        """Ends a live request everywhere at once; returns its final update."""
        self.requests.remove(group.request_id)
        self.scheduler.abort_seq_group(group.request_id)
        return _ended(group, error, reason)

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Stops or restarts scheduling a request (its reader fell behind / caught up); it keeps its blocks
        and is the first to be preempted under memory pressure."""
        self.scheduler.set_paused(request_id, paused)

    def abort_all(self, error: str) -> list[RequestDelta]:
        """Fails every live request (after an exception inside a step); returns their final deltas."""
        self._inflight = None  # its results are void; its blocks go back with their requests
        self.grammars.clear()  # (also the matchers of samples not forked yet)
        updates, self._pending = self._pending, []
        for request in self.requests:
            for seq in request.group.seqs:  # a token the host never received is not part of any output
                seq.drop_placeholder()
            updates.append(self._end(request.group, "abort", error))
        return self._process(updates)

    def has_unfinished_requests(self) -> bool:
        # A launched step whose requests have all finished is void: it needs no more steps. A failed
        # executor keeps the loop stepping (each step fails at once) until the engine loop declares it dead.
        return bool(self.requests) or bool(self._pending) or self.executor.failed

    def has_runnable_work(self) -> bool:
        """Whether a step now can make progress (False while every live request is paused)."""
        return (
            bool(self._pending) or self._inflight is not None or self.executor.failed or self.scheduler.has_runnable()
        )

    @property
    def next_deadline(self) -> float | None:
        """The monotonic time of the earliest deadline that still applies (a step at or after it expires it)."""
        return self.requests.next_deadline

    def stats(self) -> EngineStats:
        return EngineStats(
            self.block_manager.stats(),
            self.scheduler.stats(),
            len(self.requests),
            self._generated_tokens,
            self.grammars.cache_bytes(),
            self.executor.cpu_threads(),
        )

    # ---- the iteration --------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """One iteration; returns the deltas of the requests that progressed or ended. The forward of this
        step is queued on the device before the previous step's sampled tokens are read back, so the host's
        bookkeeping of step n overlaps the device's step n+1 (its inputs take those tokens on the device).
        Outputs therefore trail the device by one step. A batch with grammar-constrained rows keeps the
        overlap: its forward is queued first, then the previous step's tokens are read back and advance
        the matchers, and the masks are filled while the device runs the forward. Without the overlap
        (`engine.overlap_steps`, off on the CPU by default) a step's tokens are read back at its end (`_settle`)."""
        if self.executor.failed:  # each step fails at once, so the engine loop declares the engine dead
            raise RuntimeError("the executor failed in an earlier step; the engine cannot step")
        for request in self.requests.expired():  # timeout_s / queue_timeout_s: the output so far is kept
            self._pending.append(self._end(request.group, "timeout"))
        updates, self._pending = self._pending, []
        deltas: list[RequestDelta] = []
        prev, self._inflight = self._inflight, None
        done, self._settled = (prev.out if prev is not None else self._settled), None
        began, overlapped = self._observe_period(prev is not None), False
        if prev is not None:
            self._complete(prev)
            # Penalties and beam search need the tokens on the host, and drafts continue them: no overlap.
            if self.requests.num_serial or prev.verified is not None or self.scheduler.may_speculate():
                deltas = self._process(updates + self._read_back(prev))
                updates, prev = [], None
            else:
                self.scheduler.append_placeholders(prev.sampling)
                overlapped = True
        out = self.scheduler.schedule()
        if began is not None and out.scheduled and done is not None:
            self._period = (began, out, overlapped, done)
        updates += self._progress.step(done, self.scheduler.waiting)
        for group, reason in out.rejected:
            self.requests.remove(group.request_id)
            updates.append(_ended(group, reason))
        self._move_blocks(out)
        if out.scheduled:
            began = time.perf_counter()
            forward = self._forward(out, prev)
            dispatch_s = time.perf_counter() - began
            constrained = self.grammars.constrained_rows([item.seq for item in forward.sampling])
            if prev is not None and constrained:
                # The masks of this step follow the previous step's tokens: take them first.
                updates += self._read_back(prev)
                prev = None
            began = time.perf_counter()
            self._inflight = launch(forward, self.sampler, self.grammars, constrained)
            self._inflight.dispatch_s = dispatch_s + time.perf_counter() - began
        if prev is not None:
            updates += self._read_back(prev)
        if self._inflight is not None and self._settles_at_once:
            updates += self._settle(self._inflight)
        return deltas + self._process(updates)

    def _observe_period(self, follows_launch: bool) -> float | None:
        """This step's start, where it follows a launched step (else None: no period to measure from it); the last
        such step's period, start to now, goes to the scheduler (what a drafting step's lost overlap costs)."""
        now, last, self._period = time.perf_counter(), self._period, None
        if not follows_launch or self._settles_at_once:
            return None
        if last is not None:
            self.scheduler.observe_period(last[1], now - last[0], last[2], last[3])
        return now

    def _complete(self, step: InFlight) -> None:
        """A launched step's forward has run: its sequences advance past its tokens, its forks take their samples."""
        self.scheduler.on_step_done(step.out)
        self.grammars.drop(self.scheduler.fork_samples(step.forks))

    def _settle(self, step: InFlight) -> list[RequestUpdate]:
        """A launched step whose forward has run (the CPU's): its tokens read back now, not in the next step."""
        self._inflight = None
        self._complete(step)
        self._settled = step.out
        return self._read_back(step)

    def _move_blocks(self, out: SchedulerOutput) -> None:
        """The step's cache orders before its forward: the prefix cache's evicted blocks are read (to disk)
        or copied out (to the host tier) before anything writes the pools, restores come in with swap-ins.
        Host restores ordered ahead go last, on the swap stream without the forward waiting for them (no
        sequence of this step reads their blocks); the next step waits for them first."""
        self.executor.join_swaps()
        tiers = out.tier_orders
        if tiers is None:  # (most steps, and all without a tier)
            self.executor.swap_out(out.blocks_to_swap_out)
            self.executor.swap_in(out.blocks_to_swap_in)
        else:
            self._spill(tiers)
            self.executor.swap_out(tiers.host_spills + out.blocks_to_swap_out)
            self.executor.swap_in(out.blocks_to_swap_in + tiers.host_restores)
            self.executor.write_blocks(tiers.restores)
        self.executor.copy(out.blocks_to_copy)
        if tiers is not None and tiers.host_restores_ahead:
            self.executor.swap_in_ahead(tiers.host_restores_ahead)

    def _spill(self, orders: TierOrders | None) -> None:
        """Hands the bytes of the blocks this step evicts from the prefix cache to its lower tier, before
        anything in the step overwrites them."""
        tier = self.block_manager.tier
        if tier is None or orders is None or not (orders.spills or orders.host_to_disk):
            return
        payloads = self.executor.read_host_blocks([block for block, _ in orders.host_to_disk])
        payloads += self.executor.read_blocks([block for block, _ in orders.spills])
        for (_, key), payload in zip(orders.host_to_disk + orders.spills, payloads, strict=True):
            tier.put(key, payload)

    def close(self) -> Persisted | None:
        """At shutdown (after the last step): the device's and the host tier's cached prefixes go to the disk
        tier, most valuable first, as many as its bound holds within `cache.disk_persist_timeout_s` (its
        earlier writes finished within the same bound), so a restarted server finds them. What the tier did
        (None without one)."""
        tier = self.block_manager.tier
        if tier is None:
            return None
        began, timeout_s = time.monotonic(), self.config.cache.disk_persist_timeout_s
        done = tier.persist(self.block_manager.persist_order(), self._read_cached, timeout_s)
        tier.close(max(0.0, timeout_s - (time.monotonic() - began)))
        return done

    def _read_cached(self, blocks: list[CachedBlock]) -> list[bytes]:
        """The bytes of cached blocks, wherever each is (the device pool or the host tier's), in order."""
        host = iter(self.executor.read_host_blocks([b.block for b in blocks if b.on_host]))
        device = iter(self.executor.read_blocks([b.block for b in blocks if not b.on_host]))
        return [next(host if b.on_host else device) for b in blocks]

    def _forward(self, out: SchedulerOutput, prev: InFlight | None) -> SampleRows:
        """Queues the step's forward (its inputs take `prev`'s tokens on the device); beam rows leave for
        their candidate selection, the samples of prompts that complete in it are made, each with its
        prompt's logits row and grammar state."""
        sampling = out.sampling()
        if prev is not None:
            logits = self.executor.execute(out, prev.pending.tokens, prev.rows)
        else:
            logits = self.executor.execute(out)
        if self._prompt_logprobs:
            self._take_prompt_logprobs()
        drafted = None
        if out.num_draft_tokens:  # (first: the other items have one row each from here on)
            logits, sampling, drafted = split_drafts(logits, sampling)
        beams = None
        if self.requests.num_beam:
            logits, sampling, beams = self.beams.select(logits, sampling, self.requests, self.grammars)
        logits, sampling, forks = fork_rows(logits, sampling)
        if forks:
            self.grammars.fork_samples(forks)
        return SampleRows(out, sampling, logits, forks, beams, drafted)

    def _read_back(self, step: InFlight) -> list[RequestUpdate]:
        """Reads a launched step's tokens back: the scheduler applies them (and the beam searches theirs),
        finished sequences are freed and finished requests end; returns what is new for each request."""
        began = time.perf_counter()
        result = step.pending.result()
        # What the step cost: its dispatch and the wait for its tokens (on the CPU the dispatch computes it).
        self.scheduler.observe_step(step.out, step.dispatch_s + time.perf_counter() - began)
        outcome = self.scheduler.update_from_output(
            step.sampling, result.token_ids, result.logprobs, self.grammars.acceptor()
        )
        if step.verified is not None:
            verified = step.verified.result()
            self.scheduler.update_from_drafts(
                step.verified.items,
                verified.token_ids,
                verified.logprobs,
                verified.accepted,
                outcome,
                self.grammars.acceptor(),
            )
        if self._prompt_logprobs:
            self._attach_prompt_logprobs(outcome.updates)
        if step.beams is not None:
            self.beams.advance(step.beams, self.requests, self.scheduler, self.grammars, outcome)
        self._generated_tokens += outcome.num_tokens
        # Free what ended (also sequences preempted since this step launched: their blocks may be on the host).
        for group in self.scheduler.free_finished(outcome.ended):
            self.requests.remove(group.request_id)
        return list(outcome.updates.values())

    def _drop_prompt_logprobs(self, request: Request[BeamSearch]) -> None:
        self._prompt_logprobs.pop(request.group.request_id, None)

    def _take_prompt_logprobs(self) -> None:
        """Files the prompt logprobs the forward computed under their requests' prompt positions."""
        got = self.runner.take_prompt_logprobs()
        if got is None:
            return
        row = 0
        for request_id, first, count, _k in got.spans:
            entries = self._prompt_logprobs.get(request_id)
            if entries is not None:
                entries[first : first + count] = got.entries[row : row + count]
            row += count

    def _attach_prompt_logprobs(self, updates: dict[str, RequestUpdate]) -> None:
        """A request's prompt logprobs go with its first update that carries tokens (its prompt has been
        computed whole by then: the step that samples its first token ran the prompt's last chunk). Scans
        the few requests that asked, not the step's every update."""
        for request_id in [r for r in self._prompt_logprobs if r in updates]:
            update = updates[request_id]
            if any(seq.token_ids for seq in update.seqs):
                update.prompt_logprobs = self._prompt_logprobs.pop(request_id)

    def _process(self, updates: list[RequestUpdate]) -> list[RequestDelta]:
        """Updates -> deltas; sequences a stop string ended are finished here (blocks freed at once)."""
        if not updates:
            return []
        processed = self.output_processor.process(updates)
        for hit in processed.stop_hits:
            self.finish_choice(hit.request_id, hit.index)
        return processed.deltas

    def use_output_stage(self, stage: OutputStage) -> None:
        """Hands the step's updates to `stage` from now on (before any request): the engine process uses it when
        the network process makes the deltas."""
        assert not self.requests, "the output stage changes only before the first request"
        self.output_processor = stage

    def finish_choice(self, request_id: str, index: int) -> None:
        """Ends one choice that a stop string ended (its blocks are freed at once); its later tokens, if any
        are in flight, are void to the output processor."""
        request = self.requests.get(request_id)
        if request is not None and self.scheduler.stop_choice(request.group, index):
            self.requests.remove(request_id)


def _ended(group: SequenceGroup, error: str | None = None, reason: FinishReason = "abort") -> RequestUpdate:
    """The update of a request the engine ended outside a step (abort, timeout, rejection, failure): every
    choice, forked or not yet (the output processor skips those already finished)."""
    seqs = [SeqUpdate(index, [], finish_reason=reason) for index in range(group.sampling_params.n)]
    return RequestUpdate(group.request_id, seqs, group.num_cached_tokens, group.first_scheduled_time, error)
