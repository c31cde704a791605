"""`cache.host_cache_gib`: set, it is taken as is; unset, the host tier gets 20% of the RAM available at start
on CUDA, at most 32 GiB, and within what a container's cgroup memory limit leaves; on the CPU none (the device
pool is host memory already)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamd.config import CacheConfig
from streamd.engine import builder
from streamd.engine.worker.cache_engine import KVLayout

GIB = 2**30
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float16)
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def blocks_of(gib: float) -> int:
    return int(gib * GIB) // LAYOUT.bytes_per_block


@pytest.fixture
def ram(monkeypatch: pytest.MonkeyPatch):
    """Sets the RAM available now and the cgroup's room (bytes)."""

    def set_ram(available: int, cgroup_room: int = 1 << 62) -> None:
        monkeypatch.setattr(builder, "_ram_bytes", lambda pages: available)
        monkeypatch.setattr(builder, "_cgroup_room", lambda: cgroup_room)

    return set_ram


def test_a_set_size_is_taken_as_is(ram) -> None:
    ram(0)
    assert builder._host_cache_blocks(CacheConfig(host_cache_gib=1.5), LAYOUT, CPU) == blocks_of(1.5)


def test_unset_it_is_a_fifth_of_the_available_ram_on_cuda_at_most_32_gib_and_none_on_the_cpu(ram) -> None:
    ram(10 * GIB)
    assert builder._host_cache_blocks(CacheConfig(), LAYOUT, CUDA) == blocks_of(2.0)
    assert builder._host_cache_blocks(CacheConfig(), LAYOUT, CPU) == 0
    ram(1024 * GIB)
    assert builder._host_cache_blocks(CacheConfig(), LAYOUT, CUDA) == blocks_of(32.0)


def test_unset_it_stays_within_the_containers_memory_limit(ram) -> None:
    ram(1024 * GIB, cgroup_room=5 * GIB)
    assert builder._host_cache_blocks(CacheConfig(), LAYOUT, CUDA) == blocks_of(1.0)


def test_the_cgroup_room_is_its_limit_less_its_usage(tmp_path: Path) -> None:
    assert builder._cgroup_room(tmp_path) == 1 << 62  # no cgroup v2 files: unbounded
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text(f"{GIB}\n")
    assert builder._cgroup_room(tmp_path) == 1 << 62
    (tmp_path / "memory.max").write_text(f"{4 * GIB}\n")
    assert builder._cgroup_room(tmp_path) == 3 * GIB
