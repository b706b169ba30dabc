# Sourced by bench/gpu_loadtest.sh, gpu_overload.sh and gpu_model_swap.sh:
#   paper_data JSON   unless DATA holds them, the paper-scale world, tokenizer and index (ADS
#                     ads, on DEVICE) in DATA; bench/bench_paper_index.py's figures to JSON
#   init_model DIR [SEED]   unless DIR holds one, an untrained PROFILE model on DATA's tokenizer
#   publish_model     unless DATA/models holds one, DATA/model published into the model
#                     repository DATA/models as an operator deploys one (`grace publish-model`
#                     with the canary and the FP8 quality record on DATA's index and world:
#                     dtype auto then serves it in FP8 where its record passes)
#   wait_serving PID LOG [START]   until `grace health` says SERVING on :50051 (exit 1 with
#                     the log's tail if the server exits first); prints the seconds since START
#   worker_metrics I  worker I's Prometheus text (its /metrics on port 9464 + I)
#   scrape_workers N PREFIX   every worker's metrics to PREFIX_w<i>.prom

paper_data() {
    [ -f "$DATA/index/CURRENT" ] || python3 bench/bench_paper_index.py --ads "$ADS" --users 1000 \
        --out "$DATA" --workers "$(nproc)" --device "$DEVICE" --quiet --json "$1" || exit 1
}

init_model() {
    [ -f "$1/config.json" ] || python3 -m cli init-model --profile "$PROFILE" \
        --tokenizer "$DATA/tokenizer" --out "$1" ${2:+--seed "$2"} || exit 1
}

publish_model() {
    [ -f "$DATA/models/CURRENT" ] || python3 -m cli publish-model "$DATA/model" --root "$DATA/models" \
        --index "$DATA/index" --world "$DATA/world" --device "$DEVICE" --no-progress || exit 1
}

wait_serving() {
    local pid=$1 log=$2 start=${3:-$(date +%s)}
    until python3 -m cli health --target localhost:50051 --timeout 2 >/dev/null 2>&1; do
        kill -0 "$pid" 2>/dev/null || { echo "server exited"; tail -20 "$log"; exit 1; }
        sleep 1
    done
    echo "SERVING after $(( $(date +%s) - start )) s"
}

worker_metrics() {
    python3 -c "import urllib.request as u; print(u.urlopen('http://localhost:$((9464 + $1))/metrics').read().decode())" 2>/dev/null
}

scrape_workers() {
    local n=$1 prefix=$2 i
    for ((i = 0; i < n; i++)); do worker_metrics "$i" > "${prefix}_w$i.prom"; done
}
