# nicoffload: `make run` and `make test` set everything up from a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# System packages the integration tests use (the agent in its own network namespace).
SYSDEPS := iproute2 nftables

.PHONY: setup sysdeps run test test-unit test-integration test-gpu bench lint format clean

setup: $(STAMP)

sysdeps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=""; for p in $(SYSDEPS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then \
	    echo "installing$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  fi; \
	else echo "note: not root (or no apt-get): install $(SYSDEPS) for the network-namespace test"; fi

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "nicoffload needs Python >= 3.11 (set PYTHON=...)")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

PROFILES ?= $(or $(NICOFFLOAD_PROFILES),$(HOME)/.cache/nicoffload/profiles)

# The default pipeline end to end on this machine: the host CPU plus a local DPU agent on
# loopback (an emulated DPU), on generated sample images. The first time, this machine's
# cost profile is measured (about 20 s) so that the plan's predictions are this machine's.
run: setup
	$(BIN)/nicoffload validate pipelines/resnet50.yaml
	test -f $(PROFILES)/cpu.json || $(BIN)/nicoffload profile --quick
	$(BIN)/nicoffload plan pipelines/resnet50.yaml
	$(BIN)/nicoffload run pipelines/resnet50.yaml --sample 200

test: setup sysdeps
	$(BIN)/python -m pytest -q tests/unit tests/integration tests/device

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

test-integration: setup sysdeps
	$(BIN)/python -m pytest -q tests/integration

# GPU kernels and staging: runs where CUDA works, skips with the reason elsewhere.
test-gpu: setup
	$(BIN)/python -m pytest -q tests/device -rs

bench: setup
	$(BIN)/python bench/bench_cpu.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build *.egg-info
