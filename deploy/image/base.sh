#!/bin/sh
# The CPU image's base, made locally with mmdebstrap where no container registry can be
# reached (docs/ops/container.md "Local adaptations"): Debian bookworm, minbase, with
# Debian's python3 (3.11), venv, CA certificates and useradd; no docs, man pages or
# locales. Imported as $BASE_IMAGE (the Dockerfile's CPU_IMAGE for `make image`).
#
#   sh deploy/image/base.sh                  # BASE_IMAGE=localhost/grace-base:bookworm
set -eu
ENGINE=${ENGINE:-podman}
BASE_IMAGE=${BASE_IMAGE:-localhost/grace-base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
tar=$(mktemp --suffix=.tar)
trap 'rm -f "$tar"' EXIT
mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
    bookworm "$tar" "$MIRROR"
"$ENGINE" import "$tar" "$BASE_IMAGE"
