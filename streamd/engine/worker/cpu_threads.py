"""The CPU this process runs on: its model name, and how many threads torch runs on (`model.num_threads`,
or by default one per core this process may use, less one).

The cores come from the CPU affinity mask (`os.sched_getaffinity`), which honours `taskset`, cgroups'
cpusets and Docker's `--cpuset-cpus`; torch's own default (every core of the machine) oversubscribes a
container. One core is left to everything else (the server's event loop, the engine thread's Python
work, other processes): torch's OpenMP regions wait at a barrier for their slowest thread, so one thread
descheduled by a competing process stalls every operator (measurements: benchmarks/NOTES.md).
"""

from __future__ import annotations

import os

import torch

from streamd.logs import get_logger

log = get_logger(__name__)


def usable_cores() -> int:
    """Cores this process may run on (the affinity mask where the OS has one, else the core count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS and Windows have no affinity mask
        return max(1, os.cpu_count() or 1)


def apply_num_threads(configured: int) -> int:
    """Sets torch's intra-op threads (and inter-op threads, where torch still allows it) to `configured`,
    or when it is 0 to `usable_cores() - 1` (at least 1); returns the count in effect."""
    threads = configured or max(1, usable_cores() - 1)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # only settable once, before any inter-op work: a second engine keeps the first's
        pass
    log.info("cpu_threads", num_threads=threads, interop_threads=torch.get_num_interop_threads())
    return threads


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
