"""`streamd cluster`: N local streamd replicas behind existing routers, for `make cluster` and the tests.

- OpenAI HTTP routes go through `vllm-router` (PyPI `vllm-router`, a Rust binary in a wheel) with its
  `cache_aware` policy: per replica a radix tree of the request texts routed there; a request goes to the
  replica with the longest match when it covers `cache_threshold` of the text and loads are balanced, else
  to the least loaded one. It health-checks each replica at `/ready` (503 while warming up, draining or
  with a dead engine), so a replica that cannot serve is taken out of rotation.
- `streamd.v1` WebSockets: vllm-router does not carry WebSocket upgrades (it forwards `GET /v1/stream` as
  plain HTTP, and the replica answers 404), so nginx (Debian's package) is the front door: `/v1/stream` goes
  to the replicas directly (`least_conn`; a WebSocket is one TCP connection, so a session stays on the
  replica it reached), everything else to the router.
- The Responses API's WebSocket mode (`GET /v1/responses` with an upgrade) goes to the replicas as
  `/v1/stream` does (nginx sends `/v1/responses` by its Upgrade header: WebSockets to the replicas, POSTs
  to the router).
- `previous_response_id`: the replicas share one response store directory (`server.responses_store_dir`,
  a folder of the cluster's), so a follow-up finds its previous response whichever replica it reaches.
  Routing by response id cannot do this: the id travels in a JSON body or inside a WebSocket session,
  where neither nginx nor the router looks.
- GPUs: when `nvidia-smi -L` lists GPUs (counted in a subprocess, so this process never initializes CUDA),
  replica i gets `CUDA_VISIBLE_DEVICES` of its own `--tp K` GPUs (i*K .. i*K+K-1) and `--tp K` is passed
  to its `streamd serve`; more replicas than the GPUs hold is an error. Without GPUs every replica shares
  the CPU.
- What the router sees of each replica: `/ready` for health; load and KV usage are in each replica's
  `/metrics` (`streamd_requests_running`, `streamd_kv_blocks_used`, prefix-cache counters) for dashboards.

Processes are started with their own process groups and stopped (SIGTERM, then SIGKILL) by pid.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from streamd.config import ConfigError

_HOST = "127.0.0.1"
ROUTER_POLICIES = ("cache_aware", "round_robin")
_STOP_TIMEOUT_S = 40.0  # a replica drains in-flight requests for up to server.drain_timeout_s (30 s) on SIGTERM


@dataclass(slots=True)
class ClusterSpec:
    replicas: int
    front_port: int  # nginx: WebSockets to the replicas, the rest to the router
    router_port: int
    router_metrics_port: int  # the router's own Prometheus exporter
    first_replica_port: int
    policy: str = "cache_aware"
    serve_args: list[str] = field(default_factory=list)  # extra `streamd serve` arguments (e.g. --set k=v)
    tp: int = 1  # GPUs per replica (tensor parallelism) when GPUs exist
    num_gpus: int = 0  # GPUs on this host (0: the replicas run on the CPU)

    @property
    def replica_ports(self) -> list[int]:
        return [self.first_replica_port + i for i in range(self.replicas)]

    def check(self) -> None:
        """Raises ConfigError (a usage error: exit status 2) for a count below 1, or replicas that need more
        GPUs than the host has."""
        if self.replicas < 1 or self.tp < 1:
            raise ConfigError("--replicas and --tp must be >= 1")
        if self.num_gpus and self.replicas * self.tp > self.num_gpus:
            raise ConfigError(
                f"{self.replicas} replicas x --tp {self.tp} need {self.replicas * self.tp} GPUs; "
                f"this host has {self.num_gpus}"
            )

    def replica_gpus(self, index: int) -> str | None:
        """Replica `index`'s CUDA_VISIBLE_DEVICES (None: no GPUs, the CPU)."""
        if not self.num_gpus:
            return None
        return ",".join(str(g) for g in range(index * self.tp, (index + 1) * self.tp))


