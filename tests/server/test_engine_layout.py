"""Where `streamd serve` runs the engine: `engine.process` decided by the server (the config only holds the
setting, and never imports the engine to decide it)."""

from __future__ import annotations

import pytest

from streamd.config import load_config
from streamd.server.serve import engine_in_own_process


def test_engine_process_auto_is_on_without_tensor_parallelism(monkeypatch: pytest.MonkeyPatch) -> None:
    """`engine.process = "auto"` (the default) puts the engine in its own process on one GPU and on the CPU;
    under tensor parallelism it stays on a thread; a bool decides alone."""
    import torch

    assert engine_in_own_process(load_config(overrides={"model.device": "cpu"}, environ={})) is True
    assert engine_in_own_process(load_config(overrides={"model.device": "cpu", "engine.process": False},
                                             environ={})) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_in_own_process(load_config(environ={})) is True  # model.device "auto" resolves to cuda
    assert engine_in_own_process(load_config(overrides={"engine.process": False}, environ={})) is False
    assert engine_in_own_process(load_config(overrides={"parallel.tensor_parallel_size": 2}, environ={})) is False
