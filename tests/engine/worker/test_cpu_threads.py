"""`model.num_threads`: applied to torch when an engine is built; 0 starts from the usable cores less one and lets
`ThreadGovernor` follow how busy the other processes keep the cores."""

from __future__ import annotations

import os

import pytest
import torch

from streamd.engine.worker.cpu_threads import (
    CpuSample,
    ThreadGovernor,
    apply_num_threads,
    read_cpu_sample,
    threads_for,
    usable_cores,
)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_usable_cores_follow_the_affinity_mask() -> None:
    if hasattr(os, "sched_getaffinity"):
        assert usable_cores() == len(os.sched_getaffinity(0))
    assert usable_cores() >= 1


def test_explicit_and_automatic_thread_counts(restore_threads, monkeypatch: pytest.MonkeyPatch) -> None:
    assert apply_num_threads(1) == 1 and torch.get_num_threads() == 1
    monkeypatch.setattr("streamd.engine.worker.cpu_threads.usable_cores", lambda: 3)
    assert apply_num_threads(0) == 2 and torch.get_num_threads() == 2  # one core left to everything else
    monkeypatch.setattr("streamd.engine.worker.cpu_threads.usable_cores", lambda: 1)
    assert apply_num_threads(0) == 1


def test_engine_applies_the_setting(restore_threads) -> None:
    from transformers import LlamaConfig

    from streamd import LLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.set_num_threads(2)
    LLM(config, device="cpu", num_threads=1, num_kv_blocks=4, num_swap_blocks=0)
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("cores, others, threads", [(2, 0.0, 2), (2, 0.2, 2), (2, 0.3, 1), (2, 1.9, 1),
                                                     (1, 0.0, 1), (16, 3.5, 12), (16, 40.0, 1)])
def test_threads_follow_the_cores_the_other_processes_keep_busy(cores: int, others: float, threads: int) -> None:
    assert threads_for(cores, others) == threads


class FakeMachine:
    """/proc/stat and os.times() as a test drives them: cumulative seconds, and a clock."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 0.0, 0.0, 0.0

    def run(self, seconds: float, ours: float, others: float) -> None:
        """`seconds` pass with this process busy on `ours` cores and other processes on `others`."""
        self.now += seconds
        self.busy += (ours + others) * seconds
        self.own += ours * seconds

    def read(self, cores) -> CpuSample:
        return CpuSample(self.busy, self.own)


def test_the_governor_takes_every_core_while_the_others_are_idle_and_gives_one_back(restore_threads) -> None:
    machine = FakeMachine()
    governor = ThreadGovernor([0, 1], interval_s=0.5, read=machine.read, clock=lambda: machine.now)
    torch.set_num_threads(governor.threads)
    assert governor.threads == 1  # a fixed count's default until it has measured
    machine.run(0.3, ours=1.0, others=0.05)
    governor.tick()
    assert governor.threads == 1, "not re-decided before the interval"
    machine.run(0.3, ours=1.0, others=0.05)  # our own busy core is not the others'
    governor.tick()
    assert governor.threads == 2 and torch.get_num_threads() == 2
    machine.run(0.6, ours=1.4, others=0.6)  # a busy process took 0.6 of a core from our two threads
    governor.tick()
    assert governor.threads == 1 and torch.get_num_threads() == 1
    machine.run(0.6, ours=1.0, others=0.0)
    governor.tick()
    assert governor.threads == 2


def test_without_proc_stat_the_governor_keeps_the_fixed_default(restore_threads) -> None:
    clock = iter(range(100))
    governor = ThreadGovernor([0, 1, 2], read=lambda cores: None, clock=lambda: float(next(clock)))
    for _ in range(5):
        governor.tick()
    assert governor.threads == 2


def test_proc_stat_is_read_on_linux() -> None:
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat here")
    first = read_cpu_sample(sorted(os.sched_getaffinity(0)))
    sum(i * i for i in range(200_000))  # some CPU time of our own
    second = read_cpu_sample(sorted(os.sched_getaffinity(0)))
    assert first is not None and second is not None
    assert second.own_s >= first.own_s and second.busy_s >= first.busy_s
    none = read_cpu_sample([])
    assert none is not None and none.busy_s == 0.0  # only the cores asked for count


def test_an_automatic_count_gets_a_governor_and_a_fixed_one_does_not(restore_threads) -> None:
    from transformers import LlamaConfig

    from streamd import LLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    kwargs = dict(device="cpu", num_kv_blocks=4, num_swap_blocks=0)
    assert LLM(config, num_threads=1, **kwargs).engine.executor.threads is None
    governor = LLM(config, num_threads=0, **kwargs).engine.executor.threads
    assert isinstance(governor, ThreadGovernor) and governor.cores == tuple(sorted(os.sched_getaffinity(0)))


def test_the_executor_ticks_the_governor_before_each_step(restore_threads) -> None:
    """The governor decides on the engine thread, before a step's forward (torch's count is that thread's): a
    machine whose other processes fall idle takes the engine from one thread to both within a step."""
    from transformers import LlamaConfig

    from streamd import LLM, SamplingParams

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    llm = LLM(config, device="cpu", num_threads=0, num_kv_blocks=8, num_swap_blocks=0)
    executor = llm.engine.executor
    machine = FakeMachine()
    executor.threads = ThreadGovernor([0, 1], interval_s=0.5, read=machine.read, clock=lambda: machine.now)
    torch.set_num_threads(1)
    machine.run(1.0, ours=1.0, others=0.0)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False))
    assert executor.threads.threads == 2 and torch.get_num_threads() == 2
    assert llm.engine.stats().cpu_threads == 2
