"""The bad-row budget of a full build (docs/DATA.md "Bad rows"): a catalog with a few bad
rows builds without them instead of failing whole, while they stay within a budget.

Flow: the readers (`catalog_files.py`, `BadLines`) skip and record rows they cannot parse → the
columns' checks (`catalog.py` `_build`) run on the whole catalog; when one fails they run
again recording every row they refuse (`catalog_columns.Bad`), and only a fault they
cannot pin on a row (a null inside a list) falls back to `isolate`: every row that fails
alone, in chunks of CHUNK rows that bisect only where they fail, after one global pass for
duplicate ad ids → `read_catalog` rebuilds from the clean rows, or raises past the budget. Each bad
row is a `CatalogError` naming its line or row, field and reason, as a strict read names
the first one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa

from index_builder.catalog_files import CatalogError, Source

CHUNK = 65_536  # rows checked at once while isolating
REJECTS = "catalog-rejects.jsonl"  # the last published build's bad rows, in the index root


def write_rejects(path: Path, rejected: tuple[CatalogError, ...]) -> None:
    """The bad rows a build left out, one JSON object each (file, location, field, reason),
    replacing the last build's atomically; none: the file is removed."""
    if not rejected:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    rows = ({"file": e.path, "location": e.location, "field": e.field, "reason": e.message}
            for e in rejected)  # fmt: skip
    tmp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    os.replace(tmp, path)


def take(cols: dict[str, pa.Array], rows: np.ndarray) -> dict[str, pa.Array]:
    """The columns at `rows` (int64 indices)."""
    idx = pa.array(rows, type=pa.int64())
    return {f: a.take(idx) for f, a in cols.items()}


def sub_source(src: Source, rows: np.ndarray) -> Source:
    """A Source over the columns at `rows` that names their original lines (JSON Lines)."""
    if src.lines is not None:
        return Source(src.path, lines=src.lines[rows], parts=src.parts, starts=None)
    return src


def _duplicates(ids: np.ndarray) -> np.ndarray:
    """Rows whose ad id an earlier row has (int64 indices, ascending)."""
    order = np.argsort(ids, kind="stable")
    later = ids[order[1:]] == ids[order[:-1]]
    return np.sort(order[1:][later])


def isolate(
    cols: dict[str, pa.Array],
    src: Source,
    check: Callable[[dict[str, pa.Array], Source], object],
    rows: np.ndarray,
    limit: int,
) -> list[tuple[int, CatalogError]]:
    """Every row of `rows` that `check` refuses alone (bisecting the chunks that fail), and
    why; duplicate ad ids first, over all rows. It stops once more than `limit` are found
    (the budget is spent: the build fails whatever the rest hold)."""
    bad: list[tuple[int, CatalogError]] = []
    ids = cols["ad_id"].take(pa.array(rows, type=pa.int64())).to_numpy(zero_copy_only=False)
    dup = rows[_duplicates(ids)] if len(ids) else rows[:0]
    for row in dup.tolist():
        ad_id = cols["ad_id"][row].as_py()
        bad.append((row, src.error(row, "ad_id", f"duplicate ad_id {ad_id}")))
    rows = np.setdiff1d(rows, dup, assume_unique=True)

    def walk(part: np.ndarray) -> None:
        if len(bad) > limit:
            return
        try:
            check(take(cols, part), sub_source(src, part))
        except CatalogError as exc:
            if len(part) == 1:
                row = int(part[0])
                bad.append((row, src.error(row, exc.field, exc.message)))
                return
            half = len(part) // 2
            walk(part[:half])
            walk(part[half:])

    for lo in range(0, len(rows), CHUNK):
        walk(rows[lo : lo + CHUNK])
    return sorted(bad, key=lambda b: b[0])
