"""Host data to device tensors without a sync: the one way the engine's modules (model runner, sampler, beam
search) move per-step host lists onto the device.

numpy builds the host tensor (from a flat list of ints, faster than `torch.tensor`: benchmarks/NOTES.md);
on CUDA it is pinned and copied with `non_blocking`, since a pageable copy would synchronise the stream.
On the CPU the host tensor is the result. A step's batch (`to_device_many`) travels as one pinned buffer and one
copy, its tensors views of the device's bytes: each pinned allocation and copy costs host time that a small
model's ~1 ms step cannot hide where the host waits for the device first (a step that drafts).
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
_TORCH_DTYPES = {np.dtype(v): k for k, v in _NUMPY_DTYPES.items()}
_ALIGN = 8  # bytes: every array starts where its elements may be viewed


def to_device(data: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`data` (a list, nested lists of equal length, or an array) as a `dtype` tensor on `device`."""
    host = torch.from_numpy(np.asarray(data, dtype=_NUMPY_DTYPES[dtype]))
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def to_device_many(arrays: list[np.ndarray], device: torch.device, one_copy: bool | None = None) -> list[torch.Tensor]:
    """`arrays` (int64, int32 or float32; any shape) as tensors on `device`: with `one_copy` (CUDA's default) one
    buffer (pinned on CUDA) and one copy, each tensor a view of its bytes there; else the arrays' own memory."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if not (device.type == "cuda" if one_copy is None else one_copy):
        return [torch.from_numpy(a).to(device) for a in arrays]
    offsets = np.cumsum([0] + [-(-a.nbytes // _ALIGN) * _ALIGN for a in arrays])
    host = torch.empty(int(offsets[-1]), dtype=torch.uint8, pin_memory=device.type == "cuda")
    staging = host.numpy()
    for a, start in zip(arrays, offsets):
        staging[start : start + a.nbytes] = a.reshape(-1).view(np.uint8)
    bytes_ = host.to(device, non_blocking=True)
    return [_view(bytes_, int(start), a) for a, start in zip(arrays, offsets)]


def _view(bytes_: torch.Tensor, start: int, array: np.ndarray) -> torch.Tensor:
    return bytes_[start : start + array.nbytes].view(_TORCH_DTYPES[array.dtype]).view(array.shape)
