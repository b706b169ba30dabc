#!/usr/bin/env bash
# Goodput past capacity on the GPU (docs/RELIABILITY.md): the paper profile served as in
# bench/gpu_loadtest.sh (3 workers sharing the GPU through MPS, the 30 M-ad index built on
# the machine, an untrained `paper` model: serving speed does not depend on the weights),
# then open-loop load from loadtest/overload.py with a client DEADLINE_MS on every call at
# each of RATES req/s for DURATION seconds: goodput (OK within the deadline per second),
# outcomes, refusal latency. One JSON per rate in OUT, the server's metrics after each, its
# log, and OUT/summary.json with a table (bench/summarize_overload.py: goodput against the
# run's own BASELINE_RATE point, default 1000 req/s, about the served capacity). On the lent H200 machine: `. bench/gpu_env.sh` first (wheels from
# bench/fetch_gpu_wheels.sh).
# Usage: bash bench/gpu_overload.sh OUT [RATES] [DURATION] [DEADLINE_MS]
#   DATA=/tmp/paper bash bench/gpu_overload.sh $OUT/overload "1000 2000" 20 100
# Smoke test on a CPU: ADS=20000 PROFILE=tiny DEVICE=cpu WORKERS=1 \
#   bash bench/gpu_overload.sh /tmp/ovl "40 80" 5 1000
set -uo pipefail
. "$(dirname "$0")/serve_lib.sh"
OUT=${1:?output directory}; RATES=${2:-"1000 2000"}; DURATION=${3:-20}; DEADLINE_MS=${4:-100}
ADS=${ADS:-30000000}; PROFILE=${PROFILE:-paper}; DEVICE=${DEVICE:-cuda}; WORKERS=${WORKERS:-3}
PROCS=${GEN_PROCESSES:-4}; CHANNELS=${GEN_CHANNELS:-16}  # 64 client connections
DATA=${DATA:-$OUT}
export GRACE_PROFILE=$PROFILE
GRACE=(python3 -m cli)
mkdir -p "$OUT" "$DATA"
paper_data "$OUT/paper_index.json"
init_model "$DATA/model"
publish_model
[ -f "$DATA/requests.jsonl" ] || "${GRACE[@]}" record --world "$DATA/world" --users 1000 \
    --out "$DATA/requests.jsonl" || exit 1
"${GRACE[@]}" serve --data-dir "$DATA" --model "$DATA/models" --index-root "$DATA/index" \
    --device "$DEVICE" --no-progress --workers "$WORKERS" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER' EXIT
wait_serving $SERVER "$OUT/server.log"
echo "($WORKERS worker(s))"
metrics() { scrape_workers "$WORKERS" "$OUT/metrics_$1"; }  # worker i on 9464 + i
load() {  # rate seconds deadline_ms name
    python3 -m loadtest.overload --target localhost:50051 --replay "$DATA/requests.jsonl" \
        --rate "$1" --seconds "$2" --deadline-ms "$3" --processes "$PROCS" \
        --channels "$CHANNELS" --json "$OUT/$4.json"
}
# unjudged warm-up: cold allocator pools and library plans meet the first traffic
load "${WARMUP_RATE:-300}" 10 1000 warmup > "$OUT/warmup.log" 2>&1
metrics start
for rate in $RATES; do
    echo "== $rate req/s offered, deadline $DEADLINE_MS ms"
    load "$rate" "$DURATION" "$DEADLINE_MS" "rate_$rate" || echo "rate $rate: generator failed"
    sleep 2  # the last calls' answers (at most one deadline) and the scrape see them
    metrics "$rate"
done
python3 bench/summarize_overload.py "$OUT" --baseline "${BASELINE_RATE:-1000}" --svg "$OUT/goodput_gpu.svg"
