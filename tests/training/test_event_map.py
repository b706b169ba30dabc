"""An ads team's log of `impression`, `add_to_cart` and `purchase` events (docs/DATA.md,
"Your event types"): mapped onto the RPC's event types in every interactions file format,
unmapped types refused with their row or skipped and counted, bad maps refused in one line,
and `grace train --event-map` end to end on the examples."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli import main
from contracts.data_format import EventMap
from training.user_data import DataError, read_user_data

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
USERS = EXAMPLES / "users.csv"
AD_IDS = np.array(
    [orjson.loads(x)["ad_id"] for x in (EXAMPLES / "catalog.jsonl").read_bytes().splitlines()]
)
MAP = "Impression=view, purchase=conversion"
RENAMES = {"view": "impression", "conversion": "purchase"}


def ads_log(root: Path, suffix: str) -> Path:
    """The example interactions with views as impressions and conversions as purchases,
    plus add_to_cart events at data rows 3, 10 and 20."""
    with open(EXAMPLES / "interactions.csv") as fh:
        rows = [{**r, "event_type": RENAMES.get(r["event_type"], r["event_type"])}
                for r in csv.DictReader(fh)]  # fmt: skip
    for at in (3, 10, 20):
        rows.insert(at, {**rows[at], "event_type": "add_to_cart"})
    rows = [{k: v if k == "event_type" else int(v) for k, v in r.items()} for r in rows]
    path = root / f"ads_log{suffix}"
    if suffix == ".csv":
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, [*rows[0]])
            w.writeheader()
            w.writerows(rows)
    elif suffix == ".jsonl":
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_mapped_types_train_as_event_types_and_unmapped_are_skipped_and_counted(
    tmp_path: Path, suffix: str, caplog: pytest.LogCaptureFixture
) -> None:
    plain = read_user_data(EXAMPLES / "interactions.csv", USERS, AD_IDS)
    data = read_user_data(ads_log(tmp_path, suffix), USERS, AD_IDS, EventMap.parse(MAP, "skip"))
    for name in ("user_ids", "history_offsets", "history_ad_ids", "history_types",
                 "heldout_ad_ids", "heldout_types", "valid_index"):  # fmt: skip
        np.testing.assert_array_equal(getattr(data, name), getattr(plain, name), err_msg=name)
    assert data.summary["skipped_event_types"] == {"add_to_cart": 3}
    assert plain.summary["skipped_event_types"] == {}
    assert f"ads_log{suffix}: 3 events skipped, of event types not mapped" in caplog.text
    assert "add_to_cart 3" in caplog.text


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_unmapped_types_are_refused_by_default_with_their_row(tmp_path: Path, suffix: str) -> None:
    message = (
        rf"ads_log{suffix}: row 3: field 'event_type': 'add_to_cart' is not one of view \(1\), "
        r"click \(2\), conversion \(3\), impression \(view\), purchase \(conversion\)"
    )
    with pytest.raises(DataError, match=message):
        read_user_data(ads_log(tmp_path, suffix), USERS, AD_IDS, EventMap.parse(MAP))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("impression=veiw", "pair 'impression=veiw': unknown target 'veiw'"),
        ("impression", "pair 'impression': not SOURCE=TARGET"),
        ("impression=view,,purchase=conversion", "pair '': not SOURCE=TARGET"),
        ("=view", "pair '=view': not SOURCE=TARGET"),
        ("a=view=click", "pair 'a=view=click': not SOURCE=TARGET"),
        (
            "impression=view,Impression=click",
            "pair 'Impression=click': source 'impression' mapped twice",
        ),
    ],
)
def test_a_bad_map_is_refused_naming_the_pair_and_the_targets(text: str, message: str) -> None:
    with pytest.raises(
        ValueError, match=f"^--event-map {message}; targets are view, click, conversion$"
    ):
        EventMap.parse(text)


def test_grace_train_with_an_event_map(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    log = str(ads_log(tmp_path, ".csv"))
    files = ["--catalog", str(EXAMPLES / "catalog.jsonl"), "--interactions", log,
             "--users", str(USERS), "--sid-space", "examples-v1", "--no-progress"]  # fmt: skip
    run = [*files, "--batch-size", "4", "--epochs", "1", "--out", str(tmp_path / "model")]
    assert main(["train", *run, "--event-map", "impression=veiw"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("grace train: error: --event-map pair 'impression=veiw': unknown target "
                   "'veiw'; targets are view, click, conversion")  # fmt: skip
    assert main(["train", *run, "--event-map", MAP]) == 2  # add_to_cart: refused by default
    assert "row 3: field 'event_type': 'add_to_cart'" in capsys.readouterr().err
    assert main(["train", *run, "--event-map", MAP, "--unmapped", "skip"]) == 0
    out = capsys.readouterr().out
    assert "3 events skipped" in caplog.text  # the warning, and the training data summary:
    assert "'skipped_event_types': {'add_to_cart': 3}" in caplog.text
    # 6 users, 5 + 4 * 5 mapped events: each user's last held out, second-last validation,
    # first only a history: 2 + 1 * 5 training pairs, as from the example interactions
    assert json.loads(out[out.index("{") :])["training_pairs"] == 7
