"""Choosing the layers' all-reduce (`parallel.all_reduce`) on the CPU: "auto" takes the group's backend
(gloo) and says why in one log line, "symm_mem" is refused before any worker starts, an unknown value is a
config error; and the symmetric-memory path's own work (which outputs it takes, one-shot or two-shot by size,
the copies in and out with and without newer torch's fused ops), checked with stand-in kernels that sum a
two-rank group whose ranks hold equal outputs. The kernels themselves run in test_tensor_parallel_cuda.py."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from structlog.testing import capture_logs

from streamd import LLM
from streamd.config import ConfigError, load_config
from streamd.engine.worker.parallel.all_reduce import (
    ONE_SHOT_MAX_BYTES,
    GroupAllReduce,
    RankContext,
    SymmMemAllReduce,
    build_all_reduce,
    plan_all_reduce,
)
from tests.engine.worker.tp_models import save_random_model

CPU = torch.device("cpu")


def _gloo() -> dist.ProcessGroupGloo:
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))


def _context(device: torch.device = CPU, dtype: torch.dtype = torch.float32) -> RankContext:
    def agree(ok: bool) -> bool:
        raise AssertionError("no vote is needed where symmetric memory does not apply")

    return RankContext(0, 1, device, dtype, dist.HashStore(), agree)


def test_auto_on_the_cpu_is_the_group_backend_with_the_reason_logged() -> None:
    group = _gloo()
    with capture_logs() as logs:
        chosen = build_all_reduce(plan_all_reduce("auto", CPU, 8, 64), group, _context())
    assert isinstance(chosen, GroupAllReduce) and chosen.name == "gloo" and chosen.group is group
    [line] = [entry for entry in logs if entry["event"] == "tensor_parallel.all_reduce_fallback"]
    assert line["kind"] == "gloo" and "needs CUDA" in line["reason"]
    summed = chosen(torch.ones(4))
    assert torch.equal(summed, torch.ones(4))  # (one rank: the sum is the tensor)


def test_nccl_is_taken_as_asked_without_a_log_line() -> None:
    with capture_logs() as logs:
        chosen = build_all_reduce(plan_all_reduce("nccl", CPU, 8, 64), _gloo(), _context())
    assert isinstance(chosen, GroupAllReduce) and logs == []


def test_auto_with_float16_on_cuda_falls_back_without_touching_symmetric_memory() -> None:
    """Decided from the dtype alone (the kernels take float32 and bfloat16), alike on every rank: no vote."""
    cuda = torch.device("cuda", 0)
    with capture_logs() as logs:
        chosen = build_all_reduce(plan_all_reduce("auto", cuda, 8, 64), _gloo(), _context(cuda, torch.float16))
    assert chosen.name == "nccl"
    assert "float16" in logs[0]["reason"]


def test_symm_mem_is_refused_on_the_cpu_before_any_worker_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match='parallel.all_reduce = "symm_mem" needs CUDA'):
        plan_all_reduce("symm_mem", CPU, 8, 64)
    path = save_random_model("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match='parallel.all_reduce = "symm_mem" needs CUDA.*use "auto" or "nccl"'):
        LLM(str(path), tensor_parallel_size=2, device="cpu", dtype="float32", num_kv_blocks=8, all_reduce="symm_mem")


def test_the_config_key_takes_three_values() -> None:
    assert load_config(None, {}).parallel.all_reduce == "auto"
    assert load_config(None, {"all_reduce": "symm_mem"}).parallel.all_reduce == "symm_mem"
    with pytest.raises(ConfigError, match="parallel.all_reduce"):
        load_config(None, {"parallel.all_reduce": "custom"})


class _TwoEqualRanks:
    """torch.ops.symm_mem's all-reduces as two ranks holding equal outputs see them (the sum is twice the
    staged copy); `fused`: newer torch's copy-in one-shot and two-shot-to-output ops exist."""

    def __init__(self, fused: bool) -> None:
        self.calls: list[str] = []
        if fused:
            self.one_shot_all_reduce_copy_out = self._one_shot_copy_out
            self.two_shot_all_reduce_out = self._two_shot_out

    def one_shot_all_reduce_out(self, staged: torch.Tensor, op: str, group: str, out: torch.Tensor) -> torch.Tensor:
        self.calls.append("one_shot_out")
        return out.copy_(2 * staged)

    def two_shot_all_reduce_(self, staged: torch.Tensor, op: str, group: str) -> torch.Tensor:
        self.calls.append("two_shot_")
        return staged.mul_(2)

    def _one_shot_copy_out(
        self, staged: torch.Tensor, local: torch.Tensor, op: str, group: str, out: torch.Tensor
    ) -> torch.Tensor:
        self.calls.append("one_shot_copy_out")
        staged.copy_(local)
        return out.copy_(2 * staged)

    def _two_shot_out(self, staged: torch.Tensor, op: str, group: str, out: torch.Tensor) -> torch.Tensor:
        self.calls.append("two_shot_out")
        return out.copy_(2 * staged)


