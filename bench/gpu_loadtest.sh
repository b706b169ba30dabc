#!/usr/bin/env bash
# Served throughput of one GPU at P99 <= 100 ms (docs/ARCHITECTURE.md §9, docs/OPERATIONS.md): on the
# lent H200 machine (wheels from bench/fetch_gpu_wheels.sh, `. bench/gpu_env.sh` first).
#   1. the paper-scale world and index (bench/bench_paper_index.py), an untrained `paper`
#      model (`grace init-model`: serving speed does not depend on the weights);
#   2. the model published into DATA/models with its canary and FP8 quality record
#      (`grace publish-model`), then `grace serve` on CUDA with the paper profile (dtype auto:
#      FP8 where the record passes, else bf16; GRACE_DTYPE forces; CUDA graphs captured
#      before SERVING), waited for with `grace health`;
#   3. open-loop locust at each rate for DURATION, thresholds P99 <= 100 ms and <= 0.1 %
#      failures, after an unjudged warm-up (WARMUP_RATE req/s for WARMUP): the highest
#      rate that passes is the figure. CSVs, logs and the server's
#      /metrics after each rate go to OUT (PYSPY_RATE=R: also py-spy stacks during rate R),
#      and `nvidia-smi dmon` GPU utilisation per second during each rate (dmon_<rate>.txt).
#      WORKERS=N serves with `grace serve --workers N` (metrics of each worker kept).
#   4. bench/summarize_loadtest.py turns those files into OUT/summary.json and a table —
#      also when the script is stopped early (timeout, Ctrl-C): the rates done so far.
# Usage: bash bench/gpu_loadtest.sh OUT [RATES] [DURATION]
# DATA=DIR keeps world, index, model and the replay file there instead of in OUT, so one
# build serves several runs: DATA=/tmp/paper GRACE_MPS=true bash bench/gpu_loadtest.sh
# /tmp/res/mps "900 1000" 20s (any GRACE_* setting reaches the server).
# Smoke test on a CPU: ADS=20000 PROFILE=tiny DEVICE=cpu LOCUST_PROCESSES=2 \
#   bash bench/gpu_loadtest.sh /tmp/lt 20 8s
set -uo pipefail
. "$(dirname "$0")/serve_lib.sh"
OUT=${1:?output directory}; RATES=${2:-"250 500 750 1000 1250 1500"}; DURATION=${3:-30s}
ADS=${ADS:-30000000}; PROFILE=${PROFILE:-paper}; DEVICE=${DEVICE:-cuda}
PROCS=${LOCUST_PROCESSES:-4}  # locust worker processes: one gevent loop tops out near 1k req/s
WORKERS=${WORKERS:-1}  # grace serve --workers: serving processes sharing the port
# client connections (one per locust user): SO_REUSEPORT spreads connections, not
# requests, over workers; 16 left one of two workers with a third of the load
USERS=${USERS:-64}
DATA=${DATA:-$OUT}
for v in GRACE_PROFILE GRACE_DEVICE GRACE_WORKERS GRACE_PORT GRACE_METRICS_PORT GRACE_DATA_DIR; do
    # set by this script (flags, fixed ports it polls): use PROFILE=, DEVICE=, WORKERS=, DATA=
    [ -z "${!v:-}" ] || { echo "$v is set by this script; unset it (see the header)"; exit 2; }
done
export GRACE_QUEUE_CAPACITY=${GRACE_QUEUE_CAPACITY:-128} GRACE_PROFILE=$PROFILE
GRACE=(python3 -m cli)
mkdir -p "$OUT" "$DATA"
# what this run ran with, for the summary (the server reads every GRACE_* variable)
{ env | grep -E '^GRACE_'; echo "WORKERS=$WORKERS"; echo "USERS=$USERS"; echo "DEVICE=$DEVICE"
  echo "PROFILE=$PROFILE"; echo "DATA=$DATA"; echo "ADS=$ADS"; } | sort > "$OUT/settings.env"
