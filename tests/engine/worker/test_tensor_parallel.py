"""Tensor parallelism on the CPU (gloo, two processes): greedy tokens equal one process and Hugging Face
`generate` on random Llama, Qwen2 (attention biases) and Qwen3 (q/k norm) models with GQA, through chunked
prefill, prefix-cache hits and preemption by swap and by recompute; the per-step message round-trips; a
model whose KV heads do not split is refused."""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from streamd import LLM, SamplingParams
from streamd.config import ConfigError, load_config
from streamd.engine.worker.fusion import FusedDecoder
from streamd.engine.worker.model_runner import ModelInput
from streamd.engine.worker.parallel import executor as executor_module
from streamd.engine.worker.parallel.all_reduce import GroupAllReduce, plan_all_reduce
from streamd.engine.worker.parallel.collectives import Collectives
from streamd.engine.worker.parallel.step_message import (
    CacheOrder,
    Command,
    OrderKind,
    StepMessage,
    decode,
    decode_header,
    encode,
)
from streamd.engine.worker.parallel.workers import WorkerArgs, _load_shard
from tests.engine.worker.tp_models import VOCAB, save_random_model
from tests.helpers import fold_deltas, hf_greedy, register_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, detokenize=False)


def _engine_args(mode: str, fuse: str = "off") -> dict:
    # 24 blocks of 8 tokens hold about 3 of these sequences at full length: most of the batch is preempted.
    # 16 tokens per step: the longer prompts are prefilled in chunks beside running decodes.
    return dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=24, max_num_batched_tokens=16,
                num_swap_blocks=64 if mode == "swap" else 0, preemption_mode=mode, watermark=0.0, seed=3,
                collective_timeout_s=120.0, fuse_layers=fuse)  # (a loaded 2-core box spawns slowly)


def _prompts() -> list[list[int]]:
    """Two system prompts of 2 blocks, each shared by several requests: the later ones hit the cache."""
    gen = torch.Generator().manual_seed(5)
    systems = [torch.randint(0, VOCAB, (16,), generator=gen).tolist() for _ in range(2)]
    return [systems[i % 2] + torch.randint(0, VOCAB, (int(n),), generator=gen).tolist()
            for i, n in enumerate(torch.randint(3, 30, (8,), generator=gen))]


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Half the requests first, the rest once those run: the later ones find the shared prefixes cached."""
    engine = llm.engine
    for i, ids in enumerate(prompts[:2]):
        engine.add_request(f"r{i}", ids, GREEDY)
    builders: dict = {}
    for step in range(10_000):
        if step == 4:
            for i, ids in enumerate(prompts[2:], start=2):
                engine.add_request(f"r{i}", ids, GREEDY)
        if step > 4 and not engine.has_unfinished_requests():
            break
        fold_deltas(engine.step(), builders)
    return [builders[f"r{i}"].build().outputs[0].token_ids for i in range(len(prompts))]


@pytest.fixture
def tp_llm() -> Iterator[list[LLM]]:
    """Tensor-parallel engines made by a test, shut down (workers stopped) after it."""
    made: list[LLM] = []
    yield made
    for llm in made:
        llm.engine.executor.shutdown()


def _counts(stats):
    """The stats without the tenants' measured queue waits (wall-clock, not the schedule)."""
    tenants = [dataclasses.replace(t, queue_seconds=0.0) for t in stats.scheduler.tenants]
    return dataclasses.replace(stats, scheduler=dataclasses.replace(stats.scheduler, tenants=tenants))


@pytest.mark.parametrize("kind,mode,fuse", [("llama", "swap", "reference"), ("qwen2", "recompute", "off"),
                                            ("qwen3", "swap", "reference")])
def test_tp2_matches_tp1_and_hf_generate(kind: str, mode: str, fuse: str, tmp_path: Path,
                                         tp_llm: list[LLM]) -> None:
    """`fuse`: every rank runs the fused layers (sharded QKV and gate/up merged, all-reduce hooks kept)."""
    path = save_random_model(kind, tmp_path / kind)
    prompts = _prompts()
    single = LLM(str(path), **_engine_args(mode, fuse))
    register_engine(single.engine)
    want = _run(single, prompts)
    llm = LLM(str(path), tensor_parallel_size=2, **_engine_args(mode, fuse))
    tp_llm.append(llm)
    register_engine(llm.engine)
    got = _run(llm, prompts)
    assert got == want
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i, ids in enumerate(prompts):
        assert got[i] == hf_greedy(reference, ids, GREEDY.max_tokens, None), f"{kind}: prompt {i} diverged"
    stats = llm.engine.stats()
    assert stats.kv.prefix_hit_tokens > 0, stats
    key = "preemptions_swap" if mode == "swap" else "preemptions_recompute"
    assert getattr(stats.scheduler, key) > 0, stats
    if mode == "swap":
        assert stats.kv.swapped_out_blocks > 0 and stats.kv.swapped_in_blocks > 0, stats
    assert _counts(stats) == _counts(single.engine.stats())  # the same schedule, step for step
    assert llm.engine.executor.workers.dead() == []


def test_kv_heads_not_divisible_are_refused(tmp_path: Path) -> None:
    path = save_random_model("qwen2", tmp_path / "qwen2")  # 2 KV heads
    with pytest.raises(ValueError, match="does not divide the model's num_key_value_heads"):
        LLM(str(path), tensor_parallel_size=4, device="cpu", dtype="float32", num_kv_blocks=8)


