"""The catalog as a PostgreSQL table of ads, the way an ads team's campaign database holds
it (`grace builder --catalog postgresql://… --changes postgresql://…`; docs/DATA.md
"PostgreSQL"): a full snapshot for each build, the rows changed since as the change feed.

The table (`examples/postgres_ads.sql`): the catalog's fields as columns, `status`
('active', 'paused', 'deleted') and `change_seq`, stamped by a trigger on every insert
and update in commit order (the trigger holds an advisory lock until its transaction
ends), so a reader that has seen seq s has seen every change below it.

Flow: `snapshot` reads the active rows and the largest `change_seq`, in one
repeatable-read transaction, into a JSON Lines catalog the build reads; the version
records that seq (`catalog.seq`), and a server starts it at that `catalog_seq`. A paused
row is not in the snapshot (a version holds no paused state of its own): set back to
`active` after it, it is a new ad to that version, served from the next build.
`PostgresFeed.poll` then reads the rows whose `change_seq` is above the last one read, in
order, as change records: `paused` → pause,
`deleted` → delete, `active` → an upsert of the row (the publisher makes it a `restore`
when the version already serves that row, so a resume is one). A row removed with DELETE
is not seen until the next snapshot: mark it `deleted` instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import orjson

from contracts.changes import Change, ChangeError
from index_builder.catalog_files import CatalogError
from index_builder.change_feed import Polled

SCHEME = "postgresql://"
STATUS, SEQ = "status", "change_seq"  # the table's own columns; the others are the catalog's
OPS = {"paused": "pause", "deleted": "delete", "active": "upsert"}
BATCH = 50_000  # rows read per poll


def is_postgres(source: str | Path) -> bool:
    return str(source).startswith(SCHEME)


def split_url(url: str) -> tuple[str, str]:
    """(the connection URL, the table): `?table=NAME` (default `ads`) is the table's."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    table = query.pop("table", "ads")
    if not table.replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"table {table!r}: letters, digits, '_' and '.' only")
    return urlunsplit(parts._replace(query=urlencode(query))), table


def shown(url: str) -> str:
    """The URL without its password, for logs and manifests."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


@contextmanager
def _errors(url: str) -> Iterator[None]:
    """A database that cannot be reached or read is a CatalogError naming it (the
    sidecar waits for it as for an unreadable catalog file)."""
    import psycopg  # the postgres extra: only where a team follows a database

    try:
        yield
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise CatalogError(shown(url), None, None, f"PostgreSQL: {reason}") from None


def _connect(url: str) -> Any:
    import psycopg

    conninfo, _ = split_url(url)
    return psycopg.connect(conninfo, autocommit=True, connect_timeout=10)


def _row(names: list[str], values: tuple) -> dict[str, Any]:
    """A table row as a catalog row: its catalog columns that hold a value."""
    return {k: v for k, v in zip(names, values, strict=True)
            if k not in (STATUS, SEQ) and v is not None}  # fmt: skip


def table_seq(url: str) -> int:
    """The table's largest change_seq (0: empty): what a build would start from."""
    _, table = split_url(url)
    with _errors(url), _connect(url) as conn:
        return int(conn.execute(f"SELECT coalesce(max({SEQ}), 0) FROM {table}").fetchone()[0])


def snapshot(url: str, out: Path) -> int:
    """Write the active rows to `out` (JSON Lines, atomically); the largest change_seq
    the same snapshot holds (every change up to it is in the file)."""
    _, table = split_url(url)
    tmp = out.with_name(f".{out.name}.tmp")
    with _errors(url), _connect(url) as conn, conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        seq = int(conn.execute(f"SELECT coalesce(max({SEQ}), 0) FROM {table}").fetchone()[0])
        with conn.cursor(name="grace_snapshot") as cur, tmp.open("wb") as fh:
            cur.execute(f"SELECT * FROM {table} WHERE {STATUS} = 'active' ORDER BY ad_id")
            names = [d.name for d in cur.description]
            for values in cur:
                fh.write(orjson.dumps(_row(names, values), option=orjson.OPT_SERIALIZE_NUMPY))
                fh.write(b"\n")
    os.replace(tmp, out)
    return seq


class PostgresFeed:
    """The rows of the table changed after `after`, in change_seq order, as changes."""

    def __init__(self, url: str, after: int | None = None) -> None:
        self.url = url
        _, self.table = split_url(url)
        self.last_seq = after
        self._conn: Any = None

    def poll(self) -> Polled:
        """The rows changed since the last poll (at most BATCH of them)."""
        with _errors(self.url):
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = _connect(self.url)
                cur = self._conn.execute(
                    f"SELECT * FROM {self.table} WHERE {SEQ} > %s ORDER BY {SEQ} LIMIT {BATCH}",
                    (self.last_seq if self.last_seq is not None else -1,),
                )
                rows = cur.fetchall()
            except Exception:
                self.close()  # a fresh connection next poll
                raise
        names = [d.name for d in cur.description]
        out = Polled()
        for values in rows:
            record = dict(zip(names, values, strict=True))
            seq, ad_id, status = int(record[SEQ]), int(record["ad_id"]), record[STATUS]
            self.last_seq = seq
            where = f"table {self.table}"
            op = OPS.get(status)
            if op is None:
                reason = f"{status!r} is not one of {', '.join(OPS)}"
                out.rejects.append(ChangeError(where, seq, STATUS, reason))
            elif op == "upsert":
                out.changes.append(Change(seq, op, ad_id, _row(names, values)))
            else:
                out.changes.append(Change(seq, op, ad_id))
        return out

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