class _Fallback:
    """The group's all-reduce, recording what it was given."""

    name = "nccl"

    def __init__(self) -> None:
        self.taken: list[tuple[int, ...]] = []

    def __call__(self, output: torch.Tensor) -> torch.Tensor:
        self.taken.append(tuple(output.shape))
        return output


@pytest.mark.parametrize("fused", [True, False])
def test_symm_mem_path_by_size_and_dtype(fused: bool) -> None:
    hidden, rows = 64, 4096  # the buffer: 4096 x 64 float32 = 1 MiB
    ops, fallback = _TwoEqualRanks(fused), _Fallback()
    symm = SymmMemAllReduce("g", torch.full((rows * hidden,), -1.0), 2, fallback, ops)
    small = torch.randn(1, 8, hidden)  # 2 KiB: one-shot
    large = torch.randn(1, (ONE_SHOT_MAX_BYTES // (4 * hidden)) + 8, hidden)  # past 512 KiB: two-shot
    for partial in (small, large):
        want = 2 * partial
        assert symm(partial) is partial and torch.equal(partial, want)  # summed in place, the same tensor back
    assert (symm.one_shot_calls, symm.two_shot_calls) == (1, 1)
    fused_calls = ["one_shot_copy_out", "two_shot_out"]
    assert ops.calls == (fused_calls if fused else ["one_shot_out", "two_shot_"])
    too_many_rows, other_dtype, ragged = torch.ones(rows + 1, hidden), torch.ones(8, hidden).bfloat16(), torch.ones(3)
    for output in (too_many_rows, other_dtype, ragged, torch.ones(hidden, 8).t()):
        symm(output)
    assert fallback.taken == [(rows + 1, hidden), (8, hidden), (3,), (8, hidden)]
    assert (symm.one_shot_calls, symm.two_shot_calls) == (1, 1)


def test_the_registered_group_outlives_its_maker_and_resolves_by_name() -> None:
    """torch 2.11's symmetric-memory rendezvous looks its group up by name in c10d's registry, which holds groups
    weakly: the wrapper over the engine's backend must stay alive after registering (the second two-GPU run found
    it "already destroyed"). gloo stands in for NCCL."""
    import gc
    import uuid

    from torch._C._distributed_c10d import _resolve_process_group

    from streamd.engine.worker.parallel import all_reduce

    name = f"test-{uuid.uuid4().hex}"
    context = RankContext(0, 1, CPU, torch.float32, dist.HashStore(), lambda ok: ok)
    backend = _gloo()
    all_reduce._register_process_group(name, backend, context, dist.HashStore(), device="cpu")  # type: ignore[arg-type]
    gc.collect()
    group = _resolve_process_group(name)  # type: ignore[arg-type]
    assert group.rank() == 0 and group.size() == 1
    summed = torch.ones(4)
    group.allreduce(summed).wait()  # the wrapper reaches the backend it was built over
    assert summed.tolist() == [1.0] * 4
    del group
    all_reduce.forget(backend)  # (what closing the rank's group does)
    assert name not in all_reduce._REGISTERED