def count_gpus() -> int:
    """CUDA GPUs on this host, from `nvidia-smi -L` (no CUDA initialized here); 0 without the tool."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return 0
    return sum(line.startswith("GPU ") for line in listing.splitlines())


def replica_env(spec: ClusterSpec, index: int, store_dir: Path) -> dict[str, str]:
    """Replica `index`'s environment: its GPUs, and the response store the replicas share."""
    env = dict(os.environ, STREAMD_SERVER__RESPONSES_STORE_DIR=str(store_dir))
    gpus = spec.replica_gpus(index)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


def replica_command(port: int, serve_args: list[str], tp: int = 1) -> list[str]:
    # A replica sees every client through nginx and the router (one loopback address each): no cap per address.
    parallel = ["--tp", str(tp)] if tp > 1 else []
    return [
        sys.executable,
        "-m",
        "streamd.cli.main",
        "serve",
        "--host",
        _HOST,
        "--port",
        str(port),
        *parallel,
        "--set",
        "server.max_connections_per_client=0",
        *serve_args,
    ]


def router_command(port: int, metrics_port: int, replica_ports: list[int], policy: str) -> list[str]:
    binary = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not Path(binary).exists():
        raise SystemExit("streamd cluster needs the router: pip install vllm-router")
    return [
        binary,
        "--host",
        _HOST,
        "--port",
        str(port),
        "--policy",
        policy,
        "--prometheus-host",
        _HOST,
        "--prometheus-port",
        str(metrics_port),
        "--health-check-endpoint",
        "/ready",
        "--worker-urls",
        *[f"http://{_HOST}:{p}" for p in replica_ports],
    ]


def nginx_config(front_port: int, router_port: int, replica_ports: list[int], workdir: Path) -> str:
    servers = "\n".join(f"        server {_HOST}:{p};" for p in replica_ports)
    websocket = """proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_set_header Host $host;
            proxy_read_timeout 1h;"""
    return nginx_conf(
        workdir,
        f"""    map $http_upgrade $connection_upgrade {{
        default upgrade;
        "" close;
    }}
    map $http_upgrade $responses_upstream {{
        default replicas;
        "" router;
    }}
    upstream replicas {{
        least_conn;
{servers}
    }}
    upstream router {{
        server {_HOST}:{router_port};
    }}
    server {{
        listen {_HOST}:{front_port};
        location = /v1/stream {{
            proxy_pass http://replicas;
            {websocket}
        }}
        location = /v1/responses {{
            proxy_pass http://$responses_upstream;
            proxy_buffering off;
            {websocket}
        }}
        location / {{
            proxy_pass http://router;
            proxy_http_version 1.1;
            proxy_buffering off;
            proxy_read_timeout 1h;
        }}
    }}
""",
    )


def nginx_conf(workdir: Path, http: str) -> str:
    """A whole config for an nginx in the foreground whose own files (pid, temp files) are in `workdir`, errors
    to stderr, no access log, around `http` (the `http` block's directives; also the keepalive tests' proxy)."""
    return f"""daemon off;
pid {workdir}/nginx.pid;
error_log stderr warn;
events {{}}
http {{
    access_log off;
    client_body_temp_path {workdir}/body;
    proxy_temp_path {workdir}/proxy;
{http}}}
"""


def nginx_binary() -> str:
    """Where nginx is (Debian's package: /usr/sbin, often not on a user's PATH); it may not exist."""
    return shutil.which("nginx") or "/usr/sbin/nginx"


