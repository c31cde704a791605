"""What `pip install .` asks for: triton only where triton exists (Linux x86_64/aarch64), and a CPU engine
that runs without it. The markers are evaluated with `packaging` against each platform's environment
(a `pip install --dry-run --platform macosx_14_0_arm64` needs the network, which CI may not have)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent

PLATFORMS = {  # platform -> (marker environment, whether triton is installable there)
    "macos-arm64": ({"sys_platform": "darwin", "platform_machine": "arm64"}, False),
    "macos-x86_64": ({"sys_platform": "darwin", "platform_machine": "x86_64"}, False),
    "windows": ({"sys_platform": "win32", "platform_machine": "AMD64"}, False),
    "linux-x86_64": ({"sys_platform": "linux", "platform_machine": "x86_64"}, True),
    "linux-aarch64": ({"sys_platform": "linux", "platform_machine": "aarch64"}, True),
}


def _requirements(platform: dict[str, str]) -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    env = {"python_version": "3.11", "python_full_version": "3.11.9", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "nt" if platform["sys_platform"] == "win32"
           else "posix", "platform_system": {"darwin": "Darwin", "win32": "Windows"}.get(platform["sys_platform"],
                                                                                          "Linux"), **platform}
    wanted = set()
    for dep in deps:
        req = Requirement(dep)
        if req.marker is None or req.marker.evaluate(env):
            wanted.add(req.name)
    return wanted


@pytest.mark.parametrize("name", PLATFORMS)
def test_triton_required_only_where_it_exists(name: str) -> None:
    platform, has_triton = PLATFORMS[name]
    wanted = _requirements(platform)
    assert ("triton" in wanted) == has_triton
    assert {"torch", "transformers", "starlette", "uvicorn", "websockets"} <= wanted


def test_cpu_engine_runs_without_triton() -> None:
    """The CPU path (engine, plain-torch kernels, server app) never imports triton."""
    code = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
from transformers import LlamaConfig
from streamd import LLM, SamplingParams
import streamd.server.app
config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
llm = LLM(config, device="cpu", num_kv_blocks=8, num_swap_blocks=0)
out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False))
assert len(out[0].outputs[0].token_ids) == 2
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def _declared() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {canonicalize_name(Requirement(d).name): Requirement(d) for d in project["dependencies"]}


def test_every_third_party_import_is_declared() -> None:
    """numpy, jinja2 and the rest: a module streamd imports comes from a dependency pyproject.toml names."""
    import importlib.metadata

    from tests.import_scan import imports, modules

    known = modules()
    top = {name.split(".")[0] for module, path in known.items() for name in imports(module, path, known)}
    third_party = top - set(sys.stdlib_module_names) - {"streamd", "__future__"}
    distributions = importlib.metadata.packages_distributions()
    declared = set(_declared())
    missing = {m for m in third_party if not {canonicalize_name(d) for d in distributions.get(m, [m])} & declared}
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"
    assert "jinja2" in declared  # chat templates render with it; transformers does not require it


def test_uvicorn_private_names_streamd_relies_on_still_exist() -> None:
    """server/ws/handshake.py subclasses uvicorn's sans-I/O websockets protocol and sets its private state;
    this fails when a uvicorn release moves any of it (then widen or fix the pinned range)."""
    import inspect

    import uvicorn
    from starlette.middleware.cors import CORSMiddleware
    from uvicorn._types import ASGISendEvent  # noqa: F401
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
    from websockets.server import ServerProtocol

    assert _declared()["uvicorn"].specifier.contains(uvicorn.__version__), uvicorn.__version__
    for method in ("data_received", "handle_events", "send"):
        assert callable(getattr(WebSocketsSansIOProtocol, method, None)), method
    source = inspect.getsource(WebSocketsSansIOProtocol)
    attributes = ("conn", "transport", "handshake_initiated", "handshake_complete", "close_sent", "close_timer", "loop",
                  "writable")  # (the last three: the bounded close)
    for attribute in attributes:
        assert f"self.{attribute} =" in source, attribute
    assert "self.close_timer = self.loop.call_later(" in source  # the unanswered close handshake.py aborts
    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

    assert callable(HttpToolsProtocol.on_headers_complete) and callable(HttpToolsProtocol.connection_lost)
    assert "self.cycle" in inspect.getsource(HttpToolsProtocol)  # (http/pipelining.py)
    # server/connections.py's gated protocol: the hooks it extends and the state it reads
    for method in ("connection_made", "data_received", "on_body", "on_message_complete", "_should_upgrade"):
        assert callable(getattr(HttpToolsProtocol, method, None)), method
    http = inspect.getsource(HttpToolsProtocol)
    for attribute in ("parser", "loop", "transport", "client", "flow"):
        assert f"self.{attribute} =" in http, attribute
    assert "self.read_paused =" in inspect.getsource(FlowControl) and STATUS_LINE[503]
    cycle = inspect.getsource(RequestResponseCycle)
    for attribute in ("disconnected", "message_event", "response_complete"):
        assert f"self.{attribute} =" in cycle, attribute
    assert "self.handshake_exc" in inspect.getsource(ServerProtocol)
    assert "def is_allowed_origin(self, origin: str)" in inspect.getsource(CORSMiddleware)  # app.OriginCors


def test_test_extras_install_everywhere() -> None:
    """vllm-router ships Linux wheels only: elsewhere the test extras must not ask for it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for spec in extras["test"] + extras["cluster"]:
        req = Requirement(spec)
        if req.name == "vllm-router":
            assert req.marker is not None and not req.marker.evaluate({"sys_platform": "darwin"})
