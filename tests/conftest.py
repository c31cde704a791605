"""Shared fixtures: one converted default model per session, engines registered for the leak check that
ends every test (after each test every registered engine is idle and its KV pool is whole again)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

os.environ.setdefault("STREAMD_LOG_FORMAT", "console")

from tests.helpers import ENGINES, assert_pool_whole, register_engine


@pytest.fixture(autouse=True)
def _kv_leak_check() -> Iterator[None]:
    yield
    for engine in ENGINES:
        assert_pool_whole(engine)


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The default model converted to a safetensors directory (converted once, then cached on disk)."""
    from streamd.engine.model_loader import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def smol_llm():
    """The default model on CPU in float32 with a pool large enough for every test that shares it."""
    from streamd import LLM

    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=512, max_num_batched_tokens=256,
              num_swap_blocks=0)
    register_engine(llm.engine)
    return llm


@pytest.fixture(scope="session")
def hf_smol(smol_dir: Path):
    """The same weights as `smol_llm`, loaded by plain transformers for reference outputs."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
