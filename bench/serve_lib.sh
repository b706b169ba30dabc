# Sourced by the GPU benchmark scripts (bench/gpu_overload.sh, bench/gpu_model_swap.sh):
# wait for the server they started, and scrape every worker's metrics.
#   wait_serving PID LOG   until `grace health` says SERVING on :50051 (exit 1 with the
#                          log's tail if the server exits first); prints how long it took
#   scrape_workers N OUT_PREFIX   worker i's /metrics (port 9464 + i) to OUT_PREFIX_w<i>.prom

wait_serving() {
    local pid=$1 log=$2 start
    start=$(date +%s)
    until python3 -m cli health --target localhost:50051 --timeout 2 >/dev/null 2>&1; do
        kill -0 "$pid" 2>/dev/null || { echo "server exited"; tail -20 "$log"; exit 1; }
        sleep 1
    done
    echo "SERVING after $(( $(date +%s) - start )) s"
}

scrape_workers() {
    local n=$1 prefix=$2 i
    for ((i = 0; i < n; i++)); do
        python3 -c "import urllib.request as u; print(u.urlopen('http://localhost:$((9464 + i))/metrics').read().decode())" \
            > "${prefix}_w$i.prom" 2>/dev/null
    done
}
