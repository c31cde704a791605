"""The row-parallel layers' all-reduce (two per decoder layer): the group's backend, or torch's symmetric memory.

Why symmetric memory: a TP=2 decode step of an 8B model runs 64 all-reduces of 0.1-2 MiB inside its CUDA
graph. Captured NCCL costs 14-38 us each there; torch's symmetric-memory kernels (`one_shot_all_reduce`,
`two_shot_all_reduce`: each rank's buffer mapped into its peers, read and written over NVLink/P2P, no
multicast) 7-13 us (benchmarks/NOTES.md, issue 26). Everything else (the step's batch, eager steps larger
than the buffer, other dtypes) stays on the group.

Joining symmetric memory without torch's default group: its rendezvous finds a group by name in a per-process
registry that `_SymmetricMemory.set_group_info(name, rank, world, store)` fills (what
`enable_symm_mem_for_group` does for a registered ProcessGroup). The engine's groups are bare c10d backends
over its own TCP store (several engines per process), so each engine registers a name of its own (a uuid: the
registry never forgets a name) over a prefix of that store. torch 2.11 (the device's) resolves the name in
c10d's registry of ProcessGroups instead, so the name is also registered there, for a ProcessGroup wrapping
the engine's NCCL backend (`_register_process_group`), which this module keeps alive (`_REGISTERED`: that
registry holds groups weakly). On two H200s (torch 2.11) it runs: TP=2 1.51x TP=1, NCCL's 1.42x.

Capture-safe by construction: one buffer per rank (`scheduler.graph_rows()` x hidden size), allocated and
rendezvoused once at start and tried once (a host check of one small and one large sum); a call copies the
layer's output in and the sum back out on the current stream, with no host sync, so decode graphs capture it
like the NCCL call it replaces. One-shot (each rank reads every peer's whole buffer) up to
`ONE_SHOT_MAX_BYTES`, two-shot (reduce-scatter then all-gather through the buffers) above, where reading
every peer's whole tensor costs more than the second pass (the probe's 1-2 MiB rows).

Every rank must run the same kernels in the same order: the choice is made together (each rank's outcome
voted on the control group, `agree`), and per call it depends only on the tensor's size and dtype, which
are equal on every rank.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from streamd.engine.worker.parallel.collectives import Collectives
from streamd.logs import get_logger

log = get_logger(__name__)

NCCL = "nccl"
SYMM_MEM = "symm_mem"
AUTO = "auto"
ONE_SHOT_MAX_BYTES = 512 * 1024  # the probe: one-shot wins at 128 KiB, two-shot at 1 MiB and above
_SYMM_DTYPES = (torch.float32, torch.bfloat16)  # what torch's symmetric-memory reduction kernels take
_ALIGN_BYTES = 16  # whole 16-byte vectors: the kernels' widest access, and every hidden size in use

# The ProcessGroups registered for symmetric memory's rendezvous, by name, with the group each wraps: c10d's
# registry does not keep them alive. One per engine (a uuid name), until its group closes (`forget`).
_REGISTERED: dict[str, tuple[dist.ProcessGroup, Collectives]] = {}


def forget(group: Collectives) -> None:
    """Lets go of the wrappers over `group` (its rank closes it), and with them its backend and store."""
    for name in [name for name, (_, wrapped) in _REGISTERED.items() if wrapped is group]:
        del _REGISTERED[name]


Agree = Callable[[bool], bool]  # every rank's vote on this rank's outcome (`workers.all_agree`)


class LayerAllReduce(Protocol):
    """Sums a row-parallel layer's partial output over the ranks, in place; returns it."""

    @property
    def name(self) -> str:
        """Which all-reduce: "nccl", "gloo" or "symm_mem"."""
        ...

    def __call__(self, output: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class AllReducePlan:
    """What every rank needs to build the same all-reduce; made by rank 0, sent to the workers."""

    mode: str  # parallel.all_reduce
    group_name: str  # symmetric memory's name for this engine's ranks (unique per engine)
    max_numel: int  # the largest output the buffer holds: the graphs' rows x hidden size


@dataclass(frozen=True, slots=True)
class GroupAllReduce:
    """The group's own all-reduce (NCCL on CUDA, gloo on the CPU)."""

    group: Collectives
    name: str = NCCL

    def __call__(self, output: torch.Tensor) -> torch.Tensor:
        self.group.allreduce(output).wait()  # raises when a rank is gone or the group's timeout passes
        return output


def plan_all_reduce(mode: str, device: torch.device, max_rows: int, hidden_size: int) -> AllReducePlan:
    """Rank 0, before any worker starts: refuses `symm_mem` off CUDA (ValueError, with the reason)."""
    if mode == SYMM_MEM and device.type != "cuda":
        raise ValueError(
            f'parallel.all_reduce = "symm_mem" needs CUDA GPUs (torch\'s symmetric memory maps GPU buffers '
            f'between the ranks); this engine runs on {device.type}: use "auto" or "nccl"'
        )
    return AllReducePlan(mode, f"streamd-tp-{uuid.uuid4().hex}", max_rows * hidden_size)


@dataclass(frozen=True, slots=True)
class RankContext:
    """One rank's side of choosing the all-reduce: who it is, where its tensors live, how it votes."""

    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype  # the model's: the partial outputs' dtype
    store: dist.Store  # the engine's own store (symmetric memory's rendezvous runs over a prefix of it)
    agree: Agree


def build_all_reduce(plan: AllReducePlan, group: Collectives, ctx: RankContext) -> LayerAllReduce:
    """Every rank, together (a collective when symmetric memory is tried): the layers' all-reduce.
    `auto` falls back to the group with one log line (rank 0) saying why; `symm_mem` raises instead."""
    fallback = GroupAllReduce(group, NCCL if ctx.device.type == "cuda" else "gloo")
    if plan.mode == NCCL:
        return fallback
    unsupported = _unsupported(ctx.device, ctx.dtype)
    symm, reason = (None, unsupported) if unsupported else _start_symm_mem(plan, fallback, ctx)
    if symm is not None:
        if ctx.rank == 0:
            log.info("tensor_parallel.all_reduce", kind=SYMM_MEM, buffer_mib=round(symm.buffer_bytes / 2**20, 2))
        return symm
    if plan.mode == SYMM_MEM:
        raise RuntimeError(f'parallel.all_reduce = "symm_mem" could not start: {reason}')
    if ctx.rank == 0:  # info where symmetric memory does not apply, a warning where it failed
        report = log.info if unsupported else log.warning
        report("tensor_parallel.all_reduce_fallback", kind=fallback.name, reason=reason)
    return fallback


def _unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why symmetric memory cannot serve this engine, decided alike on every rank (no vote needed)."""
    if device.type != "cuda":
        return f"symmetric memory needs CUDA; the ranks run on {device.type}"
    if dtype not in _SYMM_DTYPES:
        return f"torch's symmetric-memory all-reduce takes float32 and bfloat16, not {dtype}"
    return None


def _start_symm_mem(
    plan: AllReducePlan, fallback: GroupAllReduce, ctx: RankContext
) -> tuple[SymmMemAllReduce | None, str]:
    """Allocates, rendezvouses and tries the buffer; (None, why) unless every rank succeeded at each stage."""
    buffer, error = _attempt(lambda: _allocate(plan, fallback.group, ctx))
    if not ctx.agree(buffer is not None):
        return None, error or "another rank could not allocate its symmetric-memory buffer"
    symm, error = _attempt(lambda: _rendezvous(plan, buffer, fallback, ctx))
    if not ctx.agree(symm is not None):
        return None, error or "another rank's symmetric-memory rendezvous or trial sum failed"
    return symm, ""


def _attempt(make: Callable[[], Any]) -> tuple[Any, str]:
    """`make()`, or None and the error's text (a failure is voted on, then logged or raised by the caller)."""
    try:
        return make(), ""
    except (RuntimeError, ImportError, AttributeError, TypeError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _allocate(plan: AllReducePlan, group: Collectives, ctx: RankContext) -> torch.Tensor:
    """Registers the engine's group with symmetric memory and allocates this rank's buffer (no collective)."""
    from torch._C._distributed_c10d import _SymmetricMemory

    store = dist.PrefixStore("symm_mem", ctx.store)
    _SymmetricMemory.set_group_info(plan.group_name, ctx.rank, ctx.world, store)
    _register_process_group(plan.group_name, group, ctx, dist.PrefixStore("symm_mem_group", ctx.store))
    device = ctx.device if ctx.device.index is not None else torch.device("cuda", torch.cuda.current_device())
    return _SymmetricMemory.empty_strided_p2p((plan.max_numel,), (1,), ctx.dtype, device, plan.group_name)


def _register_process_group(
    name: str, group: Collectives, ctx: RankContext, store: dist.Store, device: str = "cuda"
) -> None:
    """Registers a ProcessGroup over the engine's backend (NCCL; gloo in the CPU test) under `name` in c10d's
    registry as well: torch 2.11's rendezvous (the device's) resolves the name there, not in symmetric memory's
    own group info ("Could not resolve the process group registered under the name ...", measured 2026-11-27).
    The registry holds its groups weakly, so the wrapper is kept in `_REGISTERED` ("has already been
    destroyed", the second GPU run)."""
    from torch._C._distributed_c10d import _register_process_group as register

    wrapper = dist.ProcessGroup(store, ctx.rank, ctx.world)
    kind = dist.ProcessGroup.BackendType.NCCL if device == "cuda" else dist.ProcessGroup.BackendType.GLOO
    wrapper._register_backend(torch.device(device), kind, cast(Any, group))
    wrapper._set_default_backend(kind)
    register(cast(Any, name), wrapper)  # (typed as c10d's GroupName, a str)
    _REGISTERED[name] = (wrapper, group)


def _rendezvous(
    plan: AllReducePlan, buffer: torch.Tensor, fallback: GroupAllReduce, ctx: RankContext
) -> SymmMemAllReduce:
    """Maps every peer's buffer (a collective over the store), then checks one one-shot and one two-shot sum."""
    from torch._C._distributed_c10d import _SymmetricMemory

    _SymmetricMemory.rendezvous(buffer, plan.group_name)
    symm = SymmMemAllReduce(plan.group_name, buffer, ctx.world, fallback)
    largest = plan.max_numel - plan.max_numel % 16  # (16 elements: whole 16-byte vectors in either dtype)
    for numel in (16, largest):  # a one-shot sum, and the largest it serves (two-shot past 512 KiB)
        _trial_sum(symm, numel, ctx.rank, ctx.world)
    return symm


def _trial_sum(symm: SymmMemAllReduce, numel: int, rank: int, world: int) -> None:
    """Every rank adds rank + 1 everywhere: the sum is known. A host sync, at start only."""
    trial = torch.full((numel,), float(rank + 1), dtype=symm.buffer.dtype, device=symm.buffer.device)
    symm(trial)
    want = world * (world + 1) / 2
    if not bool((trial == want).all()):
        raise RuntimeError(f"a trial symmetric-memory sum of {numel} elements was wrong (want {want} everywhere)")


class SymmMemAllReduce:
    """torch's symmetric-memory all-reduce over one static buffer per rank (module docstring); outputs it
    cannot take (larger than the buffer, another dtype, not contiguous or not whole 16-byte vectors) go to
    `fallback`, the same way on every rank."""

    name = SYMM_MEM

    def __init__(
        self, group_name: str, buffer: torch.Tensor, world: int, fallback: LayerAllReduce, ops: Any = None
    ) -> None:
        ops = torch.ops.symm_mem if ops is None else ops  # (a test passes stand-ins: the kernels need GPUs)
        self.ops = ops
        self.group_name = group_name
        self.buffer = buffer  # this rank's symmetric buffer, flat; never reallocated (graphs hold its address)
        self.fallback = fallback
        self.one_shot_calls = 0  # (tests and profiling read these: which path the layers took)
        self.two_shot_calls = 0
        # Newer torch fuses the copy in (one_shot_all_reduce_copy_out) and writes a two-shot sum straight to
        # its output (two_shot_all_reduce_out, for 2, 4 or 8 ranks); without them: a copy kernel each.
        self._copy_in_one_shot = hasattr(ops, "one_shot_all_reduce_copy_out")
        self._two_shot_out = hasattr(ops, "two_shot_all_reduce_out") and world in (2, 4, 8)

    @property
    def buffer_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def takes(self, output: torch.Tensor) -> bool:
        nbytes = output.numel() * output.element_size()
        return (
            output.dtype == self.buffer.dtype
            and output.numel() <= self.buffer.numel()
            and output.is_contiguous()
            and nbytes % _ALIGN_BYTES == 0
        )

    def __call__(self, output: torch.Tensor) -> torch.Tensor:
        if not self.takes(output):
            return self.fallback(output)
        flat = output.view(-1)
        staged = self.buffer[: flat.numel()]
        if flat.numel() * flat.element_size() <= ONE_SHOT_MAX_BYTES:
            self._one_shot(staged, flat)
        else:
            self._two_shot(staged, flat)
        return output

    def _one_shot(self, staged: torch.Tensor, flat: torch.Tensor) -> None:
        """Each rank reads every peer's staged copy and writes the sum to `flat` (a thread reads its elements
        of `flat` before the kernel's barrier and writes them after it, so `flat` may be both)."""
        self.one_shot_calls += 1
        ops = self.ops
        if self._copy_in_one_shot:
            ops.one_shot_all_reduce_copy_out(staged, flat, "sum", self.group_name, flat)
        else:
            staged.copy_(flat)
            ops.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)

    def _two_shot(self, staged: torch.Tensor, flat: torch.Tensor) -> None:
        """Each rank sums its 1/N slice of every peer's copy, then gathers every slice's sum."""
        self.two_shot_calls += 1
        ops = self.ops
        staged.copy_(flat)
        if self._two_shot_out:
            ops.two_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        else:
            ops.two_shot_all_reduce_(staged, "sum", self.group_name)
            flat.copy_(staged)
