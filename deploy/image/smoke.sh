#!/bin/sh
# The image's smoke test (`make image-smoke`; docs/ops/container.md "Built and run: the
# CPU image with podman"): what CI, which has no container engine, cannot check. One
# server container as compose and Kubernetes run it (read-only root, a tmpfs on /tmp,
# uid 10001, the data volume), then:
#
#   1. it reports SERVING to `grace health` (the first start bootstraps the demo into the
#      volume: minutes) and to the image's own HEALTHCHECK;
#   2. `grace query` gets ads back;
#   3. the builder sidecar, from the image's entrypoint in a second container on the same
#      volume, publishes a new index after the catalog changed, and the server swaps it in
#      (grace_index_swaps_total and the response's index version);
#   4. SIGTERM: the server drains and exits 0.
#
# The grace commands run inside the server's network namespace (`exec`), so the container
# needs no published ports (--network none: nothing but loopback). The volume is kept, so
# a second run skips the bootstrap; SMOKE_FRESH=1 starts from an empty one.
#
#   ENGINE=podman IMAGE=grace-serving:cpu sh deploy/image/smoke.sh
set -eu
ENGINE=${ENGINE:-podman}
IMAGE=${IMAGE:-grace-serving:cpu}
NAME=${SMOKE_NAME:-grace-smoke}
VOLUME=${SMOKE_VOLUME:-grace-smoke-data}
BOOT_TIMEOUT=${SMOKE_BOOT_TIMEOUT:-1800}  # the image's HEALTHCHECK start period
SWAP_TIMEOUT=${SMOKE_SWAP_TIMEOUT:-300}

t0=$(date +%s)
step() { echo "smoke [$(($(date +%s) - t0)) s] $*"; }
fail() {
    echo "smoke FAILED: $*" >&2
    "$ENGINE" logs --tail 40 "$NAME" >&2 2>&1 || true
    exit 1
}
cleanup() {  # one at a time: podman 4.3 stops at a name it does not know
    for c in "$NAME" "$NAME-builder"; do "$ENGINE" rm -f "$c" >/dev/null 2>&1 || true; done
}
trap cleanup EXIT
rlimit_fix() {  # podman asks for 1048576 open files (RLIMIT_NOFILE, runc's "rlimit type 7")
    # and processes (RLIMIT_NPROC, type 6), more than a host may grant: name what it can set
    nofile=$(awk '/^Max open files/ {print $(NF - 1)}' /proc/self/limits)
    nproc=$(awk -v max="$(cat /proc/sys/kernel/pid_max)" '/^Max processes/ {
        hard = $(NF - 1); print (hard ~ /^[0-9]+$/ && hard < max + 0) ? hard : max }' \
        /proc/self/limits)  # podman itself ran with kernel.pid_max processes (the docs)
    fail "podman's default open-files and processes limits are above this host's: add" \
        "default_ulimits = [\"nofile=$nofile:$nofile\", \"nproc=$nproc:$nproc\"]" \
        "under [containers] in /etc/containers/containers.conf" \
        "(rootless: ~/.config/containers/containers.conf);" \
        "docs/ops/container.md \"Local adaptations\""
}
in_server() { "$ENGINE" exec "$NAME" "$@"; }
metric() {  # the sum of a metric's samples on the server's metrics port
    in_server python3 -c "import sys, urllib.request
text = urllib.request.urlopen('http://127.0.0.1:9464/metrics', timeout=5).read().decode()
print(int(sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(sys.argv[1]))))" "$1"
}

step "$("$ENGINE" --version); image $IMAGE: $("$ENGINE" image inspect "$IMAGE" --format '{{.Size}}') bytes"
cleanup
if [ "${SMOKE_FRESH:-0}" = 1 ]; then "$ENGINE" volume rm -f "$VOLUME" >/dev/null 2>&1 || true; fi
"$ENGINE" volume inspect "$VOLUME" >/dev/null 2>&1 || "$ENGINE" volume create "$VOLUME" >/dev/null

out=$("$ENGINE" run -d --name "$NAME" --read-only --tmpfs /tmp --network none \
    -v "$VOLUME:/data" -e GRACE_INDEX_POLL_SECONDS=1 "$IMAGE" 2>&1) || case $out in
    *"setting rlimit"* | *setrlimit*) rlimit_fix ;;  # runc; crun says setrlimit
    *) fail "the server container did not start: $out" ;;
esac
[ "$(in_server id -u)" = 10001 ] || fail "the server does not run as uid 10001"
if in_server sh -c 'touch /opt/venv/x' 2>/dev/null; then fail "the root filesystem is writable"; fi
step "started: uid 10001, read-only root; waiting for SERVING (first probe: $(in_server grace health 2>&1 || true))"

# 1. SERVING
until in_server grace health >/dev/null 2>&1; do
    [ "$("$ENGINE" inspect "$NAME" --format '{{.State.Running}}')" = true ] || fail "the server exited"
    [ $(($(date +%s) - t0)) -lt "$BOOT_TIMEOUT" ] || fail "not SERVING after $BOOT_TIMEOUT s"
    sleep 5
done
step "SERVING: $(in_server grace health)"
"$ENGINE" healthcheck run "$NAME" >/dev/null || fail "the image's HEALTHCHECK does not pass"
step "HEALTHCHECK passes: $("$ENGINE" inspect "$NAME" --format '{{.State.Health.Status}}')"

# 2. a Retrieve
index_of() { in_server grace query --user 3 --max-ads 3 | sed -n 's/^index \([^ ]*\) .*/\1/p'; }
in_server grace query --user 3 --max-ads 3 || fail "grace query failed"
before=$(index_of)
swaps=$(metric grace_index_swaps_total)
step "Retrieve answered from index $before; grace_index_swaps_total $swaps"

# 3. the builder sidecar publishes, the server swaps
in_server touch /data/world/catalog.parquet  # the builder's fingerprint has the mtime
"$ENGINE" run --rm --name "$NAME-builder" --read-only --tmpfs /tmp --network none \
    --no-healthcheck -v "$VOLUME:/data" "$IMAGE" builder \
    --catalog /data/world/catalog.parquet --model /data/model --out /data/index --once ||
    fail "the builder sidecar failed"
step "builder sidecar published a version"
until [ "$(metric grace_index_swaps_total)" -gt "$swaps" ]; do
    [ $(($(date +%s) - t0)) -lt $((BOOT_TIMEOUT + SWAP_TIMEOUT)) ] || fail "no swap"
    sleep 1
done
after=$(index_of)
[ -n "$after" ] && [ "$after" != "$before" ] || fail "index version still $before"
step "hot swap: grace_index_swaps_total $(metric grace_index_swaps_total), index $before -> $after"

# 4. SIGTERM
stop=$(date +%s)
"$ENGINE" kill --signal TERM "$NAME" >/dev/null
code=$("$ENGINE" wait "$NAME")
[ "$code" = 0 ] || fail "exit code $code after SIGTERM"
step "SIGTERM: exit code 0 after $(($(date +%s) - stop)) s"
"$ENGINE" logs --tail 3 "$NAME" 2>&1 | sed 's/^/  | /'
step "all steps passed"
