"""A team's own data (docs/DATA.md), not the synthetic generator: a small dataset written
here by hand — catalog as gzip JSON Lines, interactions as CSV, users as Parquet — goes
through `grace train-tokenizer`, `grace train`, `grace build-index` and a real server,
whose Retrieve answers hold only eligible ads; bad rows are named by file, row and field."""

from __future__ import annotations

import asyncio
import csv
import gzip
import json
from pathlib import Path

import grpc
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli import main
from contracts.targeting import Targeting
from service.app import start
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.helpers.oracle import Ad, eligible
from tests.helpers.serving import serving_settings
from training.user_data import DataError, read_user_data

COUNTRIES = ("US", "GB", "FR")
AD_IDS = np.arange(1000, 1048)


def read(root: Path, interactions: str = "interactions.csv", ad_ids: np.ndarray = AD_IDS):
    return read_user_data(root / interactions, root / "users.parquet", ad_ids)


def rows_of(path: Path) -> list[dict]:
    with open(path) as fh:
        return list(csv.DictReader(fh))


def own_dataset(root: Path, n_ads: int = 48, n_users: int = 30) -> dict:
    """Ads in 4 topics (8-dim embeddings) with country and location rules; users who only
    interact with ads eligible for them, 6 events each, plus two events on an ad the
    catalog lacks."""
    rng = np.random.default_rng(7)
    centers = rng.normal(size=(4, 8))
    ads = []
    for i in range(n_ads):
        rule = i % 4
        ad = {"ad_id": 1000 + i, "embedding": (centers[i % 4] + 0.1 * rng.normal(size=8)).tolist()}
        if rule == 0:
            ad["countries"] = ["US"]
        elif rule == 1:
            ad["countries"] = ["GB", "FR"]
        elif rule == 2:
            ad["locations"] = ["US/NY"]
        ads.append(ad)
    with gzip.open(root / "catalog.jsonl.gz", "wb") as fh:
        fh.writelines(orjson.dumps(a) + b"\n" for a in ads)
    users = []
    for u in range(n_users):
        country = COUNTRIES[u % 3]
        users.append({"user_id": 500 + u, "country": country, "age": 20 + u,
                      "gender": ("female", "male")[u % 2],
                      "locations": ["US/NY"] if u % 5 == 0 else []})  # fmt: skip
    pq.write_table(pa.Table.from_pylist(users), root / "users.parquet")
    oracle = {a["ad_id"]: Ad(a["ad_id"], (0, 0, 0, 0), tuple(a.get("countries", ())),
                             locations=tuple(a.get("locations", ()))) for a in ads}  # fmt: skip
    targeting = {u["user_id"]: Targeting(u["country"], u["age"], u["gender"], tuple(u["locations"]))
                 for u in users}  # fmt: skip
    rows = []
    for u in users:
        ok = [a for a in oracle if eligible(oracle[a], targeting[u["user_id"]])]
        for k, ad_id in enumerate(rng.choice(ok, 6, replace=False).tolist()):
            rows.append((u["user_id"], ad_id, ("view", "click", "conversion")[k % 3],
                         1_700_000_000_000 + 60_000 * k + u["user_id"]))  # fmt: skip
    rows += [(500, 99_999, "click", 1_700_000_900_000), (501, 99_999, "view", 1_700_000_900_000)]
    with open(root / "interactions.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["user_id", "ad_id", "event_type", "timestamp_ms"])
        w.writerows(rows)
    return {"oracle": oracle, "targeting": targeting}


def test_train_build_and_serve_on_own_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    truth = own_dataset(tmp_path)
    cat, inter, users = (str(tmp_path / f) for f in ("catalog.jsonl.gz", "interactions.csv",
                                                     "users.parquet"))  # fmt: skip
    tok = str(tmp_path / "tok")
    assert main(["train-tokenizer", "--catalog", cat, "--out", tok, "--codebook-size", "8",
                 "--iterations", "3", "--no-progress"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["train", "--catalog", cat, "--interactions", inter, "--users", users,
                 "--tokenizer", tok, "--out", str(tmp_path / "model"), "--epochs", "1",
                 "--batch-size", "16", "--eval-users", "30", "--no-progress"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    metrics = json.loads(out[out.index("{") :])
    # 6 events a user: the last held out for test, the second-last the validation target,
    # so 3 training targets (event 0 starts the history)
    assert metrics["training_pairs"] == 30 * 3 and metrics["users"] == 30
    assert len(metrics["validation_loss"]) == 1 and metrics["best_epoch"] == 1
    assert 0 <= metrics["recall@10"] <= 1 and "popularity_recall@10" in metrics
    model_tok = str(tmp_path / "model" / "tokenizer")
    assert main(["build-index", "--catalog", cat, "--tokenizer", model_tok,
                 "--out", str(tmp_path / "index"), "--no-progress"]) == 0  # fmt: skip

    async def serve() -> list:
        app = await start(serving_settings(tmp_path))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            replies = await asyncio.gather(*(
                stub.Retrieve(retrieval_pb2.RetrieveRequest(
                    request_id=f"r{uid}",
                    user=retrieval_pb2.User(user_id=uid),
                    targeting=retrieval_pb2.Targeting(country=t.country, age=t.age,
                                                      gender=t.gender, locations=t.locations),
                    options=retrieval_pb2.Options(max_ads=100),
                ))
                for uid, t in truth["targeting"].items()
            ))  # fmt: skip
        await app.drain()
        return replies

    replies = asyncio.run(serve())
    assert sum(len(r.ads) for r in replies) > 0
    for (uid, t), reply in zip(truth["targeting"].items(), replies, strict=True):
        assert all(eligible(truth["oracle"][a.ad_id], t) for a in reply.ads), uid


def test_leave_last_out_and_dropped_events_are_counted(tmp_path: Path) -> None:
    own_dataset(tmp_path)
    data = read(tmp_path)
    assert data.dropped == {"unknown_user": 0, "unknown_ad": 2}
    assert data.n_users == 30 and (data.heldout_ad_ids >= 0).all()
    assert np.diff(data.history_offsets).tolist() == [5] * 30  # the last of 6 is held out
    assert data.valid_index.tolist() == [4] * 30  # the second-last: validation
    for u in range(data.n_users):  # histories oldest first, test event after all of them
        ts = data.history(u)[2]
        assert (np.diff(ts) > 0).all() and data.heldout_ts[u] > ts[-1]


def test_an_explicit_split_column_decides_the_test_events(tmp_path: Path) -> None:
    own_dataset(tmp_path)
    rows = rows_of(tmp_path / "interactions.csv")
    first = {}
    for r in rows:  # each user's first event in the file is its test event
        r["split"] = "test" if first.setdefault(r["user_id"], r) is r else "train"
    with open(tmp_path / "split.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, [*rows[0]])
        w.writeheader()
        w.writerows(rows)
    data = read(tmp_path, "split.csv")
    by_user = {int(r["user_id"]): int(r["ad_id"]) for r in rows if r["split"] == "test"}
    assert data.heldout_ad_ids.tolist() == [by_user[u] for u in data.user_ids.tolist()]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            {"event_type": "like"},
            r"interactions.csv: row 3: field 'event_type': 'like' is not one of",
        ),
        ({"ad_id": ""}, r"interactions.csv: row 3: field 'ad_id': missing"),
        ({"user_id": "u7"}, r"interactions.csv: row 3: field 'user_id': 'u7' is not an integer"),
        ({"split": "later"}, r"interactions.csv: row 3: field 'split': 'later' is not one of"),
    ],
)
def test_a_bad_interaction_row_is_named(tmp_path: Path, edit: dict, message: str) -> None:
    own_dataset(tmp_path)
    rows = rows_of(tmp_path / "interactions.csv")
    if "split" in edit:
        for r in rows:
            r["split"] = "train"
    rows[3].update(edit)
    with open(tmp_path / "interactions.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, [*rows[0]])
        w.writeheader()
        w.writerows(rows)
    with pytest.raises(DataError, match=message):
        read_user_data(
            tmp_path / "interactions.csv", tmp_path / "users.parquet", np.arange(1000, 1048)
        )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"country": "USA"}, r"users.parquet: row 4: field 'country': expected an ISO"),
        ({"gender": "x"}, r"users.parquet: row 4: field 'gender': unknown value 'x'"),
        ({"user_id": 500}, r"users.parquet: row 4: field 'user_id': duplicate 500"),
        ({"locations": [""]}, r"users.parquet: row 4: field 'locations': '' is not 1 to 256 bytes"),
    ],
)
def test_a_bad_user_row_is_named(tmp_path: Path, edit: dict, message: str) -> None:
    own_dataset(tmp_path)
    users = pq.read_table(tmp_path / "users.parquet").to_pylist()
    users[4].update(edit)
    pq.write_table(pa.Table.from_pylist(users), tmp_path / "users.parquet")
    with pytest.raises(DataError, match=message):
        read_user_data(
            tmp_path / "interactions.csv", tmp_path / "users.parquet", np.arange(1000, 1048)
        )