def test_tensor_parallel_size_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="parallel.tensor_parallel_size"):
        LLM(None, tensor_parallel_size=0)


def test_step_message_round_trip() -> None:
    batch = ModelInput(input_ids=torch.tensor([5, 6, 7, 9]), positions=torch.tensor([0, 1, 2, 8]),
                       slot_mapping=torch.tensor([16, 17, 18, 40]),
                       block_tables=torch.tensor([[2, 0], [3, 5]], dtype=torch.int32),
                       seq_lens=torch.tensor([3, 9], dtype=torch.int32),
                       query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
                       sample_idx=torch.tensor([2, 3]), decode_only=False)
    orders = [CacheOrder(OrderKind.SWAP_OUT, [(4, 0), (7, 1)]), CacheOrder(OrderKind.COPY, [(3, 5)]),
              CacheOrder(OrderKind.SWAP_IN, [(0, 4)])]
    message = decode(*encode(StepMessage(Command.STEP, orders, batch, graph_size=16), torch.device("cpu")))
    assert message.command == Command.STEP and message.orders == orders and message.graph_size == 16
    got = message.batch
    assert got is not None and got.decode_only is False
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        want = getattr(batch, name)
        assert torch.equal(getattr(got, name), want) and getattr(got, name).dtype == want.dtype, name
    control, payload = encode(StepMessage(Command.ALLOCATE, args=(12, 34)), torch.device("cpu"))
    assert payload is None and decode_header(control).payload_words == 0
    empty = decode(control, payload)
    assert empty.command == Command.ALLOCATE and empty.batch is None and empty.args == (12, 34)


def test_a_worker_fuses_its_shard_as_rank_0_does(tmp_path: Path) -> None:
    """The worker's loader applies `model.fuse_layers` to its shard (rank 0's builder does the same)."""
    path = save_random_model("llama", tmp_path / "llama")
    config = load_config(None, {"model.name": str(path), "device": "cpu", "dtype": "float32",
                                "fuse_layers": "reference"})
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    plan = plan_all_reduce("auto", torch.device("cpu"), 4, 64)
    # rank 1 of 2 (cutting needs no collective; the all-reduce group only runs in a forward)
    args = WorkerArgs(1, 2, 0, config, None, plan)
    runner = _load_shard(args, GroupAllReduce(group, "gloo"), torch.device("cpu"), torch.float32)
    assert isinstance(runner.model.model, FusedDecoder)
    assert runner.model.model.layers[0].qkv_proj.weight.shape[0] == (4 + 2 * 1) * 16  # its 4 q heads, 1 k, 1 v


def test_shutdown_releases_rank_0_graphs_before_its_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA test hung after its TP=2 run: it kept `runner.graphs` (whose model holds the NCCL group) past
    `executor.shutdown()`, so the group died in its destructor while graphs with captured all-reduces were
    alive, and NCCL's abort waits for those graphs forever. Shutdown now releases the graphs, then closes the
    groups explicitly, in that order; the worker does the same on SHUTDOWN and exits on its own."""
    path = save_random_model("llama", tmp_path / "llama")
    llm = LLM(str(path), tensor_parallel_size=2, **_engine_args("recompute"))
    engine = llm.engine
    prompts = _prompts()[:2]
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                        detokenize=False))
    while engine.has_unfinished_requests():
        engine.step()
    events: list[str] = []

    class Graphs:  # rank 0's decode graphs (no CUDA here): what the order of teardown is about
        replays = 0

        def release(self) -> None:
            events.append("graphs released")

    held = engine.runner.graphs = Graphs()  # type: ignore[assignment]  # held, as the CUDA test holds them
    real_close = executor_module.close_group

    def close_group(group: Collectives, name: str, graceful: bool = True) -> None:
        events.append(f"{name} closed" if graceful else f"{name} aborted")
        real_close(group, name, graceful)

    monkeypatch.setattr(executor_module, "close_group", close_group)
    engine.executor.shutdown()
    assert events == ["graphs released", "collectives closed", "control closed"]
    assert engine.runner.graphs is None and held.replays == 0
    [worker] = engine.executor.workers.processes
    assert worker.exitcode == 0, "the worker did not leave on its own after SHUTDOWN"


def test_a_worker_traces_the_window_of_steps_it_is_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         tp_llm: list[LLM]) -> None:
    """`STREAMD_TP_PROFILE=first:steps:prefix` (workers.py): the worker rank writes the Chrome trace of exactly that
    window of its steps, so its GPU's timeline can be read beside rank 0's (benchmarks/tp_profile.py)."""
    path = save_random_model("llama", tmp_path / "llama")
    monkeypatch.setenv("STREAMD_TP_PROFILE", f"1:2:{tmp_path}/trace")  # (spawned workers take the environment)
    llm = LLM(str(path), tensor_parallel_size=2, **_engine_args("recompute"))
    tp_llm.append(llm)
    engine = llm.engine
    engine.add_request("r", list(range(1, 12)), GREEDY)
    for _ in range(3):  # steps 0-2: the window (steps 1 and 2) is still open
        engine.step()
    assert not (tmp_path / "trace-rank1.json").exists()  # (step 3 has not been sent)
    engine.step()  # step 3 closes the window before it runs
    engine.executor.shutdown()  # (the worker reads every step before SHUTDOWN, then exits)
    events = json.loads((tmp_path / "trace-rank1.json").read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