@contextlib.contextmanager
def running_cluster(
    spec: ClusterSpec, ready_timeout_s: float = 300.0, log_dir: Path | None = None, websockets: bool = True
) -> Iterator[ClusterSpec]:
    """Starts the replicas, waits until each `/ready`, then the router and (with `websockets`) nginx; stops
    all on exit. Without nginx only the router's port serves (HTTP and SSE: `streamd bench replicas`)."""
    processes: list[subprocess.Popen[bytes]] = []
    workdir = Path(tempfile.mkdtemp(prefix="streamd-cluster-"))  # nginx's config and temp files
    logs = log_dir or workdir

    def start(name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        log = (logs / f"{name}.log").open("wb")
        processes.append(
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        )

    try:
        for i, port in enumerate(spec.replica_ports):
            env = replica_env(spec, i, workdir / "responses")
            start(f"replica-{i}", replica_command(port, spec.serve_args, spec.tp), env)
        deadline = time.monotonic() + ready_timeout_s
        for port in spec.replica_ports:
            wait_ready(f"http://{_HOST}:{port}/ready", deadline, processes)
        start("router", router_command(spec.router_port, spec.router_metrics_port, spec.replica_ports, spec.policy))
        wait_ready(f"http://{_HOST}:{spec.router_port}/v1/models", deadline, processes)
        if websockets:
            _start_nginx(spec, workdir, start)
            wait_ready(f"http://{_HOST}:{spec.front_port}/v1/models", deadline, processes)
        yield spec
    finally:
        stop_processes(processes)
        if log_dir is not None:  # (otherwise the logs are in workdir: kept for a look after a failure)
            shutil.rmtree(workdir, ignore_errors=True)


def _start_nginx(spec: ClusterSpec, workdir: Path, start: Callable[[str, list[str]], None]) -> None:
    nginx = nginx_binary()
    if not Path(nginx).exists():
        raise SystemExit("streamd cluster needs nginx for WebSockets: apt-get install nginx-light")
    (workdir / "nginx.conf").write_text(nginx_config(spec.front_port, spec.router_port, spec.replica_ports, workdir))
    start("nginx", [nginx, "-c", str(workdir / "nginx.conf"), "-p", str(workdir)])


def wait_ready(url: str, deadline: float, processes: list[subprocess.Popen[bytes]]) -> None:
    """Polls `url` until it answers 200 (a process that exits meanwhile fails the start)."""
    while True:
        dead = [p.args for p in processes if p.poll() is not None]
        if dead:
            raise RuntimeError(f"cluster process exited during start-up: {dead[0]!r}")
        with (
            contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
            urllib.request.urlopen(url, timeout=2) as response,
        ):
            if response.status == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready in time")
        time.sleep(0.2)  # polling a process we do not control, with a deadline


def stop_processes(processes: list[subprocess.Popen[bytes]]) -> None:
    for p in reversed(processes):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in reversed(processes):
        try:
            p.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1, help="GPUs per replica (tensor parallelism) when GPUs exist")
    parser.add_argument("--port", type=int, default=8000, help="the front door (nginx): HTTP and WebSocket")
    parser.add_argument("--router-port", type=int, default=8001)
    parser.add_argument("--router-metrics-port", type=int, default=8002, help="the router's Prometheus exporter")
    parser.add_argument("--first-replica-port", type=int, default=8010)
    parser.add_argument("--policy", choices=ROUTER_POLICIES, default="cache_aware", help="vllm-router's policy")
    parser.add_argument(
        "serve_args",
        nargs=argparse.REMAINDER,
        help="after --: arguments for every `streamd serve` (e.g. -- --set cache.num_kv_blocks=512)",
    )


def cluster_main(args: argparse.Namespace) -> int:
    """Run N local replicas behind vllm-router (HTTP, cache-aware) and nginx (WebSocket) until Ctrl-C."""
    serve_args = [a for a in args.serve_args if a != "--"]
    spec = ClusterSpec(
        args.replicas,
        args.port,
        args.router_port,
        args.router_metrics_port,
        args.first_replica_port,
        args.policy,
        serve_args,
        args.tp,
        count_gpus(),
    )
    spec.check()
    signal.signal(signal.SIGTERM, _interrupt)  # `docker stop` / kill: stop the children as Ctrl-C does
    logs = Path(tempfile.mkdtemp(prefix="streamd-cluster-logs-"))
    print(f"streamd cluster: logs in {logs}", flush=True)
    with contextlib.suppress(KeyboardInterrupt), running_cluster(spec, log_dir=logs):
        print(
            f"streamd cluster: {spec.replicas} replicas on ports {spec.replica_ports}; router ({spec.policy}) "
            f"on {spec.router_port}; front door http://{_HOST}:{spec.front_port} (ws://.../v1/stream, "
            f"ws://.../v1/responses); GPUs per replica: {spec.tp if spec.num_gpus else 0}",
            flush=True,
        )
        while True:
            signal.pause()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
