"""A small, real filesystem to fill up: a tmpfs mounted for one test, and a filler file that
leaves it exactly so many bytes free (tests of full disks: tests/index_builder,
tests/service). Mounting needs root (or CAP_SYS_ADMIN); elsewhere the test is skipped."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

PAGE = os.sysconf("SC_PAGE_SIZE")  # tmpfs counts space in pages


@contextlib.contextmanager
def small_tmpfs(where: Path, size: int) -> Iterator[Path]:
    """A tmpfs of `size` bytes mounted at `where` (made if missing), unmounted afterwards;
    skips the test when mounting is not permitted."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    where.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(
            f"mounting a tmpfs is not permitted here: {done.stderr.strip().splitlines()[0]}"
        )
    try:
        yield where
    finally:  # lazy: a file a failed test left open cannot keep the mount
        subprocess.run(["umount", "-l", str(where)], timeout=60, check=False)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(directory: Path, leave: int) -> Path:
    """Fill `directory`'s filesystem with one file until `leave` bytes (rounded down to a
    page) are free; returns the file (remove it to free the space again)."""
    filler = directory / "filler"
    want = leave // PAGE * PAGE
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size + free_bytes(directory) - want
        if size > 0:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    assert free_bytes(directory) == want, (free_bytes(directory), want)
    return filler
