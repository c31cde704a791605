"""The CPU this process runs on: its model name, and how many threads torch runs on (`model.num_threads`,
or by default as many as the other processes leave idle: `ThreadGovernor`).

The cores come from the CPU affinity mask (`os.sched_getaffinity`), which honours `taskset`, cgroups'
cpusets and Docker's `--cpuset-cpus`; torch's own default (every core of the machine) oversubscribes a
container. torch's OpenMP regions wait at a barrier for their slowest thread, so a thread descheduled by a
competing process stalls every operator: beside one busy process, two threads on two cores ran a decode 2-3x
slower than one; alone, two ran it 1.5x faster than one once the step was no longer bound by operator calls
(benchmarks/NOTES.md, "Issue 25"). So by default the engine measures: every half second it reads how busy its
cores were (/proc/stat) less its own process's CPU time, and runs on every core while the rest of the machine
leaves them idle, one core fewer for each core the rest keeps busy. Where there is no /proc/stat it keeps one
core free, as a fixed count would.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from streamd.logs import get_logger

log = get_logger(__name__)


def usable_core_ids() -> list[int]:
    """The cores this process may run on (the affinity mask where the OS has one, else every core)."""
    try:
        return sorted(os.sched_getaffinity(0)) or [0]
    except (AttributeError, OSError):  # macOS and Windows have no affinity mask
        return list(range(os.cpu_count() or 1))


def usable_cores() -> int:
    return len(usable_core_ids())


def fixed_default(cores: int) -> int:
    """Threads on `cores` cores without measuring: one core left to everything else (at least one thread)."""
    return max(1, cores - 1)


def apply_num_threads(configured: int) -> int:
    """Sets torch's intra-op threads (and inter-op threads, where torch still allows it) to `configured`,
    or when it is 0 to `usable_cores() - 1` (at least 1: what `ThreadGovernor` starts from); returns the count
    in effect."""
    threads = configured or fixed_default(usable_cores())
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # only settable once, before any inter-op work: a second engine keeps the first's
        pass
    log.info("cpu_threads", num_threads=threads, interop_threads=torch.get_num_interop_threads())
    return threads


# Other processes using less than this many cores in all (a client reading a stream, an idle server's
# housekeeping) leave the cores idle enough for every thread; each further core they use costs one thread.
IDLE_ENOUGH = 0.25
GOVERNOR_INTERVAL_S = 0.5


@dataclass(frozen=True, slots=True)
class CpuSample:
    """Cumulative CPU seconds: busy on this process's cores (every process), and this process's own."""

    busy_s: float
    own_s: float


def read_cpu_sample(cores: Sequence[int]) -> CpuSample | None:
    """Now's `CpuSample` from /proc/stat's per-core lines (busy = all but idle and iowait) and os.times();
    None where there is no /proc/stat."""
    wanted = {f"cpu{core}" for core in cores}
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            lines = [line.split() for line in fh if line.startswith("cpu")]
    except OSError:
        return None
    ticks = sum(sum(map(int, f[1:])) - int(f[4]) - int(f[5]) for f in lines if f[0] in wanted)
    own = os.times()
    return CpuSample(ticks / os.sysconf("SC_CLK_TCK"), own.user + own.system)


def threads_for(cores: int, others_busy: float) -> int:
    """Threads for `cores` cores while other processes keep `others_busy` cores busy."""
    return max(1, min(cores, cores - math.ceil(others_busy - IDLE_ENOUGH)))


class ThreadGovernor:
    """`model.num_threads = 0`: torch's threads follow how busy the rest of the machine keeps this process's
    cores (`threads_for`), re-decided every `interval_s` from the engine thread (torch's thread count is that
    thread's setting) at the start of a step. `read` and `clock` are injectable for tests."""

    def __init__(
        self,
        cores: Sequence[int],
        interval_s: float = GOVERNOR_INTERVAL_S,
        read: Callable[[Sequence[int]], CpuSample | None] = read_cpu_sample,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cores, self.interval_s, self._read, self._clock = tuple(cores), interval_s, read, clock
        self.threads = fixed_default(len(self.cores))  # what `apply_num_threads` set, until it has measured
        self._since = clock()
        self._last = read(self.cores)

    def tick(self) -> None:
        """Called before each step: re-decides once `interval_s` has passed since the last decision."""
        now = self._clock()
        if now - self._since < self.interval_s or self._last is None:
            return
        sample = self._read(self.cores)
        if sample is None:
            return
        others = (sample.busy_s - self._last.busy_s) - (sample.own_s - self._last.own_s)
        threads = threads_for(len(self.cores), max(0.0, others) / (now - self._since))
        self._since, self._last, self.threads = now, sample, threads
        if torch.get_num_threads() != threads:  # (set again where other code in this process changed it)
            torch.set_num_threads(threads)


def thread_governor(configured: int) -> ThreadGovernor | None:
    """The governor for `model.num_threads` (None: a fixed count was configured)."""
    return None if configured else ThreadGovernor(usable_core_ids())


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none, as on macOS)."""
    return _cpuinfo("model name")


def cpu_runs_bf16() -> bool:
    """Whether this CPU has native bfloat16 arithmetic (AVX-512 BF16 or AMX), from /proc/cpuinfo's flags: torch's
    low-bit kernels are fast only with bfloat16 activations there (`quantized.py`)."""
    return bool(set(_cpuinfo("flags").split()) & {"avx512_bf16", "amx_bf16"})


def _cpuinfo(key: str) -> str:
    """The first value of `key` in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith(key):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""
