#!/usr/bin/env bash
# Several server configurations against one index, one `bench/gpu_loadtest.sh` run each
# (docs/OPERATIONS.md): for a GPU session that must compare settings within a few calls.
# Each configuration is NAME or NAME:VAR=VALUE,VAR=VALUE (any GRACE_* setting, or the load
# script's own WORKERS, USERS, ...), runs under a time limit of LIMIT seconds (server
# start included; a run cut short still writes the rates it finished) and writes
# RESULTS/NAME (summary.json, CSVs, logs). The index, world and model are built once in
# DATA (default /tmp/paper) by the first run. Ends with one table per configuration.
# Usage: bash bench/gpu_configs.sh RESULTS RATES DURATION LIMIT CONFIG...
#   bash bench/gpu_configs.sh /tmp/res "850 900 950 1000" 20s 290 \
#       base balance:GRACE_BALANCE=request mps:GRACE_MPS=true
set -uo pipefail
if [ $# -lt 5 ]; then
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
RESULTS=$1; RATES=$2; DURATION=$3; LIMIT=$4; shift 4
export DATA=${DATA:-/tmp/paper} WORKERS=${WORKERS:-2}
for spec in "$@"; do
    name=${spec%%:*}
    case $name in ''|*/*|.*) echo "bad configuration name in '$spec'"; exit 2 ;; esac
    settings=""
    [[ $spec == *:* ]] && settings=${spec#*:}
    echo "== $name ${settings:+($settings)}"
    (
        IFS=,
        for kv in $settings; do
            [[ $kv == [A-Za-z_]*=* ]] || { echo "bad setting '$kv' in '$spec'"; exit 2; }
            export "${kv?}"
        done
        unset IFS
        timeout "$LIMIT" bash bench/gpu_loadtest.sh "$RESULTS/$name" "$RATES" "$DURATION"
    )
    echo "== $name: exit $?"
done
