"""`grace builder --metrics-port`, a real process scraped over HTTP: a published build is
counted with its time, a catalog that breaks is a failure by reason (the catalog) that
publishes nothing, and a catalog that disappears is flagged unreadable — what an SRE
graphs instead of reading the sidecar's log."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.helpers.server_process import free_port, metric_value

REPO = Path(__file__).resolve().parents[2]
ROWS = [{"ad_id": i, "sid": [i % 3, i % 5, i % 7, 0]} for i in range(1, 40)]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def wait_for(port: int, proc: subprocess.Popen, ok: Callable[[str], bool]) -> str:
    """The first scrape `ok` accepts (a condition, never a fixed time)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            text = scrape(port)
        except OSError:  # not listening yet
            text = ""
        if text and ok(text):
            return text
        time.sleep(0.05)
    raise AssertionError(f"metrics never matched:\n{text}")


def value(text: str, name: str, **labels: str) -> float:
    return metric_value(text, name, labels) or 0.0


def metered_builder(catalog: Path, out: Path, port: int) -> subprocess.Popen:
    """`grace builder` on `catalog` into `out` (SID space "s", a check every 0.1 s), its
    metrics on `port`; output to a pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "builder", "--catalog", str(catalog), "--out", str(out),
         "--sid-space", "s", "--interval", "0.1", "--metrics-port", str(port)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_builds_failures_and_an_unreadable_catalog_are_metrics(tmp_path: Path) -> None:
    catalog = tmp_path / "catalog.jsonl"
    catalog.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    port = free_port()
    proc = metered_builder(catalog, tmp_path / "index", port)
    try:
        before = time.time()
        text = wait_for(port, proc, lambda t: value(t, "grace_builder_builds_total",
                                                     result="ok") == 1)  # fmt: skip
        assert value(text, "grace_builder_last_success_timestamp_seconds") >= before - 5
        assert value(text, "grace_builder_builds_total", result="failed") == 0
        assert value(text, "grace_builder_catalog_unreadable") == 0
        published = sorted(p.name for p in (tmp_path / "index").iterdir())

        # a row that breaks the catalog: a failure by reason, nothing published
        catalog.write_text(catalog.read_text() + '{"ad_id": 1, "sid": [0, 0, 0, 0]}\n')
        text = wait_for(port, proc, lambda t: value(t, "grace_builder_failures_total",
                                                     reason="catalog") == 1)  # fmt: skip
        assert value(text, "grace_builder_builds_total", result="failed") == 1
        assert value(text, "grace_builder_builds_total", result="ok") == 1
        assert value(text, "grace_builder_last_failure_timestamp_seconds") > 0
        assert sorted(p.name for p in (tmp_path / "index").iterdir()) == published

        catalog.unlink()  # gone: nothing to build from
        wait_for(port, proc, lambda t: value(t, "grace_builder_catalog_unreadable") == 1)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert f"builder metrics on http://127.0.0.1:{port}/metrics" in out
