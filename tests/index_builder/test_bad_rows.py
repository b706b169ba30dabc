"""The bad-row budget (docs/DATA.md "Bad rows"): a catalog with a few bad rows builds
without them — each named by its line or row, field and reason, in the rejects file and
the metrics — instead of holding back the whole update; past the budget nothing is
published and the error says how many. A strict read (budget 0) still names the first.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.index_manifest import read_manifest
from index_builder.bad_rows import REJECTS
from index_builder.build import build_index
from index_builder.catalog import read_catalog
from index_builder.catalog_files import CatalogError
from index_builder.publish import current_path
from tests.helpers.server_process import free_port
from tests.index_builder.test_builder_metrics import metered_builder, value, wait_for

REPO = Path(__file__).resolve().parents[2]


def good(i: int) -> dict:
    return {"ad_id": i, "sid": [i % 7, i % 5, 2, 3], "countries": ["US", "FR"][: 1 + i % 2]}


# one bad row of each kind: (line, field, a piece of the reason)
BAD = {
    11: ('{"ad_id": 11, "sid": [1, 2, 3', None, "invalid JSON"),
    21: (json.dumps({"ad_id": 21, "sid": [1, 2, 3, 999]}), "sid", "out of range"),
    31: (json.dumps({"ad_id": 5, "sid": [1, 2, 3, 4]}), "ad_id", "duplicate ad_id 5"),
    41: (json.dumps({"ad_id": 41, "sid": [1, 2, 3, 4], "countries": ["USA"]}), "countries",
         "unknown value 'USA'"),
    51: (json.dumps({"ad_id": 51, "sid": [1, 2, 3, 4], "locations": [""]}), "locations",
         "is empty"),
    61: (json.dumps({"ad_id": 61, "sid": [1, 2, 3, 4], "countries": [1]}), "countries",
         "not a list of strings"),
    71: (json.dumps({"ad_id": "71", "sid": [1, 2, 3, 4]}), "ad_id", "is not"),
    81: ("[1, 2]", None, "expected a JSON object"),
}  # fmt: skip


def write_catalog(path: Path, n: int, bad: dict = BAD) -> None:
    lines = [bad[i][0] if i in bad else json.dumps(good(i)) for i in range(1, n + 1)]
    path.write_text("\n".join(lines) + "\n")


def test_bad_rows_are_left_out_within_the_budget_and_each_is_named(tmp_path: Path) -> None:
    path = tmp_path / "catalog.jsonl"
    write_catalog(path, 2000)
    catalog = read_catalog(path, progress=False, bad_row_budget=0.01)
    assert [e.location for e in catalog.rejected] == [f"line {i}" for i in BAD]
    for e, (_, field, reason) in zip(catalog.rejected, BAD.values(), strict=True):
        assert e.field == field and reason in e.message and e.path == str(path)
    # the duplicate's later line is the bad one: ad 5 keeps its first row
    want = sorted(set(range(1, 2001)) - set(BAD))  # line 31 held a second ad 5
    assert sorted(catalog.ad_id.tolist()) == want
    row = catalog.ad_id.tolist().index(5)
    assert catalog.sid[row].tolist() == good(5)["sid"]
    # the clean rows read exactly as a catalog of them alone
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(json.dumps(good(i)) + "\n" for i in want))
    alone = read_catalog(clean, progress=False)
    np.testing.assert_array_equal(catalog.bitmask, alone.bitmask)
    np.testing.assert_array_equal(catalog.sid, alone.sid)


def test_past_the_budget_nothing_is_read_and_the_error_counts(tmp_path: Path) -> None:
    path = tmp_path / "catalog.jsonl"
    write_catalog(path, 2000)
    over = r"line 11: invalid JSON.* at least 8 bad rows of 2000 \(0.40%\), over the bad-row"
    with pytest.raises(CatalogError, match=over + " budget of 0.10%"):
        read_catalog(path, progress=False, bad_row_budget=0.001)
    with pytest.raises(CatalogError, match="line 11: invalid JSON") as strict:
        read_catalog(path, progress=False)  # budget 0: the first bad row, as ever
    assert "bad-row budget" not in str(strict.value)


def test_parquet_and_directory_parts_name_their_own_rows(tmp_path: Path) -> None:
    rows = [good(i) for i in range(1, 301)]
    rows[9] = {**rows[9], "sid": [1, 2, 3, 600]}
    rows[19] = {**rows[19], "countries": ["ZZ"]}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    catalog = read_catalog(tmp_path / "c.parquet", progress=False, bad_row_budget=0.05)
    got = [(e.location, e.field) for e in catalog.rejected]
    assert got == [("row 9", "sid"), ("row 19", "countries")]
    parts = tmp_path / "parts"
    parts.mkdir()
    write_catalog(parts / "a.jsonl", 100, {})
    (parts / "b.jsonl").write_text(
        "".join(json.dumps(good(i)) + "\n" for i in range(101, 150))
        + json.dumps({**good(150), "sid": [1, 2]}) + "\n"
    )  # fmt: skip
    catalog = read_catalog(parts, progress=False, bad_row_budget=0.05)
    ((e,),) = [catalog.rejected]
    assert (e.path, e.location, e.field) == (str(parts / "b.jsonl"), "line 50", "sid")
    assert catalog.n == 149


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(n=st.integers(5, 120), data=st.data())
def test_exactly_the_injected_bad_rows_are_rejected(tmp_path: Path, n: int, data) -> None:
    picks = data.draw(st.sets(st.integers(1, n), max_size=max(1, n // 4)))
    kinds = [v for k, v in BAD.items() if k != 31]  # a duplicate needs its twin: below
    bad = {i: kinds[data.draw(st.integers(0, len(kinds) - 1))] for i in picks}
    # each bad line under its own row's ad id, so no good row shares it
    bad = {i: (re.sub(r'"ad_id": \d+', f'"ad_id": {i}', line), field, reason)
           for i, (line, field, reason) in bad.items()}  # fmt: skip
    path = tmp_path / f"c{n}-{len(bad)}.jsonl"
    write_catalog(path, n, bad)
    if len(bad) == n:
        with pytest.raises(CatalogError):
            read_catalog(path, progress=False, bad_row_budget=1.0)
        return
    catalog = read_catalog(path, progress=False, bad_row_budget=1.0)
    assert [e.location for e in catalog.rejected] == [f"line {i}" for i in sorted(bad)]
    assert sorted(catalog.ad_id.tolist()) == sorted(set(range(1, n + 1)) - set(bad))


def test_a_build_publishes_without_its_bad_rows_and_lists_them(tmp_path: Path) -> None:
    """The probe that opened issue #48: one ad removed and one row with an empty location
    string added. The removed ad leaves the index; the bad row is listed, not fatal."""
    catalog = tmp_path / "catalog.jsonl"
    rows = [good(i) for i in range(1, 2001) if i != 17]  # ad 17 taken down
    lines = [json.dumps(r) for r in rows] + [json.dumps({**good(3000), "locations": [""]})]
    catalog.write_text("\n".join(lines) + "\n")
    out = tmp_path / "index"
    run = subprocess.run(
        [sys.executable, "-m", "cli", "build-index", "--catalog", str(catalog), "--out",
         str(out), "--sid-space", "s", "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "1 bad catalog rows left out" in run.stdout
    manifest = read_manifest(current_path(out))
    assert manifest["catalog"]["rejected_rows"] == 1
    ((reject,),) = [[json.loads(x) for x in (out / REJECTS).read_text().splitlines()]]
    assert reject == {"file": str(catalog), "location": "line 2000", "field": "locations",
                      "reason": reject["reason"]} and "empty" in reject["reason"]  # fmt: skip


def test_a_strict_build_fails_on_one_bad_row(tmp_path: Path) -> None:
    catalog = tmp_path / "catalog.jsonl"
    write_catalog(catalog, 50, {7: (BAD[21][0].replace('"ad_id": 21', '"ad_id": 7'), "", "")})
    with pytest.raises(CatalogError, match="line 7: field 'sid'"):
        build_index(catalog, tmp_path / "index", sid_space="s", progress=False)
    assert current_path(tmp_path / "index") is None


def test_the_builder_publishes_within_the_budget_and_says_how_many_it_left_out(
    tmp_path: Path,
) -> None:
    catalog = tmp_path / "catalog.jsonl"
    write_catalog(catalog, 2000, {100: BAD[41]})  # 0.05 %: within the default 0.1 %
    port = free_port()
    proc = metered_builder(catalog, tmp_path / "index", port)
    try:
        text = wait_for(port, proc, lambda t: value(t, "grace_builder_builds_total",
                                                     result="ok") == 1)  # fmt: skip
        assert value(text, "grace_builder_catalog_rows_rejected") == 1
        assert value(text, "grace_builder_builds_total", result="failed") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert (tmp_path / "index" / REJECTS).exists()


def test_a_budget_outside_0_to_1_is_refused_in_one_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "cli", "build-index", "--catalog", "c.jsonl", "--out",
         str(tmp_path), "--bad-row-budget", "5"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    assert "--bad-row-budget: must be a share from 0 to 1, got 5" in run.stderr


def test_a_fault_no_check_records_by_row_is_found_row_by_row(tmp_path: Path) -> None:
    """A null inside a list is refused for the whole column at once: the rows are then
    judged one chunk, one half at a time — the same rows rejected as a collecting pass."""
    path = tmp_path / "catalog.jsonl"
    bad = {7: (json.dumps({"ad_id": 7, "sid": [1, 2, 3, 4], "countries": ["US", None]}),
               "countries", "null element"),
           9: BAD[41]}  # fmt: skip
    bad[9] = (bad[9][0].replace('"ad_id": 41', '"ad_id": 9'), *bad[9][1:])
    write_catalog(path, 300, bad)
    catalog = read_catalog(path, progress=False, bad_row_budget=0.01)
    got = [(e.location, e.field) for e in catalog.rejected]
    assert got == [("line 7", "countries"), ("line 9", "countries")]
    assert "null element" in catalog.rejected[0].message
    assert catalog.n == 298
