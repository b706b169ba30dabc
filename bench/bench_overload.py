"""Reliability under overload on the CPU demo: goodput past capacity, index hot swaps
under load, and the server's memory over hundreds of swaps.

One served world (tiny synthetic world, untrained tiny model, published index: the
steps of tests/helpers/serving.py) and one real server process (`python -m cli
serve --device cpu`, index polled every 0.1 s), then:

  1. capacity: closed loop, --concurrency callers back to back (after a warm-up);
  2. sweep: open-loop offered load at each --multiples of capacity, for each client
     deadline in --deadlines-ms (loadtest/overload.py): goodput (OK within the deadline
     per second, steady state after a 20 % warm-up; absolute and as a fraction of
     capacity), outcome counts, OK latency P50/P99, refusal P99, generator lag; with
     --refusal-only the same sweep again on a second server with the beam ladder off
     (service/beam_ladder.py: refusal is then its only answer to load), same capacity;
     with --baseline-src DIR the same sweep on a server run from DIR (another checkout of
     this repository, e.g. the parent commit's tree), same capacity. The servers of a
     sweep are up together and take each point in turn (interleaved), so a shift in
     what else runs on the box hits every one of them alike. Each point also records
     where the box's CPU went while it ran (the server's, this generator's, the rest)
     and the server's own counters over the point (batches by beam rung, refusals by
     reason, expiries and drops, compute stage seconds);
  3. hot swaps under load: --swaps new index versions published (`index_builder.publish`,
     the current arrays rewritten under a new version name) one after another as fast
     as the server swaps them, while open-loop load at --swap-load x capacity runs;
     RPCs sent and failed, swaps counted by the server (grace_index_swaps_total);
  4. memory: the server's RSS before and every --rss-every swaps over --memory-swaps
     more swaps (under --memory-load x capacity), to show it stays flat.

Writes bench/results/overload_cpu.json (command, commit, device, date, figures) and the
plot docs/figures/goodput_cpu.svg (goodput / capacity against offered load / capacity, one
line per deadline, and the ideal min(offered, capacity)); --out DIR writes both there
instead. Prints a markdown table of the sweep. --quick: a short smoke run of every part;
--sweep-only: capacity and sweep, no swaps or memory.

    .venv/bin/python bench/bench_overload.py               # ~8 minutes
    .venv/bin/python bench/bench_overload.py --quick --out /tmp/overload
    .venv/bin/python bench/bench_overload.py --sweep-only --deadlines-ms 1000 \\
        --baseline-src /tmp/parent --out /tmp/overload       # this tree against another
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.common import ROOT, write_result
from bench.svg_plot import Series, write_line_chart
from contracts.index_format import read_index_dir, write_index_dir
from index_builder.publish import current_path, publish
from loadtest.overload import probe_capacity, run_open_loop, world_requests
from loadtest.overload_results import OK, OverloadResult
from tests.helpers.server_process import ServerProcess, free_ports, metric_value

FIGURES = ROOT / "docs" / "figures"
# manifest keys write_index_dir fills in itself
_FORMAT_KEYS = {"format", "format_version", "targeting", "sid_length", "vocab_size", "arrays"}
STEADY_WARMUP = 0.2  # the share of each point's run left out of its steady-state figures
_start = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - _start:6.1f} s] {msg}", flush=True)


def settle(server: ServerProcess) -> None:
    """Wait until the last point's backlog is gone (say so if it is not)."""
    if not server.wait_idle():
        progress("warning: server still busy after 120 s")


def republisher(index_root: Path) -> Callable[[Path, str], None]:
    """A `publish` writer that rewrites the current version's arrays (read once, into
    memory) with a manifest naming the new version: a valid index, quickly."""
    current = current_path(index_root)
    if current is None:
        raise FileNotFoundError(f"{index_root}: nothing published (no CURRENT)")
    manifest, arrays = read_index_dir(current, verify_checksums=False, mmap=False)
    base = {k: v for k, v in manifest.items() if k not in _FORMAT_KEYS}

    def write(directory: Path, version: str) -> None:
        created = datetime.now(UTC).isoformat()
        write_index_dir(directory, arrays, {**base, "index_version": version, "created": created})

    return write


