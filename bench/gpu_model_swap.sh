#!/usr/bin/env bash
# Model hot swap under load on the lent H200 (docs/PERFORMANCE.md, "Model rollout"), wheels
# from bench/fetch_gpu_wheels.sh, `. bench/gpu_env.sh` first:
#   1. the paper-scale world and index (bench/bench_paper_index.py) and two untrained
#      `paper` models (`grace init-model`, seeds 0 and 1: serving speed does not depend
#      on the weights); model 0 published into a model repository (`grace publish-model`);
#   2. `grace serve --model REPO` on CUDA, waited for with `grace health`;
#   3. bench/bench_model_swap.py offers RATE req/s open-loop for DURATION seconds and
#      publishes model 1 after 25 s: publish -> first answer of the new model, P50/P99
#      before, during and after the swap, failed calls, old answers after the first new.
#      Swaps are paced (rollout_share 0.25): the three workers of the paper model take
#      ~3 minutes, hence the 240 s default; GRACE_ROLLOUT_SHARE=1 turns pacing off.
# Usage: bash bench/gpu_model_swap.sh OUT [RATE] [DURATION]; DATA=DIR keeps the world,
# index and models (default /tmp/paper, shared with bench/gpu_loadtest.sh); WORKERS=N
# serves with `grace serve --workers N` (one process serves ~660 req/s at this shape: the
# 1,000 req/s figure needs 3, docs/PERFORMANCE.md); STACKS_AT="S ..." sends SIGUSR1 to the
# server S seconds after the bench starts, for each S (each worker writes its threads' stacks to
# server.log; publishing starts 30 s after the bench does, and for the paper model CURRENT
# moves ~20 s later).
# Smoke test on a CPU: ADS=20000 PROFILE=tiny DEVICE=cpu DATA=/tmp/ms bash \
#   bench/gpu_model_swap.sh /tmp/ms/out 40 40
set -uo pipefail
. "$(dirname "$0")/serve_lib.sh"
OUT=${1:?output directory}; RATE=${2:-1000}; DURATION=${3:-240}
DATA=${DATA:-/tmp/paper}; ADS=${ADS:-30000000}; PROFILE=${PROFILE:-paper}; DEVICE=${DEVICE:-cuda}
GRACE=(python3 -m cli)
mkdir -p "$OUT" "$DATA"
paper_data "$DATA/paper_index.json"
for seed in 0 1; do init_model "$DATA/model-$seed" "$seed"; done
rm -rf "$DATA/models"
"${GRACE[@]}" publish-model "$DATA/model-0" --root "$DATA/models" || exit 1
GRACE_PROFILE=$PROFILE GRACE_QUEUE_CAPACITY=${GRACE_QUEUE_CAPACITY:-128} "${GRACE[@]}" serve \
    --data-dir "$DATA" --model "$DATA/models" --index-root "$DATA/index" --device "$DEVICE" \
    --workers "${WORKERS:-1}" --no-progress > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER' EXIT
wait_serving $SERVER "$OUT/server.log"
for at in ${STACKS_AT:-}; do  # every worker's thread stacks into server.log then
    (sleep "$at"; kill -USR1 "$SERVER" 2>/dev/null) &
done
name=$(python3 -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')")
python3 bench/bench_model_swap.py --target localhost:50051 --repo "$DATA/models" \
    --checkpoint "$DATA/model-1" --world "$DATA/world" --rate "$RATE" --seconds "$DURATION" \
    --publish-at 25 --warmup 10 --processes "${PROCS:-4}" --device "$name, $PROFILE profile" \
    --out "$OUT/model_swap.json" > "$OUT/bench.log" 2>&1
rc=$?
tail -45 "$OUT/bench.log"
scrape_workers "${WORKERS:-1}" "$OUT/metrics"  # worker i serves metrics on 9464 + i
grep -E "grace.rollout|CUDA graphs" "$OUT/server.log" | tail -12
exit $rc
