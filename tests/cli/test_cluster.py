"""Two real replicas (`streamd serve` of a small random Llama on CPU) behind vllm-router and nginx on localhost: with 50 requests
over 5 shared prefixes, the router's cache-aware policy yields more prefix-cache hits than its round-robin
policy over the same replicas, and a streamd.v1 WebSocket session stays on one replica; a Responses
`previous_response_id` follow-up works on either replica whichever served the first turn, and the
Responses WebSocket mode passes the front door. Replicas are pinned to GPUs as `nvidia-smi -L` counts them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from websockets.asyncio.client import connect

from streamd.cli.cluster import (
    ClusterSpec,
    count_gpus,
    replica_env,
    router_command,
    running_cluster,
    stop_processes,
    wait_ready,
)
from streamd.config import ConfigError
from tests.engine.worker.tp_models import save_random_model

ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
pytestmark = pytest.mark.skipif(not Path(ROUTER).exists() or (shutil.which("nginx") is None and
                                not Path("/usr/sbin/nginx").exists()),
                                reason="needs vllm-router (pip) and nginx (apt); `make test` installs both")
SERVE = ["--set", "model.dtype=float32", "--set", "cache.num_kv_blocks=512", "--set", "cache.num_swap_blocks=0"]
VOCAB_WORDS = 256  # the random model's word-level tokenizer: "w0" .. "w255", one token each


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _metric(port: int, name: str) -> float:
    """The sum of every sample of metric `name` on the replica at `port`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 7919 + j * 104729) % VOCAB_WORDS}" for j in range(n))


def _prompts(tag: int) -> list[str]:
    """50 prompts: 5 system-like prefixes of 96 tokens (6 blocks), each with 10 different questions."""
    prefixes = [_words(1000 * tag + i, 96) for i in range(5)]
    return [f"{prefixes[k % 5]} {_words(50_000 + 100 * tag + k, 8)}" for k in range(50)]


def _hit_tokens(ports: list[int]) -> float:
    return sum(_metric(p, "streamd_prefix_cache_hit_tokens_total") for p in ports)


def _send_all(base_url: str, model: str, prompts: list[str]) -> None:
    client = OpenAI(base_url=base_url, api_key="none", timeout=120, max_retries=0)
    for prompt in prompts:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0)
        assert out.choices[0].text is not None


async def _ws_session(url: str, n: int) -> None:
    async with connect(url, subprotocols=["streamd.v1"], open_timeout=30) as ws:
        for i in range(n):
            await ws.send(json.dumps({"type": "generate", "id": str(i), "prompt": _words(i, 5),
                                      "params": {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}}))
            while True:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 120))
                if frame["type"] == "done":
                    assert frame["finish_reason"] == "length", frame
                    break


# The Responses API renders messages through a chat template; the word-level test tokenizer has none.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterSpec, str, Path]]:
    """Two replicas behind the cache-aware router and nginx, for every test of this module."""
    tmp_path = tmp_path_factory.mktemp("cluster")
    model = save_random_model("llama", tmp_path / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    front, router, metrics, first = _free_ports(4)
    spec = ClusterSpec(2, front, router, metrics, first, "cache_aware", ["--model", str(model), *SERVE])
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # two replicas and a router share this machine's cores
    try:
        with running_cluster(spec, log_dir=tmp_path):
            name = OpenAI(base_url=f"http://127.0.0.1:{front}/v1", api_key="none").models.list().data[0].id
            yield spec, name, tmp_path
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads


def test_cache_aware_routing_hits_more_and_websockets_stick(cluster: tuple[ClusterSpec, str, Path]) -> None:
    spec, name, tmp_path = cluster
    front, replica_ports = spec.front_port, spec.replica_ports
    rr_router, rr_metrics = _free_ports(2)
    rr = subprocess.Popen(router_command(rr_router, rr_metrics, replica_ports, "round_robin"),
                          stdout=(tmp_path / "rr.log").open("wb"), stderr=subprocess.STDOUT,
                          start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{rr_router}/v1/models", time.monotonic() + 60, [rr])
        before = _hit_tokens(replica_ports)
        _send_all(f"http://127.0.0.1:{rr_router}/v1", name, _prompts(1))
        round_robin = _hit_tokens(replica_ports) - before
    finally:
        stop_processes([rr])
    before = _hit_tokens(replica_ports)
    _send_all(f"http://127.0.0.1:{front}/v1", name, _prompts(2))  # nginx -> cache-aware router
    cache_aware = _hit_tokens(replica_ports) - before
    assert cache_aware > round_robin > 0, (cache_aware, round_robin)

    served = [_metric(p, "streamd_requests_total") for p in replica_ports]
    asyncio.run(_ws_session(f"ws://127.0.0.1:{front}/v1/stream", 6))
    gained = [_metric(p, "streamd_requests_total") - s for p, s in zip(replica_ports, served)]
    assert sorted(gained) == [0, 6], gained  # every request of the session on one replica


def _respond(port: int, name: str, text: str, previous: str | None = None) -> Any:
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
    return client.responses.create(model=name, input=text, previous_response_id=previous, max_output_tokens=3,
                                   temperature=0.0)


def test_previous_response_id_on_either_replica(cluster: tuple[ClusterSpec, str, Path]) -> None:
    spec, name, _ = cluster
    for first, second in (spec.replica_ports, spec.replica_ports[::-1]):
        opening = _respond(first, name, _words(1, 12))
        follow_up = _respond(second, name, _words(2, 4), previous=opening.id)  # the other replica
        assert follow_up.previous_response_id == opening.id
        # its prompt is the whole conversation: the first turn's prompt and answer, then the new words
        assert follow_up.usage.input_tokens > opening.usage.input_tokens + opening.usage.output_tokens


def test_responses_websocket_mode_through_the_front_door(cluster: tuple[ClusterSpec, str, Path]) -> None:
    spec, name, _ = cluster
    opening = _respond(spec.replica_ports[0], name, _words(3, 10))
    client = OpenAI(base_url=f"http://127.0.0.1:{spec.front_port}/v1", api_key="none", timeout=120, max_retries=0)
    with client.beta.responses.connect() as conn:
        conn.response.create(model=name, input=_words(4, 3), previous_response_id=opening.id, max_output_tokens=3,
                             temperature=0.0)
        events = [conn.recv()]
        while events[-1].type not in ("response.completed", "response.incomplete", "error"):
            events.append(conn.recv())
    done = events[-1]  # (incomplete: max_output_tokens reached)
    assert done.type in ("response.completed", "response.incomplete"), done
    assert done.response.usage.input_tokens > opening.usage.input_tokens + opening.usage.output_tokens


def test_replicas_are_pinned_to_their_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi = tmp_path / "nvidia-smi"  # stands in for the driver's tool: four GPUs
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(4)))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    gpus = count_gpus()
    assert gpus == 4
    spec = ClusterSpec(2, 1, 2, 3, 4, tp=2, num_gpus=gpus)
    spec.check()
    envs = [replica_env(spec, i, tmp_path / "responses") for i in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3"]
    assert {e["STREAMD_SERVER__RESPONSES_STORE_DIR"] for e in envs} == {str(tmp_path / "responses")}
    with pytest.raises(ConfigError, match="need 6 GPUs; this host has 4"):
        ClusterSpec(3, 1, 2, 3, 4, tp=2, num_gpus=gpus).check()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cpu_only = ClusterSpec(3, 1, 2, 3, 4, tp=2, num_gpus=0)  # no GPUs: any number of replicas, on the CPU
    cpu_only.check()
    assert "CUDA_VISIBLE_DEVICES" not in replica_env(cpu_only, 2, tmp_path)