def test_files_that_do_not_belong_together_are_refused(tmp_path: Path) -> None:
    own_dataset(tmp_path)
    with pytest.raises(DataError, match=r"on ads not in the catalog: .* more than 5%"):
        read_user_data(
            tmp_path / "interactions.csv", tmp_path / "users.parquet", np.arange(1000, 1010)
        )
    assert main(["train", "--catalog", "x.jsonl", "--out", str(tmp_path / "m")]) == 2


def test_validation_events_are_never_training_targets(tmp_path: Path) -> None:
    from service.model.config import PROFILES
    from service.model.features import SidLookup
    from training.data import Examples

    own_dataset(tmp_path)
    data = read(tmp_path)
    sids = np.zeros((len(AD_IDS), 4), dtype=np.int64)
    examples = Examples(data, SidLookup(AD_IDS.astype(np.int64), sids), PROFILES["tiny"])
    targets = {(int(u), int(p)) for u, p in examples.pairs}
    assert not any((u, int(data.valid_index[u])) in targets for u in range(data.n_users))
    assert examples.validation_users.tolist() == list(range(data.n_users))
    batch = examples.validation(examples.validation_users[:3])
    assert batch.target_ad.tolist() == [int(data.history(u)[0][4]) for u in range(3)]


def test_a_synthetic_world_is_one_producer_of_the_format(tmp_path: Path) -> None:
    """`grace synth` writes interactions.parquet beside its catalog and users.parquet: read
    as a team's own data they give the world's users, histories and held-out events."""
    from index_builder.catalog import read_catalog
    from index_builder.synth import generate_world, load_world

    w = tmp_path / "w"
    generate_world("tiny", 3, w, progress=False)
    world = load_world(w)
    ad_ids = read_catalog(w / "catalog.parquet", progress=False).ad_id
    data = read_user_data(w / "interactions.parquet", w / "users.parquet", ad_ids)
    assert data.dropped == {"unknown_user": 0, "unknown_ad": 0}
    np.testing.assert_array_equal(data.user_ids, world.user_ids)
    assert data.targeting == world.targeting
    for name in ("history_offsets", "history_ad_ids", "history_types", "history_ts",
                 "heldout_ad_ids", "heldout_types", "heldout_ts"):  # fmt: skip
        np.testing.assert_array_equal(getattr(data, name), getattr(world, name), err_msg=name)
    assert (data.valid_index == -1).all()  # the world's split has no validation events


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example_ads() -> dict[int, Ad]:
    rows = [orjson.loads(x) for x in (EXAMPLES / "catalog.jsonl").read_bytes().splitlines()]
    return {
        r["ad_id"]: Ad(r["ad_id"], tuple(r["sid"]), tuple(r.get("countries", ())),
                       tuple(r.get("age_buckets", ())), tuple(r.get("genders", ())),
                       tuple(r.get("locations", ())))
        for r in rows
    }  # fmt: skip


