"""A lock held by one process of a host at a time (flock on a file under the temp
directory): the rollout of each worker of `grace serve --workers` takes it while it loads,
prepares and swaps in a new model or index (service/rollout/rollout.py), so the workers
sharing a GPU swap one after the other and the others keep serving at full speed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("grace.rollout")
_unlockable: set[Path] = set()  # lock files found impossible to make (warned once each)


def swap_lock_path(*roots: Path) -> Path:
    """The lock file of the servers following these roots on this host (by their real
    paths: every worker of one supervisor names the same file)."""
    key = "\0".join(str(Path(r).resolve()) for r in roots)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"grace-swap-{os.getuid()}-{digest}.lock"


@contextlib.contextmanager
def host_lock(path: Path) -> Iterator[None]:
    """Hold the exclusive lock on `path` (made if missing), waiting for it. Where the file
    cannot be made (a read-only root with no writable temp directory) the swap goes on
    without it, said once: serialising swaps is worth less than making them."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        if path not in _unlockable:
            _unlockable.add(path)
            log.warning("swap lock %s cannot be made (%s): the workers of this host may "
                        "swap at the same time", path, exc.strerror or exc)  # fmt: skip
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
