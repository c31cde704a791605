"""Shared fixtures: one converted default model per session, engines registered for the leak check that
ends every test (after each test every registered engine is idle and its KV pool is whole again)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import pytest_asyncio
from pytest_asyncio import is_async_test

os.environ.setdefault("STREAMD_LOG_FORMAT", "console")

from tests.helpers import ENGINES, assert_pool_whole, register_engine


@pytest.fixture(autouse=True)
def _kv_leak_check() -> Iterator[None]:
    yield
    for engine in ENGINES:
        assert_pool_whole(engine)


@pytest.fixture(autouse=True)
def _free_cuda_after(request: pytest.FixtureRequest) -> Iterator[None]:
    """A CUDA test's engines go with it: each froze itself out of the collector when it loaded (`heap.settle`)
    and holds reference cycles, so without this the next test's auto-sized KV pool found no GPU memory left."""
    yield
    if request.node.get_closest_marker("cuda") is not None:
        from streamd.bench.offline import free_cuda

        free_cuda()


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The default model converted to a safetensors directory (converted once, then cached on disk)."""
    from streamd.engine.worker.model_loader import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def smol_llm():
    """The default model on CPU in float32 with a pool large enough for every test that shares it; its weights
    dequantized (`model.quantization = "none"`), as `hf_smol`'s are: the engine's reference is transformers."""
    from streamd import LLM

    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=512, max_num_batched_tokens=256,
              num_swap_blocks=0, quantization="none")
    register_engine(llm.engine)
    return llm


@pytest.fixture(scope="session")
def hf_smol(smol_dir: Path):
    """The same weights as `smol_llm`, loaded by plain transformers for reference outputs."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Server and reliability tests share the session's event loop: the engine thread delivers to one loop."""
    marker = pytest.mark.asyncio(loop_scope="session")
    for item in items:
        path = str(item.path).replace("\\", "/")
        if is_async_test(item) and ("tests/server/" in path or "tests/reliability/" in path):
            item.add_marker(marker, append=False)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def async_engine(smol_llm):
    """One AsyncEngine over the shared model for every server and reliability test (one engine thread)."""
    from streamd.engine.client.async_engine import AsyncEngine

    engine = AsyncEngine(smol_llm.engine)
    engine.start()
    _LIVE_ASYNC.append(engine)
    yield engine
    _LIVE_ASYNC.remove(engine)
    await engine.shutdown()


_LIVE_ASYNC: list = []  # the session's AsyncEngine while its engine thread runs


@pytest.fixture(autouse=True)
def _engine_thread_parked(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that steps the shared engine offline (`smol_llm`, without `async_engine`) while the session's
    AsyncEngine thread runs: the thread is parked inside a call for the test's length. Otherwise, between
    publishing its last batch and waiting for the next command, it could find the test's offline request and
    step it beside the test (under load: a shape mismatch in the KV store, or a livelock)."""
    if not _LIVE_ASYNC or "smol_llm" not in request.fixturenames or "async_engine" in request.fixturenames:
        yield
        return
    from streamd.engine.client.loop import CallEngine

    parked, release = threading.Event(), threading.Event()

    def park(_engine: object) -> None:
        parked.set()
        release.wait()

    # (the loop only asks the future `done`, `set_result`, `set_exception`: a thread-safe one serves)
    _LIVE_ASYNC[0].engine_loop.put(CallEngine(park, Future()))  # type: ignore[arg-type]
    assert parked.wait(60), "the engine thread did not park"
    try:
        yield
    finally:
        release.set()
