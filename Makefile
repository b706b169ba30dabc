# GRACE serving: set-up, tests and the everyday commands.
# `make test` on a fresh machine creates .venv, installs the project with its dev extras
# (the CPU build of torch when no NVIDIA GPU is present) and runs the test suite.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# the floor of the gpu extra (pyproject.toml): the served kernels must compile on it
TRITON_MIN ?= 3.6.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: help install test ops-tools lint format serve bench loadtest clean image image-smoke

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	@echo "setting up $(VENV), once: pip installs torch and the project's dependencies (minutes on a fresh machine)"
	$(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),)
	@echo "no NVIDIA GPU found: installing the CPU build of torch $(TORCH_VERSION)"
	$(PY) -m pip install "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
endif
	@echo "installing grace-serving (editable) with its extras: dev, loadtest, gpu, otlp, eval, postgres"
	$(PY) -m pip install -e ".[dev,loadtest,gpu,otlp,eval,postgres]"
	touch $@

install: $(VENV)/.installed  ## create .venv and install the project with dev extras

# the oldest triton the gpu extra allows, beside the venv (never imported by it): the tests
# compile the served kernels for Hopper with it as well as with the installed one
$(VENV)/triton-min/.installed: $(VENV)/.installed
	@echo "installing triton $(TRITON_MIN) into $(VENV)/triton-min, for tests/kernels/test_hopper_compile.py"
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/triton-min "triton==$(TRITON_MIN)"
	touch $@

# the suite on TEST_WORKERS processes (pytest-xdist): most long tests wait on a server or a
# clock, so two processes overlap them even on two busy cores
TEST_WORKERS ?= 2
test: install $(VENV)/triton-min/.installed ops-tools  ## run the test suite
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS)

# promtool (Debian's prometheus package) for tests/ops, node and npm (Debian's nodejs and
# npm) for tests/clients/test_node_example.py, and PostgreSQL (Debian's postgresql: a real
# server for the builder's database source, tests/helpers/postgres.py): installed when we
# may (root); elsewhere
# their tests skip and say so (CI=true makes promtool's fail instead).
ops-tools:
	@command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends prometheus >/dev/null; \
	  else echo "promtool not found (apt-get install prometheus): its tests will skip"; fi; }
	@{ command -v node && command -v npm; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends nodejs npm >/dev/null; \
	  else echo "node or npm not found (apt-get install nodejs npm): the Node example's test will skip"; fi; }
	@{ command -v initdb || ls /usr/lib/postgresql/*/bin/initdb; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends postgresql >/dev/null; \
	  else echo "PostgreSQL not found (apt-get install postgresql): its tests will skip"; fi; }

lint: install  ## ruff lint + format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install  ## apply ruff fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

serve: install  ## serve the embedded default on 127.0.0.1:50051 (its first start builds the demo world, model and index, logging each step)
	$(VENV)/bin/grace serve

bench: install  ## index-builder benchmarks (writes bench/results/)
	$(PY) bench/bench_index_build.py

LOADTEST_HOST ?= localhost:50051
loadtest: install  ## locust against a local server (make serve): 4 users, 30 s, thresholds on
	$(VENV)/bin/locust -f loadtest/locustfile.py --headless -H $(LOADTEST_HOST) -u 4 -r 4 \
	  -t 30s --only-summary --csv build/loadtest/grace --html build/loadtest/grace.html \
	  --grace-p99-ms 300 --grace-fail-ratio 0.01 --grace-rps 20

# The CPU image (docs/ops/container.md). Where no registry can be reached the base is
# made locally (deploy/image/base.sh, mmdebstrap) and torch comes from a local wheel
# directory: TORCH_WHEELS, mounted into the build, with pip's find-links on it and the
# exact `+cpu` version, so PyPI (the index then) cannot hand it a CUDA build. podman
# only: `docker build` has neither -v nor --format (use the Dockerfile's own commands).
ENGINE ?= podman
IMAGE ?= grace-serving:cpu
BASE_IMAGE ?= localhost/grace-base:bookworm
TORCH_WHEELS ?= $(firstword $(wildcard /opt/wheels))
# the host's CA bundle for pip in the build, where the host trusts CAs of its own (a
# TLS-intercepting proxy); the image itself never gets it
BUILD_CA ?= $(if $(wildcard /usr/local/share/ca-certificates/*.crt),/etc/ssl/certs/ca-certificates.crt)
IMAGE_BUILD_ARGS ?= --build-arg VARIANT=cpu --build-arg CPU_IMAGE=$(BASE_IMAGE) \
  $(if $(TORCH_WHEELS),-v $(abspath $(TORCH_WHEELS)):/wheels:ro --build-arg PIP_FIND_LINKS=/wheels \
    --build-arg TORCH_INDEX=https://pypi.org/simple --build-arg TORCH_VERSION=$(TORCH_VERSION)+cpu) \
  $(if $(BUILD_CA),-v $(BUILD_CA):/run/build-ca.crt:ro --build-arg PIP_CERT=/run/build-ca.crt)
image:  ## build the CPU image with podman (ENGINE); its base with mmdebstrap if missing
	@$(ENGINE) image inspect $(BASE_IMAGE) >/dev/null 2>&1 || ENGINE=$(ENGINE) BASE_IMAGE=$(BASE_IMAGE) sh deploy/image/base.sh
	$(ENGINE) build --format docker --network host $(IMAGE_BUILD_ARGS) -t $(IMAGE) .
	@$(ENGINE) image inspect $(IMAGE) --format '$(IMAGE): {{.Size}} bytes'

image-smoke:  ## run the image as CI cannot: read-only, non-root, query, hot swap, SIGTERM
	ENGINE=$(ENGINE) IMAGE=$(IMAGE) sh deploy/image/smoke.sh

.PHONY: proto
proto: install  ## regenerate the gRPC stubs (service/rpc, clients/python) from proto/
	$(PY) -m tools.proto_stubs

clean:  ## remove the venv and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
