"""How a process stands towards one signal, read from /proc (Linux): whether it has a
handler for it, ignores it, or has it pending, and which of its threads block it. The
workers test (tests/service/test_workers.py) prints it beside a missing SIGUSR1 stack
dump, so a failure says whether the handler was gone, the signal blocked in every
thread, or delivered and the dump written elsewhere."""

from __future__ import annotations

import signal
from pathlib import Path


def _fields(status: Path) -> dict[str, str]:
    out = {}
    for line in status.read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _has(mask_hex: str, sig: int) -> bool:
    return bool(int(mask_hex, 16) >> (sig - 1) & 1)


def signal_state(pid: int, sig: int = signal.SIGUSR1) -> str:
    """One line for `pid` and `sig`: caught / ignored / pending (process-wide and per
    thread), and the threads (name:tid) that block it; 'gone' when it has exited."""
    root = Path(f"/proc/{pid}")
    try:
        proc = _fields(root / "status")
        threads = []
        for task in sorted(root.joinpath("task").iterdir(), key=lambda p: int(p.name)):
            try:
                threads.append((task.name, _fields(task / "status")))
            except OSError:  # the thread ended while we read
                continue
    except OSError:
        return f"pid {pid}: gone"
    name = signal.Signals(sig).name
    blocking = [f"{t['Name']}:{tid}" for tid, t in threads if _has(t["SigBlk"], sig)]
    pending = [f"{t['Name']}:{tid}" for tid, t in threads if _has(t["SigPnd"], sig)]
    return (
        f"pid {pid}: {name} caught={_has(proc['SigCgt'], sig)} "
        f"ignored={_has(proc['SigIgn'], sig)} pending(process)={_has(proc['ShdPnd'], sig)} "
        f"pending(threads)={pending} threads={len(threads)} "
        f"blocking it={len(blocking)} {blocking[:12]}"
    )
