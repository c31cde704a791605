"""Host data to device tensors without a sync: the one way the engine's modules (model runner, sampler, beam
search) move per-step host lists onto the device.

numpy builds the host tensor (from a flat list of ints, faster than `torch.tensor`: benchmarks/NOTES.md);
on CUDA it is pinned and copied with `non_blocking`, since a pageable copy would synchronise the stream.
On the CPU the host tensor is the result.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def to_device(data: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`data` (a list, nested lists of equal length, or an array) as a `dtype` tensor on `device`."""
    host = torch.from_numpy(np.asarray(data, dtype=_NUMPY_DTYPES[dtype]))
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