# how load is offered at every point: run_open_loop with the target, requests, channels,
# steady-state warm-up and arrival process fixed, called as gen(rate, seconds, deadline_s)
Offer = Callable[..., Awaitable[OverloadResult]]


# the server's counters a sweep point records (their increase over the point), by label
COUNTERS = {
    "rung_batches": ("grace_beam_rung_batches_total", "rung"),
    "refused": ("grace_admission_refused_total", "reason"),
    "queue_expired": ("grace_queue_expired_total", None),
    "stage_dropped": ("grace_stage_dropped_total", "reason"),
    "batches": ("grace_batch_size_count", None),
    "batched_requests": ("grace_batch_size_sum", None),
    "compute_seconds": ("grace_stage_duration_seconds_sum", "stage=compute"),
}


def counters(text: str) -> dict[str, Any]:
    """The COUNTERS of one metrics scrape: a number, or a number by label value."""
    out: dict[str, Any] = {}
    for key, (name, label) in COUNTERS.items():
        if label is None or "=" in label:
            want = dict([label.split("=")]) if label else None
            out[key] = metric_value(text, name, want) or 0.0
            continue
        by: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(name + "{") and f'{label}="' in line:
                value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                by[value] = by.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
        out[key] = by
    return out


def _delta(after: Any, before: Any) -> Any:
    if isinstance(after, dict):
        return {k: round(v - before.get(k, 0.0), 4) for k, v in after.items()
                if v - before.get(k, 0.0)}  # fmt: skip
    return round(after - before, 4)


