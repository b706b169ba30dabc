#!/usr/bin/env bash
# Download into .whl/ the Python 3.12 manylinux wheels that the lent GPU machine lacks
# (it has torch, triton, numpy, pyarrow, grpcio-less basics and no registry): the service's
# runtime deps, the test tools and locust with its dependencies. `.whl/` is git-ignored
# locally (.git/info/exclude); carry it to the device and `. bench/gpu_env.sh` installs it.
# Usage: bash bench/fetch_gpu_wheels.sh            (about 55 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
    --platform manylinux1_x86_64 -d .whl \
    "orjson>=3.9" "protobuf>=7.35.1,<8" "grpcio>=1.85.1,<2" "grpcio-health-checking>=1.85.1,<2" \
    "grpcio-reflection>=1.85.1,<2" "pydantic>=2.7,<3" "pydantic-settings[yaml]>=2.7,<3" \
    "tqdm>=4.66" "psutil>=5.9" "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" \
    "locust>=2.40,<3" "opentelemetry-api>=1.45,<2" "opentelemetry-sdk>=1.45,<2" \
    "grpcio-status>=1.85.1,<2" "safetensors>=0.4" "prometheus-client>=0.20" "uvloop>=0.19"
# matplotlib (`grace eval --plots`) without its numpy: the device's own numpy stays
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --no-deps -d .whl "matplotlib>=3.8" contourpy cycler \
    fonttools kiwisolver pillow pyparsing python-dateutil six
du -sh .whl
