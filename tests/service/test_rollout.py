"""Model and index rollout (service/rollout/): new versions are verified before they
serve; bad ones never serve, are counted once per backoff period and retried; a version
CURRENT names before it exists is picked up when it appears; a model or an index of
another SID space is refused (counted once) and waits, staged, for a partner of its SID
space — then the two swap in together; start-up falls back to the newest pair that
serves and, when none does, names each version and why.

Indexes are real published versions (validated as the server does); models are small
stand-ins published with the same protocol (`contracts/versions.py`), so what is tested
here is the choice of the pair. The real model repository, real checkpoints and real
gRPC are in tests/service/test_model_rollout.py."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from contracts.versions import publish_version
from index_builder.publish import CURRENT, current_path, publish
from service.index.loaded import load_index
from service.pipeline.runtime import ServingHolder
from service.rollout.follower import Follower
from service.rollout.host_lock import host_lock, swap_lock_path
from service.rollout.rollout import Rollout
from tests.helpers.indexes import corrupting, flip_byte, small_index, writer

SPACE = "test"  # the SID space of the indexes `writer` publishes by default


class Clock:
    """A hand-driven monotonic clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def publish_model(root: Path, space: str = SPACE, *, bad: bool = False) -> str:
    """A stand-in model version: its SID space, and whether loading it fails."""

    def write(directory: Path, version: str) -> None:
        (directory / "config.json").write_text(json.dumps({"space": space, "bad": bad}))

    return publish_version(root, write, complete="config.json", keep=10,
                           is_valid=lambda r, v: True)  # fmt: skip


def _load_model(path: Path, version: str) -> SimpleNamespace:
    meta = json.loads((path / "config.json").read_text())
    if meta["bad"]:
        raise ValueError(f"checkpoint {path}: model.safetensors is corrupt or truncated")
    return SimpleNamespace(version=version, model_version=version, sid_space=meta["space"])


def _model_space(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text())["space"]
    except OSError:
        return None


def _index_space(path: Path) -> str | None:
    try:
        return json.loads((path / "manifest.json").read_text())["tokenizer_fingerprint"]
    except (OSError, ValueError):
        return None


def make_rollout(
    root: Path, clock: Clock | None = None, *, models: Path | None = None, **kw
) -> tuple[Rollout, dict]:
    """A rollout over the index root `root` and the model repository `models` (default:
    one stand-in model of SID space SPACE, published beside it)."""
    clock = clock or Clock()
    seen: dict[str, list] = {"swapped": [], "failed": [], "model_failed": [], "refused": []}
    if models is None:
        models = root.parent / f"{root.name}-models"
        publish_model(models)
    holder = ServingHolder()
    backoff = {k: kw.pop(k) for k in ("backoff_seconds", "max_backoff_seconds") if k in kw}

    def served(kind: str) -> Callable[[], str | None]:
        return lambda: getattr(holder.current, kind).version if holder.ready else None

    model_follower = Follower(
        models, "model", complete="config.json", load=_load_model, space=_model_space,
        served=served("model"), on_failure=lambda v, e: seen["model_failed"].append(v),
        clock=clock, **backoff,
    )  # fmt: skip
    index_follower = Follower(
        root, "index", complete="manifest.json", space=_index_space, served=served("index"),
        load=lambda path, version: load_index(path, expect_version=version),
        on_failure=lambda v, e: seen["failed"].append(v), clock=clock, **backoff,
    )  # fmt: skip

    def swapped(new, old) -> None:
        seen["swapped"].append((new.model.version, new.index.version))

    rollout = Rollout(
        model_follower, index_follower, holder, on_swap=swapped,
        on_incompatible=lambda kind, v: seen["refused"].append((kind, v)), **kw,
    )  # fmt: skip
    return rollout, seen


def served(rollout: Rollout) -> str:
    return rollout.holder.current.index.version


def served_model(rollout: Rollout) -> str:
    return rollout.holder.current.model.version


def indexes_swapped(seen: dict) -> list[str]:
    return [i for _, i in seen["swapped"]]


# -- indexes -----------------------------------------------------------------------------


