"""`bench/model_batching.py`, the batching model used to rank graph buckets before GPU
load tests: calibrated on the measured per-bucket decode cost, and behaving as a batching
server must (less padding with finer buckets, refusals past capacity)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.model_batching import MEASURED, RESULTS, Server, fit_decode_cost, simulate

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "model_batching.py"


def test_decode_cost_fits_the_measured_buckets() -> None:
    a, b = fit_decode_cost()
    per = json.loads((RESULTS / "decoder_loop_buckets.json").read_text())["figures"]["per_batch"]
    for bucket, row in per.items():
        assert abs(a + b * int(bucket) - row["p50_ms"]) < 0.3, (bucket, a, b)


def test_finer_buckets_pad_less_and_wait_less() -> None:
    """Same arrivals (seed), same load: each finer bucket set computes less padding, and
    at a load where coarse buckets saturate the GPU, latency falls with it."""
    runs = [
        simulate(Server(buckets=b, decode_ms=fit_decode_cost()), 900, seconds=10)
        for b in ((4, 8, 16), (4, 8, 12, 16), (2, 4, 6, 8, 10, 12, 14, 16))
    ]
    shares = [r["padding_share"] for r in runs]
    assert shares[0] > shares[1] > shares[2] > 0
    assert runs[0]["p99_ms"] > runs[2]["p99_ms"]
    assert all(r["refused"] == 0 for r in runs)


def test_busy_from_one_batch_stops_batches_queueing_on_the_gpu() -> None:
    """busy_batches=1 (the batcher's setting) keeps a batch filling whenever anything is in
    flight and closes it when the pipeline empties: batches stop queueing behind each
    other on the GPU, so the same load sees a lower P99."""
    fine = (2, 4, 6, 8, 10, 12, 14, 16)
    one, two = (
        simulate(Server(buckets=fine, busy_batches=b, decode_ms=fit_decode_cost()), 900, 10)
        for b in (1, 2)
    )
    assert one["p99_ms"] < 0.8 * two["p99_ms"]
    assert one["ok_rps"] == two["ok_rps"]  # the same arrivals, all answered


def test_light_load_runs_small_batches_after_max_wait() -> None:
    """At 50 req/s a batch closes max_wait after its first request, nearly alone: latency
    is that wait plus one small batch's CPU, GPU and post time."""
    server = Server()
    r = simulate(server, 50, seconds=20)
    floor = server.max_wait_ms + server.gpu_s(1) * 1e3 + server.post_ms
    assert r["mean_batch"] < 1.5
    assert floor - 1 < r["p50_ms"] < floor + 3


def test_overload_is_refused_at_the_queue() -> None:
    """Offered far past the GPU's capacity, a small queue refuses the excess and the
    answered rate stays near what the GPU can run in full batches."""
    server = Server(queue_capacity=32)
    r = simulate(server, 3000, seconds=5)
    capacity = 16 / server.gpu_s(16)
    assert r["refused"] > 0 and r["ok_rps"] < 1.05 * capacity
    assert r["mean_batch"] > 15


def test_check_prints_the_model_next_to_the_measured_runs() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--check", "--seconds", "5"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "not a measurement" in done.stdout
    assert done.stdout.count("measured P99") == sum(len(seen) for *_, seen in MEASURED)
    for bad in (["--buckets", "8,4"], ["--shares", "0.5"], ["--shares", "a,b"],
                ["--shares", "-1,2"]):  # fmt: skip
        done = subprocess.run([sys.executable, str(SCRIPT), *bad], capture_output=True)
        assert done.returncode == 2, bad


def test_uneven_request_shares_load_one_worker_more() -> None:
    """`shares` sends that share of the arrivals to each worker (SO_REUSEPORT spreads
    connections, not requests): the loaded worker forms fuller batches and the tail grows,
    while an even split is what `None` gives."""
    fine = (2, 4, 6, 8, 10, 12, 14, 16)
    even, skew = (
        simulate(Server(buckets=fine, busy_batches=1, shares=sh, decode_ms=fit_decode_cost()),
                 1000, 10)
        for sh in ((0.5, 0.5), (0.8, 0.2))
    )  # fmt: skip
    assert skew["p99_ms"] > even["p99_ms"]
    with pytest.raises(ValueError, match="shares"):
        Server(shares=(1.0,))  # two workers, one weight
