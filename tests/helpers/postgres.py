"""A real PostgreSQL server for a test: Debian's `postgresql` binaries (`make test`
installs them when it may), a fresh cluster on a temporary directory and a free port,
stopped afterwards. As root the server runs as the `postgres` user (initdb refuses root).
Skips the test, saying why, where the binaries or the driver are missing.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers.server_process import free_port


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return versions[-1] if versions else None


@contextmanager
def postgres_server(tmp: Path) -> Iterator[str]:
    """A running server on `tmp` (as root: a directory of the postgres user's, removed
    after); yields its URL (postgresql://grace@127.0.0.1:PORT/grace)."""
    pytest.importorskip("psycopg", reason="psycopg is not installed (make install)")
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    user: list[str] = []
    own = None
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root without a postgres user to run PostgreSQL as")
        user = ["runuser", "-u", "postgres", "--"]
        # a directory the postgres user can reach (a test's tmp_path is root's alone)
        own = tmp = Path(tempfile.mkdtemp(prefix="grace-pg-"))
        os.chown(tmp, owner.pw_uid, owner.pw_gid)
    data, sock = tmp / "pgdata", tmp / "pgsock"
    sock.mkdir(parents=True, exist_ok=True)
    if own is not None:
        os.chown(sock, owner.pw_uid, owner.pw_gid)
    port = free_port()

    def run(*cmd: str) -> None:
        done = subprocess.run([*user, *cmd], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stdout}{done.stderr}")

    run(initdb, "-D", str(data), "-U", "grace", "--auth=trust", "-E", "UTF8", "--no-sync")
    run(pg_ctl, "-D", str(data), "-w", "-t", "60", "-l", str(tmp / "pg.log"), "-o",
        f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off", "start")  # fmt: skip
    try:
        run(_binary("createdb") or "createdb", "-h", "127.0.0.1", "-p", str(port), "-U",
            "grace", "grace")  # fmt: skip
        yield f"postgresql://grace@127.0.0.1:{port}/grace"
    finally:
        run(pg_ctl, "-D", str(data), "-w", "-t", "60", "-m", "fast", "stop")
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)
