"""The process group of the tensor-parallel ranks, typed by the two collectives the engine calls on it.

`workers` builds its groups as c10d backends (`ProcessGroupNCCL`, `ProcessGroupGloo`) over its own store,
not as torch's `ProcessGroup` wrappers, so that several engines can live in one process. torch's stubs
declare the collectives on `ProcessGroup` only; the backends have them too (the same bindings), and this
Protocol is what the layers' all-reduce (`shard`) and the step broadcast (`step_message`) rely on.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class Collectives(Protocol):
    def allreduce(self, tensor: torch.Tensor) -> dist.Work:
        """Sums `tensor` over the ranks in place (completed by the returned work's `wait()`)."""
        ...

    def broadcast(self, tensor: torch.Tensor, root: int) -> dist.Work:
        """Copies rank `root`'s `tensor` into every rank's (completed by the returned work's `wait()`)."""
        ...
