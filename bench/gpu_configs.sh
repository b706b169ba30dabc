#!/usr/bin/env bash
# Several server configurations against one index, one `bench/gpu_loadtest.sh` run each
# (docs/OPERATIONS.md): for a GPU session that must compare settings within a few calls.
# Each configuration is NAME or NAME:VAR=VALUE,VAR=VALUE (any GRACE_* setting, or the load
# script's own USERS, ...), runs under a time limit of LIMIT seconds (server start
# included, ~150-250 s for the paper profile with 2-3 workers; a run cut short writes the
# rates it finished) and writes RESULTS/NAME (summary.json with its settings, CSVs,
# logs). DATA (default /tmp/paper) must already hold the index, world and model: build
# them first, without a limit (bench/gpu_loadtest.sh or bench/bench_paper_index.py).
# Exits non-zero when any configuration failed or timed out.
# Usage: bash bench/gpu_configs.sh RESULTS RATES DURATION LIMIT CONFIG...
#   DATA=/tmp/paper bash bench/gpu_configs.sh /tmp/res "900 1000" 20s 290 \
#       base balance:GRACE_BALANCE=request
set -uo pipefail
if [ $# -lt 5 ]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
RESULTS=$1; RATES=$2; DURATION=$3; LIMIT=$4; shift 4
# three workers (sharing the GPU through MPS by default): the gpu overlay's setting
export DATA=${DATA:-/tmp/paper} WORKERS=${WORKERS:-3}
if [ ! -f "$DATA/index/CURRENT" ] || [ ! -f "$DATA/model/config.json" ]; then
    echo "no index or model in $DATA: build them first (see the header)"; exit 2
fi
RUN=""
trap '[ -n "$RUN" ] && kill -TERM "$RUN" 2>/dev/null; wait; exit 130' INT
trap '[ -n "$RUN" ] && kill -TERM "$RUN" 2>/dev/null; wait; exit 143' TERM
failed=0
for spec in "$@"; do
    name=${spec%%:*}
    settings=""
    [[ $spec == *:* ]] && settings=${spec#*:}
    case $name in ''|*/*|.*) echo "bad configuration name in '$spec'"; failed=1; continue ;; esac
    IFS=, read -ra pairs <<< "$settings"
    bad=""
    for kv in "${pairs[@]}"; do
        [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*=.*$ ]] || bad=$kv
    done
    if [ -n "$bad" ]; then
        echo "bad setting '$bad' in '$spec'"; failed=1; continue
    fi
    echo "== $name ${settings:+($settings)}"
    # in the background, so a signal to this script reaches it (timeout runs in its own
    # process group); -k: a server that hangs while draining is killed a minute later
    env "${pairs[@]}" timeout -k 60 "$LIMIT" bash bench/gpu_loadtest.sh "$RESULTS/$name" \
        "$RATES" "$DURATION" &
    RUN=$!
    wait "$RUN"
    rc=$?
    RUN=""
    echo "== $name: exit $rc"
    [ "$rc" -eq 0 ] || failed=1
done
exit "$failed"