class CpuMeter:
    """Where the box's CPU goes over a span: the server process, this generator (with
    the generator processes it spawned and reaped) and everything else, in cores."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = psutil.Process(server.proc.pid)

    def _read(self) -> tuple[float, float, float, float]:
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        s = self.server.cpu_times()
        box = psutil.cpu_times()
        busy = box.user + box.nice + box.system + getattr(box, "irq", 0.0) + getattr(
            box, "softirq", 0.0) + getattr(box, "steal", 0.0)  # fmt: skip
        client = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
        return time.monotonic(), s.user + s.system, client, busy

    def __enter__(self) -> CpuMeter:
        self._start = self._read()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._read()
        wall = max(end[0] - self._start[0], 1e-9)
        server, client, busy = ((b - a) / wall for a, b in zip(self._start[1:], end[1:],
                                                                strict=True))  # fmt: skip
        self.figures = {
            "cpus": psutil.cpu_count(),
            "server_cores": round(server, 3),
            "generator_cores": round(client, 3),
            "other_cores": round(max(busy - server - client, 0.0), 3),
            "idle_cores": round(max((psutil.cpu_count() or 1) - busy, 0.0), 3),
        }


def sweep(servers: dict[str, tuple[ServerProcess, Offer]], capacity: float,
          a: argparse.Namespace) -> list[dict]:  # fmt: skip
    """Every point on every server of `servers` (policy -> server, its load), the
    servers taking each point in turn."""
    rows = []
    for deadline_ms in a.deadlines_ms:
        for multiple in a.multiples:
            for policy, (server, gen) in servers.items():
                settle(server)
                rate = multiple * capacity
                before = counters(server.metrics_text())
                with CpuMeter(server) as cpu:
                    r = asyncio.run(gen(rate, a.point_seconds, deadline_ms / 1e3,
                                        processes=a.processes))  # fmt: skip
                after = counters(server.metrics_text())
                share = r.steady_goodput_rps / r.offered_rps if r.offered_rps else 0.0
                row = {
                    "policy": policy,  # the beam ladder (the default), refusal-only, baseline
                    "multiple": multiple,
                    "deadline_ms": deadline_ms,
                    "goodput_fraction": round(r.steady_goodput_rps / capacity, 4),
                    "goodput_fraction_whole_run": round(r.goodput_rps / capacity, 4),
                    # the share of the offered requests answered in time (steady state)
                    "answered_share": round(share, 4),
                    "cpu": cpu.figures,
                    "server_counters": {k: _delta(after[k], before[k]) for k in after},
                    **r.to_dict(),
                }
                rows.append(row)
                counts = ", ".join(f"{k} {v.count}" for k, v in r.outcomes.items())
                c = cpu.figures
                progress(
                    f"{policy}: {multiple:g}x capacity ({rate:.0f} req/s), "
                    f"deadline {deadline_ms:g} ms: "
                    f"goodput {r.steady_goodput_rps:.1f} req/s ({row['goodput_fraction']:.2f}x"
                    f", {share:.0%} of offered); {counts}; "
                    f"lag P99 {r.lag_p99_ms} ms; cores: server {c['server_cores']}, "
                    f"generator {c['generator_cores']}, other {c['other_cores']}, "
                    f"idle {c['idle_cores']}; rungs {row['server_counters']['rung_batches']}"
                    + ("  GENERATOR BEHIND" if r.generator_behind else "")
                )
    return rows


def start_server(data: Path, log: Path, device: str, env: dict[str, str],
                 src: Path | None = None) -> ServerProcess:  # fmt: skip
    """`ServerProcess.start`, or the same `grace serve` run from the checkout `src`
    (its own code on sys.path first: `python -m cli` from its root)."""
    if src is None:
        return ServerProcess.start(data, log, device=device, env=env)
    port, metrics_port = free_ports(1, 1)
    cmd = [sys.executable, "-m", "cli", "serve", "--data-dir", str(data), "--port", str(port),
           "--metrics-port", str(metrics_port), "--device", device, "--no-progress"]  # fmt: skip
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=src, env=os.environ | env, stdout=fh,
                                stderr=subprocess.STDOUT)  # fmt: skip
    return ServerProcess(proc, port, metrics_port, log)


async def swaps_under_load(
    server: ServerProcess,
    index_root: Path,
    gen: Offer,
    *,
    swaps: int,
    rate: float,
    deadline_s: float,
    rss_every: int = 0,
    swap_timeout_s: float = 60.0,
) -> dict[str, Any]:
    """Publish `swaps` versions one after another, each as soon as the server has swapped
    (or rejected) the previous one, while open-loop load at `rate` runs."""
    write = republisher(index_root)

    def counted() -> tuple[float, float]:
        text = server.metrics_text()
        return (
            metric_value(text, "grace_index_swaps_total") or 0.0,
            metric_value(text, "grace_index_swap_failures_total") or 0.0,
        )

    swaps0, failures0 = await asyncio.to_thread(counted)
    rss = [{"swaps": 0, "rss_mb": server.rss_mb()}]
    stop = asyncio.Event()
    load = None
    if rate > 0:
        load = asyncio.create_task(gen(rate, 24 * 3600.0, deadline_s, stop=stop, processes=1))
        await asyncio.sleep(0.5)  # the load is running before the first swap
    t0 = time.perf_counter()
    try:
        for i in range(1, swaps + 1):
            await asyncio.to_thread(publish, index_root, write)
            end = time.monotonic() + swap_timeout_s
            while True:
                s, f = await asyncio.to_thread(counted)
                if s + f >= swaps0 + failures0 + i:
                    break
                server.check_alive()
                if time.monotonic() > end:
                    raise TimeoutError(f"swap {i} not seen in {swap_timeout_s:.0f} s")
                await asyncio.sleep(0.02)
            if rss_every and (i % rss_every == 0 or i == swaps):
                rss.append({"swaps": i, "rss_mb": server.rss_mb()})
                progress(f"{i} swaps: server RSS {rss[-1]['rss_mb']:.1f} MiB")
            elif i % 25 == 0:
                progress(f"{i} swaps")
        seconds = time.perf_counter() - t0
    finally:
        stop.set()
        result = await load if load is not None else None
    s, f = await asyncio.to_thread(counted)
    out: dict[str, Any] = {
        "published": swaps,
        "swaps_counted": int(s - swaps0),
        "swap_failures_counted": int(f - failures0),
        "seconds": round(seconds, 2),
        "swaps_per_s": round(swaps / seconds, 2) if seconds > 0 else None,
        "load_rate": round(rate, 2),
        "load_deadline_ms": deadline_s * 1e3,
    }
    if result is not None:
        out |= {
            "rpcs_sent": result.arrivals,
            "rpcs_ok": result.count(OK),
            "rpcs_failed": result.arrivals - result.count(OK),
            "outcomes": {k: v.count for k, v in result.outcomes.items()},
            "ok_p50_ms": result.ok_p50_ms,
            "ok_p99_ms": result.ok_p99_ms,
            "lag_p99_ms": result.lag_p99_ms,
        }
    if rss_every:
        out["rss_mb"] = rss
        out["rss_growth_mb"] = round(rss[-1]["rss_mb"] - rss[0]["rss_mb"], 1)
    return out


def deadline_label(ms: float) -> str:
    return f"{ms / 1e3:g} s" if ms >= 1000 else f"{ms:g} ms"


def markdown_table(rows: list[dict[str, Any]], capacity: float) -> str:
    def v(x: float | None, fmt: str = ".1f") -> str:
        return "—" if x is None else format(x, fmt)

    head = (
        "| policy | offered (x cap) | deadline | offered req/s | goodput req/s | goodput (x cap) "
        "| answered in time "
        "| OK | RESOURCE_EXHAUSTED | DEADLINE_EXCEEDED | other | OK P50 ms | OK P99 ms "
        "| refusal P99 ms | lag P99 ms |"
    )
    sep = "|" + "---|" * (head.count("|") - 1)
    lines = [f"capacity {capacity:.1f} req/s (closed loop)", "", head, sep]
    for r in rows:
        counts = {k: o["count"] for k, o in r["outcomes"].items()}
        ok = counts.pop(OK, 0)
        re = counts.pop("RESOURCE_EXHAUSTED", 0)
        de = counts.pop("DEADLINE_EXCEEDED", 0)
        other = sum(counts.values())
        lag = v(r["lag_p99_ms"]) + (" (behind)" if r["generator_behind"] else "")
        lines.append(
            f"| {r.get('policy', 'ladder')} | {r['multiple']:g} "
            f"| {deadline_label(r['deadline_ms'])} | {r['offered_rps']:.1f} "
            f"| {r['steady_goodput_rps']:.1f} | {r['goodput_fraction']:.2f} "
            f"| {r.get('answered_share', 0):.0%} | {ok} | {re} "
            f"| {de} | {other} | {v(r['ok_p50_ms'])} | {v(r['ok_p99_ms'])} "
            f"| {v(r['refusal_p99_ms'], '.2f')} | {lag} |"
        )
    return "\n".join(lines)


def plot(path: Path, rows: list[dict[str, Any]], capacity: float, device: str) -> Path:
    multiples = sorted({r["multiple"] for r in rows})
    top = max(multiples)
    series = [
        Series(
            "ideal: min(offered, capacity)",
            [(0.0, 0.0), (1.0, 1.0), (top, 1.0)],
            color="#888888",
            dashed=True,
            markers=False,
        )
    ]
    for policy, d in sorted({(r.get("policy", "ladder"), r["deadline_ms"]) for r in rows}):
        pts = sorted((r["multiple"], r["goodput_fraction"]) for r in rows
                     if r["deadline_ms"] == d and r.get("policy", "ladder") == policy)  # fmt: skip
        series.append(Series(f"{policy}, deadline {deadline_label(d)}", pts,
                             dashed=policy != "ladder"))  # fmt: skip
    best = max([1.0, *(r["goodput_fraction"] for r in rows)])
    return write_line_chart(
        path,
        series,
        x_range=(0.0, top),
        y_range=(0.0, max(1.2, round(best + 0.15, 1))),
        title=f"Goodput under overload ({device}, capacity {capacity:.0f} req/s)",
        x_label="offered load (× capacity)",
        y_label="goodput: OK within the deadline (× capacity)",
    )


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


QUICK = {"point_seconds": 4.0, "capacity_seconds": 3.0, "warmup_seconds": 1.0,
         "swaps": 20, "memory_swaps": 100, "rss_every": 25}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    add = p.add_argument
    add("--data", type=Path, help="served world (world/, model/, index/; built when missing)")
    add("--out", type=Path, help="dir for overload_DEVICE.json, goodput_DEVICE.svg")
    add("--device", default="cpu", help="server device (%(default)s)")
    add("--quick", action="store_true", help=f"short smoke run: {QUICK}")
    add("--concurrency", type=int, default=16, help="closed-loop callers for capacity (16)")
    add("--capacity-seconds", type=float, default=10.0, help="capacity measurement (10)")
    add("--warmup-seconds", type=float, default=3.0, help="closed-loop warm-up before it (3)")
    add("--multiples", type=_floats, default=[0.5, 1, 1.5, 2, 3, 4], help="%(default)s x capacity")
    add("--deadlines-ms", type=_floats, default=[250, 1000, 10000], help="%(default)s ms")
    add("--point-seconds", type=float, default=12.0, help="offered time per sweep point (12)")
    add("--swaps", type=int, default=95, help="versions published under load (95)")
    add("--swap-load", type=float, default=0.5, help="load during them, x capacity (0.5)")
    add("--memory-swaps", type=int, default=250, help="swaps of the memory check (250)")
    add("--rss-every", type=int, default=50, help="RSS sampled every N of them (50)")
    add("--memory-load", type=float, default=0.25, help="load then, x capacity; 0: none (0.25)")
    add("--processes", type=int, default=1, help="generator processes (1)")
    add("--channels", type=int, default=8, help="gRPC channels per generator process (8)")
    add("--poisson", action="store_true", help="Poisson arrivals instead of even spacing")
    add("--users", type=int, default=64, help="world users whose requests are sent (64)")
    add(
        "--refusal-only",
        action="store_true",
        help="also sweep a server with the beam ladder off (refusal-only), same capacity",
    )
    add(
        "--baseline-src",
        type=Path,
        help="also sweep a server run from this checkout (e.g. the parent commit's tree: "
        "its service/ and cli/ serve), interleaved with this one, same capacity",
    )
    add("--sweep-only", action="store_true", help="capacity and sweep only: no swaps, memory")
    known, _ = p.parse_known_args(argv)
    if known.quick:
        p.set_defaults(**QUICK)
    a = p.parse_args(argv)
    if min(a.concurrency, a.rss_every, a.processes, a.channels, a.users) < 1:
        p.error("--concurrency, --rss-every, --processes, --channels, --users must be >= 1")
    if not a.multiples or not a.deadlines_ms or min(*a.multiples, *a.deadlines_ms) <= 0:
        p.error("--multiples and --deadlines-ms need positive values")
    if a.baseline_src is not None and not (a.baseline_src / "cli").is_dir():
        p.error(f"--baseline-src {a.baseline_src}: not a checkout of this repository")
    return a


@contextlib.contextmanager
def served_data(data: Path | None) -> Iterator[tuple[Path, Path]]:
    """(data dir, scratch dir): `data` (built there when incomplete) or a temporary one."""
    with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp:
        root = data or Path(tmp) / "data"
        if not all((root / d).exists() for d in ("world", "model", "index")):
            from tests.helpers.serving import make_serving_data

            progress(f"building the served world in {root}")
            make_serving_data(root)
        yield root, Path(tmp)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    dev = a.device.split(":")[0]
    with served_data(a.data) as (data, scratch):
        requests = world_requests(data / "world", a.users)
        env = {"GRACE_INDEX_POLL_SECONDS": "0.1"}
        server = start_server(data, scratch / "server.log", a.device, env)
        others: list[ServerProcess] = []
        hot = mem = None
        try:
            server.wait_serving()
            rss_serving = server.rss_mb()
            progress(f"server SERVING on {server.target} (RSS {rss_serving} MiB)")
            gen = partial(run_open_loop, server.target, requests, channels=a.channels,
                          warmup=STEADY_WARMUP, poisson=a.poisson)  # fmt: skip
            probe = probe_capacity(server.target, requests, concurrency=a.concurrency,
                                   seconds=a.capacity_seconds, warmup_s=a.warmup_seconds,
                                   channels=a.channels)  # fmt: skip
            cap = asyncio.run(probe)
            if cap.ok_rps <= 0:
                raise RuntimeError(f"no capacity measured: {cap}\n{server.log_tail()}")
            progress(
                f"capacity {cap.ok_rps:.1f} req/s at concurrency {cap.concurrency} "
                f"(P50 {cap.p50_ms} ms, P99 {cap.p99_ms} ms, errors {cap.errors})"
            )
            servers = {"ladder": (server, gen)}
            # the same sweep on a server without the ladder, and on the baseline checkout
            extra = {"refusal-only": ({**env, "GRACE_BEAM_LADDER": "off"}, None)
                     if a.refusal_only else None,
                     "baseline": (env, a.baseline_src)
                     if a.baseline_src is not None else None}  # fmt: skip
            for policy, how in extra.items():
                if how is None:
                    continue
                other = start_server(data, scratch / f"{policy}.log", a.device, *how)
                others.append(other)
                other.wait_serving()
                # the same closed-loop warm-up the first server had: its estimate learns
                asyncio.run(probe_capacity(other.target, requests, concurrency=a.concurrency,
                                           seconds=a.warmup_seconds, warmup_s=0.0,
                                           channels=a.channels))  # fmt: skip
                servers[policy] = (other, partial(gen.func, other.target, *gen.args[1:],
                                                  **gen.keywords))  # fmt: skip
            rows = sweep(servers, cap.ok_rps, a)
            for other in others:
                other.stop()
            others.clear()
            if not a.sweep_only:
                settle(server)
                progress(f"publishing {a.swaps} versions under {a.swap_load:g}x capacity")
                swaps = partial(swaps_under_load, server, data / "index", gen, deadline_s=1.0)
                hot = asyncio.run(swaps(swaps=a.swaps, rate=a.swap_load * cap.ok_rps))
                progress(f"hot swaps: {hot['swaps_counted']} counted in {hot['seconds']} s")
                settle(server)
                progress(f"memory: {a.memory_swaps} more swaps, RSS every {a.rss_every}")
                mem = asyncio.run(swaps(swaps=a.memory_swaps, rate=a.memory_load * cap.ok_rps,
                                        rss_every=a.rss_every))  # fmt: skip
        finally:
            for other in others:
                other.stop()
            server.stop()
    figures = {
        "quick": a.quick,
        "server": {
            "device": a.device,
            "profile": "tiny",
            "index_poll_seconds": 0.1,
            "rss_mb_at_serving": rss_serving,
        },
        "generator": {
            "processes": a.processes,
            "channels": a.channels,
            "poisson": a.poisson,
            "users": a.users,
            "max_ads": 100,
            "filter_mode": "CD_GTM",
            "steady_state_warmup": STEADY_WARMUP,
        },
        "baseline_src": str(a.baseline_src) if a.baseline_src is not None else None,
        "capacity": cap.to_dict(),
        "sweep": rows,
        "hot_swaps": hot,
        "memory": mem,
    }
    path = write_result(f"overload_{dev}", figures, a.out and a.out / f"overload_{dev}.json")
    svg = plot((a.out or FIGURES) / f"goodput_{dev}.svg", rows, cap.ok_rps, a.device)
    print()
    print(markdown_table(rows, cap.ok_rps))
    print()
    if hot is not None and mem is not None:
        print(
            f"hot swaps under {a.swap_load:g}x load: {hot['published']} published, "
            f"{hot['swaps_counted']} swapped, {hot['swap_failures_counted']} rejected, "
            f"RPCs sent {hot.get('rpcs_sent')}, failed {hot.get('rpcs_failed')} "
            f"{hot.get('outcomes')}"
        )
        rss = ", ".join(f"{r['swaps']}: {r['rss_mb']}" for r in mem["rss_mb"])
        print(f"server RSS (MiB) by swaps: {rss} (growth {mem['rss_growth_mb']} MiB)")
    print(f"wrote {path} and {svg}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
