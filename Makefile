# GRACE serving: set-up, tests and the everyday commands.
# `make test` on a fresh machine creates .venv, installs the project with its dev extras
# (the CPU build of torch when no NVIDIA GPU is present) and runs the test suite.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: help install test lint format serve bench clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),)
	@echo "no NVIDIA GPU found: installing the CPU build of torch $(TORCH_VERSION)"
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
endif
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed  ## create .venv and install the project with dev extras

test: install  ## run the test suite
	$(VENV)/bin/pytest -q

lint: install  ## ruff lint + format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install  ## apply ruff fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

serve: install  ## serve the embedded default (builds the demo world, model and index once)
	$(VENV)/bin/grace serve

bench: install  ## index-builder benchmarks (writes bench/results/)
	$(PY) bench/bench_index_build.py

.PHONY: proto
proto: install  ## regenerate the gRPC stubs in service/rpc from proto/
	$(PY) -m service.rpc.generate

clean:  ## remove the venv and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
