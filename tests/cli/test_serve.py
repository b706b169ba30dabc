"""`grace serve` and the commands that build, as a user runs them: a taken port is one
line before anything loads; with JSON logs every line of a server's log (its bootstrap
included) is one JSON object, the start-up names where it listens (127.0.0.1 by default)
and the model by its checkpoint's version; progress bars are drawn only on a terminal
with text logs."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from service.model.checkpoint import CONFIG_FILE
from tests.helpers.server_process import ServerProcess, free_port
from tests.helpers.serving import make_serving_data

REPO = Path(__file__).resolve().parents[2]
GRACE = [sys.executable, "-m", "cli"]


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_taken_port_is_one_line_before_anything_loads(tmp_path: Path, flag: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        ports = {"--port": "0", "--metrics-port": "0", flag: port}
        done = subprocess.run([*GRACE, "serve", "--data-dir", str(tmp_path / "data"),
                               *(a for kv in ports.items() for a in kv)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert f"port {port} on 127.0.0.1 is in use" in lines[0] and flag in lines[0]
    assert not (tmp_path / "data").exists()  # nothing generated, trained or loaded


def test_a_schema_without_a_catalog_to_build_is_one_line(tmp_path: Path) -> None:
    """A served index carries its own schema: `--targeting-schema` means something only
    with `--catalog`, and alone it is refused before anything loads."""
    done = subprocess.run([*GRACE, "serve", "--data-dir", str(tmp_path / "data"),
                           "--targeting-schema", str(tmp_path / "s.yaml")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "--targeting-schema is for --catalog" in lines[0]
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
def test_json_logs_are_one_object_a_line_bootstrap_included(tmp_path: Path) -> None:
    given = make_serving_data(tmp_path / "given")  # a model: the bootstrap trains nothing
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [*GRACE, "serve", "--data-dir", str(tmp_path / "data"), "--model", str(given / "model"),
           "--port", str(port), "--metrics-port", "0", "--device", "cpu"]  # fmt: skip
    with open(log, "wb") as fh:  # no --no-progress: the log, not a flag, keeps bars out
        proc = subprocess.Popen(cmd, cwd=REPO, env=os.environ | {"GRACE_LOG_FORMAT": "json"},
                                stdout=fh, stderr=fh)  # fmt: skip
    server = ServerProcess(proc, port, 0, log)
    try:
        server.wait_serving()
    finally:
        code = server.stop()
    assert code == 0, server.log_tail()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    messages = [r["message"] for r in records]
    assert any("generating the tiny demo world" in m for m in messages)
    assert any("building and publishing the index" in m for m in messages)
    model = json.loads((given / "model" / CONFIG_FILE).read_text())["model_version"]
    ready = [m for m in messages if m.startswith("serving grace.v1.AdRetrieval")]
    assert ready and f"127.0.0.1:{port}" in ready[0] and f"model {model}," in ready[0]


def _stderr_on_a_terminal(args: list[str], env: dict[str, str]) -> str:
    """What a command writes to stderr when stderr is a terminal (a pseudo-terminal)."""
    main, child = pty.openpty()
    # 24 rows, 80 columns: a new pseudo-terminal has 0 columns, and tqdm draws within them
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen(args, cwd=REPO, env=os.environ | env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=child)  # fmt: skip
    os.close(child)
    out = bytearray()
    end = time.monotonic() + 120
    try:
        while time.monotonic() < end:
            if select.select([main], [], [], 1.0)[0]:
                try:
                    chunk = os.read(main, 1 << 16)
                except OSError:  # EIO: the command closed its end
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=60) == 0, out.decode(errors="replace")
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()
    return out.decode(errors="replace")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_progress_bars_only_on_a_terminal_with_text_logs(tmp_path: Path, fmt: str) -> None:
    cmd = [*GRACE, "synth", "--profile", "tiny", "--out", str(tmp_path / "world"), "--json"]
    text = _stderr_on_a_terminal(cmd, {"GRACE_LOG_FORMAT": fmt})
    if fmt == "text":
        assert "ads: 100%" in text  # a bar, as a person at a terminal sees it
    else:
        assert "%|" not in text
        assert all(json.loads(line) for line in text.splitlines() if line.strip())