def test_rollout_swaps_in_new_indexes_and_rejects_bad_ones(tmp_path: Path) -> None:
    clock = Clock()
    root = tmp_path / "index"
    rollout, seen = make_rollout(root, clock)
    assert not rollout.check_once() and not rollout.index_behind  # nothing published yet
    v1 = publish(root, writer(small_index(30)))
    assert rollout.check_once() and served(rollout) == v1
    assert not rollout.check_once()  # unchanged
    v2 = publish(root, writer(small_index(40)))
    assert rollout.check_once() and served(rollout) == v2
    assert rollout.holder.current.index.arrays.ads.num_ads == 40

    v3 = publish(root, writer(small_index(50)))
    flip_byte(current_path(root) / "trie.bloom_table.npy")
    assert not rollout.check_once()
    assert served(rollout) == v2 and rollout.index_behind  # the old index keeps serving
    assert not rollout.check_once() and len(seen["failed"]) == 1  # not before the backoff
    clock.advance(rollout.indexes.backoff_seconds)
    assert not rollout.check_once() and len(seen["failed"]) == 2  # retried after it

    v4 = publish(root, writer(small_index(20), tokenizer="another-model"))
    assert not rollout.check_once() and served(rollout) == v2  # a new version: at once
    assert indexes_swapped(seen) == [v1, v2] and seen["failed"] == [v3, v3]
    assert seen["refused"] == [("index", v4)]  # loads, but fits no model: refused, once
    for _ in range(3):
        assert not rollout.check_once()
    assert seen["refused"] == [("index", v4)] and rollout.index_behind


def _drop_sha256(directory: Path) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    del manifest["arrays"]["trie.bloom_table"]["sha256"]
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _rename_in_manifest(directory: Path) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["index_version"] = "20200101T000000000000Z"
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("fault", "message"),
    [(_drop_sha256, "needs a string 'sha256'"), (_rename_in_manifest, "differs from the version")],
    ids=["array-without-sha256", "index-version-not-the-directory"],
)
def test_a_malformed_manifest_is_counted_once_per_backoff_and_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fault: Callable[[Path], None], message: str
) -> None:
    caplog.set_level(logging.INFO, logger="grace.rollout")
    clock = Clock()
    rollout, seen = make_rollout(tmp_path / "index", clock, backoff_seconds=1.0,
                                 max_backoff_seconds=4.0)  # fmt: skip
    good = publish(tmp_path / "index", writer(small_index(30)))
    assert rollout.check_once()
    bad = publish(tmp_path / "index", writer(small_index(40)))
    fault(tmp_path / "index" / bad)
    counts = []
    for _ in range(40):  # 10 s in quarter seconds, several polls per step
        for _ in range(3):
            assert not rollout.check_once()
        counts.append(len(seen["failed"]))
        clock.advance(0.25)
    # tries at t = 0, 1, 1+2, 3+4, 7+4 (capped): each counted once
    assert [counts[i] for i in (0, 3, 4, 11, 12, 27, 28, 39)] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert served(rollout) == good and rollout.index_behind
    assert seen["failed"] == [bad] * 4 and indexes_swapped(seen) == [good]
    rejected = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert len(rejected) == 4
    assert all(message in r.getMessage() and "\n" not in r.getMessage() for r in rejected)
    assert not any(r.exc_info for r in caplog.records)  # an expected fault: no traceback


def test_an_unexpected_error_while_preparing_is_a_counted_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def prepare(model, index) -> None:
        calls.append(index.version)
        if len(calls) > 1:
            raise RuntimeError("graph capture failed")

    rollout, seen = make_rollout(tmp_path / "index", prepare=prepare)
    first = publish(tmp_path / "index", writer(small_index(30)))
    assert rollout.check_once()
    second = publish(tmp_path / "index", writer(small_index(40)))
    for _ in range(5):
        assert not rollout.check_once()
    assert seen["failed"] == [second] and served(rollout) == first
    assert seen["model_failed"] == []  # the model was serving already: not its fault
    tracebacks = [r for r in caplog.records if r.exc_info]  # unexpected: one per attempt
    assert len(tracebacks) == 1
    assert "RuntimeError: graph capture failed" in tracebacks[0].getMessage()


def test_current_moving_on_tries_the_new_version_at_once(tmp_path: Path) -> None:
    root = tmp_path / "index"
    rollout, seen = make_rollout(root, backoff_seconds=60.0)
    publish(root, writer(small_index(30)))
    assert rollout.check_once()
    publish(root, corrupting(writer(small_index(40))))
    assert not rollout.check_once() and len(seen["failed"]) == 1
    fixed = publish(root, writer(small_index(50)))
    assert rollout.check_once() and served(rollout) == fixed and not rollout.index_behind


