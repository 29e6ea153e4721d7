# nicoffload: `make run` and `make test` set everything up from a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# System packages the integration tests use (the agent in its own network namespace).
SYSDEPS := iproute2 nftables
# The shared libraries of the prebuilt P4 tools (p4c's BMv2 back end, BMv2's simple_switch) that
# the P4 tests run, from ../shared/p4tools beside the clone; without that folder they skip.
P4TOOLS := ../shared/p4tools
SYSDEPS += $(shell cat $(P4TOOLS)/apt-packages.txt 2>/dev/null)
# As root (CI) with the tools there, the libraries get installed, so the P4 tests must run: a
# missing piece fails them instead of skipping them.
export NICOFFLOAD_REQUIRE_P4 := $(if $(and $(wildcard $(P4TOOLS)/bin),$(filter 0,$(shell id -u))),1)

.PHONY: setup sysdeps run test test-unit test-integration test-p4 test-gpu test-rdma test-arm bench bench-rdma lint format clean

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
	$(BIN)/python -m pip install --quiet -e '.[ray]'  # tests/integration/test_ray_*.py
	@# torch, for the tests of Session.dataset and RunResult.torch(): the CPU wheel where one is
	@# on disk (this project's machines); elsewhere those tests skip ('.[gpu]' brings torch)
	@if ls /opt/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install --quiet 'torch==2.13.0'; \
	else echo "note: no CPU torch wheel on disk: the torch tests skip (pip install -e '.[gpu]')"; fi
	touch $(STAMP)

PROFILES ?= $(or $(NICOFFLOAD_PROFILES),$(HOME)/.cache/nicoffload/profiles)

# The default pipeline end to end on this machine: the host CPU plus a local DPU agent on
# loopback (an emulated DPU), on generated sample images. The first time, this machine's
# cost profile is measured (about 20 s) so that the plan's predictions are this machine's.
run: setup
	$(BIN)/nicoffload validate pipelines/resnet50.yaml
	@# a profile measured before the runtime was, its links under another frame MAC, its
	@# decode by pixels alone (before its bytes were fitted too), or before the host's serial
	@# (GIL-held) time was, or before progressive JPEGs were timed apart, or the agent's
	@# cost per batch, or its links' bandwidth between two threads (not processes): again
	$(BIN)/python -c "import json, sys; d = json.load(open('$(PROFILES)/cpu.json')); r = d.get('runtime', {}); t = d['links']['tcp']; sys.exit('serial_us_per_item' not in r or ('agent_us_per_item' in r) != ('agent_us_per_batch' in r) or t.get('frame_mac') != 'gmac' or t.get('bandwidth_from') != 'process' or not {'c_ms_per_byte', 'progressive_x'} <= set(d['kernels'].get('decode_image', {})))" 2>/dev/null || $(BIN)/nicoffload profile --quick
	$(BIN)/nicoffload plan pipelines/resnet50.yaml
	$(BIN)/nicoffload run pipelines/resnet50.yaml --sample 200

# Everything CI runs: the Python suites, then RDMA on real verbs (a Soft-RoCE guest, where QEMU
# can run) and the DPU agent on aarch64 (QEMU user mode, as root).
test: setup sysdeps
	$(BIN)/python -m pytest -q tests/unit tests/integration tests/device
	@if [ -e /dev/kvm ] || command -v qemu-system-x86_64 >/dev/null 2>&1 || [ "$$(id -u)" = 0 ]; then \
	  $(MAKE) --no-print-directory test-rdma; \
	else echo "test-rdma skipped: no /dev/kvm, no qemu-system-x86_64, and not root to install it"; fi
	@if [ "$$(id -u)" = 0 ]; then $(MAKE) --no-print-directory test-arm; \
	else echo "test-arm skipped: it needs root (mmdebstrap, chroot, binfmt_misc)"; fi

# RDMA on real verbs: Soft-RoCE in a QEMU guest; kernel, initramfs and numba cache are cached in
# ~/.cache/nicoffload/rdma-vm.
test-rdma: setup
	$(BIN)/python tests/rdma/vm.py

# The DPU agent and its kernels on aarch64 under QEMU user mode (cortex-a72 and cortex-a76); the
# arm64 root filesystem is cached in ~/.cache/nicoffload, keyed by the DPU dependency set, and so
# are numba's kernels per model, keyed by nicoffload/ops. Prints each phase's time.
test-arm: setup
	bash tests/arm/run.sh

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

test-integration: setup sysdeps
	$(BIN)/python -m pytest -q tests/integration

# The P4 program alone: compiled into build/p4/ and run on BMv2 (also part of `make test`).
test-p4: setup sysdeps
	$(BIN)/python -m pytest -q -rs tests/unit/test_p4_*.py tests/unit/test_scapy_layer.py tests/integration/test_p4_*.py

# GPU kernels and staging: runs where CUDA works, skips with the reason elsewhere.
test-gpu: setup
	$(BIN)/python -m pytest -q tests/device -rs

bench: setup
	$(BIN)/python bench/bench_cpu.py
	$(BIN)/python bench/bench_transport.py
	$(BIN)/python bench/bench_planner.py
	$(BIN)/python bench/bench_prediction.py

bench-rdma: setup
	$(BIN)/python bench/bench_rdma.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build *.egg-info
