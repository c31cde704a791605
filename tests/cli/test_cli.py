"""The `streamd` command line as a user runs it (subprocesses): one-line errors naming what was wrong, no
traceback unless --debug, the port checked before the model loads, `streamd chat` finding the server the
same config describes, benchmarks writing outside the package, an example in every --help. No test here
loads a model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def streamd(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "streamd.cli.main", *args], capture_output=True, text=True,
                          env=environ, timeout=timeout, cwd=ROOT)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str, status: int = 2) -> None:
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]  # log records aside
    assert len(errors) == 1 and result.stderr.rstrip().endswith(errors[0]), result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.mark.parametrize("args, needles", [
    (["serve", "--set", "cache.block_size=7"], ["streamd serve: error:", "cache.block_size"]),
    (["serve", "--set", "no_equals_sign"], ["--set expects KEY=VALUE"]),
    (["serve", "--set", "cache.nope=1"], ["cache.nope"]),
    (["serve", "--config", "/no/such/streamd.toml"], ["/no/such/streamd.toml", "does not exist"]),
    (["chat", "--set", "server.port=70000"], ["streamd chat: error:", "server.port"]),
    (["generate", "--device", "tpu", "hi"], ["streamd generate: error:", "model.device"]),
    (["generate", "--threads", "-2", "hi"], ["model.num_threads"]),
    (["generate", "--model", "/no/such/model", "hi"], ["/no/such/model"]),
    (["bench", "throughput", "--device", "cpu", "--out", "streamd/results"], ["inside the streamd package"]),
    (["bench", "throughput", "--device", "cpu", "--repeats", "0"], ["--repeats"]),
    (["cluster", "--replicas", "0"], ["streamd cluster: error:", "--replicas"]),
])
def test_bad_settings_and_arguments_give_one_line(args: list[str], needles: list[str]) -> None:
    assert_one_line_error(streamd(*args), *needles)


def test_the_parser_imports_no_torch() -> None:
    """`streamd --help` and every refused argument answer at once: building the parser (each benchmark brings
    its arguments) imports neither torch nor transformers."""
    code = "import sys; from streamd.cli.main import build_parser; build_parser(); " \
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]


def test_debug_shows_the_traceback() -> None:
    result = streamd("serve", "--debug", "--set", "cache.block_size=7")
    assert result.returncode != 0 and "Traceback" in result.stderr and "cache.block_size" in result.stderr


def test_busy_port_is_refused_before_the_model_loads() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = streamd("serve", "--port", str(port), "--set", "model.name=/no/such/model")
    # The model path is wrong too, but the port is found first: nothing was loaded.
    assert_one_line_error(result, f"127.0.0.1:{port}", "in use")


def test_chat_finds_the_server_the_config_describes(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "streamd.toml"
    config.write_text(f'[server]\nhost = "0.0.0.0"\nport = {port}\n')
    result = streamd("chat", "--config", str(config), "--prompt", "hi")
    assert result.returncode == 1 and f"ws://127.0.0.1:{port}/v1/stream" in result.stderr
    result = streamd("chat", "--prompt", "hi", env={"STREAMD_SERVER__PORT": str(port)})
    assert f"127.0.0.1:{port}/v1/stream" in result.stderr


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["chat"], ["bench"], ["bench", "memory"],
                                     ["bench", "throughput"], ["bench", "serve"]])
def test_every_help_shows_an_example(command: list[str]) -> None:
    result = streamd(*command, "--help")
    assert result.returncode == 0
    assert "example:" in result.stdout and "  streamd " in result.stdout.split("example:")[1]


def test_benchmark_results_default_outside_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from streamd.bench.report import results_dir

    monkeypatch.chdir(ROOT)
    assert results_dir(None) == ROOT / "benchmarks" / "results"
    monkeypatch.chdir(tmp_path)  # not a checkout
    assert results_dir(None) == tmp_path / "streamd-results"
    assert results_dir(str(tmp_path / "x")) == tmp_path / "x"


@pytest.mark.parametrize("module", ["streamd.cli", "streamd.cli.main"])
def test_python_m_runs_the_command_line(module: str) -> None:
    """`python -m streamd.cli` works as the `streamd` script does; `-m streamd.cli.main` finds its module fresh
    (the package imports nothing, so runpy has nothing to warn about)."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", module, "serve", "--help"], capture_output=True, text=True,
                            env=environ, timeout=120, cwd=ROOT)
    assert result.returncode == 0 and "usage: streamd serve" in result.stdout
    assert "RuntimeWarning" not in result.stderr, result.stderr


def _server_imports(module: str) -> set[str]:
    import ast

    path = ROOT / "streamd" / "cli" / f"{module}.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found.update(n for n in names if n.startswith("streamd.server"))
    return found


def test_the_cli_reaches_the_server_only_through_its_entry_and_the_protocol() -> None:
    """`streamd serve` hands the configuration to the server's own entry point (`streamd.server.serve`); the chat
    client knows of the server only the WebSocket protocol's name."""
    assert _server_imports("serve") == {"streamd.server.serve"}
    assert _server_imports("chat") == {"streamd.server.ws.protocol"}
    assert all(not _server_imports(m) for m in ("main", "generate", "settings"))