def test_a_version_named_before_it_appears_is_picked_up_without_a_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="grace.rollout")
    root, staging = tmp_path / "index", tmp_path / "staging"
    rollout, seen = make_rollout(root)
    first = publish(root, writer(small_index(30)))
    assert rollout.check_once()
    later = publish(staging, writer(small_index(40)))
    (root / CURRENT).write_text(later + "\n")  # CURRENT first, the directory after
    for _ in range(5):
        assert not rollout.check_once()
    assert rollout.index_behind and served(rollout) == first
    shutil.copytree(staging / later, root / later, ignore=shutil.ignore_patterns("manifest.json"))
    for _ in range(5):  # arrays there, manifest not yet: still pending
        assert not rollout.check_once()
    assert seen["failed"] == []
    shutil.copy(staging / later / "manifest.json", root / later / "manifest.json")
    assert rollout.check_once() and served(rollout) == later and not rollout.index_behind
    assert seen["failed"] == [] and seen["refused"] == []
    pending = [r for r in caplog.records if "has not appeared yet" in r.getMessage()]
    assert len(pending) == 1 and later in pending[0].getMessage()


@pytest.fixture
def three_versions(tmp_path: Path) -> tuple[Path, list[str]]:
    """v1 and v2 valid (30 and 40 ads), CURRENT on the newest, v3 (50 ads)."""
    root = tmp_path / "index"
    versions = [publish(root, writer(small_index(n))) for n in (30, 40, 50)]
    return root, versions


