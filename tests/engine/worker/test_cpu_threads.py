"""`model.num_threads`: applied to torch when an engine is built; 0 picks the usable cores less one."""

from __future__ import annotations

import os

import pytest
import torch

from streamd.engine.worker.cpu_threads import apply_num_threads, usable_cores


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
