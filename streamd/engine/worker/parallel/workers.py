"""Starting the tensor-parallel ranks: rendezvous, process groups, and the worker ranks' loop.

Rank 0 is the engine process. It loads the model, checks that it splits evenly, opens a TCP store on a
free localhost port and spawns ranks 1..N-1 (`torch.multiprocessing`, spawn context, daemon processes).
Every rank joins two process groups over that store: `collectives` (NCCL on CUDA: the layers' all-reduces
and the step's batch) fails a collective after `parallel.collective_timeout_s`; `control` (always gloo,
host memory: the step's header and cache orders, and the ranks' agreement on graph capture) waits without
such a limit, because an idle engine sends nothing for as long as no request comes. Right after joining,
the ranks choose the layers' all-reduce together (`all_reduce.py`: torch's symmetric memory over a prefix of
the same store where it starts on every rank, else `collectives`; `parallel.all_reduce`). A worker fuses its
layers as rank 0 does, and captures its decode graphs when rank 0 says CAPTURE, so every rank runs the
same kernels at the same pace. A worker that dies closes
its sockets, so the next collective fails at once; one that hangs fails the all-reduces by the timeout.
A worker whose rank 0 goes away fails its next receive and exits.

Shutdown: on SHUTDOWN every rank destroys its decode graphs, then shuts its groups down (`close_group`),
rank 0 right after sending SHUTDOWN. The order matters on CUDA: NCCL frees a communicator only once no CUDA
graph holds its captured kernels, so a group dropped to its destructor with graphs alive hung the process.

`STREAMD_TP_HANG_DUMP_S=<seconds>` (debugging; `benchmarks/tp_device.sh` sets it for the CUDA test): a worker rank arms
`faulthandler.dump_traceback_later` at start, so a rank still running that long after it started dumps every
thread's Python stack to its stderr (again each period while it runs); the process goes on running.

`STREAMD_TP_PROFILE=<first step>:<steps>:<file prefix>` (profiling; `benchmarks/tp_profile.py` sets it): a worker
rank records its steps `first .. first + steps - 1` (counted from its first step message) with torch's profiler
and writes their Chrome trace to `<prefix>-rank<N>.json` when step `first + steps` arrives, so its GPU's timeline
can be read beside rank 0's.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import PretrainedConfig

from streamd.config import Config
from streamd.engine.worker.cache_engine import CacheEngine
from streamd.engine.worker.model_loader import LoadedModel, as_module, load_model, resolve_device, resolve_dtype
from streamd.engine.worker.model_runner import ModelRunner, kv_layout_of
from streamd.engine.worker.parallel.all_reduce import (
    AllReducePlan,
    LayerAllReduce,
    RankContext,
    build_all_reduce,
    forget,
    plan_all_reduce,
)
from streamd.engine.worker.parallel.collectives import Collectives
from streamd.engine.worker.parallel.shard import ShardSpec, planned_splits, shard_model
from streamd.engine.worker.parallel.step_message import Command, StepChannel, StepMessage, apply_order
from streamd.logs import get_logger

log = get_logger(__name__)

_HOST = "127.0.0.1"
_IDLE_TIMEOUT = datetime.timedelta(days=365)  # the step broadcast waits for the next request, however late


@dataclass(slots=True)
class Groups:
    collectives: Collectives  # the device's backend: all-reduces, the step's batch
    control: Collectives  # gloo on the host: step headers and cache orders, capture agreement


def close_group(group: Collectives, name: str, graceful: bool = True) -> None:
    """Shuts one of this rank's groups down explicitly (`graceful`: flushes and destroys; otherwise aborts,
    when a rank was lost) rather than leaving it to its destructor, which aborts (and warns) at exit. The
    layers' group goes only after the rank's decode graphs (module docstring). Failures are logged: this
    runs at shutdown."""
    backend = cast(dist.ProcessGroup, group)
    forget(group)  # (symmetric memory's wrapper over it, if any)
    try:
        backend.shutdown() if graceful else backend.abort()
    except RuntimeError as exc:
        log.warning("tensor_parallel.group_close_failed", group=name, error=str(exc))


def all_agree(group: Collectives, ok: bool, world: int) -> bool:
    """Whether every rank of `group` said `ok` (one all-reduce on the host)."""
    votes = torch.tensor([int(ok)], dtype=torch.int64)
    group.allreduce(votes).wait()
    return int(votes.item()) == world


@dataclass(slots=True)
class WorkerPool:
    """Rank 0's handle on the other ranks."""

    processes: list[BaseProcess]
    groups: Groups
    device: torch.device
    all_reduce: str = "nccl"  # the layers' all-reduce the ranks agreed on: "symm_mem", "nccl" or "gloo"

    def dead(self) -> list[int]:
        """Ranks whose process has exited."""
        return [rank for rank, p in enumerate(self.processes, start=1) if not p.is_alive()]

    def stop(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for the workers to exit, then terminates those still running."""
        for p in self.processes:
            p.join(timeout_s)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(timeout_s)


@dataclass(slots=True)
class WorkerArgs:
    rank: int
    world_size: int
    port: int
    config: Config
    model_config: PretrainedConfig | None
    all_reduce: AllReducePlan


def start_tensor_parallel(
    config: Config, model_config: PretrainedConfig | None, device: torch.device, dtype: torch.dtype
) -> tuple[LoadedModel, WorkerPool]:
    """Rank 0: loads and checks the model, starts the workers, and keeps shard 0 of the model."""
    world = config.parallel.tensor_parallel_size
    if device.type == "cuda" and config.cache.num_kv_blocks is None:
        raise ValueError(
            "parallel.tensor_parallel_size > 1 on CUDA needs cache.num_kv_blocks (the pool size of "
            "each rank): profiling the memory of every rank together is not implemented"
        )
    loaded = load_model(
        model_config or config.model.name, dtype, torch.device("cpu"), config.model.cache_dir, config.model.seed
    )
    planned_splits(loaded.model, world)  # refuses a model it cannot split before any worker starts
    hidden_size = loaded.model.config.get_text_config().hidden_size
    plan = plan_all_reduce(config.parallel.all_reduce, device, config.scheduler.graph_rows(), hidden_size)
    store = dist.TCPStore(_HOST, 0, world, is_master=True, wait_for_workers=False, timeout=_timeout(config))
    context = mp.get_context("spawn")
    processes: list[BaseProcess] = []
    for rank in range(1, world):
        process = context.Process(
            target=worker_main,
            name=f"streamd-tp-{rank}",
            daemon=True,
            args=(WorkerArgs(rank, world, store.port, config, model_config, plan),),
        )
        process.start()
        processes.append(process)
    groups = _connect(store, 0, world, config, device)
    all_reduce = _layer_all_reduce(plan, store, 0, world, groups, device, dtype)
    pool = WorkerPool(processes, groups, device, all_reduce.name)
    shard_model(loaded.model, ShardSpec(0, world, all_reduce))
    as_module(loaded.model).to(device)
    log.info("tensor_parallel.started", world_size=world, worker_pids=[p.pid for p in processes])
    return loaded, pool


def worker_main(args: WorkerArgs) -> None:
    """Ranks 1..N-1: load the shard, then run whatever rank 0 broadcasts until SHUTDOWN."""
    config = args.config
    _arm_hang_dump()
    device = _device_of(config, args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # graphs, streams and Triton launches use the current device
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    store = dist.TCPStore(_HOST, args.port, args.world_size, is_master=False, timeout=_timeout(config))
    groups = _connect(store, args.rank, args.world_size, config, device)
    dtype = resolve_dtype(config.model.dtype, device)
    all_reduce = _layer_all_reduce(args.all_reduce, store, args.rank, args.world_size, groups, device, dtype)
    runner = _load_shard(args, all_reduce, device, dtype)
    Worker(args, groups, runner).serve()


def _arm_hang_dump() -> None:
    """`STREAMD_TP_HANG_DUMP_S`: dump this worker's stacks after that many seconds (module docstring)."""
    seconds = os.environ.get("STREAMD_TP_HANG_DUMP_S")
    if seconds:
        faulthandler.dump_traceback_later(float(seconds), repeat=True)


def _layer_all_reduce(
    plan: AllReducePlan,
    store: dist.Store,
    rank: int,
    world: int,
    groups: Groups,
    device: torch.device,
    dtype: torch.dtype,
) -> LayerAllReduce:
    """The layers' all-reduce, chosen by every rank together right after `_connect` (`all_reduce.py`)."""
    control = groups.control
    context = RankContext(rank, world, device, dtype, store, lambda ok: all_agree(control, ok, world))
    return build_all_reduce(plan, groups.collectives, context)


def _load_shard(args: WorkerArgs, all_reduce: LayerAllReduce, device: torch.device, dtype: torch.dtype) -> ModelRunner:
    """This rank's shard on its device in `dtype`, its layers fused as rank 0's (`builder._kv_cache`)."""
    config = args.config
    loaded = load_model(
        args.model_config or config.model.name, dtype, torch.device("cpu"), config.model.cache_dir, config.model.seed
    )
    shard_model(loaded.model, ShardSpec(args.rank, args.world_size, all_reduce))
    as_module(loaded.model).to(device)
    runner = ModelRunner(loaded.model, device, config.cache.block_size)
    runner.fuse(config.model.fuse_layers)
    return runner


class Worker:
    """A worker rank's loop: each message from rank 0 carried out on this rank's shard."""

    def __init__(self, args: WorkerArgs, groups: Groups, runner: ModelRunner) -> None:
        self.args = args
        self.groups = groups
        self.runner = runner
        self.channel = StepChannel(groups.control, groups.collectives, runner.device)
        self.cache: CacheEngine | None = None

    def serve(self) -> None:
        profile = StepProfile.from_env(self.args.rank)
        while (message := self.channel.recv()).command != Command.SHUTDOWN:
            if message.command == Command.ALLOCATE:
                self._allocate(*message.args)
            elif message.command == Command.CAPTURE:
                self._capture(*message.args)
            else:
                profile.around_step()
                self._step(message)
        self.runner.release_graphs()  # before the groups: NCCL keeps a communicator that a graph holds
        close_group(self.groups.collectives, "collectives")
        close_group(self.groups.control, "control")

    def _allocate(self, num_blocks: int, num_swap_blocks: int) -> None:
        runner, args = self.runner, self.args
        dtype = next(runner.model.parameters()).dtype
        cache = args.config.cache
        layout = kv_layout_of(runner.model, cache.block_size, dtype, args.world_size, cache.kv_cache_dtype)
        self.cache = CacheEngine(layout, num_blocks, num_swap_blocks, runner.device, runner.ops)
        runner.bind_kv_cache(self.cache.pool)

    def _capture(self, max_batch: int, max_blocks: int) -> None:
        group, world = self.groups.control, self.args.world_size
        self.runner.capture_cuda_graphs(max_batch, max_blocks, True, lambda ok: all_agree(group, ok, world))

    def _step(self, message: StepMessage) -> None:
        assert self.cache is not None, "a step before ALLOCATE"
        for order in message.orders:
            apply_order(self.cache, order)
        if message.batch is not None:
            self.runner.run_layers(message.batch, message.graph_size)


class StepProfile:
    """`STREAMD_TP_PROFILE` (module docstring): torch's profiler around a window of a worker's steps."""

    def __init__(self, first: int = -1, steps: int = 0, path: str = "") -> None:
        self.first, self.last, self.path = first, first + steps, path
        self.seen = 0
        self.profiler: torch.profiler.profile | None = None

    @classmethod
    def from_env(cls, rank: int) -> StepProfile:
        spec = os.environ.get("STREAMD_TP_PROFILE")
        if not spec:
            return cls()
        first, steps, prefix = spec.split(":", 2)
        return cls(int(first), int(steps), f"{prefix}-rank{rank}.json")

    def around_step(self) -> None:
        """Called before each step: starts the profiler at the first step of the window, stops it after the last."""
        if self.seen == self.first:
            self.profiler = torch.profiler.profile(activities=_ACTIVITIES)
            self.profiler.start()
        elif self.seen == self.last and self.profiler is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.stop()
            self.profiler.export_chrome_trace(self.path)
            self.profiler = None
        self.seen += 1


_ACTIVITIES = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def _connect(store: dist.Store, rank: int, world: int, config: Config, device: torch.device) -> Groups:
    timeout = _timeout(config)
    return Groups(
        collectives=_group(dist.PrefixStore("collectives", store), rank, world, timeout, device),
        control=_group(dist.PrefixStore("control", store), rank, world, _IDLE_TIMEOUT, torch.device("cpu")),
    )


def _group(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta, device: torch.device) -> Collectives:
    """A process group of its own (not torch's global default group), so that several engines can live
    in one process: gloo on CPU, NCCL on CUDA. A c10d backend, whose collectives torch's stubs omit
    (`collectives`)."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return cast(Collectives, dist.ProcessGroupNCCL(store, rank, world, options))
    return cast(Collectives, dist.ProcessGroupGloo(store, rank, world, timeout))


def _device_of(config: Config, rank: int) -> torch.device:
    device = resolve_device(config.model.device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _timeout(config: Config) -> datetime.timedelta:
    return datetime.timedelta(seconds=config.parallel.collective_timeout_s)
