# nicoffload: `make run` and `make test` set everything up from a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup run test test-unit test-integration test-gpu bench lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "nicoffload needs Python >= 3.11 (set PYTHON=...)")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The default pipeline end to end on generated sample images; prints the summary.
run: setup
	$(BIN)/nicoffload validate pipelines/resnet50.yaml
	$(BIN)/nicoffload run pipelines/resnet50.yaml --sample 200

test: setup
	$(BIN)/python -m pytest -q tests/unit tests/integration tests/device

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

test-integration: setup
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