paper_data "$DATA/paper_index.json"
init_model "$DATA/model"
publish_model
SERVER=""
DONE_RATES=""
finish() {  # stop the server; summarise the rates run so far (all of them, or a timeout's)
    local rc=$?
    trap - EXIT INT TERM
    [ -n "$SERVER" ] && { kill -TERM "$SERVER" 2>/dev/null; wait "$SERVER"; }
    # the figures of this run (bench/summarize_loadtest.py): OUT/summary.json and a table
    if [ -n "$DONE_RATES" ]; then
        python3 bench/summarize_loadtest.py "$OUT" --rates "$DONE_RATES" \
            --duration "$DURATION" --skip-missing || rc=1
    fi
    exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
"${GRACE[@]}" serve --data-dir "$DATA" --model "$DATA/models" --index-root "$DATA/index" \
    --device "$DEVICE" --no-progress --workers "$WORKERS" > "$OUT/server.log" 2>&1 &
SERVER=$!
start=$(date +%s)
for ((i = 0; i < WORKERS; i++)); do  # every worker has warmed up (its first batch done)
    until worker_metrics "$i" | grep -Eq '^grace_batch_size_count [1-9]'; do
        kill -0 $SERVER 2>/dev/null || { echo "server exited"; tail -20 "$OUT/server.log"; exit 1; }
        sleep 2
    done
done
wait_serving $SERVER "$OUT/server.log" "$start"
echo "($WORKERS worker(s))"
# MPS is on by default for several CUDA workers: record whether the daemon really ran
mps=no; grep -q "MPS control daemon started" "$OUT/server.log" && mps=yes
{ cat "$OUT/settings.env"; echo "MPS_STARTED=$mps"; } | sort > "$OUT/settings.tmp" \
    && mv "$OUT/settings.tmp" "$OUT/settings.env"
# a replay file loads in a fraction of a second (building requests from the world takes
# seconds, during which a locust worker would miss its heartbeats)
if [ ! -f "$DATA/requests.jsonl" ]; then  # whole or not at all: a timeout may come
    "${GRACE[@]}" record --world "$DATA/world" --users 1000 --out "$DATA/requests.tmp.jsonl" \
        && mv "$DATA/requests.tmp.jsonl" "$DATA/requests.jsonl" || exit 1
fi
# the server's Prometheus metrics (stage times, batch sizes) after the warm-up and each rate
scrape() { scrape_workers "$WORKERS" "$OUT/metrics_$1"; }
# a short unjudged warm-up: the first traffic after SERVING meets cold allocator pools
# and library plans (the first measured rate read P99 3.2 s without it)
python3 -m locust -f loadtest/locustfile.py --headless -H localhost:50051 -u "$USERS" -r "$USERS" \
    -t "${WARMUP:-10s}" --processes "$PROCS" --only-summary --replay "$DATA/requests.jsonl" \
    --arrival-rate "${WARMUP_RATE:-200}" > "$OUT/warmup.log" 2>&1
scrape start
for rate in $RATES; do
    if [ "${PYSPY_RATE:-}" = "$rate" ] && command -v py-spy >/dev/null; then
        # where the server's threads spend the GIL at this rate (collapsed stacks)
        (sleep 5; py-spy record -d 10 -r 100 --threads --nonblocking --format raw \
            -o "$OUT/pyspy_$rate.txt" --pid "$( ((WORKERS > 1)) \
            && pgrep -P $SERVER -f spawn_main | head -1 || echo $SERVER)" >/dev/null 2>&1) &
    fi
    DMON=
    if command -v nvidia-smi >/dev/null; then  # is the GPU the limit? (sm % per second)
        nvidia-smi dmon -s u -d 1 > "$OUT/dmon_$rate.txt" 2>&1 &
        DMON=$!
    fi
    python3 -m locust -f loadtest/locustfile.py --headless -H localhost:50051 -u "$USERS" -r "$USERS" -t "$DURATION" \
        --processes "$PROCS" \
        --only-summary --replay "$DATA/requests.jsonl" --arrival-rate "$rate" \
        --max-inflight 4000 --csv "$OUT/rate_$rate" --grace-p99-ms 100 \
        --grace-fail-ratio 0.001 > "$OUT/rate_$rate.log" 2>&1
    echo "rate $rate req/s: exit $? ($(grep -h 'grace loadtest' "$OUT/rate_$rate.log" | tail -1))"
    [ -n "$DMON" ] && kill "$DMON" 2>/dev/null
    scrape "$rate"
    DONE_RATES="$DONE_RATES $rate"
done