@pytest.mark.parametrize("fault", ["corrupt", "tokenizer", "pending"])
def test_first_load_falls_back_to_the_newest_version_that_loads(
    three_versions: tuple[Path, list[str]], caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    root, (_, v2, v3) = three_versions
    if fault == "corrupt":
        flip_byte(root / v3 / "ads.ad_ids.npy")
    elif fault == "tokenizer":
        shutil.rmtree(root / v3)
        v3 = publish(root, writer(small_index(50), tokenizer="another-model"))
    else:
        shutil.move(root / v3, root.parent / "elsewhere")
    rollout, seen = make_rollout(root)
    assert rollout.check_once() and served(rollout) == v2 and rollout.index_behind
    assert len(seen["failed"]) == (1 if fault == "corrupt" else 0)
    why = {"corrupt": "checksum mismatch", "tokenizer": "fits no loadable partner's SID space",
           "pending": "has not appeared yet"}[fault]  # fmt: skip
    said = [r.getMessage() for r in caplog.records if "CURRENT names" in r.getMessage()]
    assert len(said) == 1 and v3 in said[0] and why in said[0] and f"serving {v2}" in said[0]
    if fault == "pending":  # once CURRENT's version appears, it serves
        shutil.move(root.parent / "elsewhere", root / v3)
        assert rollout.check_once() and served(rollout) == v3 and not rollout.index_behind
        assert indexes_swapped(seen) == [v2, v3]


def test_first_load_with_nothing_loadable_serves_nothing_and_says_why(
    three_versions: tuple[Path, list[str]],
) -> None:
    root, versions = three_versions
    for v in versions:
        flip_byte(root / v / "trie.node_offsets.npy")
    rollout, seen = make_rollout(root)
    assert not rollout.check_once() and not rollout.holder.ready and rollout.index_behind
    assert len(seen["failed"]) == 3 and sorted(seen["failed"]) == versions
    assert not rollout.check_once() and len(seen["failed"]) == 3  # each waits for its backoff
    why = rollout.why_none()
    assert all(v in why for v in versions) and why.count("checksum mismatch") == 3
    assert f"{versions[-1]} (named by CURRENT) was rejected" in why


def test_an_unreadable_current_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "index"
    first = publish(root, writer(small_index(30)))
    rollout, seen = make_rollout(root)
    assert rollout.check_once()
    (root / CURRENT).write_text("../../elsewhere\n")
    for _ in range(5):
        assert not rollout.check_once()
    assert served(rollout) == first and seen["failed"] == []
    assert len([r for r in caplog.records if "not a version" in r.getMessage()]) == 1


# -- models --------------------------------------------------------------------------------


@pytest.fixture
def served_pair(tmp_path: Path) -> tuple[Rollout, dict, Path, Path, str, str]:
    """A rollout serving model m1 and index i1 (both SID space SPACE), with a clock."""
    models, root = tmp_path / "models", tmp_path / "index"
    m1 = publish_model(models)
    i1 = publish(root, writer(small_index(30)))
    clock = Clock()
    rollout, seen = make_rollout(root, clock, models=models)
    assert rollout.check_once()
    rollout.clock = clock  # type: ignore[attr-defined]
    return rollout, seen, models, root, m1, i1


def test_a_new_model_of_the_same_sid_space_swaps_in_with_the_served_index(served_pair) -> None:
    rollout, seen, models, _, m1, i1 = served_pair
    index = rollout.holder.current.index
    m2 = publish_model(models)
    assert rollout.check_once() and served_model(rollout) == m2 and not rollout.model_behind
    assert rollout.holder.current.index is index  # the index was not reloaded
    assert seen["swapped"] == [(m1, i1), (m2, i1)]


def test_a_bad_model_is_counted_once_per_backoff_and_never_served(served_pair) -> None:
    rollout, seen, models, _, m1, _ = served_pair
    bad = publish_model(models, bad=True)
    for _ in range(3):
        assert not rollout.check_once()
    assert served_model(rollout) == m1 and rollout.model_behind
    assert seen["model_failed"] == [bad]
    rollout.clock.advance(rollout.models.backoff_seconds)
    assert not rollout.check_once() and seen["model_failed"] == [bad, bad]
    fixed = publish_model(models)
    assert rollout.check_once() and served_model(rollout) == fixed


@pytest.mark.parametrize("order", ["model-first", "index-first"])
def test_a_model_of_a_new_sid_space_waits_for_its_index_then_both_swap_in_together(
    served_pair, caplog: pytest.LogCaptureFixture, order: str
) -> None:
    """The coordinated rollout: publish the model and the index of a new SID space, in
    either order. The first to appear fits nothing that serves: refused (counted once,
    one line), the old pair keeps serving; when its partner appears, the pair swaps in at
    once — no request ever sees the new model with the old index or the reverse."""
    rollout, seen, models, root, m1, i1 = served_pair
    if order == "model-first":
        first, first_kind = publish_model(models, "sid-space:v2"), "model"
    else:
        first, first_kind = (
            publish(root, writer(small_index(40), tokenizer="sid-space:v2")),
            "index",
        )
    for _ in range(3):
        assert not rollout.check_once()
    assert (served_model(rollout), served(rollout)) == (m1, i1)
    assert seen["refused"] == [(first_kind, first)]  # once, however many polls
    refusal = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusal) == 1 and "sid-space:v2" in refusal[0] and "still serving" in refusal[0]
    if order == "model-first":
        m2, i2 = first, publish(root, writer(small_index(40), tokenizer="sid-space:v2"))
    else:
        m2, i2 = publish_model(models, "sid-space:v2"), first
    assert rollout.check_once()
    assert seen["swapped"] == [(m1, i1), (m2, i2)]  # one swap: the pair together
    assert not rollout.model_behind and not rollout.index_behind
    assert rollout.holder.current.model.sid_space == "sid-space:v2"
    assert seen["failed"] == seen["model_failed"] == []


def test_an_incompatible_model_is_freed_when_current_moves_on(served_pair) -> None:
    rollout, seen, models, _, _m1, _ = served_pair
    other = publish_model(models, "sid-space:other")
    assert not rollout.check_once() and rollout._staged["model"].version == other
    m3 = publish_model(models)
    assert rollout.check_once() and served_model(rollout) == m3
    assert "model" not in rollout._staged and seen["refused"] == [("model", other)]


