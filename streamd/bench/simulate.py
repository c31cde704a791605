"""Step-level simulations of KV memory under load, for the memory benchmark. No model, no torch.

It owns two simulators that consume the same request stream, one iteration per step, with a backlog
always waiting (the memory-bound regime the paper measures):
- `simulate_streamd`: the real Scheduler and BlockManager, with a stand-in for the forward pass;
- `simulate_orca`: iteration-level scheduling over a contiguous pool, each request reserving one
  contiguous region at admission (first fit) for its whole life, as in the paper's Orca baselines.
Both record, per step, the requests batched and how the pool's slots are used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from streamd.bench.workloads import MAX_SEQ_LEN, RequestStream
from streamd.config import SchedulerConfig
from streamd.engine.core.block_manager import BlockManager
from streamd.engine.core.scheduler import Scheduler
from streamd.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from streamd.engine.sampling_params import SamplingParams

Progress = Callable[[float], None]
_PARAMS = SamplingParams(max_tokens=None)
# Token ids of request i start at i * _ID_STRIDE, so no two requests share a cached prefix by accident.
_ID_STRIDE = 4096


@dataclass(slots=True)
class Meter:
    """Per-step sums; divided by the step count they are time averages."""

    pool_slots: int
    steps: int = 0
    batched: int = 0
    tokens: int = 0  # slots holding token states (prompt and generated tokens of admitted requests)
    reserved: int = 0  # slots held by admitted requests
    internal: int = 0  # held slots beyond the request's final length (never used)

    def add(self, batched: int, tokens: int, reserved: int, internal: int = 0) -> None:
        self.steps += 1
        self.batched += batched
        self.tokens += tokens
        self.reserved += reserved
        self.internal += internal

    def result(self, name: str, completed: int, **extra: int) -> dict[str, object]:
        steps, pool = max(self.steps, 1), self.pool_slots * max(self.steps, 1)
        return {
            "system": name,
            "steps": self.steps,
            "batched_requests": self.batched / steps,
            "token_state_share": self.tokens / max(self.reserved, 1),
            "pool": {
                "token_states": self.tokens / pool,
                "reserved_unfilled": (self.reserved - self.tokens - self.internal) / pool,
                "internal_fragmentation": self.internal / pool,
                "free": 1 - self.reserved / pool,
            },
            "completed_requests": completed,
            "requests_per_kstep": 1000 * completed / steps,
            **extra,
        }


def simulate_streamd(
    stream: RequestStream,
    steps: int,
    warmup: int,
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    progress: Progress,
) -> dict[str, object]:
    bm = BlockManager(num_blocks, block_size, num_swap_blocks=0)
    sched = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, "recompute"), bm, MAX_SEQ_LEN)
    meter, completed, next_req = Meter(num_blocks * block_size), 0, 0
    output_lens: dict[str, int] = {}  # request id -> its output length in the workload
    every = max(1, steps // 20)
    for step in range(steps):
        while sched.num_waiting < max_num_seqs:  # keep a backlog: memory, not arrivals, is the limit
            prompt_len, output_len = stream[next_req]
            base = next_req * _ID_STRIDE
            group = SequenceGroup(str(next_req), [Sequence(list(range(base, base + prompt_len)))], _PARAMS)
            output_lens[group.request_id] = output_len
            sched.add_seq_group(group)
            next_req += 1
        out = sched.schedule()
        sampling = [item for item in out.scheduled if item.samples]
        if step >= warmup:
            tokens = sum(g.seqs[0].num_tokens for g in sched.running)
            used = (num_blocks - bm.num_free_blocks()) * block_size
            meter.add(len(sched.running), tokens, used)
        sched.on_step_done(out)
        for item in sampling:  # the forward's sampled token; the value is irrelevant to memory
            seq = item.seq
            seq.append_token(0)
            if seq.num_output_tokens >= output_lens[item.group.request_id]:
                sched.finish_seqs([seq], SequenceStatus.FINISHED_LENGTH)
        done = sched.free_finished([item.group for item in sampling])
        for group in done:
            del output_lens[group.request_id]
        if step >= warmup:
            completed += len(done)
        if step % every == 0:
            progress(step / steps)
    stats = sched.stats()
    return meter.result(
        "streamd", completed, preemptions=stats.preemptions_recompute, recomputed_tokens=stats.recomputed_tokens
    )


class FirstFit:
    """A contiguous allocator over [0, size): sorted free extents, first fit, coalescing on free."""

    __slots__ = ("_free",)

    def __init__(self, size: int) -> None:
        self._free: list[list[int]] = [[0, size]]  # [start, length], sorted by start

    def alloc(self, length: int) -> int | None:
        for extent in self._free:
            if extent[1] >= length:
                start = extent[0]
                extent[0] += length
                extent[1] -= length
                if not extent[1]:
                    self._free.remove(extent)
                return start
        return None

    def free(self, start: int, length: int) -> None:
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < start:
            i += 1
        free.insert(i, [start, length])
        if i + 1 < len(free) and start + length == free[i + 1][0]:  # merge with the next extent
            free[i][1] += free.pop(i + 1)[1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == start:  # and with the previous one
            free[i - 1][1] += free.pop(i)[1]


def reservation(policy: str, prompt_len: int, output_len: int) -> int:
    """Slots an Orca baseline reserves for a request (paper §6.1)."""
    if policy == "max":
        return MAX_SEQ_LEN
    if policy == "pow2":  # over-reserves the output by at most 2x: 25 -> 32
        return prompt_len + (1 << (output_len - 1).bit_length())
    if policy == "oracle":
        return prompt_len + output_len
    raise ValueError(f"unknown reservation policy {policy!r}")


@dataclass(slots=True)
class _Reserved:
    prompt_len: int
    output_len: int
    start: int
    size: int
    generated: int = 0


def simulate_orca(
    policy: str,
    stream: RequestStream,
    steps: int,
    warmup: int,
    pool_slots: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    progress: Progress,
) -> dict[str, object]:
    pool = FirstFit(pool_slots)
    running: list[_Reserved] = []
    meter, completed, next_req = Meter(pool_slots), 0, 0
    every = max(1, steps // 20)
    for step in range(steps):
        budget = max_num_batched_tokens
        while len(running) < max_num_seqs:  # FCFS: the head either fits now or everyone waits
            prompt_len, output_len = stream[next_req]
            size = min(reservation(policy, prompt_len, output_len), MAX_SEQ_LEN)
            if prompt_len > budget and budget < max_num_batched_tokens:
                break
            start = pool.alloc(size)
            if start is None:
                break
            running.append(_Reserved(prompt_len, output_len, start, size))
            budget -= prompt_len
            next_req += 1
        if step >= warmup:
            tokens = sum(r.prompt_len + r.generated for r in running)
            reserved = sum(r.size for r in running)
            internal = sum(max(0, r.size - r.prompt_len - r.output_len) for r in running)
            meter.add(len(running), tokens, reserved, internal)
        still = []
        for r in running:
            r.generated += 1
            if r.generated >= r.output_len:
                pool.free(r.start, r.size)
                completed += step >= warmup
            else:
                still.append(r)
        running = still
        if step % every == 0:
            progress(step / steps)
    return meter.result(f"orca-{policy}", completed)
