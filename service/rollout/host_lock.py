"""A lock held by one process of a host at a time (flock on a file under the temp
directory): the rollout of each worker of `grace serve --workers` takes it while it loads,
prepares and swaps in a new model or index (service/rollout/rollout.py), so the workers
sharing a GPU swap one after the other and the others keep serving at full speed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def swap_lock_path(*roots: Path) -> Path:
    """The lock file of the servers following these roots on this host (by their real
    paths: every worker of one supervisor names the same file)."""
    key = "\0".join(str(Path(r).resolve()) for r in roots)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"grace-swap-{os.getuid()}-{digest}.lock"


@contextlib.contextmanager
def host_lock(path: Path) -> Iterator[None]:
    """Hold the exclusive lock on `path` (made if missing), waiting for it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
