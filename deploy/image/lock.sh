#!/bin/sh
# Regenerates requirements/image.txt, the image's lock (docs/ops/container.md "The lock"):
# a clean venv on the image's Python (3.11), the CPU build of torch, the project's base
# dependencies (pyproject.toml), its `otlp` extra (so `tracing = "otlp"` works in the
# image), its `postgres` extra (so the builder can follow a PostgreSQL table) and its build
# requirements, then `pip freeze`.
# torch itself is left out: its version is the Dockerfile's TORCH_VERSION and its build
# (CPU or CUDA) the variant's wheel index. Run from the repository root:
#
#   sh deploy/image/lock.sh                  # PYTHON=python3.11 TORCH_VERSION=2.13.0
#   TORCH_INDEX=https://download.pytorch.org/whl/cpu sh deploy/image/lock.sh
set -eu
PYTHON=${PYTHON:-python3.11}
TORCH_VERSION=${TORCH_VERSION:-$(sed -n 's/^TORCH_VERSION ?= //p' Makefile)}
OUT=${OUT:-requirements/image.txt}
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
"$PYTHON" -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install -q ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch==$TORCH_VERSION"
"$venv/bin/python" - > "$venv/requirements.txt" <<'PY'
import tomllib

with open("pyproject.toml", "rb") as f:
    doc = tomllib.load(f)
project = doc["project"]
extras = project["optional-dependencies"]
print("\n".join(project["dependencies"] + extras["otlp"] + extras["postgres"]
                + doc["build-system"]["requires"]))
PY
"$pip" install -q -r "$venv/requirements.txt"
"$pip" check
{
    echo "# The image's lock: every package of the CPU image except torch (TORCH_VERSION,"
    echo "# from the variant's index) and the project, with the build requirements."
    echo "# Made by deploy/image/lock.sh on $("$venv/bin/python" -V); do not edit by hand."
    "$pip" freeze --all --exclude pip --exclude torch | LC_ALL=C sort -f
} > "$OUT"
echo "wrote $OUT ($(grep -c '==' "$OUT") pins)"
