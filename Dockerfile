# GRACE serving image: `grace serve`, the `grace builder` sidecar and every other `grace`
# command from one image (docs/ops/container.md).
#
#   docker build -t grace-serving:gpu .                           # CUDA runtime + CUDA torch
#   docker build -t grace-serving:cpu --build-arg VARIANT=cpu .   # python:3.11-slim + CPU torch
#   make image                        # the CPU image with podman, from a local Debian base
#   docker run --gpus all -p 50051:50051 -p 9464:9464 -v grace-data:/data grace-serving:gpu
#   docker run -v grace-data:/data grace-serving:gpu builder \
#       --catalog /data/world/catalog.parquet --tokenizer /data/model/tokenizer --out /data/index
#
# Stages, for each VARIANT (gpu | cpu):
#   runtime-<variant>  the OS and Python the venv runs on
#   build-<variant>    + a C++ compiler and the variant's PyTorch wheel index
#   builder            /opt/venv: torch, the locked dependencies (requirements/image.txt),
#                      the project with its C++ post stage
#   runtime            runtime-<variant> + /opt/venv; non-root, read-only-root friendly
# BuildKit (docker build's default) builds only the stages of the chosen variant.
#
# Lint: hadolint (tests/ops/test_container.py). System packages are not pinned: the base
# image tag fixes the release and its security updates should flow in on rebuild.
# hadolint global ignore=DL3008

ARG VARIANT=gpu
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG CPU_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- what each variant runs on
FROM ${CPU_IMAGE} AS runtime-cpu
# python3 is the image's own (/usr/local/bin), headers included; a Debian base with
# Debian's python3 (make image: deploy/image/base.sh) works too, see build-cpu.

FROM ${CUDA_IMAGE} AS runtime-gpu
# Ubuntu's python3 (3.12). Triton compiles its kernel launchers with cc against Python.h
# when a process first runs them, so the GPU runtime keeps gcc and the Python headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# ---------------------------------------------------------------- what building adds to it
FROM runtime-cpu AS build-cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV TORCH_INDEX=${TORCH_INDEX}
# python3-dev only where the base's Python has no headers (Debian's python3 package)
RUN headers=python3-dev \
    && if python3 -c "import sysconfig, os, sys; \
sys.exit(not os.path.exists(sysconfig.get_path('include') + '/Python.h'))"; then headers=; fi \
    && apt-get update \
    && apt-get install -y --no-install-recommends g++ ${headers} \
    && rm -rf /var/lib/apt/lists/*

FROM runtime-gpu AS build-gpu
# the CUDA of the wheels matches the base image's (12.8); the host driver must support it
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV TORCH_INDEX=${TORCH_INDEX}
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# ---------------------------------------------------------------- the venv
# hadolint ignore=DL3006
FROM build-${VARIANT} AS builder
# keep in step with the Makefile's TORCH_VERSION (make image passes 2.13.0+cpu, which
# only the CPU build matches, so no index can hand it a CUDA build)
ARG TORCH_VERSION=2.13.0
# Local adaptations, unset by default; pip reads them from the environment. make image
# sets them where needed: a wheel directory mounted into the build (-v /opt/wheels:/wheels)
# and the host's CA bundle, where a TLS-intercepting proxy stands between it and PyPI.
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
WORKDIR /src
# The lock: every package but torch and the project, pinned (deploy/image/lock.sh).
COPY requirements/image.txt requirements/
# torch first, from the variant's index: the largest layer, and one that changes only with
# TORCH_VERSION or the lock. Not held to the lock (-c) here: the PyTorch indexes carry only
# some versions of torch's dependencies; the next step sets them to the lock's. Its C++ test
# binaries and protoc (torch/test, torch/bin: 130 MB) are never run and go;
# torch_shm_manager stays (tensor sharing between processes). The CPU image has no
# compiler, so torch's C++ headers (torch/include, 60 MB) would serve nothing there.
ARG VARIANT
RUN python3 -m venv /opt/venv \
    && pip install --index-url "$TORCH_INDEX" "torch==${TORCH_VERSION}" \
    && torch=$(python -c "import sysconfig; print(sysconfig.get_path('purelib'))")/torch \
    && rm -rf "$torch/test" \
    && find "$torch/bin" -mindepth 1 ! -name torch_shm_manager -delete \
    && if [ "$VARIANT" = cpu ]; then rm -rf "$torch/include"; fi
# the dependencies (torch's too) and the build requirements at exactly the lock's versions
# (torch is already there), so a code change reuses this layer; pip check: it is consistent
RUN pip install -r requirements/image.txt \
    && pip check
COPY pyproject.toml setup.py README.md ./
COPY cli ./cli
COPY contracts ./contracts
COPY index_builder ./index_builder
COPY kernels ./kernels
COPY service ./service
COPY training ./training
# Compiles the C++ post stage (service/post/_post.cpp) into the venv. The gRPC stubs are
# the committed ones (CI checks them byte for byte against `make proto`, so the image does
# not regenerate them); importing them from the venv (-P: not from /src) checks that they
# load with the protobuf runtime just installed and that the extension was built.
# --no-build-isolation: setuptools, wheel and pybind11 are the lock's, already installed.
RUN pip install --no-deps --no-build-isolation . \
    && python -P -c "import service.post._post, service.rpc.grace.v1.retrieval_pb2_grpc" \
    && grace --help > /dev/null

# ---------------------------------------------------------------- the image
# hadolint ignore=DL3006
FROM runtime-${VARIANT} AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="grace-serving" \
      org.opencontainers.image.description="GRACE serving: gRPC generative ads retrieval"
# A fixed numeric uid/gid, so Kubernetes' runAsNonRoot can verify it; /data is its own.
RUN groupadd --system --gid 10001 grace \
    && useradd --system --uid 10001 --gid grace --home-dir /tmp --no-create-home \
        --shell /usr/sbin/nologin grace \
    && mkdir -p /data \
    && chown grace:grace /data
COPY --from=builder /opt/venv /opt/venv
# The process writes only under /data (world, model, index) and /tmp (HOME, caches), so
# the root filesystem can be mounted read-only with a tmpfs or emptyDir on /tmp. A
# container listens on every interface (GRACE_HOST): probes and scrapes come from outside.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    GRACE_DATA_DIR=/data \
    GRACE_HOST=0.0.0.0 \
    GRACE_IMAGE_VARIANT=${VARIANT}
# From /, the CLI's relative defaults (`grace query --world data/world`) land in /data.
WORKDIR /
USER 10001:10001
VOLUME ["/data"]
EXPOSE 50051 9464
# SERVING only once the model and index are loaded and warmed up: the first start of the
# embedded demo generates, trains and indexes first (minutes), hence the start period.
HEALTHCHECK --interval=10s --timeout=5s --start-period=1800s --retries=3 \
    CMD ["grace", "health", "--timeout", "3"]
ENTRYPOINT ["grace"]
CMD ["serve", "--no-progress"]
