"""Tensor parallelism on two GPUs: greedy tokens of a random float32 model of Llama-3.2-1B's shape equal one
GPU's, with every rank's decode graphs captured (the all-reduces inside) and replayed, and equal again with
`parallel.cuda_graphs` off (eager decode on every rank); the layers' all-reduces through symmetric memory
(`parallel.all_reduce = "symm_mem"`: fails rather than falling back) and through NCCL. Run by
benchmarks/tp_device.sh and benchmarks/multi_gpu_device.sh symm."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from streamd import LLM, SamplingParams
from streamd.bench.offline import model_config
from streamd.bench.tensor_parallel import save_checkpoint
from tests.helpers import fold_deltas

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random float32 weights of Llama-3.2-1B's shape, saved (every rank loads the same weights)."""
    config = model_config("llama3.2-1b", max_len=1024)
    return save_checkpoint(config, tmp_path_factory.mktemp("llama1b"), dtype="float32")


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128256, (int(n),), generator=gen).tolist() for n in (5, 37, 200, 513)]


def _greedy(path: Path, **overrides: object) -> tuple[list[list[int]], int]:
    """Token ids of every prompt, and how many decode steps rank 0 served from a graph."""
    llm = LLM(str(path), dtype="float32", num_kv_blocks=512, max_num_seqs=8, **overrides)
    engine = llm.engine
    builders: dict = {}
    for i, ids in enumerate(_prompts()):
        engine.add_request(f"r{i}", ids, GREEDY)
    while engine.has_unfinished_requests():
        fold_deltas(engine.step(), builders)
    graphs = engine.runner.graphs
    replays = graphs.replays if graphs is not None else 0
    engine.executor.shutdown()
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return [builders[f"r{i}"].build().outputs[0].token_ids for i in range(len(builders))], replays


def test_tp2_greedy_equals_tp1_with_graphs_and_eager(checkpoint: Path) -> None:
    want, one_gpu_replays = _greedy(checkpoint)
    assert one_gpu_replays > 0
    for all_reduce in ("symm_mem", "nccl"):
        got, replays = _greedy(checkpoint, tensor_parallel_size=2, all_reduce=all_reduce)
        assert replays > 0, f"{all_reduce}: rank 0 never replayed a decode graph: capture under TP failed"
        assert got == want, all_reduce
    eager, eager_replays = _greedy(checkpoint, tensor_parallel_size=2, cuda_graphs=False, all_reduce="symm_mem")
    assert eager_replays == 0 and eager == want
