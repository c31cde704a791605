"""`to_device_many`: a step's host arrays as device tensors through one pinned buffer and one copy, each tensor a
view of its own bytes (every dtype and shape the model runner sends, empty ones and odd lengths between them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamd.engine.worker.host_to_device import to_device, to_device_many

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# (device, one_copy): the CPU's own path, the one-buffer path on the CPU (what CUDA runs, but for the pinning), CUDA
CASES = [("cpu", None), ("cpu", True), pytest.param("cuda", None, marks=CUDA)]


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.integers(-(2**40), 2**40, 5, dtype=np.int64),
        rng.integers(-(2**20), 2**20, (3, 7), dtype=np.int32),  # 84 bytes: the next array must start aligned
        np.zeros(0, dtype=np.int64),
        rng.integers(0, 9, 3, dtype=np.int32),
        rng.standard_normal(11).astype(np.float32),
        np.arange(6, dtype=np.int64)[::2],  # not contiguous
    ]


@pytest.mark.parametrize(("device", "one_copy"), CASES)
def test_each_array_arrives_whole_with_its_dtype_and_shape(device: str, one_copy: bool | None) -> None:
    arrays = _arrays()
    tensors = to_device_many(arrays, torch.device(device), one_copy)
    for array, tensor in zip(arrays, tensors, strict=True):
        assert tensor.device.type == device and tensor.shape == array.shape
        want = to_device(array, tensor.dtype, torch.device(device))
        assert tensor.dtype == want.dtype and torch.equal(tensor.cpu(), want.cpu())
    tensors[0][1] = -1  # writable, and a write lands in that tensor alone
    assert tensors[0][1].item() == -1 and torch.equal(tensors[1].cpu(), torch.from_numpy(arrays[1]))