@pytest.mark.parametrize("fault", ["bad", "new-sid-space"])
def test_a_restart_with_current_on_a_refused_model_serves_the_previous_valid_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    """The restart hazard: CURRENT names a model the server refuses (corrupt, or of a SID
    space no index has yet); a new process serves the newest model that works instead of
    failing to start, says why, and reports itself behind."""
    models, root = tmp_path / "models", tmp_path / "index"
    good = publish_model(models)
    i1 = publish(root, writer(small_index(30)))
    refused = (publish_model(models, bad=True) if fault == "bad"
               else publish_model(models, "sid-space:v2"))  # fmt: skip
    rollout, _seen = make_rollout(root, models=models)
    assert rollout.check_once()
    assert (served_model(rollout), served(rollout)) == (good, i1)
    assert rollout.model_behind and not rollout.index_behind
    said = [r.getMessage() for r in caplog.records if "CURRENT names" in r.getMessage()]
    why = "corrupt or truncated" if fault == "bad" else "fits no loadable partner"
    assert len(said) == 1 and refused in said[0] and why in said[0] and good in said[0]


def test_no_pair_that_serves_together_names_each_version_and_why(tmp_path: Path) -> None:
    models, root = tmp_path / "models", tmp_path / "index"
    m_bad = publish_model(models, bad=True)
    m_other = publish_model(models, "sid-space:other")
    i1 = publish(root, writer(small_index(30)))
    rollout, _ = make_rollout(root, models=models)
    assert not rollout.check_once() and not rollout.holder.ready
    why = rollout.why_none()
    assert f"model {m_other} (sid-space:other) fits no index" in why
    assert m_bad in why and "corrupt or truncated" in why and i1 in why


def test_a_fixed_checkpoint_directory_is_one_version_that_never_changes(tmp_path: Path) -> None:
    checkpoint, root = tmp_path / "model", tmp_path / "index"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"space": SPACE, "bad": False}))
    publish(root, writer(small_index(30)))
    holder = ServingHolder()
    follower = Follower(checkpoint, "model", complete="config.json", load=_load_model,
                        space=_model_space, single=True)  # fmt: skip
    assert follower.read() == "model" and follower.fallbacks("model") == []
    index_follower = Follower(root, "index", complete="manifest.json", space=_index_space,
                              load=lambda p, v: load_index(p, expect_version=v))  # fmt: skip
    rollout = Rollout(follower, index_follower, holder)
    assert rollout.check_once() and holder.current.model.version == "model"
    assert not rollout.check_once() and not rollout.model_behind


def test_one_at_a_time_is_held_while_a_newcomer_loads_and_swaps_in(served_pair) -> None:
    """Workers sharing a GPU swap one after the other: the rollout holds the lock it is
    given around loading, preparing and swapping a newcomer — not for polls that find
    nothing new."""
    rollout, _, models, *_ = served_pair
    held: list[bool] = []
    entered: list[str] = []

    @contextlib.contextmanager
    def lock():
        entered.append("in")
        held.append(True)
        try:
            yield
        finally:
            held.pop()

    loads = rollout.models._load

    def load(path, version):
        assert held == [True], "a model loads only while the lock is held"
        return loads(path, version)

    rollout.models._load = load
    rollout._one_at_a_time = lock
    for _ in range(3):
        assert not rollout.check_once()  # nothing new: the lock is not taken
    assert entered == []
    m2 = publish_model(models)
    assert rollout.check_once() and served_model(rollout) == m2
    assert entered == ["in"] and held == []


def test_the_host_lock_lets_one_holder_in_at_a_time(tmp_path: Path) -> None:
    path = swap_lock_path(tmp_path / "models", tmp_path / "index")
    assert path == swap_lock_path(tmp_path / "models", tmp_path / "x" / ".." / "index")
    order: list[str] = []
    a_in, b_tried = threading.Event(), threading.Event()

    def a() -> None:
        with host_lock(path):
            order.append("a in")
            a_in.set()
            b_tried.wait(30)
            order.append("a out")

    def b() -> None:
        a_in.wait(30)
        b_tried.set()
        with host_lock(path):  # waits for a: separate opens of one file exclude
            order.append("b in")

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert order == ["a in", "a out", "b in"]


def test_a_host_lock_that_cannot_be_made_lets_the_swap_go_on(tmp_path: Path, caplog) -> None:
    """A read-only root without a writable temp directory: the swap is not blocked, and
    the one warning says the workers may swap at once."""
    path = tmp_path / "missing-dir" / "grace-swap.lock"  # its directory does not exist
    entered = []
    for _ in range(2):
        with host_lock(path):
            entered.append(True)
    assert entered == [True, True]
    warnings = [r for r in caplog.records if "cannot be made" in r.getMessage()]
    assert len(warnings) == 1 and not path.exists()