def test_precomputed_sids_train_index_and_serve_in_a_named_sid_space(tmp_path: Path) -> None:
    """The examples (docs/DATA.md): a catalog of SIDs made elsewhere, no embeddings, no
    tokenizer — trained, indexed and served under one SID space name; an index of another
    SID space is refused by the model's server."""
    from contracts.index_validation import IndexValidationError, validate_index
    from index_builder.build import build_index
    from service.model.checkpoint import load_checkpoint

    catalog = str(EXAMPLES / "catalog.jsonl")
    files = ["--catalog", catalog, "--interactions", str(EXAMPLES / "interactions.csv"),
             "--users", str(EXAMPLES / "users.csv")]  # fmt: skip
    model = ["--out", str(tmp_path / "model"), "--no-progress"]
    assert main(["train", *files, "--sid-space", "examples-v1", "--batch-size", "4",
                 "--epochs", "2", *model]) == 0  # fmt: skip
    loaded = load_checkpoint(tmp_path / "model")
    assert loaded.sid_space == "sid-space:examples-v1"
    assert not (tmp_path / "model" / "tokenizer").exists()
    index = ["--out", str(tmp_path / "index"), "--no-progress"]
    assert main(["build-index", "--catalog", catalog, "--sid-space", "examples-v1", *index]) == 0
    users = {
        500: Targeting("US", 30, "female", ("US/NY/New York",)),
        501: Targeting("GB", 22, "male", ("GB/London",)),
        504: Targeting("JP", 28, "female"),
    }
    oracle = example_ads()

    async def serve() -> list:
        app = await start(serving_settings(tmp_path))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            replies = [
                await stub.Retrieve(retrieval_pb2.RetrieveRequest(
                    request_id=str(u), user=retrieval_pb2.User(user_id=u),
                    targeting=retrieval_pb2.Targeting(country=t.country, age=t.age,
                                                      gender=t.gender, locations=t.locations),
                ))
                for u, t in users.items()
            ]  # fmt: skip
        await app.drain()
        return replies

    replies = asyncio.run(serve())
    for (u, t), reply in zip(users.items(), replies, strict=True):
        assert reply.ads and all(eligible(oracle[a.ad_id], t) for a in reply.ads), u
    other, _ = build_index(catalog, tmp_path / "other", sid_space="other-v2", progress=False)
    with pytest.raises(IndexValidationError, match="built for SID space sid-space:other-v2"):
        validate_index(tmp_path / "other" / other, expect_tokenizer=loaded.sid_space)


def test_a_sid_space_needs_every_row_to_carry_its_sid(tmp_path: Path) -> None:
    own_dataset(tmp_path)  # a catalog of embeddings, no sid
    files = ["--catalog", str(tmp_path / "catalog.jsonl.gz"),
             "--interactions", str(tmp_path / "interactions.csv"),
             "--users", str(tmp_path / "users.parquet")]  # fmt: skip
    out = ["--out", str(tmp_path / "m"), "--no-progress"]
    assert main(["train", *files, "--sid-space", "x1", *out]) == 2  # rows without a sid
    catalog = str(EXAMPLES / "catalog.jsonl")
    assert main(["build-index", "--catalog", catalog, "--sid-space", "bad name!", *out]) == 2
